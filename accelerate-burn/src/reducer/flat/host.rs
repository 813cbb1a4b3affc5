//! The flat buffers in host memory: the f32 master parameters, the gathered gradients, this
//! rank's averaged shard of them, and the optimizer state over the shard. The update is one
//! pass of `accelerate_kernels::optim` per segment (moments and parameters in place, no
//! allocation); the model receives its new values in one upload per parameter tensor.

use std::ops::{Deref, DerefMut};

use accelerate_core::comm::{ProcessGroup, Reduction, SharedBuffer};
use accelerate_kernels::optim::{adam_step, sgd_step};
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::{Device, Tensor};

use super::plan::FlatPlan;
use crate::error::AccelerateError;
use crate::fused::FusedOptimizer;
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
    /// Master parameters, all of them (padded).
    params: Vec<f32>,
    /// Gradients, all of them (padded), as copied from the device; without ZeRO, averaged
    /// there in place.
    grads: GradBuffer,
    /// This rank's averaged gradients under ZeRO (empty otherwise).
    shard_grads: Vec<f32>,
    sharded: bool,
    /// Optimizer state over the shard: `state_buffers` vectors.
    pub state: Vec<Vec<f32>>,
    /// This rank's updated shard, sent to the others (ZeRO).
    shard_params: Vec<f32>,
    /// Where the model's parameters are uploaded.
    device: Device,
}

impl HostFlat {
    /// Buffers for `plan`, starting from `trainable` (one tensor per segment), with `grads`
    /// (`plan.padded` zeros) for the gradients.
    pub fn new(
        plan: &FlatPlan,
        trainable: Vec<Tensor<1>>,
        state_buffers: usize,
        grads: GradBuffer,
        sharded: bool,
    ) -> Self {
        let device = trainable.first().map(Tensor::device).unwrap_or_default();
        let mut params = vec![0.0; plan.padded];
        for (segment, value) in plan.segments.iter().zip(trainable) {
            copy_f32(
                value.into_data(),
                &mut params[segment.offset..segment.offset + segment.len],
            );
        }
        let shard = plan.shard.len();
        Self {
            params,
            grads,
            shard_grads: if sharded {
                vec![0.0; shard]
            } else {
                Vec::new()
            },
            sharded,
            state: vec![vec![0.0; shard]; state_buffers],
            shard_params: vec![0.0; shard],
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
        for (segment, grad) in plan.segments.iter().zip(grads) {
            let range = segment.offset..segment.offset + segment.len;
            match grad {
                // Moved, not cloned: a uniquely owned tensor hands its data over uncopied.
                Some(grad) => copy_f32(grad.into_data(), &mut self.grads[range]),
                None => self.grads[range].fill(0.0),
            }
        }
    }

    /// Averages the gathered gradients over the processes into the shard (all-reduce, or
    /// reduce-scatter with ZeRO) and returns the sum of their squares over every rank.
    pub fn average(&mut self, wire: &mut Wire, comm: &Comm) -> Result<f64, AccelerateError> {
        if comm.is_distributed() {
            comm.timed(|group| match &mut self.grads {
                GradBuffer::Local(grads) if self.sharded => {
                    wire.reduce_scatter_mean(grads, &mut self.shard_grads, group)
                }
                GradBuffer::Local(grads) => wire.all_reduce_mean(grads, group),
                GradBuffer::Group(grads) => wire.all_reduce_mean_shared(grads, group),
            })?;
        } else if self.sharded {
            // One process's shard is everything (ZeRO kept for one GPU under required NCCL,
            // on a model too large for the device buffers).
            let n = self.shard_grads.len();
            self.shard_grads.copy_from_slice(&self.grads[..n]);
        }
        let mut sum_sq = accelerate_kernels::sum_of_squares(self.averaged());
        if comm.is_distributed() && self.sharded {
            // Each rank measured its shard; infinities and NaN survive the sum.
            let mut total = [sum_sq as f32];
            comm.timed(|group| group.all_reduce(&mut total, Reduction::Sum))?;
            sum_sq = f64::from(total[0]);
        }
        Ok(sum_sq)
    }

    /// This rank's averaged gradients: its shard under ZeRO, else all of them.
    fn averaged(&self) -> &[f32] {
        if self.sharded {
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
            let params = &mut self.params[start..end];
            let local = start - shard.start..end - shard.start;
            let grads = if self.sharded {
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

    /// Gives every rank every shard of the updated parameters (ZeRO).
    pub fn gather_params(
        &mut self,
        plan: &FlatPlan,
        group: &mut ProcessGroup,
    ) -> Result<(), AccelerateError> {
        self.shard_params
            .copy_from_slice(&self.params[plan.shard.clone()]);
        group.all_gather(&self.shard_params, &mut self.params)?;
        Ok(())
    }

    /// The master parameters, one tensor per segment.
    pub fn values(&self, plan: &FlatPlan) -> Vec<Tensor<1>> {
        plan.segments
            .iter()
            .map(|s| {
                params::upload(
                    self.params[s.offset..s.offset + s.len].to_vec(),
                    &self.device,
                )
            })
            .collect()
    }

    /// Bytes of optimizer state held.
    pub fn state_bytes(&self) -> usize {
        self.state.iter().map(|s| s.capacity() * 4).sum()
    }
}
