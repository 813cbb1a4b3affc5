//! Saving a model's weights into a directory, in either layout, without losing or mixing
//! models: a sharded save stages its shards in a private directory and publishes them only
//! once all are written (crash-safely: [`super::publish`]); the files of the layout a save
//! replaces are removed only when accelerate-rs wrote them (their `saved_by` mark); a model
//! that someone else wrote stops the save before anything is written.

use std::path::{Path, PathBuf};

use super::header::read_header;
use super::publish::{self, Replaced, staging_name};
use super::sharding::{INDEX_FILE, MODEL_FILE, ShardIndex, is_shard_file_name};
use super::{WeightsError, io, malformed};

/// Fails when `dir` holds a whole `model.safetensors` that accelerate-rs did not write; returns
/// whether it holds one that it did.
fn whole_model_of_ours(dir: &Path) -> Result<bool, WeightsError> {
    let path = dir.join(MODEL_FILE);
    if std::fs::symlink_metadata(&path).is_err() {
        return Ok(false);
    }
    match read_header(&path) {
        Ok(header) if header.is_ours() => Ok(true),
        _ => Err(malformed(
            &path,
            "a whole model that accelerate-rs did not write: a save here would replace it (or \
             leave two models beside each other); move it away, or save to another directory",
        )),
    }
}

/// The index in `dir` when accelerate-rs wrote it; fails for someone else's.
fn index_of_ours(dir: &Path) -> Result<Option<ShardIndex>, WeightsError> {
    let path = dir.join(INDEX_FILE);
    if std::fs::symlink_metadata(&path).is_err() {
        return Ok(None);
    }
    match ShardIndex::read(dir) {
        Ok(index) if index.is_ours() => Ok(Some(index)),
        _ => Err(malformed(
            &path,
            "a sharded model that accelerate-rs did not write; saving another model beside it \
             would leave two: move it away, or save to another directory",
        )),
    }
}

/// Removes the shards `index` names that match our shard names, then nothing else: a name
/// the index gives that we would not have written stays.
fn remove_shards(dir: &Path, index: &ShardIndex) -> Result<(), WeightsError> {
    for file in index.files() {
        if is_shard_file_name(file) {
            let path = dir.join(file);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io("removing the replaced shard", &path)(e));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// A whole-model save into `dir`: [`begin`](Self::begin) before `model.safetensors` is written,
/// [`finish`](Self::finish) after.
pub struct WholeSave {
    dir: PathBuf,
    replaced: Option<ShardIndex>,
}

impl WholeSave {
    /// Checks that `dir` holds no model that is not ours, whole or sharded (and creates it):
    /// the whole file is about to be replaced, and a sharded model removed. A sharded save
    /// killed while it published there is finished first.
    pub fn begin(dir: &Path) -> Result<Self, WeightsError> {
        std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
        publish::finish_interrupted(dir);
        whole_model_of_ours(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            replaced: index_of_ours(dir)?,
        })
    }

    /// Once the whole model is written: removes the sharded model of ours it replaces.
    pub fn finish(self) -> Result<(), WeightsError> {
        if let Some(index) = &self.replaced {
            let path = self.dir.join(INDEX_FILE);
            std::fs::remove_file(&path).map_err(io("removing the replaced index", &path))?;
            remove_shards(&self.dir, index)?;
        }
        Ok(())
    }
}

/// A sharded save into `dir`: shards go to [`shard_path`](Self::shard_path) (a private staging
/// directory inside `dir`), then [`commit`](Self::commit) publishes them with their index.
/// Dropped without a commit, the staging directory and what is in it are removed.
pub struct ShardedSave {
    dir: PathBuf,
    staging: PathBuf,
    replaced_index: Option<ShardIndex>,
    replaced_whole: bool,
    committed: bool,
}

impl ShardedSave {
    /// Finishes or removes what saves of this host killed in `dir` left
    /// ([`finish_interrupted`](super::finish_interrupted)), checks that `dir` holds no model that is not ours,
    /// and creates the staging directory (`.shards.<scope>.<pid>.staging`, exclusively:
    /// someone else's of that name is an error).
    pub fn begin(dir: &Path) -> Result<Self, WeightsError> {
        std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
        publish::finish_interrupted(dir);
        let replaced_whole = whole_model_of_ours(dir)?;
        let replaced_index = index_of_ours(dir)?;
        let scope = crate::process::pid_scope();
        let staging = dir.join(staging_name(&scope, std::process::id()));
        std::fs::create_dir(&staging).map_err(io("creating the staging directory", &staging))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            staging,
            replaced_index,
            replaced_whole,
            committed: false,
        })
    }

    /// Where the shard `name` is written before the commit (a file that does not exist yet).
    pub fn shard_path(&self, name: &str) -> PathBuf {
        self.staging.join(name)
    }

    /// Publishes the staged shards that `index` names (every one must have been written) and
    /// `index`, then removes the model of ours they replace; returns the paths written. Once
    /// the publish is journalled, a failure or a kill leaves it for the next save or load of
    /// the directory to finish: the old model or the new one always loads whole.
    pub fn commit(mut self, index: &ShardIndex) -> Result<Vec<PathBuf>, WeightsError> {
        let replaced = Replaced {
            shards: self
                .replaced_index
                .as_ref()
                .map(|old| old.files().into_iter().map(str::to_string).collect())
                .unwrap_or_default(),
            whole: self.replaced_whole,
        };
        let published = publish::publish(&self.dir, &self.staging, index, replaced);
        // Journalled, the staging directory is the publish's record: it stays until done.
        self.committed = published.is_ok() || self.staging.join(INDEX_FILE).exists();
        published
    }
}

impl Drop for ShardedSave {
    fn drop(&mut self) {
        if !self.committed {
            // Ours: created exclusively in `begin`, holding only what this save wrote.
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::TensorEntry;
    use super::super::header;
    use super::super::sharding::{SAVED_BY, SAVED_BY_KEY, shard_file_name};
    use super::super::test_file_names as names;
    use super::*;
    use std::collections::BTreeMap;

    /// A one-tensor safetensors file, marked as ours or not.
    fn model_file(path: &Path, ours: bool) {
        let mut metadata = BTreeMap::new();
        if ours {
            metadata.insert(SAVED_BY_KEY.to_string(), SAVED_BY.to_string());
        }
        let tensors = BTreeMap::from([(
            "w".to_string(),
            TensorEntry {
                dtype: "F32".into(),
                shape: vec![1],
                data_offsets: [0, 4],
            },
        )]);
        let mut bytes = header::encode(&metadata, &tensors).unwrap();
        bytes.extend_from_slice(&[0; 4]);
        std::fs::write(path, bytes).unwrap();
    }

    /// A sharded save of `count` one-tensor shards into `dir`.
    fn save_sharded(dir: &Path, count: usize) -> Result<Vec<PathBuf>, WeightsError> {
        let save = ShardedSave::begin(dir)?;
        let names: Vec<String> = (0..count).map(|i| shard_file_name(i, count)).collect();
        for name in &names {
            model_file(&save.shard_path(name), true);
        }
        let index = ShardIndex::new(
            4 * count as u64,
            names
                .iter()
                .enumerate()
                .map(|(i, n)| (format!("w{i}"), n.clone())),
        );
        save.commit(&index)
    }

    #[test]
    fn a_save_replaces_our_other_layout_and_leaves_no_staging() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        std::fs::write(dir.join("notes.txt"), "mine").unwrap();
        model_file(&dir.join(MODEL_FILE), true);
        save_sharded(dir, 3).unwrap();
        assert_eq!(
            names(dir),
            [
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors",
                INDEX_FILE,
                "notes.txt"
            ]
        );
        // Fewer shards: the three-shard files go.
        save_sharded(dir, 2).unwrap();
        assert_eq!(names(dir).len(), 4, "{:?}", names(dir));
        // Back to one file: the index and its shards go.
        let whole = WholeSave::begin(dir).unwrap();
        model_file(&dir.join(MODEL_FILE), true);
        whole.finish().unwrap();
        assert_eq!(names(dir), [MODEL_FILE, "notes.txt"]);
        assert_eq!(
            std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
            "mine"
        );
    }

    #[test]
    fn someone_elses_model_stops_the_save_before_anything_is_written() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        model_file(&dir.join(MODEL_FILE), false);
        let before = std::fs::read(dir.join(MODEL_FILE)).unwrap();
        let err = save_sharded(dir, 2).unwrap_err().to_string();
        assert!(err.contains("did not write"), "{err}");
        assert_eq!(names(dir), [MODEL_FILE]);
        assert_eq!(std::fs::read(dir.join(MODEL_FILE)).unwrap(), before);

        // A hub-downloaded sharded model: a whole save refuses to sit beside it.
        let other = tmp.path().join("hub");
        std::fs::create_dir(&other).unwrap();
        let mut index = ShardIndex::new(4, [("w".to_string(), shard_file_name(0, 1))]);
        index.metadata.saved_by = None;
        index.write(&other).unwrap();
        assert!(WholeSave::begin(&other).is_err());
        assert!(ShardedSave::begin(&other).is_err());
    }

    #[test]
    fn a_whole_save_replaces_only_a_whole_model_of_ours() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        // A hub download: refused before anything is written, left as it was.
        model_file(&dir.join(MODEL_FILE), false);
        let before = std::fs::read(dir.join(MODEL_FILE)).unwrap();
        let err = WholeSave::begin(dir).err().unwrap().to_string();
        assert!(err.contains("did not write"), "{err}");
        assert_eq!(std::fs::read(dir.join(MODEL_FILE)).unwrap(), before);
        // A file that is not safetensors at all is not ours either.
        std::fs::write(dir.join(MODEL_FILE), "weights of some other program").unwrap();
        assert!(WholeSave::begin(dir).is_err());
        // Ours: replaced.
        model_file(&dir.join(MODEL_FILE), true);
        WholeSave::begin(dir).unwrap().finish().unwrap();
    }

    /// What a save killed before its commit left is removed by the next save, and only that:
    /// a live process's staging, another scope's (another host or container sharing the
    /// directory) and a file we would not have written stay.
    #[test]
    fn a_save_removes_the_staging_a_killed_save_left_and_nothing_else() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let scope = crate::process::pid_scope();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let staged = |name: &str| {
            let path = dir.join(name);
            std::fs::create_dir(&path).unwrap();
            model_file(&path.join(shard_file_name(0, 2)), true);
            path
        };
        let killed = staged(&staging_name(&scope, dead));
        // Killed while Burn wrote the second shard: its scratch file goes too.
        let scratch = format!("{}.{dead}-0.tmp", shard_file_name(1, 2));
        std::fs::write(killed.join(&scratch), "half a shard").unwrap();
        // A name that only looks like one stays (and so does its directory).
        let not_scratch = staged(&staging_name(&scope, dead.wrapping_add(2_000_000)));
        std::fs::write(
            not_scratch.join(format!("{}.x-0.tmp", shard_file_name(1, 2))),
            "?",
        )
        .unwrap();
        let live = staged(&staging_name(&scope, 1));
        let elsewhere = staged(&staging_name("0123456789ab", dead));
        let with_user_file = staged(&staging_name(&scope, dead.wrapping_add(1_000_000)));
        std::fs::write(with_user_file.join("notes.txt"), "mine").unwrap();
        save_sharded(dir, 1).unwrap();
        assert!(!killed.exists());
        assert_eq!(names(&not_scratch).len(), 1, "{:?}", names(&not_scratch));
        for kept in [&live, &elsewhere] {
            assert!(
                kept.join(shard_file_name(0, 2)).exists(),
                "{}",
                kept.display()
            );
        }
        assert_eq!(
            std::fs::read_to_string(with_user_file.join("notes.txt")).unwrap(),
            "mine"
        );
    }

    #[test]
    fn an_abandoned_save_removes_its_staging_only() {
        let tmp = tempfile::tempdir().unwrap();
        let save = ShardedSave::begin(tmp.path()).unwrap();
        model_file(&save.shard_path(&shard_file_name(0, 2)), true);
        drop(save);
        assert!(names(tmp.path()).is_empty(), "{:?}", names(tmp.path()));
    }
}
