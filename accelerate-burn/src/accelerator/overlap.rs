//! `backward` through the gradient pipe ([`crate::overlap`]): the pipe averages a completed
//! window's gradients on the host, while backward runs where units feed it, and the reducer
//! takes them averaged (with a group of one); under ZeRO-2 it reduces each micro-batch into
//! the reducer's shard of the window's sum, the units' gradients let go as they go.

use std::collections::HashMap;
use std::sync::Arc;

use burn::module::{Module, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};

use super::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::overlap::pipe::{Averager, Delivery, PipePlan, PipeRun, WindowStart};
use crate::overlap::throttle::Throttle;
use crate::params::{self, ParamLayout, ParamList};
use crate::reducer::{GradientReducer, ReducerKind};

impl<B: AcceleratorBackend> Accelerator<B> {
    /// The pipe's plan for `reducer`'s gradients, when the pipe averages them: several
    /// processes, a reducer that takes averaged gradients, and Burn's optimizer (whose host
    /// path is the pipe) or a model with units.
    pub(crate) fn pipe_plan(&self, reducer: &dyn GradientReducer) -> Option<Arc<PipePlan>> {
        if !self.comm.is_distributed() || !reducer.takes_averaged() {
            return None;
        }
        let plan = self.units_plan(reducer);
        (reducer.kind() == ReducerKind::Burn || plan.has_units).then(|| Arc::new(plan))
    }

    /// `reducer`'s gradients cut into buckets at the accelerator's bucket size and at its
    /// units' edges.
    fn units_plan(&self, reducer: &dyn GradientReducer) -> PipePlan {
        PipePlan::new(reducer.layout(), self.config.gradient_bucket_bytes, |id| {
            self.taps.unit_of(id)
        })
    }

    /// The pipe's plan for a ZeRO-2 reducer's micro-batches, when the units' taps feed it:
    /// several processes, overlap on, a model with units, computing in f32. (Under autocast
    /// the taps see the parameters' casts, whose gradients Burn must carry on to the f32
    /// parameters: nothing would be let go, so ZeRO-2 averages after backward there.)
    pub(crate) fn shard_pipe_plan(&self, reducer: &dyn GradientReducer) -> Option<Arc<PipePlan>> {
        if !self.comm.is_distributed()
            || !self.taps.enabled()
            || !reducer.holds_window_sum()
            || self.compute_dtype != DType::F32
        {
            return None;
        }
        let plan = self.units_plan(reducer);
        plan.has_units.then(|| Arc::new(plan))
    }

    /// ZeRO-2 over units' taps: runs `loss`'s backward pass with the micro-batch's gradients
    /// reduce-scattered into `reducer`'s shard of the window's sum bucket by bucket, on a
    /// communication thread the taps feed as backward leaves each unit (each unit's gradients
    /// let go once in their bucket, so whole gradients never all exist at once: 4P + 12P/N),
    /// the other parameters' after backward. `first`: the window's first micro-batch.
    pub(crate) fn backward_into_shard<M: Module>(
        &self,
        loss: Tensor<1>,
        model: &M,
        reducer: &mut dyn GradientReducer,
        plan: Arc<PipePlan>,
        first: bool,
    ) -> Result<(), AccelerateError> {
        let rank = self.state.rank;
        let Some(sink) = reducer.lend_shard(first, &self.comm) else {
            return Err(AccelerateError::UnexpectedGradients { rank });
        };
        let layout = Arc::clone(reducer.layout());
        let mut delivered: Vec<bool> = plan.handed_in_at_start();
        // Each unit's anchor holds backward until the unit's gradients are sent: one unit's
        // gradients at a time beside the shards (ZeRO-2 is for memory; without the hold a busy
        // machine lets several units' pile up, 8P/N more on 4 processes here).
        let throttle = Arc::new(Throttle::new(0));
        let averager = Averager::into_shard(Arc::clone(&plan), sink, Arc::clone(&throttle));
        let mut run = PipeRun::spawn(averager)?;
        if let Some(sender) = run.sender() {
            self.taps.arm(
                entry_map(&layout),
                delivered.clone(),
                sender,
                Some(throttle),
            );
        }
        let (list, failure) = self.backward_tapped(loss, model, &layout, &mut delivered);
        // The pipe is finished whatever happened, so that no peer waits for this process.
        let handed = self.deliver_rest(&mut run, list.as_ref().ok(), &delivered, &plan);
        let sink = run.finish(rank).and_then(|sink| sink.into_shard(rank))?;
        reducer.return_shard(sink);
        handed?;
        list?;
        match failure {
            Some(cause) => Err(AccelerateError::Tensor {
                rank,
                op: "reducing a unit's gradients into the shards during backward",
                detail: cause,
            }),
            None => Ok(()),
        }
    }

    /// Runs `loss`'s backward pass with the window's gradients going through the pipe: on a
    /// communication thread fed by the units' taps while backward runs (overlap on, a model
    /// with units), else on this thread after it. Returns the averaged gradients (layout
    /// order), for the reducer to take with a group of one.
    pub(crate) fn backward_through_pipe<M: Module>(
        &self,
        loss: Tensor<1>,
        model: &M,
        layout: &ParamLayout,
        plan: Arc<PipePlan>,
        start: WindowStart,
    ) -> Result<ParamList, AccelerateError> {
        let averager = Averager::new(
            Arc::clone(&plan),
            start,
            self.config.gradient_communication,
            self.comm.clone(),
        );
        let mut delivered: Vec<bool> = plan.handed_in_at_start();
        let run = if self.taps.enabled() && plan.has_units {
            let run = PipeRun::spawn(averager)?;
            if let Some(sender) = run.sender() {
                self.taps
                    .arm(entry_map(layout), delivered.clone(), sender, None);
            }
            run
        } else {
            PipeRun::Inline(Box::new(averager))
        };
        let (list, failure) = self.backward_tapped(loss, model, layout, &mut delivered);
        // The pipe is finished whatever happened, so that no peer waits for this process.
        let averaged = self.finish_pipe(run, list.as_ref().ok(), &delivered, &plan);
        let averaged = averaged?;
        list?;
        if let Some(cause) = failure {
            return Err(AccelerateError::Tensor {
                rank: self.state.rank,
                op: "averaging a unit's gradients during backward",
                detail: cause,
            });
        }
        Ok(averaged)
    }

    /// Runs `loss`'s backward pass with the taps armed, then disarms them: the gradients Burn
    /// returned (`layout` order; none for what the taps let go), with `delivered` updated to
    /// what the taps handed over, and the first tap's failure to read a gradient.
    fn backward_tapped<M: Module>(
        &self,
        loss: Tensor<1>,
        model: &M,
        layout: &ParamLayout,
        delivered: &mut Vec<bool>,
    ) -> (Result<ParamList, AccelerateError>, Option<String>) {
        let grads = loss.backward();
        let (tapped, failure) = self.taps.disarm();
        if !tapped.is_empty() {
            *delivered = tapped;
        }
        let list = layout
            .take_grads(GradientsParams::from_grads(grads, model))
            .map_err(|unknown| AccelerateError::ModelChanged {
                rank: self.state.rank,
                detail: unknown.to_string(),
            });
        (list, failure)
    }

    /// Averages a window's summed gradients through the pipe on this thread (the Learner's
    /// windows).
    #[cfg(feature = "train")]
    pub(crate) fn average_through_pipe(
        &self,
        list: &ParamList,
        plan: Arc<PipePlan>,
    ) -> Result<ParamList, AccelerateError> {
        let start = WindowStart {
            held: Vec::new(),
            factor: None,
        };
        let averager = Averager::new(
            Arc::clone(&plan),
            start,
            self.config.gradient_communication,
            self.comm.clone(),
        );
        let delivered: Vec<bool> = plan.handed_in_at_start();
        let run = PipeRun::Inline(Box::new(averager));
        self.finish_pipe(run, Some(list), &delivered, &plan)
    }

    /// Hands the pipe every gradient of `list` no tap delivered (last entry first, as
    /// backward finishes them), waits for the last bucket, and returns the averaged
    /// gradients as tensors. Without a list (backward failed) every entry goes in absent.
    fn finish_pipe(
        &self,
        mut run: PipeRun,
        list: Option<&ParamList>,
        delivered: &[bool],
        plan: &PipePlan,
    ) -> Result<ParamList, AccelerateError> {
        self.deliver_rest(&mut run, list, delivered, plan)?;
        let buckets = run
            .finish(self.state.rank)?
            .into_averaged(self.state.rank)?;
        // Where backward's gradients live: the inner backend's device (the accelerator's
        // device is autodiff's, whose tensors would be tracked).
        let device = list
            .and_then(|list| list.iter().flatten().next().map(Tensor::device))
            .unwrap_or_else(|| self.device.clone().inner());
        let mut averaged: ParamList = vec![None; plan.len()];
        for bucket in buckets {
            let joined = params::upload(bucket.values, &device);
            for (entry, range) in bucket.entries {
                let mut part = joined.clone().narrow(0, range.start, range.len());
                // The type of the gradient backward gave the parameter (f32 where there is
                // none here: another process's average).
                let dtype = list
                    .and_then(|list| list.get(entry)?.as_ref().map(Tensor::dtype))
                    .unwrap_or(DType::F32);
                if dtype != DType::F32 {
                    part = part.cast(dtype);
                }
                if let Some(slot) = averaged.get_mut(entry) {
                    *slot = Some(part);
                }
            }
        }
        Ok(averaged)
    }

    /// Hands the pipe every gradient of `list` no tap delivered, last entry first (as
    /// backward finishes them); without a list (backward failed) every entry goes in absent.
    fn deliver_rest(
        &self,
        run: &mut PipeRun,
        list: Option<&ParamList>,
        delivered: &[bool],
        plan: &PipePlan,
    ) -> Result<(), AccelerateError> {
        for entry in (0..plan.len()).rev() {
            if delivered.get(entry).copied().unwrap_or(false) {
                continue;
            }
            let grad = list.and_then(|list| list.get(entry).cloned().flatten());
            let delivery = match grad {
                Some(grad) => Delivery::Grad {
                    entry,
                    values: params::to_host_f32(grad),
                    tapped: false,
                },
                None => Delivery::Absent { entry },
            };
            run.deliver(delivery)?;
        }
        Ok(())
    }
}

/// Each layout entry's index, by parameter id (what the taps look their parameter up in).
fn entry_map(layout: &ParamLayout) -> Arc<HashMap<ParamId, usize>> {
    Arc::new(
        layout
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.id, i))
            .collect(),
    )
}

/// The host copy of a window's earlier micro-batches' sum, for the pipe to add first.
pub(crate) fn held_on_host(held: Option<ParamList>) -> Vec<Option<Vec<f32>>> {
    held.map(|list| {
        list.into_iter()
            .map(|grad| grad.map(params::to_host_f32))
            .collect()
    })
    .unwrap_or_default()
}
