//! The training loop's state, in two owners. Loop-wide, [`LoopClock`]: the batch the training
//! loader handed out last (the loader ticks it) and the policy of the device's random stream
//! (reseeded at every window boundary of the first prepared model from `(seed, rank,
//! windows)`, so a resumed run draws what an uninterrupted one would). Per prepared model,
//! [`ModelWindows`] (held by its [`ModelSlot`](crate::model_slot::ModelSlot)): its
//! accumulation windows, the gradients summed over the open window and its fp16 loss scaler.
//! Each saves and restores its own part of a checkpoint.

use std::sync::{Arc, Mutex, PoisonError};

use accelerate_core::checkpoint::ModelLoopState;
use accelerate_core::sampler::SplitMix64;
use accelerate_core::{
    BatchPosition, DynamicLossScaler, GradientAccumulation, MicroStep, ScaledStep,
};
use burn::tensor::Device;

use crate::params::ParamList;

/// The loop-wide state: the latest training batch and the random stream's seed. Cloned
/// handles share it; its lock is held only to read or write a position, never across a
/// collective.
#[derive(Clone)]
pub(crate) struct LoopClock {
    latest: Arc<Mutex<LatestBatch>>,
    /// Seed of the device's random stream (`None`: the stream is not managed).
    seed: Option<u64>,
    rank: usize,
}

/// The batch the training loader handed out last.
#[derive(Debug, Clone, Copy, Default)]
struct LatestBatch {
    /// Batches handed out so far (the latest one's number, from 1; 0 before any).
    serial: u64,
    position: Option<BatchPosition>,
}

impl LoopClock {
    pub fn new(seed: Option<u64>, rank: usize) -> Self {
        Self {
            latest: Arc::default(),
            seed,
            rank,
        }
    }

    /// A training batch begins at `position` of its epoch (reported by the training loader):
    /// every model's windows follow it at their next backward pass.
    pub fn begin_batch(&self, position: BatchPosition) {
        let mut latest = self.latest.lock().unwrap_or_else(PoisonError::into_inner);
        latest.serial += 1;
        latest.position = Some(position);
    }

    /// The latest batch: its number and position.
    fn latest(&self) -> LatestBatch {
        *self.latest.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reseeds `device` for the window after `windows` completed ones (when the stream is
    /// managed).
    fn reseed(&self, device: &Device, windows: u64) {
        if let Some(seed) = self.seed {
            device.seed(window_seed(seed, self.rank, windows));
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

/// One model's windows: what it accumulates, its loss scale and its updates.
pub(crate) struct ModelWindows {
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
    /// The clock's batch these windows last followed (its serial).
    batch_seen: u64,
    clock: LoopClock,
    /// True for the first prepared model: its windows drive the random stream.
    drives_random_stream: bool,
}

impl ModelWindows {
    /// Windows of `steps` micro-batches following `clock`; a model made during a batch joins
    /// that batch's window (its first backward pass follows the latest position).
    pub fn new(
        steps: usize,
        scaler: Option<DynamicLossScaler>,
        clock: LoopClock,
        drives_random_stream: bool,
    ) -> Self {
        Self {
            accumulation: GradientAccumulation::new(steps),
            window_sum: None,
            window_kind: None,
            scaler,
            step_skipped: false,
            windows: 0,
            batch_seen: 0,
            clock,
            drives_random_stream,
        }
    }

    /// What the backward pass now running must do (following the loader's latest batch).
    pub fn micro_step(&mut self) -> MicroStep {
        let latest = self.clock.latest();
        if latest.serial != self.batch_seen {
            self.batch_seen = latest.serial;
            if let Some(position) = latest.position {
                self.accumulation.begin_batch(position);
            }
        }
        self.accumulation.micro_step()
    }

    /// The loss scale to multiply the loss by (`None` without fp16).
    pub fn loss_scale(&self) -> Option<f32> {
        self.scaler.as_ref().map(DynamicLossScaler::scale)
    }

    /// The factor that unscales the gradients (`None` without fp16).
    pub fn inv_scale(&self) -> Option<f32> {
        self.scaler.as_ref().map(DynamicLossScaler::inv_scale)
    }

    /// Records how micro-batch `step` weighs its loss; an error when the window's earlier
    /// micro-batches were weighted the other way (then nothing is recorded).
    pub fn weigh(&mut self, kind: LossKind, step: MicroStep) -> Result<(), MixedLossKinds> {
        let open = if step.first { None } else { self.window_kind };
        self.window_kind = Some(match (open, kind) {
            (None, kind) | (Some(LossKind::Mean), kind @ LossKind::Mean) => kind,
            (Some(LossKind::Sum(a)), LossKind::Sum(b)) => LossKind::Sum(a.saturating_add(b)),
            (Some(began), now) => return Err(MixedLossKinds { began, now }),
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

    /// The open window's sum of its earlier micro-batches, taken for the micro-batch `step`
    /// that completes it (the gradient pipe adds the last one itself); `None` when it is the
    /// window's first.
    pub fn take_window_sum(&mut self, step: MicroStep) -> Option<ParamList> {
        let held = self.window_sum.take();
        if step.first { None } else { held }
    }

    /// Counts a completed window, reseeding `device` for the next one when these windows
    /// drive the random stream; returns the window's number (from 1).
    pub fn complete_window(&mut self, device: &Device) -> u64 {
        self.windows += 1;
        if self.drives_random_stream {
            self.clock.reseed(device, self.windows);
        }
        self.windows
    }

    /// Feeds the window's overflow test to the fp16 scaler; true when the step is skipped (on
    /// every rank alike: the test saw every rank's gradients).
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

    /// True when the latest micro-batch completed a window.
    pub fn sync_gradients(&self) -> bool {
        self.accumulation.sync_gradients()
    }

    /// This model's part of a checkpoint.
    pub fn snapshot(&self) -> ModelLoopState {
        ModelLoopState {
            updates: self.accumulation.updates(),
            windows: self.windows,
            scaler: self.scaler.as_ref().map(DynamicLossScaler::state),
        }
    }

    /// Continues from a checkpoint's `snapshot`; windows that drive the random stream also
    /// reseed `device` to where it stood.
    pub fn restore(&mut self, snapshot: ModelLoopState, device: &Device) {
        self.accumulation.restore(snapshot.updates);
        self.window_sum = None;
        self.window_kind = None;
        self.step_skipped = false;
        self.windows = snapshot.windows;
        // The batch handed out before the load belongs to the run that was replaced.
        self.batch_seen = self.clock.latest().serial;
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
        if self.drives_random_stream {
            self.clock.reseed(device, snapshot.windows);
        }
    }
}

/// A window whose micro-batches weigh their losses in two ways ([`ModelWindows::weigh`]).
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
