//! Step outputs put together across the processes, so that the main process's metrics see the
//! global batch: predictions and targets concatenated in rank order (without the samples
//! `even_batches` repeated), a batch-mean loss averaged by each process's real samples.

use burn::tensor::{Int, Tensor, TensorData};
use burn::train::{
    ClassificationOutput, MultiLabelClassificationOutput, RegressionOutput, SequenceOutput,
};

use crate::accelerator::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;

/// A training or validation step's output that can be put together across the processes.
/// Every process calls [`gather`](Self::gather) for every batch; the result is the output of
/// the global batch (the main process hands it to the Learner's metrics, the others drop it).
///
/// Implemented for burn-train's outputs. For an output of your own, gather each tensor with
/// [`Accelerator::gather_for_metrics`] and its loss with [`gather_loss`]:
///
/// ```text
/// impl GatherOutput for MyOutput {
///     fn gather<B: AcceleratorBackend>(self, acc: &Accelerator<B>) -> Result<Self, AccelerateError> {
///         let rows = self.targets.dims()[0];
///         Ok(Self {
///             loss: gather_loss(acc, self.loss, rows)?,
///             logits: acc.gather_for_metrics(self.logits)?,
///             targets: acc.gather_for_metrics(self.targets)?,
///         })
///     }
/// }
/// ```
pub trait GatherOutput: Sized {
    /// The output of every process's batch together, on every process.
    fn gather<B: AcceleratorBackend>(self, acc: &Accelerator<B>) -> Result<Self, AccelerateError>;
}

/// The loss of the global batch from each process's `loss` over its `rows` samples: a
/// one-element loss (a batch mean, what burn-train's `LossMetric` reads) is averaged with each
/// process's real samples as weights (the samples `even_batches` repeated count in the loss
/// they were part of, but not as samples); a per-sample loss is concatenated like the outputs.
pub fn gather_loss<B: AcceleratorBackend>(
    acc: &Accelerator<B>,
    loss: Tensor<1>,
    rows: usize,
) -> Result<Tensor<1>, AccelerateError> {
    if acc.num_processes() == 1 {
        return Ok(loss);
    }
    if loss.dims() != [1] {
        return acc.gather_for_metrics(loss);
    }
    let device = loss.device();
    let dtype = loss.dtype();
    let value = loss
        .into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .ok()
        .and_then(|v| v.first().copied())
        .ok_or_else(|| AccelerateError::Tensor {
            rank: acc.process_index(),
            op: "gather_loss",
            detail: "the loss could not be read as a number".to_string(),
        })?;
    let real = acc.rows_for_metrics(rows) as f64;
    let [weighted, samples] = acc.sum_across_processes([value * real, real])?;
    let mean = if samples > 0.0 {
        weighted / samples
    } else {
        0.0
    };
    Ok(Tensor::<1>::from_data(TensorData::new(vec![mean as f32], [1]), &device).cast(dtype))
}

/// burn-train's outputs of a loss, an `output` and `targets` (of any kind and rank).
macro_rules! gather_output_targets {
    ($($output:ty),*) => {$(
        impl GatherOutput for $output {
            fn gather<B: AcceleratorBackend>(
                self,
                acc: &Accelerator<B>,
            ) -> Result<Self, AccelerateError> {
                let rows = self.targets.dims()[0];
                Ok(Self {
                    loss: gather_loss(acc, self.loss, rows)?,
                    output: acc.gather_for_metrics(self.output)?,
                    targets: acc.gather_for_metrics(self.targets)?,
                })
            }
        }
    )*};
}

gather_output_targets!(
    ClassificationOutput,
    MultiLabelClassificationOutput,
    RegressionOutput
);

impl GatherOutput for SequenceOutput {
    fn gather<B: AcceleratorBackend>(self, acc: &Accelerator<B>) -> Result<Self, AccelerateError> {
        let rows = self.targets.dims()[0];
        let predictions: Option<Tensor<2, Int>> = match self.predictions {
            Some(p) => Some(acc.gather_for_metrics(p)?),
            None => None,
        };
        Ok(Self {
            loss: gather_loss(acc, self.loss, rows)?,
            logits: acc.gather_for_metrics(self.logits)?,
            predictions,
            targets: acc.gather_for_metrics(self.targets)?,
        })
    }
}
