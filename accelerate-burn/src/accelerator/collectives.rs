//! The cross-process operations a training script calls directly: gathering predictions for
//! metrics, reducing values, synchronising, sharing work, and an early-stop flag.
//!
//! With one process every operation returns its input (or does nothing).

use std::sync::atomic::Ordering;

use accelerate_core::MixedPrecision;
use accelerate_core::comm::Reduction;
use accelerate_kernels::schedule::chunk_range;
use burn::tensor::kind::Basic;
use burn::tensor::{Tensor, TensorData};

use super::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::loader_link::BatchPadding;

impl<B: AcceleratorBackend> Accelerator<B> {
    fn tensor_error(&self, op: &'static str, detail: String) -> AccelerateError {
        AccelerateError::Tensor {
            rank: self.process_index(),
            op,
            detail,
        }
    }

    /// Every process's `tensor`, concatenated along dim 0 in rank order. The other dimensions
    /// must agree; dim 0 may differ (each process contributes its own rows). Works for float,
    /// int and bool tensors of any dtype.
    pub fn gather<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
    ) -> Result<Tensor<D, K>, AccelerateError> {
        self.gather_first_rows(tensor, None)
    }

    /// [`gather`](Self::gather) of each process's first `keep` rows (all with `None`).
    fn gather_first_rows<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
        keep: Option<usize>,
    ) -> Result<Tensor<D, K>, AccelerateError> {
        let distributed = self.state().is_distributed();
        if D == 0 || (!distributed && keep.is_none()) {
            return Ok(tensor);
        }
        let device = tensor.device();
        let mut dims = tensor.dims();
        let data = tensor.into_data();
        let dtype = data.dtype();
        let row_bytes = dims[1..].iter().product::<usize>() * dtype.size();
        dims[0] = keep.map_or(dims[0], |keep| keep.min(dims[0]));
        let kept = &data.as_bytes()[..dims[0] * row_bytes];
        if !distributed {
            let data = TensorData::from_bytes_vec(kept.to_vec(), dims, dtype);
            return Ok(Tensor::from_data(data, &device));
        }
        let mut group = self.comm.lock();
        let shapes: Vec<Vec<usize>> = group.all_gather_object(&dims.to_vec())?;
        if let Some((r, shape)) = shapes
            .iter()
            .enumerate()
            .find(|(_, shape)| shape.len() != D || shape[1..] != dims[1..])
        {
            return Err(self.tensor_error(
                "gather",
                format!(
                    "rank {r} has shape {shape:?}, this rank {dims:?}: only dim 0 may differ. \
                     hint: pad_across_processes evens out other dimensions"
                ),
            ));
        }
        let most_rows = shapes.iter().map(|s| s[0]).max().unwrap_or(0);
        let mut mine = kept.to_vec();
        mine.resize(most_rows * row_bytes, 0);
        let mut all = vec![0u8; mine.len() * shapes.len()];
        group.all_gather_raw(&mine, &mut all)?;
        let mut bytes = Vec::with_capacity(all.len());
        for (r, shape) in shapes.iter().enumerate() {
            let start = r * mine.len();
            bytes.extend_from_slice(&all[start..start + shape[0] * row_bytes]);
        }
        let mut out_dims = dims;
        out_dims[0] = shapes.iter().map(|s| s[0]).sum();
        Ok(Tensor::from_data(
            TensorData::from_bytes_vec(bytes, out_dims, dtype),
            &device,
        ))
    }

    /// [`gather`](Self::gather) for evaluation: drops the samples that `even_batches`
    /// repeated to even out the processes' shares (a map-style loader's last round, a stream
    /// loader's padded batches), so that an evaluation over N samples yields exactly N rows,
    /// in the loader's order.
    pub fn gather_for_metrics<const D: usize, K: Basic>(
        &self,
        tensor: Tensor<D, K>,
    ) -> Result<Tensor<D, K>, AccelerateError> {
        let rows = |t: &Tensor<D, K>| t.dims().first().copied().unwrap_or(0);
        match self.links.batch_padding() {
            Some(BatchPadding::LastRound(padding)) if padding > 0 && D > 0 => {
                let gathered = self.gather(tensor)?;
                let real = rows(&gathered).saturating_sub(padding);
                Ok(gathered.narrow(0, 0, real))
            }
            // Padding is this process's own last rows: each process drops its own.
            Some(BatchPadding::Own(padding)) if padding > 0 => {
                let real = rows(&tensor).saturating_sub(padding);
                self.gather_first_rows(tensor, Some(real))
            }
            _ => self.gather(tensor),
        }
    }

    /// How many of the `rows` samples in this process's latest evaluation batch are real: not
    /// the samples `even_batches` repeated (the ones
    /// [`gather_for_metrics`](Self::gather_for_metrics) drops). For metrics accumulated on
    /// each process, like [`crate::metrics::MeanMetric`].
    pub fn rows_for_metrics(&self, rows: usize) -> usize {
        match self.links.batch_padding() {
            Some(BatchPadding::LastRound(padding)) if padding > 0 => {
                // Padding only happens with even batches: every process holds `rows` in that
                // round, and the padding is the last samples in rank order.
                let real_total = (rows * self.num_processes()).saturating_sub(padding);
                real_total
                    .saturating_sub(rows * self.process_index())
                    .min(rows)
            }
            Some(BatchPadding::Own(padding)) => rows.saturating_sub(padding),
            _ => rows,
        }
    }

    /// `values` summed over every process, in rank order (so every process gets the same,
    /// exactly), in f64.
    pub(crate) fn sum_across_processes<const N: usize>(
        &self,
        values: [f64; N],
    ) -> Result<[f64; N], AccelerateError> {
        if !self.state().is_distributed() {
            return Ok(values);
        }
        // Bit patterns: JSON has no NaN, and its decimal form need not round-trip.
        let bits: Vec<u64> = values.iter().map(|v| v.to_bits()).collect();
        let all: Vec<Vec<u64>> = self.comm.lock().all_gather_object(&bits)?;
        let mut total = [0.0; N];
        for theirs in all {
            for (t, v) in total.iter_mut().zip(theirs) {
                *t += f64::from_bits(v);
            }
        }
        Ok(total)
    }

    /// `tensor` combined element-wise over every process with `reduction` (sum, mean, max
    /// or min), on every process: on the GPUs where the job uses NCCL (in f32), else through
    /// the host.
    pub fn reduce<const D: usize>(
        &self,
        tensor: Tensor<D>,
        reduction: Reduction,
    ) -> Result<Tensor<D>, AccelerateError> {
        let (device, dims, dtype) = (tensor.device(), tensor.dims(), tensor.dtype());
        if let Some(nccl) = self.comm.device_collectives() {
            // On the GPUs (f32), where the job uses NCCL; the collective runs off autodiff and
            // the result comes back to the caller's autodiff context as a constant.
            let strategy = tensor.gradient_checkpointing_strategy();
            let n = tensor.shape().num_elements();
            let flat = tensor.inner().reshape([n]);
            let reduced = nccl
                .all_reduce(flat, reduction, MixedPrecision::No)?
                .reshape(dims)
                .cast(dtype);
            return Ok(match strategy {
                Some(strategy) => reduced
                    .autodiff()
                    .with_gradient_checkpointing_strategy(strategy),
                None => reduced,
            });
        }
        if !self.state().is_distributed() {
            return Ok(tensor);
        }
        let mut values: Vec<f32> = tensor.into_data().convert::<f32>().iter::<f32>().collect();
        self.comm.lock().all_reduce(&mut values, reduction)?;
        Ok(Tensor::<D>::from_data(TensorData::new(values, dims), &device).cast(dtype))
    }

    /// Pads `tensor` along `dim` with `value` to the largest size any process has there, so
    /// that tensors of different lengths can be gathered.
    pub fn pad_across_processes<const D: usize>(
        &self,
        tensor: Tensor<D>,
        dim: usize,
        value: f32,
    ) -> Result<Tensor<D>, AccelerateError> {
        if dim >= D {
            return Err(self.tensor_error(
                "pad_across_processes",
                format!("dimension {dim} of a {D}-dimensional tensor"),
            ));
        }
        if !self.state().is_distributed() {
            return Ok(tensor);
        }
        let dims = tensor.dims();
        let sizes: Vec<usize> = self.comm.lock().all_gather_object(&dims[dim])?;
        let largest = sizes.into_iter().max().unwrap_or(dims[dim]);
        if largest == dims[dim] {
            return Ok(tensor);
        }
        let mut pad_dims = dims;
        pad_dims[dim] = largest - dims[dim];
        let pad = Tensor::<D>::full(pad_dims, value, &tensor.device()).cast(tensor.dtype());
        Ok(Tensor::cat(vec![tensor, pad], dim))
    }

    /// Returns once every process has called it.
    pub fn wait_for_everyone(&self) -> Result<(), AccelerateError> {
        Ok(self.comm.lock().barrier()?)
    }

    /// Runs `f` on the main process first, then on the others (for example to download or
    /// preprocess data once).
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R, AccelerateError> {
        if self.is_main_process() {
            let result = f();
            self.wait_for_everyone()?;
            Ok(result)
        } else {
            self.wait_for_everyone()?;
            Ok(f())
        }
    }

    /// This process's contiguous share of `items` (the first `len % n` processes get one
    /// more), for splitting work such as prompts to evaluate.
    pub fn split_between_processes<T: Clone>(&self, items: &[T]) -> Vec<T> {
        items[chunk_range(items.len(), self.num_processes(), self.process_index())].to_vec()
    }

    /// Raises this process's early-stop flag; [`check_trigger`](Self::check_trigger) tells
    /// every process.
    pub fn set_trigger(&self) {
        self.trigger.store(true, Ordering::Relaxed);
    }

    /// True on every process when any process raised its flag since the last check (which
    /// lowers it). Every process must call it at the same points.
    pub fn check_trigger(&self) -> Result<bool, AccelerateError> {
        let mine = self.trigger.swap(false, Ordering::Relaxed);
        let mut flag = [f32::from(u8::from(mine))];
        self.comm.lock().all_reduce(&mut flag, Reduction::Max)?;
        Ok(flag[0] > 0.0)
    }
}
