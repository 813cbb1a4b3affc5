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

    /// NCCL could not be loaded, agreed on or run (the message names the rank and the hint).
    #[cfg(unix)]
    #[error(transparent)]
    Nccl(#[from] accelerate_core::nccl::NcclError),

    /// Training the model at this ZeRO stage needs more memory than the process may use.
    #[error("rank {rank}: out of memory: {detail}. hint: {hint}")]
    OutOfMemory {
        /// This process's rank.
        rank: usize,
        /// What is needed, and the limit.
        detail: String,
        /// A configuration that fits.
        hint: String,
    },

    /// The processes did not build the same model.
    #[error("rank {rank}: {detail}. hint: every process must build the same model")]
    ModelMismatch {
        /// This process's rank.
        rank: usize,
        /// What differs.
        detail: String,
    },

    /// The model given to `backward` is not the one its optimizer was prepared for.
    #[error(
        "rank {rank}: {detail}. hint: add or replace parameters before prepare, or prepare the \
         new model with its optimizer again on a new accelerator"
    )]
    ModelChanged {
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

    /// A stream loader cannot read or split its data.
    #[error("rank {rank}: stream loader: {detail}")]
    Stream {
        /// This process's rank.
        rank: usize,
        /// What happened, where.
        detail: String,
    },

    /// The data loader's batching cannot be shared across the processes.
    #[error("rank {rank}: data loader: {source}")]
    Sampler {
        /// This process's rank.
        rank: usize,
        /// What is wrong.
        source: accelerate_core::SamplerError,
    },

    /// The optimizer was asked to apply gradients that are not this update's.
    #[error(
        "rank {rank}: optimizer step with gradients that are not this update's (from an \
         earlier window, another accelerator, or a second step for the same update). hint: \
         call `acc.backward(loss, &model)` once per batch and pass its result to `optim.step`"
    )]
    UnexpectedGradients {
        /// This process's rank.
        rank: usize,
    },

    /// The accelerator was used in a way it does not support.
    #[error("rank {rank}: {what}. hint: {hint}")]
    Misuse {
        /// This process's rank.
        rank: usize,
        /// What was asked.
        what: String,
        /// What to do instead.
        hint: &'static str,
    },

    /// A Burn optimizer config cannot be fused.
    #[error("fused optimizer: {config}: {what}. hint: {hint}")]
    NotFusable {
        /// The config type (`AdamWConfig`, ...).
        config: &'static str,
        /// What cannot be fused.
        what: String,
        /// What to do instead.
        hint: &'static str,
    },

    /// A checkpoint does not fit this run (another model, optimizer, world size, loader).
    #[error("rank {rank}: checkpoint {}: {detail}. hint: {hint}", path.display())]
    ResumeMismatch {
        /// This process's rank.
        rank: usize,
        /// The checkpoint directory.
        path: PathBuf,
        /// What differs.
        detail: String,
        /// What to do.
        hint: &'static str,
    },

    /// A checkpoint's files could not be read or written.
    #[error("rank {rank}: checkpoint {}: {source}", path.display())]
    CheckpointUnreadable {
        /// This process's rank.
        rank: usize,
        /// The checkpoint directory.
        path: PathBuf,
        /// What the file system or the format said.
        source: accelerate_core::CheckpointError,
    },

    /// Some rank failed a stage of a save or load; every rank reports it.
    #[error("rank {rank}: checkpoint {}: {stage} failed: {failures}", path.display())]
    CheckpointFailed {
        /// This process's rank.
        rank: usize,
        /// The checkpoint directory.
        path: PathBuf,
        /// The stage (`writing the checkpoint`, ...).
        stage: &'static str,
        /// Each failed rank with its error.
        failures: String,
    },

    /// Writing a file (model weights, metrics) failed.
    #[error("rank {rank}: {action} ({}): {source}", path.display())]
    Io {
        /// This process's rank.
        rank: usize,
        /// What was being done.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },

    /// A tracker failed (only returned with `tracker_errors_fatal(true)`; else a warning).
    #[error("rank {rank}: {source}")]
    Tracker {
        /// This process's rank.
        rank: usize,
        /// Which tracker, and what happened.
        #[source]
        source: accelerate_core::TrackerError,
    },

    /// A model's weight files could not be saved, read or merged.
    #[error("rank {rank}: {source}")]
    Weights {
        /// This process's rank.
        rank: usize,
        /// What went wrong, and with which file.
        #[source]
        source: accelerate_core::weights::WeightsError,
    },

    /// Weight files that do not fit the model they are loaded into.
    #[error(
        "rank {rank}: loading {}: {detail}. hint: load into the model type (and configuration) \
         the weights were saved from", path.display()
    )]
    WeightsMismatch {
        /// This process's rank.
        rank: usize,
        /// The weights' file or directory.
        path: PathBuf,
        /// Which tensors do not fit.
        detail: String,
    },
}
