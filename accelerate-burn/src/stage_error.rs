//! Why one rank's part of a checkpoint stage failed, in the checkpoint's own steps or in a
//! reducer's part of it (its state files): below both, so that neither imports the other for
//! it. The ranks compare their outcomes before any moves on (the checkpoint's `Context::agree`):
//! a peer's failure crosses processes as its message, so every variant's message is whole
//! (what, which file, why).

use std::path::PathBuf;

use accelerate_core::CheckpointError;

use crate::error::AccelerateError;
use crate::fused::FusedOptimizer;

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
    /// A name given to [`Checkpoint::pair`](crate::Checkpoint::pair) that cannot be a
    /// directory, or one given twice.
    #[error(
        "pair name {0:?} is not a file name, begins as the checkpoint's own files do (zero3_, \
         fused_optimizer_, rank_) or is used twice; hint: give each pair its own name of \
         letters, digits, - and _"
    )]
    PairName(String),
    /// A name given to [`Checkpoint::module`](crate::Checkpoint::module) that cannot be a
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

/// Why a checkpoint's fused optimizer state cannot be loaded into this run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum FusedStateError {
    /// The file has no JSON header line.
    #[error("no header line")]
    NoHeader,
    /// The header is not the JSON of one (serde's message).
    #[error("{0}")]
    Header(String),
    /// A buffer holds fewer values than its header says.
    #[error("buffer `{0}` is truncated")]
    Truncated(String),
    /// The state is another optimizer's.
    #[error("the checkpoint's fused optimizer state is for {saved:?}, this run uses {ours:?}")]
    OtherOptimizer {
        /// The optimizer of the checkpoint.
        saved: FusedOptimizer,
        /// This run's.
        ours: FusedOptimizer,
    },
    /// The state was saved for other parameters.
    #[error("the checkpoint's fused optimizer state was saved for other parameters")]
    OtherParameters,
    /// The step counts do not match the parameter groups.
    #[error(
        "the checkpoint's fused optimizer state counts steps of {saved} parameter groups, this \
         model has {ours}: the file is corrupt"
    )]
    StepCounts {
        /// Groups in the checkpoint.
        saved: usize,
        /// Groups of this model.
        ours: usize,
    },
    /// A buffer the optimizer needs is missing.
    #[error("the checkpoint's fused optimizer state has no `{0}` buffer")]
    NoBuffer(String),
    /// The shards leave some values of a buffer out.
    #[error(
        "the checkpoint's fused optimizer shards do not cover all {len} values of `{name}`: a \
         shard file is missing or corrupt"
    )]
    Uncovered {
        /// Values of the buffer.
        len: usize,
        /// The buffer.
        name: String,
    },
}
