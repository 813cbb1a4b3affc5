//! Publishing a sharded save so that a crash at any moment leaves a directory the next run can
//! finish or undo. The staged shards are synced, then the list of the files the save replaces
//! and the new index are written into the staging directory: the index there is the journal
//! (the save is complete, and these are its files). Then the old index is removed (no index
//! ever names a mix of old and new shards), the shards are moved into place, the index is
//! written beside them, what was replaced is removed, and the staging directory last.
//!
//! A staging directory whose process is gone is, on the next save or load of the directory
//! ([`finish_interrupted`]): without its index, a save that never began to publish (the model's
//! directory untouched), removed; with it, a publish to complete, which is run again from the
//! start: every step can be repeated.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::header::read_header;
use super::sharding::{INDEX_FILE, MODEL_FILE, ShardIndex, is_shard_file_name};
use super::{WeightsError, io, malformed};
use crate::checkpoint::{read_json, sync_dir, sync_file, write_json};

/// In a staging directory: what the publish replaces ([`Replaced`]).
const REPLACED_FILE: &str = "replaced.json";

/// The files of ours a publish replaces, removed once the new model is in place.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Replaced {
    /// The shards the previous index named (names a sharded save of ours gives only).
    pub shards: Vec<String>,
    /// A whole `model.safetensors` of ours.
    pub whole: bool,
}

/// One change a publish makes to the disk, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    /// Syncs a staged shard.
    SyncShard(PathBuf),
    /// Writes what is replaced into the staging directory.
    WriteReplaced(PathBuf, Replaced),
    /// Writes the index into a directory (a temporary file renamed: whole or absent).
    WriteIndex(PathBuf),
    /// Removes a file of ours if it is there.
    Remove(PathBuf),
    /// Removes the index in a directory if it is there, refusing one we did not write.
    RemoveIndexOfOurs(PathBuf),
    /// Moves a staged shard into place.
    Move(PathBuf, PathBuf),
    /// Removes the whole model file if it is ours.
    RemoveWholeOfOurs(PathBuf),
    /// Syncs a directory.
    SyncDir(PathBuf),
    /// Removes the staging directory (empty by then).
    RemoveStaging(PathBuf),
}

/// Every step of publishing `staging`'s shards (every file `index` names is there) into
/// `dir`, replacing `replaced`.
fn publish_steps(dir: &Path, staging: &Path, index: &ShardIndex, replaced: Replaced) -> Vec<Step> {
    let mut steps: Vec<Step> = index
        .files()
        .into_iter()
        .map(|file| Step::SyncShard(staging.join(file)))
        .collect();
    steps.push(Step::WriteReplaced(
        staging.join(REPLACED_FILE),
        replaced.clone(),
    ));
    steps.push(Step::WriteIndex(staging.to_path_buf()));
    steps.push(Step::SyncDir(staging.to_path_buf()));
    steps.extend(completion_steps(dir, staging, index, &replaced, &|_| true));
    steps
}

/// The steps from the journal on: the old index out, each shard still in `staging` (as
/// `staged` says) moved in, the index written, what was replaced removed, the journal and the
/// staging directory last.
fn completion_steps(
    dir: &Path,
    staging: &Path,
    index: &ShardIndex,
    replaced: &Replaced,
    staged: &dyn Fn(&Path) -> bool,
) -> Vec<Step> {
    let files = index.files();
    let mut steps = vec![Step::RemoveIndexOfOurs(dir.to_path_buf())];
    for file in &files {
        let from = staging.join(file);
        if staged(&from) {
            steps.push(Step::Move(from, dir.join(file)));
        }
    }
    steps.push(Step::WriteIndex(dir.to_path_buf()));
    steps.push(Step::SyncDir(dir.to_path_buf()));
    for old in &replaced.shards {
        if is_shard_file_name(old) && !files.contains(old.as_str()) {
            steps.push(Step::Remove(dir.join(old)));
        }
    }
    if replaced.whole {
        steps.push(Step::RemoveWholeOfOurs(dir.join(MODEL_FILE)));
    }
    steps.push(Step::Remove(staging.join(REPLACED_FILE)));
    steps.push(Step::Remove(staging.join(INDEX_FILE)));
    steps.push(Step::RemoveStaging(staging.to_path_buf()));
    steps.push(Step::SyncDir(dir.to_path_buf()));
    steps
}

/// Runs `steps` in order; `index` is the index the `WriteIndex` steps write.
fn run(steps: &[Step], index: &ShardIndex) -> Result<(), WeightsError> {
    for step in steps {
        match step {
            Step::SyncShard(path) => drop(sync_file(path)?),
            Step::WriteReplaced(path, replaced) => drop(write_json(path, replaced)?),
            Step::WriteIndex(dir) => index.write(dir)?,
            Step::Remove(path) => match std::fs::remove_file(path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(io("removing", path)(e));
                }
                _ => {}
            },
            Step::RemoveIndexOfOurs(dir) => {
                let path = dir.join(INDEX_FILE);
                if std::fs::symlink_metadata(&path).is_ok() {
                    if !ShardIndex::read(dir).is_ok_and(|index| index.is_ours()) {
                        return Err(malformed(
                            &path,
                            "an index accelerate-rs did not write is where a sharded save \
                             publishes its own: move it away",
                        ));
                    }
                    std::fs::remove_file(&path)
                        .map_err(io("removing the replaced index", &path))?;
                }
            }
            Step::Move(from, to) => {
                std::fs::rename(from, to).map_err(io("moving into place", from))?
            }
            Step::RemoveWholeOfOurs(path) => {
                if read_header(path).is_ok_and(|header| header.is_ours()) {
                    std::fs::remove_file(path).map_err(io("removing the replaced model", path))?;
                }
            }
            Step::SyncDir(dir) => sync_dir(dir)?,
            Step::RemoveStaging(dir) => {
                std::fs::remove_dir(dir).map_err(io("removing the staging directory", dir))?;
            }
        }
    }
    Ok(())
}

/// Publishes the shards staged in `staging` (every file `index` names) and `index` into
/// `dir`, then removes what `replaced` lists; returns the paths written.
pub(super) fn publish(
    dir: &Path,
    staging: &Path,
    index: &ShardIndex,
    replaced: Replaced,
) -> Result<Vec<PathBuf>, WeightsError> {
    run(&publish_steps(dir, staging, index, replaced), index)?;
    let mut written: Vec<PathBuf> = index.files().into_iter().map(|f| dir.join(f)).collect();
    written.push(dir.join(INDEX_FILE));
    Ok(written)
}

/// Completes the publish that `staging` (a staging directory of `dir` whose process is gone)
/// journals, or removes it when it holds no journal; `false` when it holds a file we would not
/// have written (it is left alone).
fn finish_or_remove(dir: &Path, staging: &Path) -> Result<bool, WeightsError> {
    if staging.join(INDEX_FILE).is_file() {
        let index = ShardIndex::read(staging)?;
        let replaced: Replaced = read_json(&staging.join(REPLACED_FILE)).unwrap_or_default();
        for file in index.files() {
            if !staging.join(file).is_file() && !dir.join(file).is_file() {
                return Err(malformed(
                    staging,
                    format!("an interrupted publish lost its shard {file}"),
                ));
            }
        }
        let steps = completion_steps(dir, staging, &index, &replaced, &|p| p.is_file());
        run(&steps, &index)?;
        return Ok(true);
    }
    // Never began to publish: what the save wrote goes, and nothing else.
    let Ok(files) = std::fs::read_dir(staging) else {
        return Ok(false);
    };
    for file in files.flatten() {
        let regular = file.file_type().is_ok_and(|t| t.is_file());
        if regular && file.file_name().to_str().is_some_and(is_staged_name) {
            let _ = std::fs::remove_file(file.path());
        }
    }
    Ok(std::fs::remove_dir(staging).is_ok())
}

/// True for the names a save writes into its staging directory: shards, the scratch files
/// Burn's store and our index writer make beside them (`<name>.<pid>-<n>.tmp`,
/// `.<name>.<pid>.<n>.tmp`, left by a kill during the write), and the journal's files.
fn is_staged_name(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let burn_scratch = || {
        let (file, writer) = name.strip_suffix(".tmp")?.rsplit_once('.')?;
        let (pid, n) = writer.split_once('-')?;
        (is_shard_file_name(file) && digits(pid) && digits(n)).then_some(())
    };
    let our_scratch = || {
        let rest = name.strip_prefix('.')?.strip_suffix(".tmp")?;
        let (rest, n) = rest.rsplit_once('.')?;
        let (file, pid) = rest.rsplit_once('.')?;
        (file == INDEX_FILE && digits(pid) && digits(n)).then_some(())
    };
    is_shard_file_name(name)
        || name == INDEX_FILE
        || name == REPLACED_FILE
        || burn_scratch().is_some()
        || our_scratch().is_some()
}

/// The staging directory of a save by process `pid` of PID scope `scope`
/// ([`crate::process::pid_scope`]).
pub(super) fn staging_name(scope: &str, pid: u32) -> String {
    format!(".shards.{scope}.{pid}.staging")
}

/// Finishes what the sharded saves of this host killed in `dir` left (a save that ends any
/// other way cleans up itself): a staging directory named as ours whose process is gone is
/// completed when it journals a publish, else removed with what the save wrote into it. A
/// live process's, another host's or container's (another scope), or one holding a file we
/// would not have written, stays. Saves and loads of a directory call it first (processes
/// that do so at once take turns: the directory is locked); failing to finish is a warning
/// (the load then reads what is there, the next save tries again).
pub fn finish_interrupted(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!(".shards.{}.", crate::process::pid_scope());
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|n| n.strip_suffix(".staging"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if !is_dir || pid == std::process::id() || crate::process::process_alive(u64::from(pid)) {
            continue;
        }
        let path = entry.path();
        // The ranks of a job that load the directory at once: one finishes, the others wait
        // for it, then find the directory gone.
        let Ok(handle) = std::fs::File::open(&path) else {
            continue;
        };
        if handle.lock().is_err() || !path.exists() {
            continue;
        }
        match finish_or_remove(dir, &path) {
            Ok(true) => tracing::info!(
                "finished what process {pid}, killed during a sharded save, left in {}",
                path.display()
            ),
            Ok(false) => tracing::warn!(
                "left {} (an abandoned sharded save's staging directory) in place: it holds \
                 files a save does not write",
                path.display()
            ),
            Err(e) => tracing::warn!(
                "could not finish {} (a sharded save killed while it published): {e}",
                path.display()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::sharding::{SAVED_BY, SAVED_BY_KEY, shard_file_name};
    use super::super::test_file_names as names;
    use super::super::{TensorEntry, header};
    use super::*;
    use std::collections::BTreeMap;

    /// A safetensors file of ours holding `names`, each tensor 4 bytes of `tag`.
    fn model_file(path: &Path, names: &[&str], tag: u8) {
        let metadata = BTreeMap::from([(SAVED_BY_KEY.to_string(), SAVED_BY.to_string())]);
        let tensors = names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let entry = TensorEntry {
                    dtype: "U8".into(),
                    shape: vec![4],
                    data_offsets: [4 * i as u64, 4 * i as u64 + 4],
                };
                (name.to_string(), entry)
            })
            .collect();
        let mut bytes = header::encode(&metadata, &tensors).unwrap();
        bytes.resize(bytes.len() + 4 * names.len(), tag);
        std::fs::write(path, bytes).unwrap();
    }

    /// Writes a model of tensors a, b, c with bytes `tag` into `dir`: sharded in `shards`
    /// (1 to 3) files, or (0) as one `model.safetensors`; returns the index of the shards
    /// (not written: in a staging directory it would be the journal).
    fn write_model(dir: &Path, shards: usize, tag: u8) -> Option<ShardIndex> {
        if shards == 0 {
            model_file(&dir.join(MODEL_FILE), &["a", "b", "c"], tag);
            return None;
        }
        let groups: Vec<&[&str]> = match shards {
            1 => vec![&["a", "b", "c"]],
            2 => vec![&["a", "b"], &["c"]],
            _ => vec![&["a"], &["b"], &["c"]],
        };
        let mut map = Vec::new();
        for (i, names) in groups.iter().enumerate() {
            let file = shard_file_name(i, shards);
            model_file(&dir.join(&file), names, tag);
            map.extend(names.iter().map(|n| (n.to_string(), file.clone())));
        }
        Some(ShardIndex::new(12, map))
    }

    /// What a load of `dir` reads: each tensor's bytes, from the index's shards or the whole
    /// file (the index preferred, as the loaders do when there is no whole file).
    fn load(dir: &Path) -> BTreeMap<String, Vec<u8>> {
        let files: Vec<PathBuf> = match ShardIndex::read(dir) {
            Ok(index) => index.files().into_iter().map(|f| dir.join(f)).collect(),
            Err(_) => vec![dir.join(MODEL_FILE)],
        };
        let mut tensors = BTreeMap::new();
        for file in files {
            let header = read_header(&file).unwrap_or_else(|e| panic!("{e}"));
            let bytes = std::fs::read(&file).unwrap();
            for (name, entry) in header.tensors {
                let start = (header.data_start + entry.data_offsets[0]) as usize;
                tensors.insert(name, bytes[start..start + 4].to_vec());
            }
        }
        tensors
    }

    /// A publish killed after each of its steps in turn (the process gone, as a SIGKILL or an
    /// OOM kill leaves it), replacing a model of 3 shards, of 1 shard and a whole file with one
    /// of 2 shards: the next load of the directory finds the old model or the new one, whole
    /// (every tensor from one of them), and nothing of the save is left: no staging directory,
    /// no shard of the old model that the new one does not use.
    #[test]
    fn a_publish_killed_at_any_step_leaves_the_old_model_or_the_new_one() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let scope = crate::process::pid_scope();
        for old_shards in [3, 1, 0] {
            let (mut saw_old, mut saw_new) = (false, false);
            let mut killed_after = 0;
            loop {
                let tmp = tempfile::tempdir().unwrap();
                let dir = tmp.path();
                let old = write_model(dir, old_shards, 1);
                if let Some(index) = &old {
                    index.write(dir).unwrap();
                }
                let staging = dir.join(staging_name(&scope, dead));
                std::fs::create_dir(&staging).unwrap();
                let new = write_model(&staging, 2, 2).unwrap();
                let replaced = Replaced {
                    shards: old.as_ref().map_or_else(Vec::new, |index| {
                        index.files().into_iter().map(str::to_string).collect()
                    }),
                    whole: old.is_none(),
                };
                let steps = publish_steps(dir, &staging, &new, replaced);
                run(&steps[..killed_after], &new).unwrap();

                finish_interrupted(dir);
                let loaded = load(dir);
                let context = format!("old {old_shards} shards, killed after step {killed_after}");
                assert_eq!(loaded.len(), 3, "{context}: {loaded:?}");
                let tags: Vec<u8> = loaded.values().map(|bytes| bytes[0]).collect();
                let expected_files = if tags == [2, 2, 2] {
                    saw_new = true;
                    vec![
                        shard_file_name(0, 2),
                        shard_file_name(1, 2),
                        super::super::INDEX_FILE.to_string(),
                    ]
                } else {
                    assert_eq!(tags, [1, 1, 1], "{context}: a mix of models");
                    saw_old = true;
                    match &old {
                        Some(index) => {
                            let mut files: Vec<String> =
                                index.files().into_iter().map(str::to_string).collect();
                            files.push(INDEX_FILE.to_string());
                            files
                        }
                        None => vec![MODEL_FILE.to_string()],
                    }
                };
                let mut expected_files = expected_files;
                expected_files.sort();
                assert_eq!(names(dir), expected_files, "{context}");
                if killed_after == steps.len() {
                    break;
                }
                killed_after += 1;
            }
            assert!(
                saw_old && saw_new,
                "old {old_shards}: both outcomes reached"
            );
        }
    }

    /// A staging directory that journals a publish and is not this host's, or whose process
    /// is alive, is left alone; a dead save's staging holding a file a save does not write
    /// loses what the save wrote and keeps the rest.
    #[test]
    fn only_our_dead_saves_are_finished() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let scope = crate::process::pid_scope();
        for name in [
            staging_name(&scope, 1),
            staging_name("0123456789ab", 4_000_000),
        ] {
            let staging = dir.join(name);
            std::fs::create_dir(&staging).unwrap();
            write_model(&staging, 2, 2)
                .unwrap()
                .write(&staging)
                .unwrap();
        }
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let with_user_file = dir.join(staging_name(&scope, dead));
        std::fs::create_dir(&with_user_file).unwrap();
        write_model(&with_user_file, 2, 2).unwrap();
        std::fs::write(with_user_file.join("notes.txt"), "mine").unwrap();
        let before = names(dir);
        finish_interrupted(dir);
        assert_eq!(names(dir), before);
        // What the save wrote goes; the user's file, and so the directory, stay.
        assert_eq!(names(&with_user_file), ["notes.txt"]);
    }
}
