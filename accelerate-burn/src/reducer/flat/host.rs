//! The flat buffers in host memory: the f32 master parameters, the gathered gradients, this
//! rank's averaged shard of them, and the optimizer state over the shard. The update is one
//! pass of `accelerate_kernels::optim` per segment (moments and parameters in place, no
//! allocation); the model receives its new values in one upload per parameter tensor.

use std::ops::{Deref, DerefMut};

use accelerate_core::comm::{Reduction, SharedBuffer};
use accelerate_kernels::optim::{adam_step, sgd_step};
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::{Device, Tensor};

use super::plan::{FlatPlan, Sharding};
use crate::error::AccelerateError;
use crate::fused::{FusedOptimizer, HeldBytes};
use crate::group::Comm;
use crate::params::{self, copy_f32};
use crate::reducer::wire::Wire;

/// Where the gathered gradients live: the process group's shared buffer when they are
/// all-reduced whole (on shared memory the peers then read them where they are, with no
/// staging copy), else an ordinary vector.
pub(crate) enum GradBuffer {
    /// One process, or ZeRO (reduce-scattered into the shard).
    Local(Vec<f32>),
    /// All-reduced in place.
    Group(SharedBuffer<f32>),
}

impl Deref for GradBuffer {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Self::Local(v) => v,
            Self::Group(b) => b,
        }
    }
}

impl DerefMut for GradBuffer {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            Self::Local(v) => v,
            Self::Group(b) => b,
        }
    }
}

/// Flat buffers on the host.
pub(crate) struct HostFlat {
    /// Master parameters: all of them (padded), or this rank's shard under ZeRO-2.
    params: Vec<f32>,
    /// Gradients, all of them (padded), as copied from the device; without ZeRO, averaged
    /// there in place. Empty under ZeRO-2, which gathers each micro-batch into a buffer of
    /// its own and lets it go once scattered.
    grads: GradBuffer,
    /// This rank's averaged gradients under ZeRO (empty otherwise); under ZeRO-2 the sum of
    /// the open window's micro-batches.
    shard_grads: Vec<f32>,
    sharding: Sharding,
    /// Optimizer state over the shard: `state_buffers` vectors.
    pub state: Vec<Vec<f32>>,
    /// This rank's updated shard, sent to the others (ZeRO-1; ZeRO-2 sends `params`).
    shard_params: Vec<f32>,
    /// Where the model's parameters are uploaded.
    device: Device,
}

impl HostFlat {
    /// Buffers for `plan`, starting from `trainable` (one tensor per segment), with `grads`
    /// (`plan.padded` zeros; empty under ZeRO-2) for the gradients.
    pub fn new(
        plan: &FlatPlan,
        trainable: Vec<Tensor<1>>,
        state_buffers: usize,
        grads: GradBuffer,
        sharding: Sharding,
    ) -> Self {
        let device = trainable.first().map(Tensor::device).unwrap_or_default();
        let shard = plan.shard.len();
        let held = if sharding == Sharding::Gradients {
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
            grads,
            shard_grads: if sharding.splits() {
                vec![0.0; shard]
            } else {
                Vec::new()
            },
            sharding,
            state: vec![vec![0.0; shard]; state_buffers],
            shard_params: if sharding == Sharding::State {
                vec![0.0; shard]
            } else {
                Vec::new()
            },
            device,
        }
    }

    /// Elements of the gradient buffer.
    pub fn grads_len(&self) -> usize {
        self.grads.len()
    }

    /// The gradient buffer, for new buffers of the same length to reuse (this one is left
    /// with an empty one).
    pub fn take_grads(&mut self) -> GradBuffer {
        std::mem::replace(&mut self.grads, GradBuffer::Local(Vec::new()))
    }

    /// Copies each segment's gradient into the flat gradient buffer (zeros where a parameter
    /// got none).
    pub fn gather(&mut self, plan: &FlatPlan, grads: impl Iterator<Item = Option<Tensor<1>>>) {
        flatten(plan, grads, &mut self.grads);
    }

    /// Averages the gathered gradients over the processes into the shard (all-reduce, or
    /// reduce-scatter with ZeRO-1) and returns the sum of their squares over every rank.
    pub fn average(&mut self, wire: &mut Wire, comm: &Comm) -> Result<f64, AccelerateError> {
        if comm.is_distributed() {
            comm.timed(|group| match &mut self.grads {
                GradBuffer::Local(grads) if self.sharding.splits() => {
                    wire.reduce_scatter_mean(grads, &mut self.shard_grads, group)
                }
                GradBuffer::Local(grads) => wire.all_reduce_mean(grads, group),
                GradBuffer::Group(grads) => wire.all_reduce_mean_shared(grads, group),
            })?;
        } else if self.sharding.splits() {
            // One process's shard is everything (ZeRO kept for one GPU under required NCCL,
            // on a model too large for the device buffers).
            let n = self.shard_grads.len();
            self.shard_grads.copy_from_slice(&self.grads[..n]);
        }
        self.measure(comm)
    }

    /// ZeRO-2: averages one micro-batch's gradients over the processes straight into this
    /// rank's shard of the window's sum (`first`: the window's first micro-batch, which
    /// replaces the sum). The whole flat gradient exists only for this call.
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
        comm: &Comm,
    ) -> Result<(), AccelerateError> {
        let mut flat = vec![0.0; plan.padded];
        flatten(plan, grads, &mut flat);
        let mut part = if first {
            std::mem::take(&mut self.shard_grads)
        } else {
            vec![0.0; plan.shard.len()]
        };
        if comm.is_distributed() {
            comm.timed(|group| wire.reduce_scatter_mean(&mut flat, &mut part, group))?;
        } else {
            part.copy_from_slice(&flat[plan.shard.clone()]);
        }
        if first {
            self.shard_grads = part;
        } else {
            for (sum, value) in self.shard_grads.iter_mut().zip(&part) {
                *sum += value;
            }
        }
        Ok(())
    }

    /// ZeRO-2: multiplies the window's held sum by `factor` (a window of summed losses,
    /// weighted by its items).
    pub fn scale_held(&mut self, factor: f32) {
        accelerate_kernels::scale_in_place(&mut self.shard_grads, factor);
    }

    /// The sum of the squares of the averaged gradients over every rank (this rank's shard,
    /// summed across the ranks, under ZeRO).
    pub fn measure(&self, comm: &Comm) -> Result<f64, AccelerateError> {
        let mut sum_sq = accelerate_kernels::sum_of_squares(self.averaged());
        if comm.is_distributed() && self.sharding.splits() {
            // Each rank measured its shard; infinities and NaN survive the sum.
            let mut total = [sum_sq as f32];
            comm.timed(|group| group.all_reduce(&mut total, Reduction::Sum))?;
            sum_sq = f64::from(total[0]);
        }
        Ok(sum_sq)
    }

    /// This rank's averaged gradients: its shard under ZeRO, else all of them.
    fn averaged(&self) -> &[f32] {
        if self.sharding.splits() {
            &self.shard_grads
        } else {
            &self.grads
        }
    }

    /// Applies the fused update to this rank's shard with the learning rates of `lr`.
    pub fn step(
        &mut self,
        plan: &mut FlatPlan,
        optimizer: &FusedOptimizer,
        lr: &ModuleLearningRate,
        grad_scale: f32,
    ) {
        let shard = plan.shard.clone();
        for index in 0..plan.segments.len() {
            if !plan.has_grad[index] {
                continue;
            }
            let segment = &plan.segments[index];
            let start = segment.offset.max(shard.start);
            let end = (segment.offset + segment.len).min(shard.end);
            // Burn counts updates per parameter; every rank advances every segment's count so
            // that a shard boundary inside a segment sees one count.
            plan.times[index] += 1;
            if start >= end {
                continue;
            }
            let rate = plan.rate(index, lr);
            let time = plan.times[index];
            // ZeRO-2 holds only the shard of the master parameters.
            let base = if self.sharding == Sharding::Gradients {
                shard.start
            } else {
                0
            };
            let params = &mut self.params[start - base..end - base];
            let local = start - shard.start..end - shard.start;
            let grads = if self.sharding.splits() {
                &self.shard_grads[local.clone()]
            } else {
                &self.grads[local.clone()]
            };
            match optimizer {
                FusedOptimizer::Adam { hyper, amsgrad } => {
                    let (m, rest) = self.state.split_at_mut(1);
                    let (v, rest) = rest.split_at_mut(1);
                    let max_v = if *amsgrad {
                        Some(&mut rest[0][local.clone()])
                    } else {
                        None
                    };
                    adam_step(
                        params,
                        grads,
                        &mut m[0][local.clone()],
                        &mut v[0][local.clone()],
                        max_v,
                        time,
                        rate,
                        grad_scale,
                        hyper,
                    );
                }
                FusedOptimizer::Sgd { .. } => {
                    let Some(hyper) = optimizer.sgd_hyper() else {
                        continue;
                    };
                    let velocity = self.state.first_mut().map(|v| &mut v[local.clone()]);
                    sgd_step(params, grads, velocity, time == 1, rate, grad_scale, &hyper);
                }
            }
        }
    }

    /// The updated master parameters, one tensor per segment; under ZeRO every rank's shard
    /// is gathered first (under ZeRO-2 into a buffer that lives only for this call).
    pub fn publish(
        &mut self,
        plan: &FlatPlan,
        comm: &Comm,
    ) -> Result<Vec<Tensor<1>>, AccelerateError> {
        let gathered = comm.is_distributed() && plan.shard.len() < plan.padded;
        match self.sharding {
            Sharding::State if gathered => {
                self.shard_params
                    .copy_from_slice(&self.params[plan.shard.clone()]);
                comm.timed(|group| group.all_gather(&self.shard_params, &mut self.params))?;
            }
            Sharding::Gradients if gathered => {
                let mut all = vec![0.0; plan.padded];
                comm.timed(|group| group.all_gather(&self.params, &mut all))?;
                return Ok(self.upload(plan, &all));
            }
            _ => {}
        }
        Ok(self.upload(plan, &self.params))
    }

    /// `all` (every master parameter, padded), one tensor per segment on the model's device.
    fn upload(&self, plan: &FlatPlan, all: &[f32]) -> Vec<Tensor<1>> {
        plan.segments
            .iter()
            .map(|s| params::upload(all[s.offset..s.offset + s.len].to_vec(), &self.device))
            .collect()
    }

    /// What these buffers hold between steps.
    pub fn held_bytes(&self) -> HeldBytes {
        let bytes = |v: &Vec<f32>| v.capacity() * 4;
        HeldBytes {
            master_parameters: bytes(&self.params) + bytes(&self.shard_params),
            gradients: self.grads.len() * 4 + bytes(&self.shard_grads),
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
