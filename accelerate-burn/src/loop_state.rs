//! The bookkeeping shared by an accelerator and what it prepared: the accumulation state
//! machine and the gradients of the open window.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use accelerate_core::{DynamicLossScaler, GradientAccumulation};
use burn::optim::GradientsParams;

/// State shared between an [`Accelerator`](crate::Accelerator), its prepared optimizers,
/// schedulers and training loaders.
#[derive(Clone)]
pub(crate) struct SharedLoop(Arc<Mutex<LoopState>>);

pub(crate) struct LoopState {
    pub accumulation: GradientAccumulation,
    /// Gradients summed over the micro-batches of the open window (none when `steps == 1`).
    pub accumulated: Option<GradientsParams>,
    /// Rank of this process, for error messages.
    pub rank: usize,
    /// Set while the latest batch handed out is its loader's last of the epoch: how many
    /// samples of that round, over all processes, are padding.
    pub last_batch_padding: Option<usize>,
    /// The fp16 loss scaler (none in f32 and bf16).
    pub scaler: Option<DynamicLossScaler>,
    /// True when the latest completed window's step was skipped (overflow).
    pub step_skipped: bool,
}

impl SharedLoop {
    pub fn new(accumulation_steps: usize, rank: usize) -> Self {
        Self(Arc::new(Mutex::new(LoopState {
            accumulation: GradientAccumulation::new(accumulation_steps),
            accumulated: None,
            rank,
            last_batch_padding: None,
            scaler: None,
            step_skipped: false,
        })))
    }

    /// Locks the state. A panic in another thread cannot leave it half-updated (every update
    /// is a handful of field writes), so a poisoned lock is still used.
    pub fn lock(&self) -> MutexGuard<'_, LoopState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
