//! Model weight files in the safetensors format, without tensors in memory: reading a file's
//! header (names, dtypes, shapes, where each tensor's bytes lie), the Hugging Face hub's
//! sharded layout (`model-00001-of-00003.safetensors` ... and `model.safetensors.index.json`),
//! and merging a sharded model into one file by copying each tensor's bytes from disk to disk.
//!
//! What reads these files must expect anything: a header is bounded, every offset is checked
//! against the file's size and the tensor's shape, and an index may name only plain file names
//! in its own directory.
//!
//! ```
//! use accelerate_core::weights::{self, ShardIndex};
//!
//! // Three tensors of 48, 16 and 40 bytes in shards of at most 64: [48, 16] and [40].
//! assert_eq!(weights::plan_shards(&[48, 16, 40], 64), vec![0..2, 2..3]);
//! assert_eq!(weights::shard_file_name(0, 2), "model-00001-of-00002.safetensors");
//!
//! let tmp = tempfile::tempdir()?;
//! let names = [("a", 0), ("b", 0), ("c", 1)];
//! let index = ShardIndex::new(104, names.iter().map(|(t, f)| (t.to_string(), weights::shard_file_name(*f, 2))));
//! index.write(tmp.path())?;
//! assert_eq!(ShardIndex::read(tmp.path())?.files().len(), 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod header;
mod merge;
mod publish;
mod save;
mod sharding;
mod stream;

#[cfg(test)]
pub(crate) use header::write_test_file;

/// The names in `dir`, sorted (tests).
#[cfg(test)]
pub(crate) fn test_file_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
pub use header::{Header, TensorEntry, dtype_size, read_header};
pub use merge::{MergeReport, merge_sharded};
pub use publish::finish_interrupted;
pub use save::{ShardedSave, WholeSave};
pub use sharding::{
    INDEX_FILE, IndexMetadata, MODEL_FILE, SAVED_BY, SAVED_BY_KEY, ShardIndex, is_shard_file_name,
    plan_shards, shard_file_name,
};
pub use stream::{StreamedTensor, write_streamed};

use std::path::{Path, PathBuf};

/// A weight file or index that could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// The file system refused.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// A file's contents are not what the format allows.
    #[error("{path}: {what}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        what: String,
    },
    /// Writing, syncing or renaming through the checkpoint module's durable writes.
    #[error(transparent)]
    Files(#[from] crate::checkpoint::CheckpointError),
    /// The output exists: it is not ours to replace.
    #[error("{path} exists; it is not replaced: choose another output, or move it away")]
    OutputExists {
        /// The file that exists.
        path: PathBuf,
    },
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> WeightsError {
    let path = path.to_path_buf();
    move |source| WeightsError::Io {
        action,
        path,
        source,
    }
}

fn malformed(path: &Path, what: impl Into<String>) -> WeightsError {
    WeightsError::Malformed {
        path: path.to_path_buf(),
        what: what.into(),
    }
}
