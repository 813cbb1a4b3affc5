//! The fused update written into the model's own f32 parameters (on the CPU backends, where
//! they live in host memory), one parameter at a time:
//! each is moved out of the model (`into_data` of its only reference hands the storage over),
//! updated where this process holds its optimizer state, and moved back. Without ZeRO that is
//! the whole parameter; under ZeRO-1/2 each rank updates its part and broadcasts it to the
//! others straight into their copy of the parameter, so no process keeps a master copy or
//! builds a second copy of the model's parameters.

use std::ops::Range;

use accelerate_kernels::optim::{adam_step, sgd_step};
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::{Device, Tensor, TensorData};

use super::grads::{GradBuffer, ShardGrads};
use super::plan::FlatPlan;
use crate::error::AccelerateError;
use crate::fused::FusedOptimizer;
use crate::group::Comm;
use crate::params::{self, ParamUpdate};

/// What one step applies: the optimizer, its learning rates and the gradient scale (fp16
/// unscale x clip factor).
#[derive(Clone, Copy)]
pub(crate) struct StepRates<'a> {
    pub optimizer: &'a FusedOptimizer,
    pub lr: &'a ModuleLearningRate,
    pub grad_scale: f32,
}

impl<'a> StepRates<'a> {
    /// Segment `segment`'s update in this step, its update count advanced; `None` where it got
    /// no gradient in the window. Burn counts updates per parameter, and every rank advances
    /// every segment's count, so that a shard boundary inside a segment sees one count.
    pub fn counted(&self, plan: &mut FlatPlan, segment: usize) -> Option<SegmentUpdate<'a>> {
        if !plan.has_grad[segment] {
            return None;
        }
        plan.times[segment] += 1;
        Some(SegmentUpdate {
            optimizer: self.optimizer,
            time: plan.times[segment],
            rate: plan.rate(segment, self.lr),
            grad_scale: self.grad_scale,
        })
    }
}

/// Where the averaged gradients are.
#[derive(Clone, Copy)]
pub(super) enum Averaged<'a> {
    /// Whole, as the step's gradient buffer holds them.
    Whole(&'a GradBuffer),
    /// This rank's shard of the flat range (ZeRO-1/2).
    Shard(&'a ShardGrads),
}

/// One segment's fused update: its count, rate and gradient scale.
pub(crate) struct SegmentUpdate<'a> {
    pub optimizer: &'a FusedOptimizer,
    pub time: i32,
    pub rate: f64,
    pub grad_scale: f32,
}

impl SegmentUpdate<'_> {
    /// Updates `params` from `grads` and the state at `local` (the segment's place in the
    /// state buffers), moments and parameters in place.
    pub fn apply(
        &self,
        params: &mut [f32],
        grads: &[f32],
        state: &mut [Vec<f32>],
        local: Range<usize>,
    ) {
        match self.optimizer {
            FusedOptimizer::Adam { hyper, amsgrad } => {
                let (m, rest) = state.split_at_mut(1);
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
                    &mut v[0][local],
                    max_v,
                    self.time,
                    self.rate,
                    self.grad_scale,
                    hyper,
                );
            }
            FusedOptimizer::Sgd { .. } => {
                let Some(hyper) = self.optimizer.sgd_hyper() else {
                    return;
                };
                let velocity = state.first_mut().map(|v| &mut v[local]);
                sgd_step(
                    params,
                    grads,
                    velocity,
                    self.time == 1,
                    self.rate,
                    self.grad_scale,
                    &hyper,
                );
            }
        }
    }
}

/// The update of the model's own parameters, one at a time.
pub(super) struct InPlace<'a> {
    plan: &'a mut FlatPlan,
    /// The segment of each float parameter (visit order), for those trained.
    segment_of: Vec<Option<usize>>,
    step: StepRates<'a>,
    grads: Averaged<'a>,
    state: &'a mut [Vec<f32>],
    device: &'a Device,
    comm: &'a Comm,
    /// The first failed broadcast: the parameters after it are left as they are (the step
    /// fails, and so do the peers' collectives).
    error: Option<AccelerateError>,
}

impl<'a> InPlace<'a> {
    pub fn new(
        plan: &'a mut FlatPlan,
        step: StepRates<'a>,
        grads: Averaged<'a>,
        state: &'a mut [Vec<f32>],
        device: &'a Device,
        comm: &'a Comm,
    ) -> Self {
        let entries = plan.entries.iter().max().map_or(0, |&e| e + 1);
        let mut segment_of = vec![None; entries];
        for (index, &entry) in plan.entries.iter().enumerate() {
            segment_of[entry] = Some(index);
        }
        Self {
            plan,
            segment_of,
            step,
            grads,
            state,
            device,
            comm,
            error: None,
        }
    }

    /// The step's outcome once every parameter was visited.
    pub fn finish(self) -> Result<(), AccelerateError> {
        self.error.map_or(Ok(()), Err)
    }

    fn segment(&self, index: usize) -> Option<usize> {
        self.segment_of.get(index).copied().flatten()
    }

    /// Applies segment `segment`'s update to `values` (the whole parameter) where this
    /// process holds its state, then (under ZeRO) has every rank's part broadcast into it.
    fn update_segment(&mut self, segment: usize, values: &mut [f32]) {
        let update = self.step.counted(self.plan, segment);
        let (offset, len) = (
            self.plan.segments[segment].offset,
            self.plan.segments[segment].len,
        );
        match self.grads {
            Averaged::Whole(grads) => {
                let range = offset..offset + len;
                if let Some(update) = update
                    && let Some(grads) = grads.whole(segment, range.clone())
                    && grads.len() == values.len()
                {
                    update.apply(values, grads, self.state, range);
                }
            }
            Averaged::Shard(grads) => {
                let shard = self.plan.shard.clone();
                let (start, end) = (offset.max(shard.start), (offset + len).min(shard.end));
                if let Some(update) = update
                    && start < end
                {
                    let local = start - shard.start..end - shard.start;
                    let params = &mut values[start - offset..end - offset];
                    if let Some(grads) = grads.part(self.plan, segment, local.clone())
                        && grads.len() == params.len()
                    {
                        update.apply(params, grads, self.state, local);
                    }
                }
                if self.error.is_none()
                    && let Err(e) = self.share(offset, values)
                {
                    self.error = Some(e);
                }
            }
        }
    }

    /// Every rank's part of a parameter (`values`, at `offset` of the flat range), broadcast
    /// by its owner to the others.
    fn share(&self, offset: usize, values: &mut [f32]) -> Result<(), AccelerateError> {
        if !self.comm.is_distributed() {
            return Ok(());
        }
        let per_rank = self.plan.shard.len();
        let end = offset + values.len();
        for root in 0..self.comm.world_size() {
            let start = offset.max(root * per_rank);
            let stop = end.min((root + 1) * per_rank);
            if start < stop {
                let part = &mut values[start - offset..stop - offset];
                self.comm.timed(|group| group.broadcast(part, root))?;
            }
        }
        Ok(())
    }
}

impl ParamUpdate for InPlace<'_> {
    fn updates(&self, index: usize) -> bool {
        // Under ZeRO every trained parameter is visited, gradient or not, so that every rank
        // makes the same broadcasts.
        self.segment(index).is_some_and(|s| match self.grads {
            Averaged::Whole(_) => self.plan.has_grad[s],
            Averaged::Shard(_) => true,
        })
    }

    fn update(&mut self, index: usize, current: TensorData) -> Tensor<1> {
        let mut data = params::into_f32(current);
        if let Some(segment) = self.segment(index)
            && let Ok(values) = data.as_mut_slice::<f32>()
            && values.len() == self.plan.segments[segment].len
        {
            self.update_segment(segment, values);
        }
        Tensor::from_data(data, self.device)
    }
}
