//! Automatically named checkpoints under `<project>/checkpoints`: `checkpoint_<updates>`,
//! ordered by commit (the manifest's sequence), the oldest committed removed beyond the limit.
//!
//! Commit order, not the update count: after a resume from an older checkpoint, the new run's
//! checkpoints are the newest even where the abandoned run counted further, so rotation keeps
//! them and "latest" resumes them.

use std::path::{Path, PathBuf};

use super::commit::{Found, found_at, is_partial};
use super::{CHECKPOINT_PREFIX, CheckpointError, OLD_SUFFIX, io, locate, read_manifest};

/// Automatically named checkpoints under `<project>/checkpoints`: `checkpoint_<updates>`, the
/// oldest committed removed beyond `total_limit`.
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

    /// Complete checkpoints as `(updates, directory)`, in commit order, oldest first
    /// (incomplete ones are left out). The directory is where a load reads it: its own, or
    /// the `.old` one a save that crashed mid-swap left.
    pub fn list(&self) -> Vec<(u64, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut found: Vec<(u64, u64, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter_map(|e| {
                let name = e.file_name();
                let name = name.to_str()?.strip_prefix(CHECKPOINT_PREFIX)?;
                let updates: u64 = name.strip_suffix(OLD_SUFFIX).unwrap_or(name).parse().ok()?;
                // A `.old` directory counts only where it stands in for its checkpoint.
                let path = locate(&self.path_for(updates));
                (path == e.path()).then_some((updates, path))
            })
            .filter_map(|(updates, path)| {
                let manifest = read_manifest(&path).ok()?;
                Some((manifest.sequence, updates, path))
            })
            .collect();
        found.sort();
        found
            .into_iter()
            .map(|(_, updates, path)| (updates, path))
            .collect()
    }

    /// The most recently committed complete checkpoint.
    pub fn latest(&self) -> Option<PathBuf> {
        self.list().pop().map(|(_, path)| path)
    }

    /// Call after a commit, on the main process: removes the partial directories of crashed
    /// saves and the oldest committed checkpoints beyond the limit, never `keep` (the one
    /// just written) nor anything a save did not write; returns what it removed.
    pub fn rotate(&self, keep: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
        let mut removed = Vec::new();
        let mut remove = |path: PathBuf| -> Result<(), CheckpointError> {
            std::fs::remove_dir_all(&path).map_err(io("removing", &path))?;
            removed.push(path);
            Ok(())
        };
        if let Ok(entries) = std::fs::read_dir(&self.root) {
            for entry in entries.filter_map(Result::ok) {
                let path = entry.path();
                let stale = is_partial(&path)
                    && path
                        .file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(CHECKPOINT_PREFIX));
                // Stray files, links and other people's directories are left alone.
                if stale && found_at(&path)? == Found::Ours {
                    remove(path)?;
                }
            }
        }
        if let Some(limit) = self.total_limit {
            let complete: Vec<PathBuf> = self
                .list()
                .into_iter()
                .map(|(_, path)| path)
                .filter(|path| path != keep)
                .collect();
            // `keep` counts as one of the kept.
            let excess = (complete.len() + 1).saturating_sub(limit.max(1));
            for path in complete.into_iter().take(excess) {
                remove(path)?;
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::super::commit::tests::save;
    use super::super::{MANIFEST_FILE, partial_dir, read_json, write_json};
    use super::*;

    fn kept(rotation: &CheckpointRotation) -> Vec<u64> {
        rotation.list().into_iter().map(|(n, _)| n).collect()
    }

    #[test]
    fn rotation_keeps_the_most_recently_committed_checkpoints() {
        let tmp = tempfile::tempdir().unwrap();
        let rotation = CheckpointRotation::new(tmp.path(), Some(2));
        for updates in [5, 10, 100, 20] {
            save(&rotation.path_for(updates), b"x").unwrap();
        }
        std::fs::create_dir_all(partial_dir(&rotation.path_for(200))).unwrap();
        // Committed last, so the latest, although 100 counted further.
        assert_eq!(rotation.latest(), Some(rotation.path_for(20)));
        rotation.rotate(&rotation.path_for(20)).unwrap();
        assert_eq!(kept(&rotation), vec![100, 20]);
        assert!(!partial_dir(&rotation.path_for(200)).exists());
    }

    #[test]
    fn after_a_resume_from_an_older_checkpoint_the_new_run_wins() {
        let tmp = tempfile::tempdir().unwrap();
        let rotation = CheckpointRotation::new(tmp.path(), Some(1));
        save(&rotation.path_for(100), b"a").unwrap();
        save(&rotation.path_for(200), b"abandoned").unwrap();
        // The user resumed checkpoint_100 and saves after 110 updates with limit 1.
        save(&rotation.path_for(110), b"resumed").unwrap();
        let removed = rotation.rotate(&rotation.path_for(110)).unwrap();
        assert_eq!(removed.len(), 2);
        assert_eq!(kept(&rotation), vec![110]);
        assert_eq!(rotation.latest(), Some(rotation.path_for(110)));
    }

    #[test]
    fn rotation_touches_nothing_a_save_did_not_write() {
        let tmp = tempfile::tempdir().unwrap();
        let rotation = CheckpointRotation::new(tmp.path(), Some(1));
        save(&rotation.path_for(1), b"x").unwrap();
        // A stray file named like a partial directory, a user's directory, a link.
        std::fs::write(rotation.root.join("checkpoint_7.partial"), b"notes").unwrap();
        let theirs = rotation.root.join("checkpoint_8.partial");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::write(theirs.join("data"), b"d").unwrap();
        std::fs::create_dir(rotation.root.join("checkpoint_9")).unwrap();
        std::fs::write(rotation.root.join("checkpoint_9").join("mine"), b"m").unwrap();
        save(&rotation.path_for(2), b"y").unwrap();
        let removed = rotation.rotate(&rotation.path_for(2)).unwrap();
        assert_eq!(removed, vec![rotation.path_for(1)]);
        assert!(rotation.root.join("checkpoint_7.partial").is_file());
        assert!(theirs.join("data").is_file());
        assert!(rotation.root.join("checkpoint_9").join("mine").is_file());
    }

    #[test]
    fn checkpoints_from_before_the_sequence_order_by_updates() {
        let tmp = tempfile::tempdir().unwrap();
        let rotation = CheckpointRotation::new(tmp.path(), None);
        for updates in [30, 4] {
            let dir = rotation.path_for(updates);
            save(&dir, b"x").unwrap();
            // As an older version wrote it: no sequence field.
            let mut manifest: serde_json::Value = read_json(&dir.join(MANIFEST_FILE)).unwrap();
            manifest.as_object_mut().unwrap().remove("sequence");
            write_json(&dir.join(MANIFEST_FILE), &manifest).unwrap();
        }
        assert_eq!(kept(&rotation), vec![4, 30]);
        // A new save comes after both.
        save(&rotation.path_for(5), b"x").unwrap();
        assert_eq!(rotation.latest(), Some(rotation.path_for(5)));
    }
}
