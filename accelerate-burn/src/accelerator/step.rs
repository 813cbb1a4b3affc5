//! The step: `backward` (loss weighting, accumulation, handing a completed window to the
//! reducer), global clipping, precision, and the loop's counters.

use std::sync::PoisonError;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};

use super::{Accelerator, ReducerSlot};
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::precision::{Autocast, Caster, low_precision_view};
use crate::reducer::{self, Gradients, OptimizerChoice, Outcome, ReducerHandle};

impl<B: AcceleratorBackend> Accelerator<B> {
    /// Runs the backward pass of `loss` and returns what the optimizer steps with.
    ///
    /// With gradient accumulation the loss is divided by the real length of its window (a
    /// short last window of an epoch is weighted by its size) and gradients are summed on the
    /// device; a micro-batch that completes no window returns
    /// [`NotDue`](crate::GradientsStatus::NotDue) and communicates nothing. The micro-batch
    /// that completes one hands the sum to the prepared optimizer's reducer, which averages it
    /// over the processes (in buckets, in module visit order, or into the fused optimizer's
    /// flat buffer) and unscales it for fp16; an overflow on any process makes the step
    /// [`Skipped`](crate::GradientsStatus::Skipped) on every process.
    pub fn backward<M: Module>(
        &self,
        loss: Tensor<1>,
        model: &M,
    ) -> Result<Gradients, AccelerateError> {
        let handle = self.reducer_for(model)?;
        let mut training = self.training.lock();
        let step = training.micro_step();
        let mut loss = loss;
        if loss.dtype() != DType::F32 {
            loss = loss.cast(DType::F32);
        }
        if step.window_len > 1 {
            loss = loss.div_scalar(step.window_len as f64);
        }
        if let Some(scale) = training.loss_scale() {
            loss = loss.mul_scalar(scale);
        }
        let grads = GradientsParams::from_grads(loss.backward(), model);
        let mut reducer = handle.lock();
        let list =
            reducer
                .layout()
                .take_grads(grads)
                .map_err(|detail| AccelerateError::ModelChanged {
                    rank: self.state.rank,
                    detail,
                })?;
        let Some(summed) = training.accumulate(list, step) else {
            return Ok(Gradients::new(Outcome::NotDue, 0, handle.id));
        };
        let window = training.complete_window(&self.device);
        let reduced = reducer.reduce(summed, &self.comm, training.inv_scale())?;
        // The overflow test saw every rank's gradients (averages keep inf and NaN), so every
        // rank decides the same here without another collective.
        if training.record_overflow(reduced.overflow) {
            reducer.discard();
            return Ok(Gradients::new(Outcome::Skipped, window, handle.id));
        }
        Ok(Gradients::new(reduced.outcome, window, handle.id))
    }

    /// The reducer of the prepared optimizer; without one, a reducer (no optimizer) for
    /// `model`, so that `backward` also serves a loop that steps an optimizer of its own.
    fn reducer_for<M: Module>(&self, model: &M) -> Result<ReducerHandle, AccelerateError> {
        let mut slot = self.reducer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = slot.as_ref() {
            return Ok(slot.handle.clone());
        }
        let reducer = reducer::build(self.reducer_spec(model)?, OptimizerChoice::None, &self.comm)?;
        let handle = ReducerHandle::new(reducer);
        *slot = Some(ReducerSlot {
            handle: handle.clone(),
            prepared: false,
        });
        Ok(handle)
    }

    /// Clips `grads` so that their global L2 norm, over every parameter of the prepared model
    /// together, is at most `max_norm`, and returns the norm before clipping (Burn's own
    /// clipping acts on each tensor separately). Gradients of Burn's optimizer are scaled on
    /// the device; a fused optimizer's held gradients record the factor, which its update
    /// applies. Returns `None` when there is nothing to clip (no window completed, or the step
    /// was skipped). `model` is the prepared model (kept for Accelerate's signature).
    pub fn clip_grad_norm<M: Module>(
        &self,
        _model: &M,
        grads: &mut Gradients,
        max_norm: f32,
    ) -> Result<Option<f32>, AccelerateError> {
        Ok(grads.clip(max_norm))
    }

    /// Runs `forward` in the compute precision: on a view of `model` whose float parameters
    /// are cast (tracked by autodiff, so gradients reach the f32 master parameters as f32),
    /// with a [`Caster`] for the inputs; float tensors in the result come back as f32.
    /// Without mixed precision this is `forward(model, caster)` with an identity caster.
    ///
    /// ```text
    /// let loss = acc.autocast(&model, |m, c| m.forward_loss(c.input(batch.images), batch.targets));
    /// ```
    pub fn autocast<M: Module, R: Autocast>(
        &self,
        model: &M,
        forward: impl FnOnce(&M, &Caster) -> R,
    ) -> R {
        let caster = Caster::new(self.compute_dtype);
        if self.compute_dtype == DType::F32 {
            return forward(model, &caster);
        }
        let view = low_precision_view(model, self.compute_dtype);
        forward(&view, &caster).autocast(DType::F32)
    }

    /// The dtype forward passes compute in under [`autocast`](Self::autocast).
    pub fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }

    /// True when the latest completed window's optimizer step was skipped because a gradient
    /// overflowed (fp16 only); the optimizer and scheduler did not move.
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.training.lock().step_skipped()
    }

    /// The current fp16 loss scale (`None` without fp16).
    pub fn loss_scale(&self) -> Option<f32> {
        self.training.lock().loss_scale()
    }

    /// Time spent so far averaging gradients across processes (zero with one process), to
    /// tell how much of a step is communication.
    pub fn communication_time(&self) -> std::time::Duration {
        self.comm.communication_time()
    }

    /// True when the latest backward pass completed an accumulation window, so the optimizer
    /// steps now (always true without accumulation).
    pub fn sync_gradients(&self) -> bool {
        self.training.lock().sync_gradients()
    }

    /// Optimizer updates applied so far.
    pub fn updates(&self) -> u64 {
        self.training.lock().updates()
    }
}
