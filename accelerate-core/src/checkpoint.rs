//! Checkpoint directories: the manifest, each rank's loop state, the atomic commit and the
//! rotation of automatically named checkpoints. No tensors: the accelerator writes the model
//! and optimizer files into the directory this module hands it.
//!
//! A save writes everything into `<name>.partial`; only when every rank has finished its part
//! does the main process write `manifest.json` (last, synced) and rename the directory into
//! place. A directory without a manifest, or whose files do not match it, never loads, so a
//! crash in the middle of a save leaves the previous checkpoint as the latest one and nothing
//! half-written that could be mistaken for a checkpoint.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::distributed_sampler::{SamplerConfig, SamplerCursor};
use crate::scaler::ScalerState;

/// Version of the checkpoint layout this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The manifest's file name; written last, so its presence marks a complete checkpoint.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Suffix of a checkpoint directory being written.
pub const PARTIAL_SUFFIX: &str = ".partial";
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

/// The directory a save of `dir` writes into before it is committed.
pub fn partial_dir(dir: &Path) -> PathBuf {
    with_suffix(dir, PARTIAL_SUFFIX)
}

/// True for a directory a save is writing (or a crashed save left).
fn is_partial(dir: &Path) -> bool {
    dir.extension().is_some_and(|e| e == &PARTIAL_SUFFIX[1..])
}

/// `dir` with `suffix` appended to its last component.
fn with_suffix(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

/// Starts a save of `dir` (main process): removes what an earlier crashed save left and
/// creates the empty partial directory, which it returns.
pub fn begin_save(dir: &Path) -> Result<PathBuf, CheckpointError> {
    let partial = partial_dir(dir);
    if partial.exists() {
        std::fs::remove_dir_all(&partial).map_err(io("removing the stale", &partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(io("creating", &partial))?;
    Ok(partial)
}

/// Writes `bytes` to `path` and syncs it to disk; returns the size.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<u64, CheckpointError> {
    let mut file = File::create(path).map_err(io("creating", path))?;
    file.write_all(bytes).map_err(io("writing", path))?;
    file.sync_all().map_err(io("syncing", path))?;
    Ok(bytes.len() as u64)
}

/// Syncs a file written by someone else (Burn's writers) and returns its size.
pub fn sync_file(path: &Path) -> Result<u64, CheckpointError> {
    let file = File::open(path).map_err(io("opening", path))?;
    file.sync_all().map_err(io("syncing", path))?;
    Ok(file
        .metadata()
        .map_err(io("reading the size of", path))?
        .len())
}

/// Serialises `value` as pretty JSON into `path`, synced; returns the size.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<u64, CheckpointError> {
    let bytes = serde_json::to_vec_pretty(value).map_err(|source| CheckpointError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    write_synced(path, &bytes)
}

/// Reads a JSON file written by [`write_json`].
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, CheckpointError> {
    let bytes = std::fs::read(path).map_err(io("reading", path))?;
    serde_json::from_slice(&bytes).map_err(|source| CheckpointError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// Finishes a save (main process, after every rank wrote its files into `partial`): checks
/// the files against `manifest`, writes the manifest last and renames the directory to `dir`,
/// replacing an older checkpoint of the same name only once the new one is complete.
pub fn commit(dir: &Path, partial: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
    check_files(partial, manifest)?;
    write_json(&partial.join(MANIFEST_FILE), manifest)?;
    sync_dir(partial)?;
    let old = with_suffix(dir, ".old");
    let replacing = dir.exists();
    if replacing {
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(io("removing", &old))?;
        }
        std::fs::rename(dir, &old).map_err(io("moving aside the previous", dir))?;
    }
    std::fs::rename(partial, dir).map_err(io("renaming into place", partial))?;
    if let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    if replacing {
        std::fs::remove_dir_all(&old).map_err(io("removing", &old))?;
    }
    Ok(())
}

/// Syncs a directory's entries (a rename is durable only once its directory is synced).
pub fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    let path = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", path))
}

fn check_files(dir: &Path, manifest: &Manifest) -> Result<(), CheckpointError> {
    for file in &manifest.files {
        let path = dir.join(&file.name);
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
    if is_partial(dir) || !path.exists() {
        return Err(CheckpointError::Incomplete {
            path: dir.to_path_buf(),
            reason: format!(
                "no {MANIFEST_FILE} (a save that did not finish leaves its files without one)"
            ),
        });
    }
    let manifest: Manifest = read_json(&path)?;
    if manifest.format_version != FORMAT_VERSION {
        return Err(CheckpointError::Version {
            path: dir.to_path_buf(),
            found: manifest.format_version,
        });
    }
    check_files(dir, &manifest)?;
    Ok(manifest)
}

/// Automatically named checkpoints under `<project>/checkpoints`: `checkpoint_<updates>`, the
/// oldest removed beyond `total_limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRotation {
    /// The directory holding the checkpoints.
    pub root: PathBuf,
    /// How many complete checkpoints to keep (all when `None`).
    pub total_limit: Option<usize>,
}

impl CheckpointRotation {
    /// Checkpoints of the project in `project_dir`.
    pub fn new(project_dir: impl AsRef<Path>, total_limit: Option<usize>) -> Self {
        Self {
            root: project_dir.as_ref().join("checkpoints"),
            total_limit,
        }
    }

    /// The directory of the checkpoint taken after `updates` updates.
    pub fn path_for(&self, updates: u64) -> PathBuf {
        self.root.join(format!("{CHECKPOINT_PREFIX}{updates}"))
    }

    /// Complete checkpoints, oldest first (by update count; incomplete ones are left out).
    pub fn list(&self) -> Vec<(u64, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut found: Vec<(u64, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name();
                let n = name
                    .to_str()?
                    .strip_prefix(CHECKPOINT_PREFIX)?
                    .parse()
                    .ok()?;
                Some((n, e.path()))
            })
            .filter(|(_, path)| read_manifest(path).is_ok())
            .collect();
        found.sort();
        found
    }

    /// The newest complete checkpoint.
    pub fn latest(&self) -> Option<PathBuf> {
        self.list().pop().map(|(_, path)| path)
    }

    /// Removes the oldest complete checkpoints beyond the limit, and partial directories that
    /// crashed saves left (call after a commit, on the main process); returns what it removed.
    pub fn rotate(&self) -> Result<Vec<PathBuf>, CheckpointError> {
        let mut removed = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&self.root) {
            for entry in entries.filter_map(Result::ok) {
                let path = entry.path();
                if is_partial(&path) {
                    std::fs::remove_dir_all(&path).map_err(io("removing", &path))?;
                    removed.push(path);
                }
            }
        }
        if let Some(limit) = self.total_limit {
            let complete = self.list();
            let excess = complete.len().saturating_sub(limit.max(1));
            for (_, path) in complete.into_iter().take(excess) {
                std::fs::remove_dir_all(&path).map_err(io("removing", &path))?;
                removed.push(path);
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(files: Vec<ManifestFile>) -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            library_version: "test".into(),
            world_size: 1,
            updates: 3,
            files,
        }
    }

    fn save(dir: &Path, payload: &[u8]) -> Result<(), CheckpointError> {
        let partial = begin_save(dir)?;
        let bytes = write_synced(&partial.join("a.bin"), payload)?;
        let files = vec![ManifestFile {
            name: "a.bin".into(),
            contents: "test".into(),
            rank: None,
            bytes,
        }];
        commit(dir, &partial, &manifest(files))
    }

    #[test]
    fn a_committed_checkpoint_loads_and_replaces_the_previous_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        save(&dir, b"first").unwrap();
        assert_eq!(read_manifest(&dir).unwrap().files[0].bytes, 5);
        save(&dir, b"second!").unwrap();
        assert_eq!(read_manifest(&dir).unwrap().files[0].bytes, 7);
        assert_eq!(std::fs::read(dir.join("a.bin")).unwrap(), b"second!");
        assert!(!partial_dir(&dir).exists());
    }

    #[test]
    fn an_unfinished_save_never_loads() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        save(&dir, b"first").unwrap();
        // A save that died before its commit: files, no manifest.
        let partial = begin_save(&dir).unwrap();
        write_synced(&partial.join("a.bin"), b"half").unwrap();
        let err = read_manifest(&partial).unwrap_err().to_string();
        assert!(err.contains("not a complete checkpoint"), "{err}");
        // The previous checkpoint is untouched.
        assert_eq!(std::fs::read(dir.join("a.bin")).unwrap(), b"first");
        // A truncated file is caught by its recorded size.
        std::fs::write(dir.join("a.bin"), b"fir").unwrap();
        let err = read_manifest(&dir).unwrap_err().to_string();
        assert!(
            err.contains("a.bin has 3 bytes, the manifest says 5"),
            "{err}"
        );
    }

    #[test]
    fn rotation_keeps_the_newest_complete_checkpoints() {
        let tmp = tempfile::tempdir().unwrap();
        let rotation = CheckpointRotation::new(tmp.path(), Some(2));
        for updates in [5, 10, 100, 20] {
            save(&rotation.path_for(updates), b"x").unwrap();
        }
        std::fs::create_dir_all(partial_dir(&rotation.path_for(200))).unwrap();
        assert_eq!(rotation.latest(), Some(rotation.path_for(100)));
        rotation.rotate().unwrap();
        let kept: Vec<u64> = rotation.list().into_iter().map(|(n, _)| n).collect();
        assert_eq!(kept, vec![20, 100]);
        assert!(!partial_dir(&rotation.path_for(200)).exists());
    }
}
