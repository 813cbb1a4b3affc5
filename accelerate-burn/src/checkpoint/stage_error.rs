//! Why one rank's part of a checkpoint stage failed. The ranks compare their outcomes before
//! any moves on ([`Context::agree`](super::Context::agree)): a peer's failure crosses processes
//! as its message, so every variant's message is whole (what, which file, why).

use std::path::PathBuf;

use accelerate_core::CheckpointError;

use crate::error::AccelerateError;
use crate::reducer::flat::FusedStateError;

/// One rank's failure in a stage of a save or load.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StageError {
    /// Writing, syncing or renaming in the checkpoint directory.
    #[error(transparent)]
    Files(#[from] CheckpointError),
    /// A directory or file operation outside the directory protocol.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Burn could not write or read a record or a weights file.
    #[error("{what}: {detail}")]
    Burn {
        /// What was written or read (`model weights`, `optimizer record`, a file name).
        what: String,
        /// Burn's error.
        detail: String,
    },
    /// A weights file whose tensors are not this model's.
    #[error("{file} does not fit this model ({detail})")]
    DoesNotFit {
        /// The file's name.
        file: String,
        /// What does not fit, in Burn's words.
        detail: String,
    },
    /// A fused optimizer state file that does not fit this run, or is damaged.
    #[error("{file}: {source}")]
    FusedStateFile {
        /// The file's name.
        file: String,
        /// What is wrong with it.
        source: FusedStateError,
    },
    /// The fused optimizer state of a checkpoint does not fit this run.
    #[error(transparent)]
    FusedState(#[from] FusedStateError),
    /// The optimizer's buffers could not be rebuilt for the loaded model.
    #[error(transparent)]
    Rebuild(Box<AccelerateError>),
    /// A name given to [`Checkpoint::pair`](super::Checkpoint::pair) that cannot be a
    /// directory, or one given twice.
    #[error(
        "pair name {0:?} is not a file name, begins as the checkpoint's own files do (zero3_, \
         fused_optimizer_, rank_) or is used twice; hint: give each pair its own name of \
         letters, digits, - and _"
    )]
    PairName(String),
    /// A name given to [`Checkpoint::module`](super::Checkpoint::module) that cannot be a
    /// file name.
    #[error(
        "module name {0:?} is not a file name or begins as the checkpoint's own files do \
         (zero3_, fused_optimizer_, rank_); hint: use letters, digits, - and _"
    )]
    ModuleName(String),
    /// A user object that does not serialise.
    #[error("object {name:?} does not serialise: {source}")]
    Object {
        /// The object's name.
        name: String,
        /// serde's error.
        source: serde_json::Error,
    },
    /// The scheduler was stepped ahead of the optimizer.
    #[error(
        "the scheduler was stepped more than once past the latest update; hint: call \
         sched.step() once per optimizer update"
    )]
    SchedulerAhead,
}

impl From<AccelerateError> for StageError {
    fn from(error: AccelerateError) -> Self {
        Self::Rebuild(Box::new(error))
    }
}
