//! The bookkeeping shared by an accelerator and what it prepared: the accumulation state
//! machine and the gradients of the open window.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use accelerate_core::{DistributedSampler, DynamicLossScaler, GradientAccumulation, SamplerConfig};
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
    /// Accumulation windows completed, skipped steps included (the device's random stream
    /// is reseeded from it).
    pub windows: u64,
    /// The training loader, for checkpoints: where it stands and how to move it.
    pub train: Option<TrainLoaderLink>,
    /// Where the training loader continues after a checkpoint was loaded.
    pub resume: Option<ResumePoint>,
    /// The flat buffers of a fused optimizer, when one was prepared.
    pub flat: Option<crate::fused::FlatEngine>,
}

/// What a checkpoint needs of the (latest prepared) training loader.
pub(crate) struct TrainLoaderLink {
    /// The loader's epoch, shared so that loading a checkpoint can set it.
    pub epoch: Arc<AtomicU64>,
    /// This rank's sampler.
    pub sampler: DistributedSampler,
    /// The epoch being iterated (or last iterated).
    pub cursor_epoch: u64,
    /// Batches of that epoch handed to the loop.
    pub batches: usize,
    /// Samples of the epoch order, over all ranks, consumed before this epoch's iteration
    /// started (non-zero only when resumed with another world size).
    pub start_sample: usize,
}

impl TrainLoaderLink {
    /// Moves this loader to the epoch of `point`, if it cuts its data as the saved one did.
    pub fn attach(&self, point: &ResumePoint) -> Result<(), String> {
        if self.sampler.config() != &point.sampler {
            return Err(format!(
                "the training loader differs from the saved one (saved {:?}, now {:?}). hint: \
                 resume with the same data set, batch size and shuffling",
                point.sampler,
                self.sampler.config()
            ));
        }
        self.epoch.store(point.epoch, Ordering::Relaxed);
        Ok(())
    }
}

/// Where a resumed training loader continues (kept until a training loader takes it, so the
/// loader may be prepared before or after the checkpoint is loaded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResumePoint {
    /// The checkpoint it came from, for errors.
    pub checkpoint: PathBuf,
    /// How the saved loader cut its data.
    pub sampler: SamplerConfig,
    /// The epoch to continue.
    pub epoch: u64,
    /// What to skip of it.
    pub skip: Skip,
}

/// The part of a resumed epoch that was already consumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Skip {
    /// This rank's first batches (same world size: exactly the batches it would have had).
    Batches(usize),
    /// The first samples of the epoch order over all ranks (another world size).
    Samples(usize),
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
            windows: 0,
            train: None,
            resume: None,
            flat: None,
        })))
    }

    /// Locks the state. A panic in another thread cannot leave it half-updated (every update
    /// is a handful of field writes), so a poisoned lock is still used.
    pub fn lock(&self) -> MutexGuard<'_, LoopState> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
