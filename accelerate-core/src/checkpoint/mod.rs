//! Checkpoint directories: the manifest, each rank's loop state, the crash-safe commit and the
//! rotation of automatically named checkpoints. No tensors: the accelerator writes the model
//! and optimizer files into the directory this module hands it.
//!
//! A save writes everything into `<name>.partial`; only when every rank has finished its part
//! does the main process write `manifest.json` (last, synced) and swap the directory into
//! place. A directory without a manifest, or whose files do not match it, never loads, so a
//! crash in the middle of a save leaves the previous checkpoint as the latest one and nothing
//! half-written that could be mistaken for a checkpoint.
//!
//! Nothing here deletes or replaces what it did not write: a save replaces a directory only
//! when it is empty or a checkpoint (its manifest reads), and rotation removes only complete
//! checkpoints and the partial directories of crashed saves (which carry a marker file).
//!
//! ```
//! use accelerate_core::checkpoint::{self, Manifest, ManifestFile, FORMAT_VERSION};
//!
//! let tmp = tempfile::tempdir()?;
//! let dir = tmp.path().join("ckpt");
//! let partial = checkpoint::begin_save(&dir)?;
//! let bytes = checkpoint::write_synced(&partial.join("weights.bin"), b"1234")?;
//! let file = ManifestFile { name: "weights.bin".into(), contents: "weights".into(), rank: None, bytes };
//! let manifest = Manifest {
//!     format_version: FORMAT_VERSION,
//!     library_version: "0.1.0".into(),
//!     world_size: 1,
//!     updates: 10,
//!     sequence: 0,
//!     files: vec![file],
//! };
//! checkpoint::commit(&dir, &partial, manifest)?;
//! assert_eq!(checkpoint::read_manifest(&dir)?.updates, 10);
//!
//! // A directory holding somebody else's files is never replaced.
//! let theirs = tmp.path().join("output");
//! std::fs::create_dir(&theirs)?;
//! std::fs::write(theirs.join("notes.txt"), "mine")?;
//! assert!(checkpoint::begin_save(&theirs).is_err());
//! assert_eq!(std::fs::read_to_string(theirs.join("notes.txt"))?, "mine");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod commit;
mod files;
mod rotation;

pub use commit::{begin_save, commit, locate, old_dir, partial_dir};
pub use files::{
    MAX_JSON_BYTES, create_file, read_json, replace_file, sync_dir, sync_file, write_json,
    write_synced,
};
pub use rotation::CheckpointRotation;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::distributed_sampler::{SamplerConfig, SamplerCursor};
use crate::piece_order::ConsumedShares;
use crate::scaler::ScalerState;

/// Version of the checkpoint layout this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name; written last, so its presence marks a complete checkpoint.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Suffix of a checkpoint directory being written.
pub const PARTIAL_SUFFIX: &str = ".partial";
/// Suffix of the previous checkpoint while a save on a file system without an atomic
/// exchange swaps the new one into place; a load that finds only this directory uses it.
pub const OLD_SUFFIX: &str = ".old";
/// The file that marks a partial directory as written by a save (so that only such
/// directories are ever removed as stale).
pub const PARTIAL_MARKER: &str = ".accelerate-rs-partial";
/// Prefix of automatically named checkpoints (`checkpoint_<updates>`).
pub const CHECKPOINT_PREFIX: &str = "checkpoint_";

/// What a checkpoint holds, written by the main process once every rank finished.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// accelerate-rs version of the writer.
    pub library_version: String,
    /// Processes in the job that saved.
    pub world_size: usize,
    /// Optimizer updates applied before the save.
    pub updates: u64,
    /// Commit order: one more than the highest of the checkpoints beside it when it was
    /// committed (assigned by [`commit`]; 0 in checkpoints written before it existed).
    /// Rotation and "latest" follow it, not the update count, so that after a resume from an
    /// older checkpoint the new run's checkpoints win over the abandoned run's.
    #[serde(default)]
    pub sequence: u64,
    /// Every file of the checkpoint besides the manifest.
    pub files: Vec<ManifestFile>,
}

/// One file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// What it holds (`"model weights (safetensors)"`, ...).
    pub contents: String,
    /// The rank that wrote it, for per-rank files.
    pub rank: Option<usize>,
    /// Its size in bytes, checked on load.
    pub bytes: u64,
}

/// The training loop's position, as seen by one rank (`rank_<r>.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankState {
    /// The rank that wrote it.
    pub rank: usize,
    /// Processes in the job that saved.
    pub world_size: usize,
    /// Optimizer updates applied.
    pub updates: u64,
    /// Accumulation windows completed (including skipped fp16 steps): the device's random
    /// stream is reseeded from `(seed, rank, windows)` at each window boundary.
    pub windows: u64,
    /// The seed of the device's random streams, if one was configured.
    pub seed: Option<u64>,
    /// The fp16 loss scaler.
    pub scaler: Option<ScalerState>,
    /// Where the training loader stood.
    pub loader: Option<LoaderState>,
    /// Where this process's training stream loader stood.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<crate::stream_order::StreamState>,
    /// The loop state of each other model trained beside the main one, by the name it was
    /// saved under.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub models: BTreeMap<String, ModelLoopState>,
}

/// The loop state of one model and its optimizer (checkpoints with several).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelLoopState {
    /// Its optimizer's updates.
    pub updates: u64,
    /// Its accumulation windows completed (including skipped fp16 steps).
    pub windows: u64,
    /// Its fp16 loss scaler.
    pub scaler: Option<ScalerState>,
}

/// A training loader's position in its data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Epoch and batches this rank consumed in it.
    pub cursor: SamplerCursor,
    /// Samples of the epoch's order, over all ranks, consumed before the first of those
    /// batches (non-zero only after a resume with a different world size).
    pub start_sample: usize,
    /// Samples of the epoch's order consumed over all ranks, counting from its start.
    pub samples_consumed: usize,
    /// How the loader cuts its data.
    pub sampler: SamplerConfig,
    /// For data read in pieces: what earlier runs of other world sizes consumed of this
    /// epoch before the run that saved (oldest first), which the cursor counts from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub consumed_shares: Vec<ConsumedShares>,
}

/// A checkpoint could not be written, found or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file-system operation failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done ("writing", "renaming", ...).
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The directory is not a complete checkpoint.
    #[error("{} is not a complete checkpoint: {reason}", path.display())]
    Incomplete {
        /// The directory.
        path: PathBuf,
        /// What is missing or wrong.
        reason: String,
    },
    /// A JSON file could not be read.
    #[error("{}: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// The directory to save into holds something a save did not write.
    #[error(
        "{} {found}; a save replaces only an empty directory or an accelerate-rs checkpoint, \
         so nothing was written or removed. hint: save into a directory of its own (for example \
         {}), or move what is there away first",
        path.display(),
        path.join("checkpoint").display()
    )]
    NotOurs {
        /// The directory.
        path: PathBuf,
        /// What is there (`holds files but no manifest.json`, ...).
        found: &'static str,
    },
    /// A manifest names a file outside its checkpoint directory.
    #[error(
        "{}: the manifest names {name:?}, which is not a file inside the checkpoint; the \
         manifest is corrupt or was not written by accelerate-rs",
        path.display()
    )]
    UnsafeName {
        /// The checkpoint directory.
        path: PathBuf,
        /// The name as the manifest gives it.
        name: String,
    },
    /// The checkpoint was written by an incompatible version.
    #[error(
        "{} has checkpoint format {found}, this build reads format {FORMAT_VERSION}. \
         hint: resume with the accelerate-rs version that wrote it",
        path.display()
    )]
    Version {
        /// The directory.
        path: PathBuf,
        /// The version found.
        found: u32,
    },
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError {
    let path = path.to_path_buf();
    move |source| CheckpointError::Io {
        action,
        path,
        source,
    }
}

/// True for a name a manifest may list: a relative path of at most two plain components (a
/// pair's directory and a file in it), none of them `.`, `..` or hidden behind a separator
/// trick, so that joining it to the checkpoint directory stays inside it.
pub fn is_safe_file_name(name: &str) -> bool {
    let parts: Vec<&str> = name.split('/').collect();
    parts.len() <= 2
        && parts.iter().all(|part| {
            !part.is_empty()
                && *part != "."
                && *part != ".."
                && !part.contains(['\\', '\0'])
                && part.len() <= 255
        })
}

/// Fails unless every name `manifest` lists is a file inside `dir` ([`is_safe_file_name`],
/// and not the manifest itself).
fn check_names(dir: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
    match manifest
        .files
        .iter()
        .find(|f| !is_safe_file_name(&f.name) || f.name == MANIFEST_FILE)
    {
        Some(file) => Err(CheckpointError::UnsafeName {
            path: dir.to_path_buf(),
            name: file.name.clone(),
        }),
        None => Ok(()),
    }
}

/// Fails unless every file `manifest` lists (its names already checked) is in `dir` with its
/// recorded size, and none is a symbolic link.
fn check_files(dir: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
    for file in &manifest.files {
        // Not followed: a link in a checkpoint points outside it.
        let path = dir.join(&file.name);
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(CheckpointError::UnsafeName {
                path: dir.to_path_buf(),
                name: file.name.clone(),
            });
        }
        let incomplete = |reason: String| CheckpointError::Incomplete {
            path: dir.to_path_buf(),
            reason,
        };
        match std::fs::metadata(&path) {
            Ok(meta) if meta.len() == file.bytes => {}
            Ok(meta) => {
                return Err(incomplete(format!(
                    "{} has {} bytes, the manifest says {}",
                    file.name,
                    meta.len(),
                    file.bytes
                )));
            }
            Err(e) => return Err(incomplete(format!("{}: {e}", file.name))),
        }
    }
    Ok(())
}

/// Reads and checks the manifest of the checkpoint in `dir`: present, of this format, and
/// every file it lists present with its recorded size.
pub fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST_FILE);
    if commit::is_partial(dir) || !path.is_file() {
        return Err(CheckpointError::Incomplete {
            path: dir.to_path_buf(),
            reason: format!(
                "no {MANIFEST_FILE} (a save that did not finish leaves its files without one)"
            ),
        });
    }
    let bytes = crate::input_file::read_at_most(&path, files::MAX_JSON_BYTES)
        .map_err(io("reading", &path))?;
    let manifest = decode_manifest(dir, &bytes)?;
    check_files(dir, &manifest)?;
    Ok(manifest)
}

/// Decodes the bytes of `dir`'s manifest: JSON of this format whose file names all stay
/// inside `dir` ([`is_safe_file_name`]). Whether the files are there is [`read_manifest`]'s
/// part.
pub fn decode_manifest(dir: &Path, bytes: &[u8]) -> Result<Manifest, CheckpointError> {
    let manifest: Manifest =
        serde_json::from_slice(bytes).map_err(|source| CheckpointError::Json {
            path: dir.join(MANIFEST_FILE),
            source,
        })?;
    if manifest.format_version != FORMAT_VERSION {
        return Err(CheckpointError::Version {
            path: dir.to_path_buf(),
            found: manifest.format_version,
        });
    }
    check_names(dir, &manifest)?;
    Ok(manifest)
}
