//! The save protocol's file-system half: which directories a save may replace, the partial
//! directory it writes into, and the swap that puts a finished checkpoint into place.
//!
//! The swap is one `renameat2(RENAME_EXCHANGE)` where the file system has it (ext4, xfs,
//! btrfs, tmpfs): at every instant the name points at a complete checkpoint, the previous one
//! or the new one. Elsewhere it is two renames, `dir -> dir.old` then `dir.partial -> dir`; a
//! crash between them leaves only `dir.old`, which [`locate`] (and so every load and
//! "latest") uses until the next save completes.

use std::path::{Path, PathBuf};

use super::{
    CHECKPOINT_PREFIX, CheckpointError, MANIFEST_FILE, Manifest, OLD_SUFFIX, PARTIAL_MARKER,
    PARTIAL_SUFFIX, check_files, check_names, io, read_json, read_manifest, sync_dir, write_json,
    write_synced,
};

/// The directory a save of `dir` writes into before it is committed.
pub fn partial_dir(dir: &Path) -> PathBuf {
    with_suffix(dir, PARTIAL_SUFFIX)
}

/// Where the previous checkpoint at `dir` waits while a two-rename swap is under way.
pub fn old_dir(dir: &Path) -> PathBuf {
    with_suffix(dir, OLD_SUFFIX)
}

/// True for a directory a save is writing (or a crashed save left).
pub(super) fn is_partial(dir: &Path) -> bool {
    dir.extension().is_some_and(|e| e == &PARTIAL_SUFFIX[1..])
}

/// `dir` with `suffix` appended to its last component.
fn with_suffix(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

/// The directory holding `dir` (`.` for a bare name).
fn parent_of(dir: &Path) -> &Path {
    match dir.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// What is at a path a save would replace or remove.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Found {
    /// Nothing.
    Nothing,
    /// Something a save wrote: an empty directory, a checkpoint (its manifest parses) or the
    /// partial directory of a save (it has the marker).
    Ours,
    /// Anything else, described for the error.
    Theirs(&'static str),
}

/// Classifies `path` without following a symbolic link.
pub(super) fn found_at(path: &Path) -> Result<Found, CheckpointError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Nothing),
        Err(e) => return Err(io("inspecting", path)(e)),
    };
    if meta.file_type().is_symlink() {
        return Ok(Found::Theirs("is a symbolic link"));
    }
    if !meta.is_dir() {
        return Ok(Found::Theirs("is a file, not a directory"));
    }
    let mut entries = std::fs::read_dir(path).map_err(io("listing", path))?;
    if entries.next().is_none() {
        return Ok(Found::Ours);
    }
    if read_json::<Manifest>(&path.join(MANIFEST_FILE)).is_ok() {
        return Ok(Found::Ours);
    }
    if path.join(PARTIAL_MARKER).is_file() {
        return Ok(Found::Ours);
    }
    Ok(Found::Theirs(
        "holds files but no accelerate-rs manifest.json",
    ))
}

/// Fails unless what is at `path` may be replaced or removed by a save.
fn ensure_ours(path: &Path) -> Result<Found, CheckpointError> {
    match found_at(path)? {
        Found::Theirs(found) => Err(CheckpointError::NotOurs {
            path: path.to_path_buf(),
            found,
        }),
        found => Ok(found),
    }
}

/// Starts a save of `dir` (main process): checks that `dir` (and the `.partial` and `.old`
/// directories beside it) are absent, empty or a save's own, removes what an earlier crashed
/// save left, and creates the empty partial directory with its marker, which it returns.
///
/// A directory holding anything else is a [`CheckpointError::NotOurs`] error, and nothing is
/// touched.
pub fn begin_save(dir: &Path) -> Result<PathBuf, CheckpointError> {
    if dir.file_name().is_none() {
        return Err(CheckpointError::NotOurs {
            path: dir.to_path_buf(),
            found: "has no name of its own (`.`, `..` or `/`)",
        });
    }
    let partial = partial_dir(dir);
    ensure_ours(dir)?;
    ensure_ours(&old_dir(dir))?;
    if ensure_ours(&partial)? == Found::Ours {
        std::fs::remove_dir_all(&partial).map_err(io("removing the stale", &partial))?;
    }
    std::fs::create_dir_all(&partial).map_err(io("creating", &partial))?;
    write_synced(&partial.join(PARTIAL_MARKER), b"a save in progress\n")?;
    Ok(partial)
}

/// Finishes a save (main process, after every rank wrote its files into `partial`): checks
/// the files against `manifest`, gives it its commit [`sequence`](Manifest::sequence), writes
/// it last and swaps the directory into place, replacing an older checkpoint of the same name
/// only once the new one is complete.
pub fn commit(dir: &Path, partial: &Path, mut manifest: Manifest) -> Result<(), CheckpointError> {
    check_names(partial, &manifest)?;
    check_files(partial, &manifest)?;
    manifest.sequence = next_sequence(dir);
    write_json(&partial.join(MANIFEST_FILE), &manifest)?;
    let marker = partial.join(PARTIAL_MARKER);
    std::fs::remove_file(&marker).map_err(io("removing", &marker))?;
    sync_dir(partial)?;
    // Checked again: something may have appeared at `dir` while the ranks wrote.
    let replacing = ensure_ours(dir)? == Found::Ours;
    let old = old_dir(dir);
    let parent = parent_of(dir);
    if replacing && exchange(partial, dir).map_err(io("swapping into place", partial))? {
        // `partial` now holds the previous checkpoint.
        sync_dir(parent)?;
        remove_leftover(partial);
    } else {
        if replacing {
            if ensure_ours(&old)? == Found::Ours {
                std::fs::remove_dir_all(&old).map_err(io("removing", &old))?;
            }
            std::fs::rename(dir, &old).map_err(io("moving aside the previous", dir))?;
        }
        std::fs::rename(partial, dir).map_err(io("renaming into place", partial))?;
        sync_dir(parent)?;
    }
    // The previous checkpoint of a two-rename swap, this one's or a crashed one's.
    if matches!(found_at(&old), Ok(Found::Ours)) {
        remove_leftover(&old);
    }
    Ok(())
}

/// Removes the previous checkpoint once the new one is in place. The save has succeeded by
/// then, so a failure is a warning: the leftover is ours and the next save removes it.
fn remove_leftover(path: &Path) {
    if let Err(e) = std::fs::remove_dir_all(path) {
        tracing::warn!(path = %path.display(), "could not remove the previous checkpoint: {e}");
    }
}

/// The directory a load of `dir` should read: `dir`, or `dir.old` when `dir` holds no
/// manifest (it is absent, or something made it again empty: a script's `mkdir -p`) and
/// `dir.old` holds a complete checkpoint (a save that crashed between its two renames).
pub fn locate(dir: &Path) -> PathBuf {
    // Only whether `dir`'s manifest exists: reading it is the load's part (and rotation's,
    // which would otherwise read every checkpoint's twice).
    let absent = matches!(std::fs::symlink_metadata(dir.join(MANIFEST_FILE)), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
    if absent {
        let old = old_dir(dir);
        if read_manifest(&old).is_ok() {
            return old;
        }
    }
    dir.to_path_buf()
}

/// One more than the highest commit sequence among the checkpoint at `dir` and the
/// automatically named checkpoints beside it.
fn next_sequence(dir: &Path) -> u64 {
    let sequence_of = |path: &Path| {
        read_json::<Manifest>(&path.join(MANIFEST_FILE)).map_or(0, |manifest| manifest.sequence)
    };
    let mut highest = sequence_of(dir).max(sequence_of(&old_dir(dir)));
    let parent = parent_of(dir);
    if let Ok(entries) = std::fs::read_dir(parent) {
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name();
            if name
                .to_str()
                .is_some_and(|n| n.starts_with(CHECKPOINT_PREFIX) && !n.ends_with(PARTIAL_SUFFIX))
            {
                highest = highest.max(sequence_of(&entry.path()));
            }
        }
    }
    highest.saturating_add(1)
}

/// Atomically exchanges the directories `a` and `b`; `Ok(false)` where the file system or
/// the platform cannot.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    use nix::errno::Errno;
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    match renameat2(AT_FDCWD, a, AT_FDCWD, b, RenameFlags::RENAME_EXCHANGE) {
        Ok(()) => Ok(true),
        // Not supported by this file system (EINVAL) or kernel (ENOSYS).
        Err(Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => Ok(false),
        Err(e) => Err(std::io::Error::from(e)),
    }
}

/// Atomically exchanges the directories `a` and `b`; `Ok(false)` where the file system or
/// the platform cannot.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn exchange(_a: &Path, _b: &Path) -> std::io::Result<bool> {
    Ok(false)
}

#[cfg(test)]
pub(super) mod tests {
    use super::super::{FORMAT_VERSION, ManifestFile};
    use super::*;

    fn manifest(files: Vec<ManifestFile>) -> Manifest {
        Manifest {
            format_version: FORMAT_VERSION,
            library_version: "test".into(),
            world_size: 1,
            updates: 3,
            sequence: 0,
            files,
        }
    }

    /// A partial directory holding `payload` as its one file, and its manifest.
    fn prepare(dir: &Path, payload: &[u8]) -> (PathBuf, Manifest) {
        let partial = begin_save(dir).unwrap();
        let bytes = write_synced(&partial.join("a.bin"), payload).unwrap();
        let files = vec![ManifestFile {
            name: "a.bin".into(),
            contents: "test".into(),
            rank: None,
            bytes,
        }];
        (partial, manifest(files))
    }

    /// Saves a checkpoint of one file holding `payload` into `dir`.
    pub(crate) fn save(dir: &Path, payload: &[u8]) -> Result<(), CheckpointError> {
        let (partial, manifest) = prepare(dir, payload);
        commit(dir, &partial, manifest)
    }

    fn payload(dir: &Path) -> Vec<u8> {
        let dir = locate(dir);
        read_manifest(&dir).unwrap();
        std::fs::read(dir.join("a.bin")).unwrap()
    }

    #[test]
    fn a_committed_checkpoint_loads_and_replaces_the_previous_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        save(&dir, b"first").unwrap();
        assert_eq!(read_manifest(&dir).unwrap().files[0].bytes, 5);
        save(&dir, b"second!").unwrap();
        assert_eq!(read_manifest(&dir).unwrap().files[0].bytes, 7);
        assert_eq!(payload(&dir), b"second!");
        // Nothing of the swap is left, and the marker is not part of the checkpoint.
        let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
        assert!(!dir.join(PARTIAL_MARKER).exists());
        // An empty directory is replaced too.
        let empty = tmp.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        save(&empty, b"x").unwrap();
        assert_eq!(payload(&empty), b"x");
    }

    #[test]
    fn a_directory_with_a_users_files_is_never_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("output");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("train.log"), b"epoch 1").unwrap();
        let err = begin_save(&dir).unwrap_err().to_string();
        assert!(
            err.contains("holds files but no accelerate-rs manifest.json"),
            "{err}"
        );
        assert!(err.contains("output/checkpoint"), "{err}");
        assert!(!partial_dir(&dir).exists());
        // Files, symbolic links, and a foreign directory where `.partial` or `.old` would go.
        let file = tmp.path().join("file");
        std::fs::write(&file, b"data").unwrap();
        assert!(matches!(
            begin_save(&file),
            Err(CheckpointError::NotOurs { .. })
        ));
        let link = tmp.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(
            begin_save(&link)
                .unwrap_err()
                .to_string()
                .contains("symbolic link")
        );
        let fresh = tmp.path().join("fresh");
        std::fs::create_dir(partial_dir(&fresh)).unwrap();
        std::fs::write(partial_dir(&fresh).join("keep"), b"k").unwrap();
        assert!(begin_save(&fresh).is_err());
        assert!(partial_dir(&fresh).join("keep").exists());
        // Files appearing in the target while the ranks write: the commit refuses too.
        let late = tmp.path().join("late");
        let (partial, manifest) = prepare(&late, b"x");
        std::fs::create_dir(&late).unwrap();
        std::fs::write(late.join("theirs"), b"t").unwrap();
        assert!(commit(&late, &partial, manifest).is_err());
        assert_eq!(std::fs::read(late.join("theirs")).unwrap(), b"t");
        assert_eq!(std::fs::read(dir.join("train.log")).unwrap(), b"epoch 1");
    }

    #[test]
    fn every_crash_point_of_a_two_rename_swap_loads_a_complete_checkpoint() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        save(&dir, b"previous").unwrap();
        let (partial, mut manifest) = prepare(&dir, b"next");
        manifest.sequence = next_sequence(&dir);
        write_json(&partial.join(MANIFEST_FILE), &manifest).unwrap();
        std::fs::remove_file(partial.join(PARTIAL_MARKER)).unwrap();
        // Killed after the first rename: only `.old` and the (never loaded) partial remain.
        std::fs::rename(&dir, old_dir(&dir)).unwrap();
        assert_eq!(locate(&dir), old_dir(&dir));
        assert_eq!(payload(&dir), b"previous");
        // Something made `dir` again, empty (a script's `mkdir -p`): still `.old`.
        std::fs::create_dir(&dir).unwrap();
        assert_eq!(locate(&dir), old_dir(&dir));
        assert_eq!(payload(&dir), b"previous");
        std::fs::remove_dir(&dir).unwrap();
        // The next save over it completes and cleans up.
        save(&dir, b"after").unwrap();
        assert_eq!(payload(&dir), b"after");
        assert!(!old_dir(&dir).exists() && !partial_dir(&dir).exists());
        // Killed after the second rename, before `.old` was removed: the new one loads, and
        // the next save removes the leftover.
        let stale = tmp.path().join("stale");
        save(&stale, b"stale").unwrap();
        std::fs::rename(&stale, old_dir(&dir)).unwrap();
        assert_eq!(payload(&dir), b"after");
        save(&dir, b"last").unwrap();
        assert_eq!(payload(&dir), b"last");
        assert!(!old_dir(&dir).exists());
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
    fn a_manifest_cannot_name_files_outside_its_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("ckpt");
        save(&dir, b"x").unwrap();
        let mut manifest = read_manifest(&dir).unwrap();
        for name in [
            "../secret",
            "/etc/passwd",
            "a/b/c",
            "",
            "pair/..",
            "manifest.json",
        ] {
            manifest.files[0].name = name.into();
            write_json(&dir.join(MANIFEST_FILE), &manifest).unwrap();
            let err = read_manifest(&dir).unwrap_err();
            assert!(
                matches!(err, CheckpointError::UnsafeName { .. }),
                "{name}: {err}"
            );
        }
        assert!(super::super::is_safe_file_name("second/model.safetensors"));
    }
}
