//! The flat buffers on a cubecl device (wgpu, cuda): the gradients are concatenated there, the
//! update is our cubecl kernel, and the model's parameters become views of the flat parameter
//! buffer, so a step moves nothing to the host but a 4-byte norm. With several processes the
//! gradients are averaged on the host, or, where the job uses NCCL, in place on the GPUs;
//! there ZeRO-1 also stays on the device (reduce-scatter into this rank's shard, the update on
//! the shard, all-gather of the parameters).

use std::ops::Range;

use accelerate_core::comm::Reduction;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::{Device, Tensor};

use super::plan::FlatPlan;
use crate::error::AccelerateError;
use crate::fused::FusedOptimizer;
use crate::group::Comm;
use crate::params;
use crate::reducer::wire::Wire;

/// `parts` end to end in one new `[len]` tensor on `device`, each copied into its range.
/// Not `Tensor::cat`: Burn's fusion fuses a cat with what follows it (the sum of squares of the
/// gradients) into one kernel that picks the input per element, 30-40 ms for 2.9 M values on
/// lavapipe against a few ms for the copies.
fn concat(parts: Vec<Tensor<1>>, device: &Device) -> Tensor<1> {
    let total = parts
        .iter()
        .map(|p| p.shape().num_elements())
        .sum::<usize>();
    let mut flat = Tensor::<1>::empty([total], device);
    let mut offset = 0;
    for part in parts {
        let n = part.shape().num_elements();
        flat = flat.slice_assign(offset..offset + n, part);
        offset += n;
    }
    flat
}

/// Flat buffers as Burn tensors of shape `[len]` on the model's device (plain tensors: the
/// kernels run on the backend itself, never through autodiff).
pub(crate) struct DeviceFlat {
    /// Master parameters (a new buffer after every update; the model views it). Padded to a
    /// multiple of the world size under ZeRO.
    params: Tensor<1>,
    /// The gathered (and averaged) gradients of the pending step: all of them, or this
    /// rank's shard under ZeRO.
    grads: Option<Tensor<1>>,
    /// Optimizer state (over the shard under ZeRO).
    state: Vec<Tensor<1>>,
    /// ZeRO-1 over NCCL: this rank's range of the padded buffers, and their padded length.
    shard: Option<(Range<usize>, usize)>,
}

impl DeviceFlat {
    /// Buffers starting from `trainable` (one tensor per segment, on the device); `shard` for
    /// ZeRO-1 (only where NCCL averages the gradients: sharded state needs device collectives).
    pub fn new(
        trainable: Vec<Tensor<1>>,
        state_buffers: usize,
        shard: Option<(Range<usize>, usize)>,
    ) -> Self {
        let mut parts: Vec<Tensor<1>> = trainable.into_iter().map(params::as_f32).collect();
        let len: usize = parts.iter().map(|p| p.shape().num_elements()).sum();
        let device = parts.first().map(Tensor::device).unwrap_or_default();
        if let Some((_, padded)) = &shard
            && *padded > len
        {
            parts.push(Tensor::zeros([*padded - len], &device));
        }
        let params = concat(parts, &device);
        let state_len = shard
            .as_ref()
            .map_or_else(|| params.shape().num_elements(), |(range, _)| range.len());
        let state = (0..state_buffers)
            .map(|_| Tensor::<1>::zeros([state_len], &device))
            .collect();
        Self {
            params,
            grads: None,
            state,
            shard,
        }
    }

    /// Concatenates each segment's gradient into the flat gradient buffer (zeros where a
    /// parameter got none, and over the padding under ZeRO).
    pub fn gather(&mut self, plan: &FlatPlan, grads: impl Iterator<Item = Option<Tensor<1>>>) {
        let device = self.params.device();
        let mut parts: Vec<Tensor<1>> = plan
            .segments
            .iter()
            .zip(grads)
            .map(|(segment, grad)| match grad {
                Some(grad) => params::as_f32(grad),
                // Gradients are plain tensors; so must the filler be.
                None => Tensor::zeros([segment.len], &device),
            })
            .collect();
        if let Some((_, padded)) = &self.shard
            && *padded > plan.len
        {
            parts.push(Tensor::zeros([*padded - plan.len], &device));
        }
        self.grads = Some(concat(parts, &device));
    }

    /// Averages the gathered gradients over the processes (on the host, where the collectives
    /// run) and returns the sum of their squares (on the device with one process: one 4-byte
    /// read).
    pub fn average(&mut self, wire: &mut Wire, comm: &Comm) -> Result<f64, AccelerateError> {
        let Some(grads) = self.grads.take() else {
            return Err(AccelerateError::UnexpectedGradients { rank: comm.rank() });
        };
        if let Some(nccl) = comm.device_collectives() {
            let precision = wire.precision;
            let averaged = match &self.shard {
                None => comm.timed_device(|| nccl.all_reduce_mean(grads, precision))?,
                Some((range, _)) => {
                    comm.timed_device(|| nccl.reduce_scatter_mean(grads, range.len(), precision))?
                }
            };
            let mut sum_sq = [averaged.clone().square().sum().into_scalar::<f32>()];
            if self.shard.is_some() && comm.is_distributed() {
                // Each rank measured its shard; infinities and NaN survive the sum.
                comm.timed(|group| group.all_reduce(&mut sum_sq, Reduction::Sum))?;
            }
            self.grads = Some(averaged);
            return Ok(f64::from(sum_sq[0]));
        }
        if !comm.is_distributed() {
            let sum_sq = grads.clone().square().sum().into_scalar::<f32>();
            self.grads = Some(grads);
            return Ok(f64::from(sum_sq));
        }
        let device = grads.device();
        // One host copy, which then becomes the averaged tensor's buffer.
        let mut values = params::to_host_f32(grads);
        comm.timed(|group| wire.all_reduce_mean(&mut values, group))?;
        let sum_sq = accelerate_kernels::sum_of_squares(&values);
        self.grads = Some(params::upload(values, &device));
        Ok(sum_sq)
    }

    /// One cubecl kernel per segment (a copy for segments without a gradient), writing the
    /// parameters to a new buffer.
    pub fn step(
        &mut self,
        plan: &mut FlatPlan,
        optimizer: &FusedOptimizer,
        lr: &ModuleLearningRate,
        grad_scale: f32,
        comm: &Comm,
    ) -> Result<(), AccelerateError> {
        use crate::device_kernels::{FusedPlan, PlannedSegment, UpdateRule};

        // The part of the buffers this rank updates: all of them, or its shard.
        let range = self
            .shard
            .as_ref()
            .map_or(0..plan.len, |(range, _)| range.clone());
        let mut segments = Vec::with_capacity(plan.segments.len() + 1);
        for index in 0..plan.segments.len() {
            // Every rank advances every segment's count (a shard boundary inside a segment
            // must see one count).
            let update = plan.has_grad[index].then(|| {
                plan.times[index] += 1;
                (plan.times[index], plan.rate(index, lr))
            });
            let segment = &plan.segments[index];
            let start = segment.offset.max(range.start);
            let end = (segment.offset + segment.len).min(range.end);
            if start < end {
                segments.push(PlannedSegment {
                    offset: start - range.start,
                    len: end - start,
                    update,
                });
            }
        }
        // The padding at the end of the last shard is carried over unchanged (zeros).
        let tail = plan.len.max(range.start);
        if tail < range.end {
            segments.push(PlannedSegment {
                offset: tail - range.start,
                len: range.end - tail,
                update: None,
            });
        }
        let Some(grads) = self.grads.take() else {
            return Ok(());
        };
        let rule = match (optimizer, optimizer.sgd_hyper()) {
            (FusedOptimizer::Adam { hyper, amsgrad }, _) => UpdateRule::Adam {
                hyper: *hyper,
                amsgrad: *amsgrad,
            },
            (FusedOptimizer::Sgd { .. }, Some(hyper)) => UpdateRule::Sgd(hyper),
            (FusedOptimizer::Sgd { .. }, None) => return Ok(()),
        };
        let plan = FusedPlan {
            rule,
            grad_scale,
            segments,
        };
        let state = std::mem::take(&mut self.state);
        let params = match &self.shard {
            None => self.params.clone(),
            Some((range, _)) => self.params.clone().narrow(0, range.start, range.len()),
        };
        let (params, state) = crate::device_kernels::fused_update(params, grads, state, plan);
        self.state = state;
        self.params = match (&self.shard, comm.device_collectives()) {
            (Some(_), Some(nccl)) => comm.timed_device(|| nccl.all_gather(params))?,
            _ => params,
        };
        Ok(())
    }

    /// Views of the flat parameter buffer, one per segment (no copy).
    pub fn values(&self, plan: &FlatPlan) -> Vec<Tensor<1>> {
        plan.segments
            .iter()
            .map(|s| self.params.clone().narrow(0, s.offset, s.len))
            .collect()
    }

    /// The optimizer state copied to the host (for a checkpoint).
    pub fn state_to_host(&self) -> Vec<Vec<f32>> {
        self.state
            .iter()
            .map(|s| params::to_host_f32(s.clone()))
            .collect()
    }

    /// Replaces the optimizer state with `state` (from a checkpoint).
    pub fn set_state(&mut self, state: Vec<Vec<f32>>) {
        let device = self.params.device();
        self.state = state
            .into_iter()
            .map(|values| params::upload(values, &device))
            .collect();
    }

    /// Bytes of optimizer state held.
    pub fn state_bytes(&self) -> usize {
        self.state
            .iter()
            .map(|s| s.shape().num_elements() * 4)
            .sum()
    }
}
