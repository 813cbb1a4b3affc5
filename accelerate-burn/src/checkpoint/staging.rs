//! Where a save's files go before the commit. Every part of a checkpoint is serialised first
//! (a [`SavedFile`]); a synchronous save then writes and syncs it into the partial directory at
//! once, an asynchronous save keeps it: in memory (the snapshot), or written into the partial
//! directory without waiting for the disk. [`Pending::make_durable`] finishes what is left, on
//! the background thread.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use accelerate_core::checkpoint::{self, ManifestFile};

use burn::store::SafetensorsStore;

use super::{ModuleWriter, StageError};
use crate::reducer::SavedFile;

/// Where an asynchronous save keeps its snapshot until the background thread writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CheckpointSnapshot {
    /// In memory: the training thread only serialises (the fastest; the snapshot's bytes are
    /// held until the write finishes, as the memory estimate says).
    #[default]
    Memory,
    /// In the checkpoint's own files, written without waiting for the disk (the page cache
    /// holds them, and may write them out under memory pressure): for a model whose state does
    /// not fit in memory twice. The background thread syncs them.
    Files,
}

/// How a save stages its files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StageMode {
    /// Written and synced as each is serialised (a synchronous save).
    Now,
    /// Kept for the background thread ([`CheckpointSnapshot`]).
    Snapshot(CheckpointSnapshot),
}

/// The files of one rank's part of a save, as they are staged.
pub(crate) struct Staging {
    partial: PathBuf,
    mode: StageMode,
    /// What the manifest will list.
    listed: Vec<ManifestFile>,
    /// Files the background thread writes (in memory) or syncs (in files; their data empty).
    held: Vec<SavedFile>,
    /// Directories inside the checkpoint that files went into (synced at the end).
    subdirs: BTreeSet<PathBuf>,
}

impl Staging {
    /// Stages into `partial` (the directory the save commits).
    pub(crate) fn new(partial: &Path, mode: StageMode) -> Self {
        Self {
            partial: partial.to_path_buf(),
            mode,
            listed: Vec::new(),
            held: Vec::new(),
            subdirs: BTreeSet::new(),
        }
    }

    /// Stages one file (its name may be `dir/name`: the directory is made).
    pub(crate) fn put(&mut self, mut file: SavedFile) -> Result<(), StageError> {
        self.listed.push(ManifestFile {
            name: file.name.clone(),
            contents: file.contents.to_string(),
            rank: file.rank,
            bytes: file.data.len() as u64,
        });
        let mut sub = Path::new(&file.name).parent();
        while let Some(dir) = sub.filter(|d| !d.as_os_str().is_empty()) {
            self.subdirs.insert(dir.to_path_buf());
            sub = dir.parent();
        }
        let path = self.partial.join(&file.name);
        match self.mode {
            StageMode::Now => {
                make_parent(&path)?;
                checkpoint::write_synced(&path, &file.data)?;
            }
            StageMode::Snapshot(CheckpointSnapshot::Files) => {
                make_parent(&path)?;
                std::fs::write(&path, &file.data).map_err(|source| StageError::Io {
                    path: path.clone(),
                    source,
                })?;
                file.data = Vec::new();
                self.held.push(file);
            }
            StageMode::Snapshot(CheckpointSnapshot::Memory) => self.held.push(file),
        }
        Ok(())
    }

    /// Stages a safetensors file of the module `write` saves: Burn writes it straight into
    /// its file in a synchronous save, into memory otherwise.
    pub(crate) fn put_safetensors(
        &mut self,
        name: &str,
        contents: &'static str,
        write: &ModuleWriter<'_>,
    ) -> Result<(), StageError> {
        let burn_error = |e: burn::store::SafetensorsStoreError| StageError::Burn {
            what: name.to_string(),
            detail: e.to_string(),
        };
        if self.mode == StageMode::Now {
            let path = self.partial.join(name);
            make_parent(&path)?;
            let mut store = SafetensorsStore::from_file(&path).overwrite(true);
            write(&mut store).map_err(burn_error)?;
            let bytes = checkpoint::sync_file(&path)?;
            self.listed.push(ManifestFile {
                name: name.to_string(),
                contents: contents.to_string(),
                rank: None,
                bytes,
            });
            return Ok(());
        }
        let mut store = SafetensorsStore::from_bytes(None);
        write(&mut store).map_err(burn_error)?;
        let data = store.get_bytes().map_err(burn_error)?;
        self.put(SavedFile {
            name: name.to_string(),
            contents,
            rank: None,
            data,
        })
    }

    /// What the manifest lists, and what is left to make the files durable.
    pub(crate) fn finish(self) -> (Vec<ManifestFile>, Pending) {
        let pending = Pending {
            partial: self.partial,
            mode: self.mode,
            held: self.held,
            subdirs: self.subdirs,
        };
        (self.listed, pending)
    }
}

/// What a staged save still has to do before its files are on disk.
pub(crate) struct Pending {
    partial: PathBuf,
    mode: StageMode,
    held: Vec<SavedFile>,
    subdirs: BTreeSet<PathBuf>,
}

impl Pending {
    /// Writes (or syncs) the held files and syncs the directories they are in. `before_each`
    /// runs ahead of each file, given its path (the tests' fault injection).
    pub(crate) fn make_durable(
        self,
        mut before_each: impl FnMut(&Path) -> Result<(), StageError>,
    ) -> Result<(), StageError> {
        for file in &self.held {
            let path = self.partial.join(&file.name);
            before_each(&path)?;
            match self.mode {
                StageMode::Snapshot(CheckpointSnapshot::Memory) => {
                    make_parent(&path)?;
                    checkpoint::write_synced(&path, &file.data)?;
                }
                StageMode::Snapshot(CheckpointSnapshot::Files) => {
                    checkpoint::sync_file(&path)?;
                }
                StageMode::Now => {}
            }
        }
        for sub in &self.subdirs {
            checkpoint::sync_dir(&self.partial.join(sub))?;
        }
        Ok(())
    }
}

/// Makes the directory `path` is in (inside the checkpoint).
fn make_parent(path: &Path) -> Result<(), StageError> {
    match path.parent() {
        Some(parent) => std::fs::create_dir_all(parent).map_err(|source| StageError::Io {
            path: parent.to_path_buf(),
            source,
        }),
        None => Ok(()),
    }
}
