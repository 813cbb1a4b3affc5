//! The error type of `accelerate-burn`: one enum, each message naming what failed, on which
//! rank, and what to do about it.

use std::path::PathBuf;

use accelerate_core::{ConfigError, StateError};

/// Everything the accelerated loop can report instead of panicking.
#[derive(Debug, thiserror::Error)]
pub enum AccelerateError {
    /// The launcher environment is inconsistent.
    #[error("launcher environment: {0}")]
    State(#[from] StateError),

    /// A configuration value is invalid.
    #[error("configuration: {0}")]
    Config(#[from] ConfigError),

    /// The backend this build selected cannot run on this machine.
    #[error("the {backend} backend is unavailable: {reason}. hint: {hint}")]
    BackendUnavailable {
        /// Backend name.
        backend: &'static str,
        /// What Burn or the system said.
        reason: String,
        /// What to do instead.
        hint: &'static str,
    },

    /// Strict mixed precision was asked for a dtype the device cannot compute in.
    #[error(
        "the {backend} backend cannot compute in {dtype} on this device. hint: use another \
         mixed precision, or drop strict mode to train in f32"
    )]
    PrecisionUnsupported {
        /// Backend name.
        backend: &'static str,
        /// The dtype asked for.
        dtype: String,
    },

    /// A collective between the processes failed (the message names the call and ranks).
    #[error(transparent)]
    Comm(#[from] accelerate_core::CommError),

    /// The processes did not build the same model.
    #[error("rank {rank}: {detail}. hint: every process must build the same model")]
    ModelMismatch {
        /// This process's rank.
        rank: usize,
        /// What differs.
        detail: String,
    },

    /// A tensor cannot be gathered or reduced as asked.
    #[error("rank {rank}: {op}: {detail}")]
    Tensor {
        /// This process's rank.
        rank: usize,
        /// The operation.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },

    /// The data set failed to produce an item.
    #[error("rank {rank}: data set item for batch {batch} of epoch {epoch}: {source}")]
    Data {
        /// This process's rank.
        rank: usize,
        /// Epoch being iterated.
        epoch: u64,
        /// Batch index within the epoch.
        batch: usize,
        /// The data set's error.
        source: burn::data::dataset::DatasetError,
    },

    /// The data loader's batching cannot be shared across the processes.
    #[error("rank {rank}: data loader: {source}")]
    Sampler {
        /// This process's rank.
        rank: usize,
        /// What is wrong.
        source: accelerate_core::SamplerError,
    },

    /// The optimizer was asked to apply gradients that no accumulation window produced.
    #[error(
        "rank {rank}: optimizer step with gradients that did not come from Accelerator::backward \
         for this update (or a second step for the same update). hint: call \
         `acc.backward(loss, &model)` once per batch and pass its result to `optim.step`"
    )]
    UnexpectedGradients {
        /// This process's rank.
        rank: usize,
    },

    /// Writing model weights failed.
    #[error("rank {rank}: saving the model to {path}: {reason}")]
    Save {
        /// This process's rank.
        rank: usize,
        /// The file or directory being written.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },

    /// A checkpoint could not be saved or loaded.
    #[error("rank {rank}: checkpoint {}: {reason}", path.display())]
    Checkpoint {
        /// This process's rank.
        rank: usize,
        /// The checkpoint directory.
        path: PathBuf,
        /// What went wrong, and what to do.
        reason: String,
    },

    /// Metrics could not be logged.
    #[error("rank {rank}: logging metrics: {reason}")]
    Tracking {
        /// This process's rank.
        rank: usize,
        /// What went wrong, and what to do.
        reason: String,
    },

    /// A fused optimizer cannot be built or used as asked.
    #[error("fused optimizer: {reason}")]
    FusedOptimizer {
        /// What is wrong, and what to do.
        reason: String,
    },
}
