//! The fused optimizer on a cubecl device (wgpu, cuda): the state in flat buffers, the update
//! our cubecl kernel, one launch per parameter, reading the parameter and its gradient where
//! they are and writing the new values to a tensor of its own (which the model then holds), so
//! a step moves nothing to the host. Even the norm stays on the device until clipping or
//! fp16's overflow test reads it: 4 bytes, but a wait for everything queued. With several
//! processes the gradients are concatenated and averaged on the host, or, where the job uses
//! NCCL, in place on the GPUs; there ZeRO-1 also stays on the device (reduce-scatter into this
//! rank's shard, the update on the shard, all-gather into a flat parameter buffer the model
//! views).

use std::ops::Range;

use accelerate_core::comm::Reduction;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::{Device, Tensor};

use super::plan::FlatPlan;
use crate::error::AccelerateError;
use crate::fused::{FusedOptimizer, HeldBytes};
use crate::group::Comm;
use crate::params;
use crate::reducer::api::{SumOfSquares, sum_of_squares_on_device};
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

/// The master parameters on the device.
enum DeviceParams {
    /// One tensor per segment, which the model holds as its parameter: no view into a flat
    /// buffer, because a view whose range is not aligned to the device's binding alignment is
    /// a copy on every use (Burn's `slice`), 4-5 ms a step for this MLP on lavapipe.
    Segments(Vec<Tensor<1>>),
    /// One flat buffer that the model views, padded to a multiple of the world size: ZeRO-1
    /// over NCCL, whose all-gather fills it.
    Flat(Box<Tensor<1>>),
}

/// The gradients of the pending step on the device.
enum DeviceGrads {
    /// Concatenated into one buffer, what the collectives average (all of them, or this
    /// rank's shard under ZeRO).
    Flat(Box<Tensor<1>>),
    /// One process updating parameters of their own: each segment's gradient as backward
    /// made it (`None`: the parameter got none), read by the update where it is.
    Segments(Vec<Option<Tensor<1>>>),
}

/// Flat buffers as Burn tensors of shape `[len]` on the model's device (plain tensors: the
/// kernels run on the backend itself, never through autodiff).
pub(crate) struct DeviceFlat {
    /// Master parameters (new tensors after every update).
    params: DeviceParams,
    /// The device all buffers live on.
    device: Device,
    /// The gathered (and averaged) gradients of the pending step.
    grads: Option<DeviceGrads>,
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
        let (params, state_len) = match &shard {
            None => (DeviceParams::Segments(parts), len),
            Some((range, padded)) => {
                if *padded > len {
                    parts.push(Tensor::zeros([*padded - len], &device));
                }
                let flat = concat(parts, &device);
                (DeviceParams::Flat(Box::new(flat)), range.len())
            }
        };
        let state = (0..state_buffers)
            .map(|_| Tensor::<1>::zeros([state_len], &device))
            .collect();
        Self {
            params,
            device,
            grads: None,
            state,
            shard,
        }
    }

    /// Concatenates each segment's gradient into the flat gradient buffer (zeros where a
    /// parameter got none, and over the padding under ZeRO); with `alone` (one process) and
    /// parameters of their own, keeps them as they are instead: nothing averages them.
    pub fn gather(
        &mut self,
        plan: &FlatPlan,
        grads: impl Iterator<Item = Option<Tensor<1>>>,
        alone: bool,
    ) {
        if alone && matches!(self.params, DeviceParams::Segments(_)) {
            let parts = grads.map(|grad| grad.map(params::as_f32)).collect();
            self.grads = Some(DeviceGrads::Segments(parts));
            return;
        }
        let device = self.device.clone();
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
        self.grads = Some(DeviceGrads::Flat(Box::new(concat(parts, &device))));
    }

    /// Averages the gathered gradients over the processes (on the host, where the collectives
    /// run, or with NCCL on the device) and returns the sum of their squares. With one process
    /// and `defer`, the sum is left to whoever needs it (the gradients stay queued on the
    /// device, no read waits for them); without `defer`, one 4-byte read.
    pub fn average(
        &mut self,
        wire: &mut Wire,
        comm: &Comm,
        defer: bool,
    ) -> Result<SumOfSquares, AccelerateError> {
        let grads = match self.grads.take() {
            None => return Err(AccelerateError::UnexpectedGradients { rank: comm.rank() }),
            Some(DeviceGrads::Flat(grads)) => *grads,
            // Gathered so only for one process: nothing to average.
            Some(DeviceGrads::Segments(parts)) => {
                let present: Vec<Tensor<1>> = parts.iter().flatten().cloned().collect();
                self.grads = Some(DeviceGrads::Segments(parts));
                return Ok(if defer {
                    SumOfSquares::Deferred(present)
                } else {
                    SumOfSquares::Measured(sum_of_squares_on_device(&present))
                });
            }
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
            self.grads = Some(DeviceGrads::Flat(Box::new(averaged)));
            return Ok(SumOfSquares::Measured(f64::from(sum_sq[0])));
        }
        if !comm.is_distributed() {
            self.grads = Some(DeviceGrads::Flat(Box::new(grads.clone())));
            return Ok(if defer {
                SumOfSquares::Deferred(vec![grads])
            } else {
                SumOfSquares::Measured(sum_of_squares_on_device(&[grads]))
            });
        }
        let device = grads.device();
        // One host copy, which then becomes the averaged tensor's buffer.
        let mut values = params::to_host_f32(grads);
        comm.timed(|group| wire.all_reduce_mean(&mut values, group))?;
        let sum_sq = accelerate_kernels::sum_of_squares(&values);
        self.grads = Some(DeviceGrads::Flat(Box::new(params::upload(values, &device))));
        Ok(SumOfSquares::Measured(sum_sq))
    }

    /// One cubecl kernel per segment, writing the parameters to new tensors: one per updated
    /// segment (the others keep theirs), or, under ZeRO, a new flat buffer (segments without
    /// a gradient copied).
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
        // Each with the index of its parameter (the padding: one past the last).
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
                let planned = PlannedSegment {
                    offset: start - range.start,
                    len: end - start,
                    update,
                };
                segments.push((index, planned));
            }
        }
        // The padding at the end of the last shard is carried over unchanged (zeros).
        let tail = plan.len.max(range.start);
        if tail < range.end {
            let padding = PlannedSegment {
                offset: tail - range.start,
                len: range.end - tail,
                update: None,
            };
            segments.push((plan.segments.len(), padding));
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
        let len = range.len();
        let mut state = std::mem::take(&mut self.state);
        match (&mut self.params, &self.shard) {
            (DeviceParams::Segments(values), _) => {
                // One update per segment, reading and writing that parameter's own tensor;
                // a segment without a gradient keeps its tensor.
                for (index, segment) in segments {
                    let Some(value) = values.get_mut(index).filter(|_| segment.update.is_some())
                    else {
                        continue;
                    };
                    let (grad, grads_offset) = match &grads {
                        DeviceGrads::Flat(flat) => (Tensor::clone(flat), 0),
                        DeviceGrads::Segments(parts) => {
                            match parts.get(index).and_then(Option::as_ref) {
                                Some(grad) => (grad.clone(), segment.offset),
                                None => continue,
                            }
                        }
                    };
                    let plan = FusedPlan {
                        rule: rule.clone(),
                        grad_scale,
                        len,
                        params_offset: segment.offset,
                        grads_offset,
                        segments: vec![segment],
                    };
                    let (updated, next) =
                        crate::device_kernels::fused_update(value.clone(), grad, state, plan);
                    *value = updated;
                    state = next;
                }
            }
            (DeviceParams::Flat(flat), shard) => {
                let DeviceGrads::Flat(grads) = grads else {
                    // Gathered per segment only where the parameters are.
                    self.state = state;
                    return Err(AccelerateError::UnexpectedGradients { rank: comm.rank() });
                };
                let params = match shard {
                    None => Tensor::clone(flat),
                    Some((range, _)) => Tensor::clone(flat).narrow(0, range.start, range.len()),
                };
                let plan = FusedPlan {
                    rule,
                    grad_scale,
                    len,
                    params_offset: 0,
                    grads_offset: 0,
                    segments: segments.into_iter().map(|(_, s)| s).collect(),
                };
                let (params, next) =
                    crate::device_kernels::fused_update(params, *grads, state, plan);
                state = next;
                let gathered = match (shard, comm.device_collectives()) {
                    (Some(_), Some(nccl)) => comm.timed_device(|| nccl.all_gather(params)),
                    _ => Ok(params),
                };
                match gathered {
                    Ok(params) => **flat = params,
                    Err(error) => {
                        self.state = state;
                        return Err(error);
                    }
                }
            }
        }
        self.state = state;
        Ok(())
    }

    /// The parameters, one tensor per segment (no copy: the tensors themselves, or views of
    /// the flat buffer).
    pub fn values(&self, plan: &FlatPlan) -> Vec<Tensor<1>> {
        match &self.params {
            DeviceParams::Segments(values) => values.clone(),
            DeviceParams::Flat(flat) => plan
                .segments
                .iter()
                .map(|s| Tensor::clone(flat).narrow(0, s.offset, s.len))
                .collect(),
        }
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
        self.state = state
            .into_iter()
            .map(|values| params::upload(values, &self.device))
            .collect();
    }

    /// Bytes of optimizer state held.
    pub fn held_bytes(&self) -> HeldBytes {
        HeldBytes {
            // The model views the master parameters; the gradients live for one step.
            master_parameters: 0,
            gradients: 0,
            optimizer_state: self
                .state
                .iter()
                .map(|s| s.shape().num_elements() * 4)
                .sum(),
        }
    }
}
