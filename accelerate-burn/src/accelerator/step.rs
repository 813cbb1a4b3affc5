//! The step: `backward` (loss weighting, accumulation, handing a completed window to the
//! reducer), global clipping, precision, and the loop's counters.

use std::sync::Arc;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor};

use super::Accelerator;
use super::overlap::held_on_host;
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::model_slot::{ModelSlot, SlotState};
use crate::overlap::pipe::WindowStart;
use crate::params::{self, ParamLayout, ParamList, Replacement};
use crate::precision::{Autocast, Caster, low_precision_view};
use crate::reducer::{self, Gradients, OptimizerChoice, Outcome};
use crate::training_loop::LossKind;

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
    ///
    /// Each micro-batch weighs the same here, whatever it holds; for losses over tokens (or
    /// any items) whose count varies between micro-batches, see
    /// [`backward_sum`](Self::backward_sum).
    pub fn backward<M: Module>(
        &self,
        loss: Tensor<1>,
        model: &M,
    ) -> Result<Gradients, AccelerateError> {
        self.backward_weighted(loss, LossKind::Mean, model)
    }

    /// Runs the backward pass of a loss *summed* over `items` tokens (or samples), so that
    /// every token of an accumulation window, on every process, weighs the same: the update
    /// uses the gradient of the window's summed loss divided by the number of tokens in the
    /// whole window across all processes. That count is summed once per window (one small
    /// collective when the window completes, none per micro-batch). With
    /// [`backward`](Self::backward) and a per-micro-batch mean instead, a micro-batch of 10
    /// tokens weighs as much as one of 1,000 (the gradient-accumulation bias Hugging Face's
    /// Trainer once had).
    ///
    /// ```text
    /// let (loss_sum, tokens) = model.forward_loss_sum(batch); // sum over non-padding tokens
    /// let grads = acc.backward_sum(loss_sum, tokens, &model)?;
    /// ```
    ///
    /// A window whose processes hold no token at all gives zero gradients. Calls of
    /// `backward` and `backward_sum` cannot be mixed inside one window (an error).
    pub fn backward_sum<M: Module>(
        &self,
        loss_sum: Tensor<1>,
        items: u64,
        model: &M,
    ) -> Result<Gradients, AccelerateError> {
        self.backward_weighted(loss_sum, LossKind::Sum(items), model)
    }

    fn backward_weighted<M: Module>(
        &self,
        loss: Tensor<1>,
        kind: LossKind,
        model: &M,
    ) -> Result<Gradients, AccelerateError> {
        let _phase = crate::phases::backward();
        let slot = self.slot_for(model)?;
        self.slots.set_latest(&slot);
        let mut state = slot.lock();
        let SlotState {
            windows,
            reducer,
            reducer_id,
            ..
        } = &mut *state;
        let id = *reducer_id;
        let step = windows.micro_step();
        windows
            .weigh(kind, step)
            .map_err(|mixed| AccelerateError::Misuse {
                rank: self.state.rank,
                what: mixed.to_string(),
                hint: "use backward_sum for every micro-batch of a window, or backward for all",
            })?;
        let mut loss = loss;
        if loss.dtype() != DType::F32 {
            loss = loss.cast(DType::F32);
        }
        if kind == LossKind::Mean && step.window_len > 1 {
            loss = loss.div_scalar(step.window_len as f64);
        }
        if let Some(scale) = windows.loss_scale() {
            loss = loss.mul_scalar(scale);
        }
        // The gradients of a completed window, and the group that averages them: the pipe
        // averages them itself (during backward, where units feed it), the reducer then takes
        // them with a group of one.
        let (summed, comm) = if step.sync
            && let Some(plan) = self.pipe_plan(&**reducer)
        {
            // The factor first (a collective), so that the pipe applies it as gradients come.
            let factor = match windows.window_items() {
                Some(local) => Some(self.per_item_factor(local)? as f32),
                None => None,
            };
            let start = WindowStart {
                held: held_on_host(windows.take_window_sum(step)),
                factor,
            };
            let layout = Arc::clone(reducer.layout());
            let averaged = self.backward_through_pipe(loss, model, &layout, plan, start)?;
            (averaged, &self.local_comm)
        } else {
            let mut summed = if reducer.holds_window_sum() {
                // ZeRO-2: each micro-batch is averaged into the reducer's shard of the sum now,
                // bucket by bucket while backward runs where units hand their gradients over.
                match self.shard_pipe_plan(&**reducer) {
                    Some(plan) => {
                        self.backward_into_shard(loss, model, &mut **reducer, plan, step.first)?;
                    }
                    None => {
                        let list = self.backward_list(loss, model, reducer.layout())?;
                        reducer.accumulate(list, step.first, &self.comm)?;
                    }
                }
                if !step.sync {
                    return Ok(Gradients::new(Outcome::NotDue, 0, id));
                }
                ParamList::new()
            } else {
                let list = self.backward_list(loss, model, reducer.layout())?;
                let Some(summed) = windows.accumulate(list, step) else {
                    return Ok(Gradients::new(Outcome::NotDue, 0, id));
                };
                summed
            };
            if let Some(local) = windows.window_items() {
                let factor = self.per_item_factor(local)?;
                reducer.scale_held(factor);
                for grad in summed.iter_mut() {
                    if let Some(g) = grad.take() {
                        *grad = Some(g.mul_scalar(factor));
                    }
                }
            }
            (summed, &self.comm)
        };
        let window = windows.complete_window(&self.device);
        let reduced = reducer.reduce(summed, comm, windows.inv_scale())?;
        // The overflow test saw every rank's gradients (averages keep inf and NaN), so every
        // rank decides the same here without another collective.
        if windows.record_overflow(reduced.overflow) {
            reducer.discard();
            return Ok(Gradients::new(Outcome::Skipped, window, id));
        }
        Ok(Gradients::new(reduced.outcome, window, id))
    }

    /// Runs `loss`'s backward pass and returns its gradients (`layout` order), the shards'
    /// averages across hybrid sharding's replicas in place.
    fn backward_list<M: Module>(
        &self,
        loss: Tensor<1>,
        model: &M,
        layout: &ParamLayout,
    ) -> Result<ParamList, AccelerateError> {
        let grads = loss.backward();
        // Hybrid sharding: the shards' averages across the replicas, from the thread that
        // ran them during backward (done before any collective of the job's).
        let across_replicas = self.shards.finish_replicas();
        // A sharded unit's gather or reduce-scatter that failed inside the graph.
        self.sharding_failure()?;
        let grads = GradientsParams::from_grads(grads, model);
        let mut list =
            layout
                .take_grads(grads)
                .map_err(|unknown| AccelerateError::ModelChanged {
                    rank: self.state.rank,
                    detail: unknown.to_string(),
                })?;
        self.take_replica_averages(&mut list, layout, across_replicas)?;
        Ok(list)
    }

    /// A reducer of its own for `model`, outside the accelerator's prepared models, for a
    /// loop that sums its windows itself and steps an optimizer of its own (burn-train's
    /// Learner, which may train several models in turn on one accelerator).
    #[cfg(feature = "train")]
    pub(crate) fn window_reducer<M: Module>(
        &self,
        model: &M,
    ) -> Result<Box<dyn reducer::GradientReducer>, AccelerateError> {
        reducer::build(self.reducer_spec(model)?, OptimizerChoice::None, &self.comm)
    }

    /// Averages a window's gradients, already summed on this process, over the processes
    /// through `reducer` (from [`window_reducer`](Self::window_reducer)): what
    /// [`backward`](Self::backward) does once a window completes, without its windows, loss
    /// weighting or loss scaling.
    #[cfg(feature = "train")]
    pub(crate) fn reduce_window(
        &self,
        reducer: &mut dyn reducer::GradientReducer,
        grads: GradientsParams,
    ) -> Result<Gradients, AccelerateError> {
        let list = reducer.layout().take_grads(grads).map_err(|unknown| {
            AccelerateError::ModelChanged {
                rank: self.state.rank,
                detail: unknown.to_string(),
            }
        })?;
        let reduced = match self.pipe_plan(reducer) {
            Some(plan) => {
                let averaged = self.average_through_pipe(&list, plan)?;
                reducer.reduce(averaged, &self.local_comm, None)?
            }
            None => reducer.reduce(list, &self.comm, None)?,
        };
        Ok(Gradients::new(reduced.outcome, 0, 0))
    }

    /// The factor that turns this rank's summed window gradient into its share of the mean
    /// over every item of the window on every rank: the reducer then averages over the ranks,
    /// so the factor is `world / items in the window across ranks`.
    fn per_item_factor(&self, local: u64) -> Result<f64, AccelerateError> {
        // Counts stay exact in f64 up to 2^53 items per window.
        let [total] = self.sum_across_processes([local as f64])?;
        Ok(if total == 0.0 {
            0.0
        } else {
            self.state.world_size as f64 / total
        })
    }

    /// The slot of `model`: the prepared optimizer's whose parameters `model` holds; with
    /// none, one made for `model` with a reducer and no optimizer, so that `backward` also
    /// serves a loop that steps an optimizer of its own.
    fn slot_for<M: Module>(&self, model: &M) -> Result<ModelSlot, AccelerateError> {
        if let Some(slot) = self.slots.find(params::first_id(model)) {
            return Ok(slot);
        }
        // One model and a model of its shapes under other ids: the same model rebuilt (or
        // not the one `prepare` returned); its reducer says which parameter differs.
        if let Some(only) = self.slots.only()
            && only.lock().reducer.layout().shapes() == ParamLayout::of(model).shapes()
        {
            return Ok(only);
        }
        let reducer = reducer::build(self.reducer_spec(model)?, OptimizerChoice::None, &self.comm)?;
        Ok(match self.slots.register(reducer, false) {
            Ok(slot) => slot,
            Err(registered) => registered.slot,
        })
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

    /// One step of an exponential moving average of the weights: every float parameter of
    /// `ema` becomes `decay * ema + (1 - decay) * model` (on the device, in f32), keeping
    /// `ema`'s own parameter ids and gradient settings. Every process holds the same model, so
    /// every process's average is the same without communication. Make the copy once with
    /// `model.clone().no_grad()`, update it after each optimizer step, evaluate with it, and
    /// save it with [`Checkpoint::module`](crate::Checkpoint::module).
    ///
    /// ```text
    /// model = optim.step(lr, model, grads)?;
    /// ema = acc.ema_update(ema, &model, 0.999)?;
    /// ```
    pub fn ema_update<M: Module>(
        &self,
        ema: M,
        model: &M,
        decay: f64,
    ) -> Result<M, AccelerateError> {
        let _phase = crate::phases::ema();
        if !(0.0..=1.0).contains(&decay) {
            return Err(AccelerateError::Misuse {
                rank: self.state.rank,
                what: format!("ema_update with decay {decay}"),
                hint: "give a decay between 0 and 1 (0.999 is usual)",
            });
        }
        let (averaged, current) = (ParamLayout::of(&ema), ParamLayout::of(model));
        if averaged.shapes() != current.shapes() {
            return Err(AccelerateError::Misuse {
                rank: self.state.rank,
                what: "ema_update with an average whose parameters differ from the model's".into(),
                hint: "make the average with model.clone().no_grad()",
            });
        }
        let values = params::values(&ema)
            .into_iter()
            .zip(params::values(model))
            .map(|(average, value)| {
                Some(average.mul_scalar(decay) + value.cast(DType::F32).mul_scalar(1.0 - decay))
            })
            .collect();
        Ok(params::replace(
            ema,
            Replacement {
                values,
                ids: Vec::new(),
            },
        ))
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

    /// True when the latest completed window's optimizer step (of the model of the latest
    /// backward pass) was skipped because a gradient overflowed (fp16 only); the optimizer and
    /// scheduler did not move.
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.slots
            .latest()
            .is_some_and(|slot| slot.lock().windows.step_skipped())
    }

    /// The current fp16 loss scale of the first prepared model (`None` without fp16); each
    /// prepared model has its own.
    pub fn loss_scale(&self) -> Option<f32> {
        self.slots.loss_scale()
    }

    /// Time spent so far averaging gradients across processes (zero with one process), to
    /// tell how much of a step is communication.
    pub fn communication_time(&self) -> std::time::Duration {
        self.comm.communication_time()
    }

    /// True when the latest backward pass completed an accumulation window, so the optimizer
    /// steps now (always true without accumulation).
    pub fn sync_gradients(&self) -> bool {
        self.slots
            .latest()
            .is_none_or(|slot| slot.lock().windows.sync_gradients())
    }

    /// Updates the first prepared optimizer applied so far (each
    /// [`PreparedOptimizer::updates`](crate::PreparedOptimizer::updates) counts its own).
    pub fn updates(&self) -> u64 {
        self.slots.updates()
    }
}
