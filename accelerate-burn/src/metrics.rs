//! Evaluation metrics that add up over batches and processes: each process adds its batches
//! on the host (dropping the samples `even_batches` repeated to fill the last round), and
//! [`compute`](MeanMetric::compute) sums every process's totals once, in rank order, so all
//! processes get the same value, equal to one process evaluating the whole set.
//!
//! ```
//! use accelerate_burn::metrics::MeanMetric;
//! use accelerate_burn::{Accelerator, DefaultBackend};
//! use burn::tensor::Tensor;
//!
//! let acc = Accelerator::<DefaultBackend>::from_env()?;
//! let mut loss = MeanMetric::new();
//! // Per-sequence summed losses and their token counts, batch by batch.
//! let sums = Tensor::<1>::from_floats([6.0, 2.0], &acc.device());
//! let tokens = Tensor::<1>::from_floats([3.0, 1.0], &acc.device());
//! loss.update_sums(&acc, sums, tokens)?;
//! let mean = loss.compute(&acc)?;
//! assert_eq!((mean.value, mean.weight), (2.0, 4.0));
//! assert!((mean.perplexity() - 2f64.exp()).abs() < 1e-12);
//! # Ok::<(), accelerate_burn::AccelerateError>(())
//! ```

use burn::tensor::{Int, Tensor};

use crate::accelerator::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;

/// A weighted mean over the samples of an evaluation (a loss, an error rate), on every
/// process.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MeanMetric {
    sum: f64,
    weight: f64,
}

/// A metric's value over every process's samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MetricValue {
    /// The weighted mean (`NaN` when nothing was added).
    pub value: f64,
    /// The total weight: samples, or tokens for [`MeanMetric::update_sums`].
    pub weight: f64,
}

impl MetricValue {
    /// `exp(value)`: the perplexity, when the value is a mean cross-entropy in nats.
    pub fn perplexity(&self) -> f64 {
        self.value.exp()
    }

    /// `value / ln 2`: a mean cross-entropy in nats as bits per token (bits per byte for a
    /// byte-level model).
    pub fn bits(&self) -> f64 {
        self.value / std::f64::consts::LN_2
    }
}

impl MeanMetric {
    /// An empty metric.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one value per sample of this process's batch (`[batch]`), each of weight 1.
    pub fn update<B: AcceleratorBackend>(
        &mut self,
        acc: &Accelerator<B>,
        values: Tensor<1>,
    ) -> Result<(), AccelerateError> {
        let values = host_values(values);
        let real = acc.rows_for_metrics(values.len());
        self.sum += values[..real].iter().sum::<f64>();
        self.weight += real as f64;
        Ok(())
    }

    /// Adds per-sample sums and their weights (`[batch]` each), e.g. each sequence's summed
    /// token losses and its token count: the mean is then per token, however the tokens are
    /// spread over sequences, batches and processes.
    pub fn update_sums<B: AcceleratorBackend>(
        &mut self,
        acc: &Accelerator<B>,
        sums: Tensor<1>,
        weights: Tensor<1>,
    ) -> Result<(), AccelerateError> {
        let (sums, weights) = (host_values(sums), host_values(weights));
        if sums.len() != weights.len() {
            return Err(AccelerateError::Tensor {
                rank: acc.process_index(),
                op: "MeanMetric::update_sums",
                detail: format!(
                    "{} sums but {} weights: give one weight per sum",
                    sums.len(),
                    weights.len()
                ),
            });
        }
        let real = acc.rows_for_metrics(sums.len());
        self.sum += sums[..real].iter().sum::<f64>();
        self.weight += weights[..real].iter().sum::<f64>();
        Ok(())
    }

    /// The mean over every process's samples. A collective: every process calls it, at the
    /// same point.
    pub fn compute<B: AcceleratorBackend>(
        &self,
        acc: &Accelerator<B>,
    ) -> Result<MetricValue, AccelerateError> {
        let [sum, weight] = acc.sum_across_processes([self.sum, self.weight])?;
        Ok(MetricValue {
            value: sum / weight,
            weight,
        })
    }
}

/// The fraction of samples whose highest logit is the target class, on every process.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Accuracy(MeanMetric);

impl Accuracy {
    /// An empty metric.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a batch: `logits` `[batch, classes]`, `targets` `[batch]`.
    pub fn update<B: AcceleratorBackend>(
        &mut self,
        acc: &Accelerator<B>,
        logits: Tensor<2>,
        targets: Tensor<1, Int>,
    ) -> Result<(), AccelerateError> {
        let [rows, _] = logits.dims();
        let hits = logits
            .argmax(1)
            .reshape([rows])
            .equal(targets)
            .float()
            .cast(burn::tensor::DType::F32);
        self.0.update(acc, hits)
    }

    /// The accuracy over every process's samples (`value` in 0..=1, `weight` the samples). A
    /// collective: every process calls it.
    pub fn compute<B: AcceleratorBackend>(
        &self,
        acc: &Accelerator<B>,
    ) -> Result<MetricValue, AccelerateError> {
        self.0.compute(acc)
    }
}

fn host_values(tensor: Tensor<1>) -> Vec<f64> {
    tensor.into_data().convert::<f64>().iter::<f64>().collect()
}
