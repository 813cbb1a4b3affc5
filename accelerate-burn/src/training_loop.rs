//! The training loop's own state, shared by an accelerator and what it prepared: the
//! accumulation windows, the gradients summed over the open window, the fp16 loss scaler, and
//! the random-stream policy (the device is reseeded at every window boundary from `(seed,
//! rank, windows)`, so a resumed run draws what an uninterrupted one would). It saves and
//! restores its own part of a checkpoint.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use accelerate_core::checkpoint::ModelLoopState;
use accelerate_core::sampler::SplitMix64;
use accelerate_core::{
    BatchPosition, DynamicLossScaler, GradientAccumulation, MicroStep, ScaledStep,
};
use burn::tensor::Device;

use crate::params::ParamList;

/// The loop state behind a lock; cloned handles share it.
#[derive(Clone)]
pub(crate) struct SharedLoop(Arc<Mutex<TrainingLoop>>);

impl SharedLoop {
    pub fn new(loop_state: TrainingLoop) -> Self {
        Self(Arc::new(Mutex::new(loop_state)))
    }

    /// Locks the state. Every method leaves it consistent, so a panic in another thread
    /// cannot leave it half-updated and a poisoned lock is still used.
    pub fn lock(&self) -> MutexGuard<'_, TrainingLoop> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Accumulation, loss scaling and the random stream of one training loop, with the window
/// state of each prepared model (indexed by its slot: the order models first met `prepare` or
/// `backward`). Every slot sees every training batch; slot 0's windows drive the random
/// stream.
pub(crate) struct TrainingLoop {
    models: Vec<ModelLoop>,
    /// The slot of the latest backward pass.
    latest: usize,
    accumulation_steps: usize,
    /// The fp16 scaler each new slot starts from.
    scaler: Option<DynamicLossScaler>,
    /// Seed of the device's random stream (`None`: the stream is not managed).
    seed: Option<u64>,
    rank: usize,
}

/// One model's windows: what it accumulates, its loss scale and its updates.
struct ModelLoop {
    accumulation: GradientAccumulation,
    /// Gradients summed over the micro-batches of the open window.
    window_sum: Option<ParamList>,
    /// How the open window's losses are weighted, and its items so far (`backward_sum`).
    window_kind: Option<LossKind>,
    scaler: Option<DynamicLossScaler>,
    /// True when the latest completed window's step was skipped (overflow).
    step_skipped: bool,
    /// Accumulation windows completed, skipped ones included.
    windows: u64,
}

impl ModelLoop {
    fn new(steps: usize, scaler: Option<DynamicLossScaler>) -> Self {
        Self {
            accumulation: GradientAccumulation::new(steps),
            window_sum: None,
            window_kind: None,
            scaler,
            step_skipped: false,
            windows: 0,
        }
    }
}

/// How a backward pass's loss is weighted within its accumulation window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LossKind {
    /// A mean over its micro-batch: each micro-batch of a window weighs the same.
    Mean,
    /// A sum over this many items: each item of a window weighs the same.
    Sum(u64),
}

impl TrainingLoop {
    pub fn new(
        accumulation_steps: usize,
        scaler: Option<DynamicLossScaler>,
        seed: Option<u64>,
        rank: usize,
    ) -> Self {
        Self {
            models: vec![ModelLoop::new(accumulation_steps, scaler.clone())],
            latest: 0,
            accumulation_steps,
            scaler,
            seed,
            rank,
        }
    }

    /// `slot`'s state, made on first use (a model prepared after training began starts with
    /// no updates and joins the windows at the next batch).
    fn model(&mut self, slot: usize) -> &mut ModelLoop {
        if slot >= self.models.len() {
            self.models.resize_with(slot + 1, || {
                ModelLoop::new(self.accumulation_steps, self.scaler.clone())
            });
        }
        &mut self.models[slot]
    }

    fn peek(&self, slot: usize) -> Option<&ModelLoop> {
        self.models.get(slot)
    }

    /// A training batch begins at `position` of its epoch (reported by the training loader):
    /// every model's windows follow it.
    pub fn begin_batch(&mut self, position: BatchPosition) {
        for model in &mut self.models {
            model.accumulation.begin_batch(position);
        }
    }

    /// What the backward pass now running for `slot` must do.
    pub fn micro_step(&mut self, slot: usize) -> MicroStep {
        self.latest = slot;
        self.model(slot).accumulation.micro_step()
    }

    /// The loss scale to multiply `slot`'s loss by (`None` without fp16).
    pub fn loss_scale(&self, slot: usize) -> Option<f32> {
        self.peek(slot)?
            .scaler
            .as_ref()
            .map(DynamicLossScaler::scale)
    }

    /// The factor that unscales `slot`'s gradients (`None` without fp16).
    pub fn inv_scale(&self, slot: usize) -> Option<f32> {
        self.peek(slot)?
            .scaler
            .as_ref()
            .map(DynamicLossScaler::inv_scale)
    }

    /// Records how `slot`'s micro-batch `step` weighs its loss; an error when the window's
    /// earlier micro-batches were weighted the other way (then nothing is recorded).
    pub fn weigh(
        &mut self,
        slot: usize,
        kind: LossKind,
        step: MicroStep,
    ) -> Result<(), MixedLossKinds> {
        let model = self.model(slot);
        let open = if step.first { None } else { model.window_kind };
        model.window_kind = Some(match (open, kind) {
            (None, kind) | (Some(LossKind::Mean), kind @ LossKind::Mean) => kind,
            (Some(LossKind::Sum(a)), LossKind::Sum(b)) => LossKind::Sum(a.saturating_add(b)),
            (Some(began), now) => return Err(MixedLossKinds { began, now }),
        });
        Ok(())
    }

    /// The items of `slot`'s window now completing when its losses were sums (`backward_sum`).
    pub fn window_items(&self, slot: usize) -> Option<u64> {
        match self.peek(slot)?.window_kind {
            Some(LossKind::Sum(items)) => Some(items),
            _ => None,
        }
    }

    /// Adds `grads` to `slot`'s open window's sum; returns the sum when `step` completes the
    /// window. Sums are taken on the device, in visit order.
    pub fn accumulate(
        &mut self,
        slot: usize,
        grads: ParamList,
        step: MicroStep,
    ) -> Option<ParamList> {
        let model = self.model(slot);
        let summed = match model.window_sum.take() {
            Some(mut sum) if !step.first => {
                for (total, grad) in sum.iter_mut().zip(grads) {
                    *total = match (total.take(), grad) {
                        (Some(a), Some(b)) => Some(a + b),
                        (a, b) => a.or(b),
                    };
                }
                sum
            }
            _ => grads,
        };
        if step.sync {
            Some(summed)
        } else {
            model.window_sum = Some(summed);
            None
        }
    }

    /// Counts a completed window of `slot`, reseeding `device` for the next one when it is
    /// slot 0's; returns the slot's window number (from 1).
    pub fn complete_window(&mut self, slot: usize, device: &Device) -> u64 {
        let (seed, rank) = (self.seed, self.rank);
        let model = self.model(slot);
        model.windows += 1;
        let windows = model.windows;
        if let Some(seed) = seed.filter(|_| slot == 0) {
            device.seed(window_seed(seed, rank, windows));
        }
        windows
    }

    /// Feeds `slot`'s window's overflow test to its fp16 scaler; true when the step is skipped
    /// (on every rank alike: the test saw every rank's gradients).
    pub fn record_overflow(&mut self, slot: usize, overflow: bool) -> bool {
        let model = self.model(slot);
        model.step_skipped = model
            .scaler
            .as_mut()
            .is_some_and(|scaler| scaler.update(overflow) == ScaledStep::Skip);
        if model.step_skipped {
            model.accumulation.skip_update();
        }
        model.step_skipped
    }

    /// True when the latest backward pass's model skipped its latest completed window.
    pub fn step_skipped(&self) -> bool {
        self.peek(self.latest).is_some_and(|m| m.step_skipped)
    }

    /// Windows `slot` completed so far.
    pub fn windows(&self, slot: usize) -> u64 {
        self.peek(slot).map_or(0, |m| m.windows)
    }

    /// Claims `slot`'s due update; false when there is none.
    pub fn take_update(&mut self, slot: usize) -> bool {
        self.model(slot).accumulation.take_update()
    }

    /// Optimizer updates `slot` applied so far.
    pub fn updates(&self, slot: usize) -> u64 {
        self.peek(slot).map_or(0, |m| m.accumulation.updates())
    }

    /// Micro-batches summed in the open windows (the most of any slot).
    pub fn pending(&self) -> usize {
        self.models
            .iter()
            .map(|m| m.accumulation.pending())
            .max()
            .unwrap_or(0)
    }

    /// Micro-batches per update.
    pub fn accumulation_steps(&self) -> usize {
        self.accumulation_steps
    }

    /// True when the latest micro-batch completed a window.
    pub fn sync_gradients(&self) -> bool {
        self.peek(self.latest)
            .is_none_or(|m| m.accumulation.sync_gradients())
    }

    /// `slot`'s part of a checkpoint.
    pub fn snapshot(&self, slot: usize) -> ModelLoopState {
        let model = self.peek(slot);
        ModelLoopState {
            updates: model.map_or(0, |m| m.accumulation.updates()),
            windows: model.map_or(0, |m| m.windows),
            scaler: model.and_then(|m| m.scaler.as_ref().map(DynamicLossScaler::state)),
        }
    }

    /// Continues `slot` from a checkpoint's `snapshot`; slot 0 also reseeds `device` to where
    /// it stood.
    pub fn restore(&mut self, slot: usize, snapshot: ModelLoopState, device: &Device) {
        let (seed, rank) = (self.seed, self.rank);
        let model = self.model(slot);
        model.accumulation.restore(snapshot.updates);
        model.window_sum = None;
        model.window_kind = None;
        model.step_skipped = false;
        model.windows = snapshot.windows;
        match (model.scaler.as_mut(), snapshot.scaler) {
            (Some(scaler), Some(state)) => scaler.load_state(state),
            (None, None) => {}
            (now, _) => tracing::warn!(
                "the checkpoint was saved {} fp16 loss scaling and this run is {}: the loss \
                 scale starts afresh",
                if now.is_some() { "without" } else { "with" },
                if now.is_some() { "fp16" } else { "not" },
            ),
        }
        if let Some(seed) = seed.filter(|_| slot == 0) {
            device.seed(window_seed(seed, rank, snapshot.windows));
        }
    }
}

/// A window whose micro-batches weigh their losses in two ways ([`TrainingLoop::weigh`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "this accumulation window began with {} and now calls {}",
    kind_call(*began),
    kind_call(*now)
)]
pub(crate) struct MixedLossKinds {
    /// How the window's first micro-batch weighed its loss.
    pub began: LossKind,
    /// How this one does.
    pub now: LossKind,
}

fn kind_call(kind: LossKind) -> &'static str {
    match kind {
        LossKind::Mean => "backward (a mean loss)",
        LossKind::Sum(_) => "backward_sum (a summed loss)",
    }
}

/// The seed of the device's random stream after `windows` completed windows.
pub(crate) fn window_seed(seed: u64, rank: usize, windows: u64) -> u64 {
    let mut mix = SplitMix64::new(seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let base = mix.next_u64();
    SplitMix64::new(base ^ windows.wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64()
}
