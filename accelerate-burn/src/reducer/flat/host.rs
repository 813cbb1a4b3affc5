//! The flat buffers in host memory: the step's gradients (a flat buffer all-reduced whole, else
//! each parameter's own tensor until the update), this rank's averaged shard of them under
//! ZeRO, and the optimizer state over the shard. The update is one pass of
//! `accelerate_kernels::optim` per segment (moments and parameters in place): into the model's
//! own f32 parameters where they are in host memory (`in_place`), else into an f32 master
//! copy (this rank's shard under ZeRO) from which the model receives its new values in one
//! upload per parameter tensor.

use burn::tensor::{DType, Device, Tensor};

use super::columns::{self, SegmentGrads};
use super::cut::Cut;
use super::grads::{GradBuffer, ShardGrads};
use super::in_place::{Averaged, InPlace, StepRates};
use super::plan::{FlatPlan, Sharding};
use crate::error::AccelerateError;
use crate::fused::HeldBytes;
use crate::params::{self, copy_f32};
use crate::reducer::api::ModelUpdate;
use crate::reducer::wire::Wire;

/// Flat buffers on the host.
pub(crate) struct HostFlat {
    /// Master parameters: all of them (padded), or this rank's shard under ZeRO; none when
    /// `in_place`.
    params: Vec<f32>,
    /// The model's own f32 parameters, in host memory, are the master copy: the update reads
    /// and writes them one parameter at a time, and these buffers keep no copy of them.
    in_place: bool,
    /// The step's gradients until the update (none kept under ZeRO).
    grads: GradBuffer,
    /// This rank's averaged gradients under ZeRO (none otherwise): in backward's own tensors,
    /// or under ZeRO-2 the sum of a window of several micro-batches.
    shard_grads: ShardGrads,
    sharding: Sharding,
    /// Optimizer state over the shard: `state_buffers` vectors.
    pub state: Vec<Vec<f32>>,
    /// Where the model's parameters are uploaded.
    device: Device,
}

impl HostFlat {
    /// Buffers for `plan`, starting from `trainable` (one tensor per segment), with `grads`
    /// for the gradients; `on_host`: the model's parameters live in host memory, where the
    /// update can write them without copying them down and up (a GPU model keeps the master
    /// copy here instead).
    pub fn new(
        plan: &FlatPlan,
        trainable: Vec<Tensor<1>>,
        state_buffers: usize,
        grads: GradBuffer,
        sharding: Sharding,
        on_host: bool,
    ) -> Self {
        let device = trainable.first().map(Tensor::device).unwrap_or_default();
        let shard = plan.shard.len();
        let in_place = on_host && trainable.iter().all(|t| t.dtype() == DType::F32);
        let held = if in_place {
            0..0
        } else if sharding.splits() {
            plan.shard.clone()
        } else {
            0..plan.padded
        };
        let mut params = vec![0.0; held.len()];
        for (segment, value) in plan.segments.iter().zip(trainable) {
            let start = segment.offset.max(held.start);
            let end = (segment.offset + segment.len).min(held.end);
            if start >= end {
                continue;
            }
            let target = &mut params[start - held.start..end - held.start];
            if end - start == segment.len {
                copy_f32(value.into_data(), target);
            } else {
                // Only part of this parameter is ours: read it whole, keep the part.
                let whole = params::to_host_f32(value);
                target.copy_from_slice(&whole[start - segment.offset..end - segment.offset]);
            }
        }
        Self {
            params,
            in_place,
            grads,
            shard_grads: ShardGrads::none(),
            sharding,
            state: vec![vec![0.0; shard]; state_buffers],
            device,
        }
    }

    /// Elements of the flat gradient buffer (0 without one).
    pub fn grads_len(&self) -> usize {
        self.grads.flat_len()
    }

    /// The gradient buffer, for new buffers of the same length to reuse (this one is left
    /// with none).
    pub fn take_grads(&mut self) -> GradBuffer {
        std::mem::replace(&mut self.grads, GradBuffer::Segments(SegmentGrads::none()))
    }

    /// Averages one window's gradients (`plan` order) over the processes: all-reduced in the
    /// flat buffer, or under ZeRO-1 reduce-scattered where they are (this rank's shard of each
    /// averaged in its own tensor, no flat copy); one process keeps them as they are. Returns
    /// the sum of their squares over every rank.
    pub fn average(
        &mut self,
        plan: &mut FlatPlan,
        grads: impl Iterator<Item = Option<Tensor<1>>>,
        wire: &mut Wire,
        cut: Cut<'_>,
    ) -> Result<f64, AccelerateError> {
        let comm = cut.job;
        if self.sharding.splits() {
            let grads = SegmentGrads::take(grads);
            let kept = columns::reduce_scatter_in_place(plan, grads, wire, cut)?;
            self.shard_grads = ShardGrads::InSegments(kept);
        } else if let Some(flat) = self.grads.flat_mut() {
            flatten(plan, grads, flat);
            if comm.is_distributed() {
                comm.timed(|group| match &mut self.grads {
                    GradBuffer::Group(grads) => wire.all_reduce_mean_shared(grads, group),
                    GradBuffer::Flat(grads) => wire.all_reduce_mean(grads, group),
                    GradBuffer::Segments(_) => Ok(()),
                })?;
            }
        } else if comm.is_distributed() {
            // Built with a flat buffer whenever there are processes to average over.
            return Err(AccelerateError::UnexpectedGradients { rank: comm.rank() });
        } else {
            self.grads = GradBuffer::Segments(SegmentGrads::take(grads));
        }
        self.measure(plan, cut)
    }

    /// ZeRO-2: averages one micro-batch's gradients over the processes straight into this
    /// rank's shard of the window's sum (`first`: the window's first micro-batch, which
    /// replaces the sum), column by column from the gradients themselves. A window's first
    /// micro-batch is averaged where it is, as at ZeRO-1; its second moves the sum into a
    /// vector of the shard's length (kept for later windows), so a window of one costs no
    /// more than ZeRO-1.
    ///
    /// Each micro-batch communicates: holding the window's sum as shards means each rank's
    /// share of it must be sent away before the next backward pass, as DeepSpeed's ZeRO-2
    /// does. (ZeRO-1 keeps the whole local sum and communicates once per window.)
    pub fn accumulate(
        &mut self,
        plan: &FlatPlan,
        grads: impl Iterator<Item = Option<Tensor<1>>>,
        first: bool,
        wire: &mut Wire,
        cut: Cut<'_>,
    ) -> Result<(), AccelerateError> {
        let grads = SegmentGrads::take(grads);
        match &mut self.shard_grads {
            ShardGrads::Buffer(sum) => columns::reduce_scatter(plan, grads, sum, !first, wire, cut),
            ShardGrads::InSegments(_) if first => {
                let kept = columns::reduce_scatter_in_place(plan, grads, wire, cut)?;
                self.shard_grads = ShardGrads::InSegments(kept);
                Ok(())
            }
            ShardGrads::InSegments(held) => {
                let mut sum = held.shard_values(plan);
                // The first micro-batch's gradients are let go before the second is sent.
                self.shard_grads = ShardGrads::Buffer(Vec::new());
                columns::reduce_scatter(plan, grads, &mut sum, true, wire, cut)?;
                self.shard_grads = ShardGrads::Buffer(sum);
                Ok(())
            }
        }
    }

    /// ZeRO-2 over units' taps: the vector of this rank's shard of the window's sum, for the
    /// gradient pipe to reduce into (made here the first time, of the shard's length; a
    /// window's first micro-batch replaces what it holds).
    pub fn take_shard_sum(&mut self, plan: &FlatPlan, first: bool) -> Vec<f32> {
        match std::mem::replace(&mut self.shard_grads, ShardGrads::none()) {
            ShardGrads::Buffer(sum) if sum.len() == plan.shard.len() => sum,
            // A window begun after backward (without taps) goes on here.
            ShardGrads::InSegments(held) if !first => held.shard_values(plan),
            _ => vec![0.0; plan.shard.len()],
        }
    }

    /// Takes back the window's sum [`take_shard_sum`](Self::take_shard_sum) lent.
    pub fn keep_shard_sum(&mut self, sum: Vec<f32>) {
        self.shard_grads = ShardGrads::Buffer(sum);
    }

    /// ZeRO-2: multiplies the window's held sum by `factor` (a window of summed losses,
    /// weighted by its items).
    pub fn scale_held(&mut self, plan: &FlatPlan, factor: f32) {
        self.shard_grads.scale(plan, factor);
    }

    /// The sum of the squares of the averaged gradients over every rank (this rank's shard,
    /// summed across the ranks, under ZeRO); the ranks agree on which segments got gradients
    /// in the window ([`FlatPlan::agree_grads`]) on the way.
    pub fn measure(&self, plan: &mut FlatPlan, cut: Cut<'_>) -> Result<f64, AccelerateError> {
        if self.sharding.splits() {
            // Each rank measured its shard: the sum over the ranks rides on the agreement on
            // which segments got gradients.
            let shard = self.shard_grads.sum_of_squares(plan);
            let total = plan.agree_grads(cut, Some(shard))?;
            return Ok(total.unwrap_or(shard));
        }
        plan.agree_grads(cut, None)?;
        Ok(self.grads.sum_of_squares())
    }

    /// Lets go of gradients kept as backward returned them (after the update, or a skipped
    /// step).
    pub fn release_grads(&mut self) {
        if let GradBuffer::Segments(grads) = &mut self.grads {
            *grads = SegmentGrads::none();
        }
        self.shard_grads.release();
    }

    /// Applies the fused update to this rank's shard with the learning rates of `lr`.
    pub fn step(&mut self, plan: &mut FlatPlan, step: StepRates<'_>) {
        let shard = plan.shard.clone();
        // Under ZeRO the master parameters are the shard only.
        let base = if self.sharding.splits() {
            shard.start
        } else {
            0
        };
        for index in 0..plan.segments.len() {
            let Some(update) = step.counted(plan, index) else {
                continue;
            };
            let segment = &plan.segments[index];
            let start = segment.offset.max(shard.start);
            let end = (segment.offset + segment.len).min(shard.end);
            if start >= end {
                continue;
            }
            let params = &mut self.params[start - base..end - base];
            let local = start - shard.start..end - shard.start;
            let grads = if self.sharding.splits() {
                self.shard_grads.part(plan, index, local.clone())
            } else {
                self.grads.whole(index, local.clone())
            };
            let Some(grads) = grads.filter(|grads| grads.len() == params.len()) else {
                continue;
            };
            update.apply(params, grads, &mut self.state, local);
        }
        self.release_grads();
    }

    /// Without a copy of the parameters (`in_place`): the fused update of each parameter of
    /// `model`, read from the model and written back one at a time; under ZeRO each rank
    /// updates its part of a parameter and sends it to the others there
    /// ([`in_place::InPlace`]).
    pub fn step_in_place(
        &mut self,
        plan: &mut FlatPlan,
        step: StepRates<'_>,
        model: &mut dyn ModelUpdate,
        cut: Cut<'_>,
    ) -> Result<(), AccelerateError> {
        let grads = if self.sharding.splits() {
            Averaged::Shard(&self.shard_grads)
        } else {
            Averaged::Whole(&self.grads)
        };
        let mut update = InPlace::new(plan, step, grads, &mut self.state, &self.device, cut.shard);
        model.update_each(&mut update);
        let result = update.finish();
        self.release_grads();
        result
    }

    /// Whether the update writes the model's parameters (no master copy here).
    pub fn in_place(&self) -> bool {
        self.in_place
    }

    /// The updated master parameters, one tensor per segment; under ZeRO every rank's shard
    /// is gathered into each parameter's own buffer, column by column.
    pub fn publish(
        &mut self,
        plan: &FlatPlan,
        cut: Cut<'_>,
    ) -> Result<Vec<Tensor<1>>, AccelerateError> {
        if self.sharding.splits() {
            let values = columns::all_gather(plan, &self.params, cut)?;
            return Ok(values
                .into_iter()
                .map(|values| params::upload(values, &self.device))
                .collect());
        }
        Ok(plan
            .segments
            .iter()
            .map(|s| {
                params::upload(
                    self.params[s.offset..s.offset + s.len].to_vec(),
                    &self.device,
                )
            })
            .collect())
    }

    /// What these buffers hold between steps.
    pub fn held_bytes(&self) -> HeldBytes {
        let bytes = |v: &Vec<f32>| v.capacity() * 4;
        HeldBytes {
            master_parameters: bytes(&self.params),
            gradients: self.grads.bytes() + self.shard_grads.bytes(),
            optimizer_state: self.state.iter().map(bytes).sum(),
        }
    }
}

/// Copies each segment's gradient into `flat` at its offset (zeros where a parameter got
/// none).
fn flatten(plan: &FlatPlan, grads: impl Iterator<Item = Option<Tensor<1>>>, flat: &mut [f32]) {
    for (segment, grad) in plan.segments.iter().zip(grads) {
        let range = segment.offset..segment.offset + segment.len;
        match grad {
            // Moved, not cloned: a uniquely owned tensor hands its data over uncopied.
            Some(grad) => copy_f32(grad.into_data(), &mut flat[range]),
            None => flat[range].fill(0.0),
        }
    }
}
