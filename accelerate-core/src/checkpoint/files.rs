//! Durable writes: every file a checkpoint or `save_model` writes is synced before anything
//! points at it, and a file that replaces another goes through a temporary name and a rename,
//! so a crash leaves the old file or the new one, never a truncated one.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{CheckpointError, io};

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

/// Longest JSON file of a checkpoint read (a manifest lists a few dozen files).
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// Reads a JSON file written by [`write_json`] (at most [`MAX_JSON_BYTES`]).
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, CheckpointError> {
    let bytes =
        crate::input_file::read_at_most(path, MAX_JSON_BYTES).map_err(io("reading", path))?;
    serde_json::from_slice(&bytes).map_err(|source| CheckpointError::Json {
        path: path.to_path_buf(),
        source,
    })
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

/// Replaces `path` with what `write` puts into a temporary file beside it: `write` is given
/// the temporary path, the file is synced and renamed over `path`, and the directory synced.
/// On any failure the temporary file is removed and `path` is as it was. Returns the size.
/// The temporary file is created here first, exclusively, so a file of that name that is not
/// ours is never written over or removed.
pub fn replace_file<E: std::fmt::Display>(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<u64, CheckpointError> {
    publish(path, write, "renaming into place", |temporary| {
        std::fs::rename(temporary, path)
    })
}

/// Creates `path` with what `write` puts into a temporary file beside it, as [`replace_file`]
/// does, except that `path` must not exist when the file is put in place: it is hard-linked
/// there (which never replaces a file), then the temporary name removed. A file that someone
/// created at `path` meanwhile stays as it is, and the error's source is `AlreadyExists`.
pub fn create_file<E: std::fmt::Display>(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<u64, CheckpointError> {
    publish(path, write, "linking into place", |temporary| {
        std::fs::hard_link(temporary, path)?;
        std::fs::remove_file(temporary)
    })
}

/// Writes a temporary file beside `path` with `write`, syncs it, puts it in place with `place`
/// (given the temporary path), then syncs the directory; on failure removes the temporary.
fn publish<E: std::fmt::Display>(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), E>,
    placing: &'static str,
    place: impl FnOnce(&Path) -> std::io::Result<()>,
) -> Result<u64, CheckpointError> {
    let temporary = create_temporary_beside(path)?;
    let written = write(&temporary)
        .map_err(|e| CheckpointError::Io {
            action: "writing",
            path: temporary.clone(),
            source: std::io::Error::other(e.to_string()),
        })
        .and_then(|()| sync_file(&temporary))
        .and_then(|bytes| {
            place(&temporary).map_err(io(placing, path))?;
            Ok(bytes)
        });
    match written {
        Ok(bytes) => {
            sync_dir(path.parent().unwrap_or(Path::new(".")))?;
            Ok(bytes)
        }
        Err(e) => {
            // Ours: created exclusively above.
            let _ = std::fs::remove_file(&temporary);
            Err(e)
        }
    }
}

/// Attempts at a free temporary name before giving up (each name holds this process's id,
/// so only leftovers of an earlier process with the same id, or someone's own files, collide).
const TEMPORARY_ATTEMPTS: u32 = 16;

/// Creates `.<name>.<pid>.<n>.tmp` beside `path` (hidden, private to this process), with the
/// first `n` whose name is free.
fn create_temporary_beside(path: &Path) -> Result<PathBuf, CheckpointError> {
    let mut last = None;
    for attempt in 0..TEMPORARY_ATTEMPTS {
        let mut name = std::ffi::OsString::from(".");
        name.push(path.file_name().unwrap_or_default());
        name.push(format!(".{}.{attempt}.tmp", std::process::id()));
        let temporary = path.with_file_name(name);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temporary)
        {
            Ok(_) => return Ok(temporary),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(temporary),
            Err(e) => return Err(io("creating", &temporary)(e)),
        }
    }
    Err(CheckpointError::Io {
        action: "creating a temporary file beside",
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!(
                "{TEMPORARY_ATTEMPTS} temporary names are taken (the last: {}); they are not \
                 ours to remove: move them away and save again",
                last.map(|p| p.display().to_string()).unwrap_or_default()
            ),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_file_is_the_old_one_or_the_new_one() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("model.safetensors");
        std::fs::write(&path, b"old").unwrap();
        let bytes = replace_file(&path, |p| std::fs::write(p, b"new!")).unwrap();
        assert_eq!(bytes, 4);
        assert_eq!(std::fs::read(&path).unwrap(), b"new!");
        // A writer that fails leaves the previous file and no temporary one.
        let err = replace_file(&path, |p| {
            std::fs::write(p, b"half")?;
            Err::<(), _>(std::io::Error::other("disk full"))
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("disk full"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"new!");
        let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    /// A created file never replaces one that appeared at its path while it was written (the
    /// window between merge-weights' check that its output is free and its publish): the
    /// other file stays, the error says it exists, and no temporary file is left.
    #[test]
    fn a_created_file_never_replaces_one_made_meanwhile() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("model.safetensors");
        assert_eq!(
            create_file(&path, |p| std::fs::write(p, b"ours")).unwrap(),
            4
        );
        assert_eq!(std::fs::read(&path).unwrap(), b"ours");
        std::fs::remove_file(&path).unwrap();
        let err = create_file(&path, |p| {
            std::fs::write(&path, b"someone else's")?;
            std::fs::write(p, b"ours")
        })
        .unwrap_err();
        match &err {
            CheckpointError::Io { source, .. } => {
                assert_eq!(source.kind(), std::io::ErrorKind::AlreadyExists, "{err}");
            }
            other => panic!("{other}"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
        let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    /// A user's file under the first temporary name is neither written nor removed: the next
    /// free name is used; with every name taken, an error and nothing touched.
    #[test]
    fn a_file_under_the_temporary_name_is_left_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("model.safetensors");
        let theirs = |n: u32| {
            tmp.path()
                .join(format!(".model.safetensors.{}.{n}.tmp", std::process::id()))
        };
        std::fs::write(theirs(0), b"user's").unwrap();
        replace_file(&path, |p| std::fs::write(p, b"new")).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        assert_eq!(std::fs::read(theirs(0)).unwrap(), b"user's");
        for n in 1..TEMPORARY_ATTEMPTS {
            std::fs::write(theirs(n), b"user's").unwrap();
        }
        let err = replace_file(&path, |p| std::fs::write(p, b"newer"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not ours to remove"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
        for n in 0..TEMPORARY_ATTEMPTS {
            assert_eq!(std::fs::read(theirs(n)).unwrap(), b"user's");
        }
    }
}
