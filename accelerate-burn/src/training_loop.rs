//! The training loop's own state, shared by an accelerator and what it prepared: the
//! accumulation windows, the gradients summed over the open window, the fp16 loss scaler, and
//! the random-stream policy (the device is reseeded at every window boundary from `(seed,
//! rank, windows)`, so a resumed run draws what an uninterrupted one would). It saves and
//! restores its own part of a checkpoint.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use accelerate_core::sampler::SplitMix64;
use accelerate_core::{
    BatchPosition, DynamicLossScaler, GradientAccumulation, MicroStep, ScaledStep, ScalerState,
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

/// Accumulation, loss scaling and the random stream of one training loop.
pub(crate) struct TrainingLoop {
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
    /// Seed of the device's random stream (`None`: the stream is not managed).
    seed: Option<u64>,
    rank: usize,
}

/// How a backward pass's loss is weighted within its accumulation window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LossKind {
    /// A mean over its micro-batch: each micro-batch of a window weighs the same.
    Mean,
    /// A sum over this many items: each item of a window weighs the same.
    Sum(u64),
}

/// The loop's part of a checkpoint.
pub(crate) struct LoopSnapshot {
    pub updates: u64,
    pub windows: u64,
    pub scaler: Option<ScalerState>,
}

impl TrainingLoop {
    pub fn new(
        accumulation_steps: usize,
        scaler: Option<DynamicLossScaler>,
        seed: Option<u64>,
        rank: usize,
    ) -> Self {
        Self {
            accumulation: GradientAccumulation::new(accumulation_steps),
            window_sum: None,
            window_kind: None,
            scaler,
            step_skipped: false,
            windows: 0,
            seed,
            rank,
        }
    }

    /// A training batch begins at `position` of its epoch (reported by the training loader).
    pub fn begin_batch(&mut self, position: BatchPosition) {
        self.accumulation.begin_batch(position);
    }

    /// What the backward pass now running must do.
    pub fn micro_step(&mut self) -> MicroStep {
        self.accumulation.micro_step()
    }

    /// The loss scale to multiply the loss by (`None` without fp16).
    pub fn loss_scale(&self) -> Option<f32> {
        self.scaler.as_ref().map(DynamicLossScaler::scale)
    }

    /// The factor that unscales gradients (`None` without fp16).
    pub fn inv_scale(&self) -> Option<f32> {
        self.scaler.as_ref().map(DynamicLossScaler::inv_scale)
    }

    /// Records how the micro-batch `step` weighs its loss; an error when the window's earlier
    /// micro-batches were weighted the other way (then nothing is recorded).
    pub fn weigh(&mut self, kind: LossKind, step: MicroStep) -> Result<(), String> {
        let open = if step.first { None } else { self.window_kind };
        self.window_kind = Some(match (open, kind) {
            (None, kind) | (Some(LossKind::Mean), kind @ LossKind::Mean) => kind,
            (Some(LossKind::Sum(a)), LossKind::Sum(b)) => LossKind::Sum(a.saturating_add(b)),
            (Some(open), kind) => {
                return Err(format!(
                    "this accumulation window began with {} and now calls {}",
                    kind_call(open),
                    kind_call(kind)
                ));
            }
        });
        Ok(())
    }

    /// The items of the window now completing when its losses were sums (`backward_sum`).
    pub fn window_items(&self) -> Option<u64> {
        match self.window_kind {
            Some(LossKind::Sum(items)) => Some(items),
            _ => None,
        }
    }

    /// Adds `grads` to the open window's sum; returns the sum when `step` completes the
    /// window. Sums are taken on the device, in visit order.
    pub fn accumulate(&mut self, grads: ParamList, step: MicroStep) -> Option<ParamList> {
        let summed = match self.window_sum.take() {
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
            self.window_sum = Some(summed);
            None
        }
    }

    /// Counts a completed window and reseeds `device` for the next one; returns the window's
    /// number (from 1).
    pub fn complete_window(&mut self, device: &Device) -> u64 {
        self.windows += 1;
        if let Some(seed) = self.seed {
            device.seed(window_seed(seed, self.rank, self.windows));
        }
        self.windows
    }

    /// Feeds the window's overflow test to the fp16 scaler; true when the step is skipped
    /// (on every rank alike: the test saw every rank's gradients).
    pub fn record_overflow(&mut self, overflow: bool) -> bool {
        self.step_skipped = self
            .scaler
            .as_mut()
            .is_some_and(|scaler| scaler.update(overflow) == ScaledStep::Skip);
        if self.step_skipped {
            self.accumulation.skip_update();
        }
        self.step_skipped
    }

    /// True when the latest completed window's step was skipped.
    pub fn step_skipped(&self) -> bool {
        self.step_skipped
    }

    /// Windows completed so far.
    pub fn windows(&self) -> u64 {
        self.windows
    }

    /// Claims the due update; false when there is none.
    pub fn take_update(&mut self) -> bool {
        self.accumulation.take_update()
    }

    /// Optimizer updates applied so far.
    pub fn updates(&self) -> u64 {
        self.accumulation.updates()
    }

    /// Micro-batches summed in the open window.
    pub fn pending(&self) -> usize {
        self.accumulation.pending()
    }

    /// Micro-batches per update.
    pub fn accumulation_steps(&self) -> usize {
        self.accumulation.steps()
    }

    /// True when the latest micro-batch completed a window.
    pub fn sync_gradients(&self) -> bool {
        self.accumulation.sync_gradients()
    }

    /// The loop's part of a checkpoint.
    pub fn snapshot(&self) -> LoopSnapshot {
        LoopSnapshot {
            updates: self.accumulation.updates(),
            windows: self.windows,
            scaler: self.scaler.as_ref().map(DynamicLossScaler::state),
        }
    }

    /// Continues from a checkpoint's `snapshot`, reseeding `device` to where it stood.
    pub fn restore(&mut self, snapshot: LoopSnapshot, device: &Device) {
        self.accumulation.restore(snapshot.updates);
        self.window_sum = None;
        self.window_kind = None;
        self.step_skipped = false;
        self.windows = snapshot.windows;
        match (self.scaler.as_mut(), snapshot.scaler) {
            (Some(scaler), Some(state)) => scaler.load_state(state),
            (None, None) => {}
            (now, _) => tracing::warn!(
                "the checkpoint was saved {} fp16 loss scaling and this run is {}: the loss \
                 scale starts afresh",
                if now.is_some() { "without" } else { "with" },
                if now.is_some() { "fp16" } else { "not" },
            ),
        }
        if let Some(seed) = self.seed {
            device.seed(window_seed(seed, self.rank, self.windows));
        }
    }
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
