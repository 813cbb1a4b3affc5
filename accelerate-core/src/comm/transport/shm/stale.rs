//! Leftovers of jobs killed while they set up. A segment's name stays in `/dev/shm` only until
//! every rank has mapped it; a job killed in between (`scancel` during the rendezvous, a
//! SIGKILL) leaves the file behind. Whoever creates a segment or an MPI progress board first
//! removes this user's files of that kind whose creator is gone: the creator's pid is the
//! file's first word (rank 0's control block, line 0 of a board), written right after the
//! file is created (0 means it died before), or, for a rank's shared buffer
//! (`<segment>-b<id>-r<rank>-p<pid>`, plain data), the end of its name.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::time::{Duration, SystemTime};

/// How old a file whose creator is gone must be before it is removed: far beyond any set-up
/// still running in this pid namespace, and a margin for creators in another one.
pub const STALE_AFTER: Duration = Duration::from_secs(600);

/// Where a file of ours names its creator.
#[derive(Debug, PartialEq, Eq)]
enum Creator {
    /// In its first word: a segment (`accelerate-rs-` and 16 hex digits) or an MPI progress
    /// board (`accelerate-rs-mpi-` and 32).
    FirstWord,
    /// In its name: a shared buffer, `accelerate-rs-<16 hex>-b<id>-r<rank>-p<pid>`.
    Named(u64),
}

/// Whether `name` is one of ours that names its creator, and where.
fn creator_of(name: &str) -> Option<Creator> {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let rest = name.strip_prefix("accelerate-rs-")?;
    if hex(rest, 16)
        || rest
            .strip_prefix("mpi-")
            .is_some_and(|board| hex(board, 32))
    {
        return Some(Creator::FirstWord);
    }
    let (segment, buffer) = rest.split_at_checked(16)?;
    let parts: Vec<&str> = buffer.strip_prefix("-b")?.split(['-']).collect();
    match parts.as_slice() {
        [id, rank, pid]
            if hex(segment, 16)
                && digits(id)
                && rank.strip_prefix('r').is_some_and(digits)
                && pid.strip_prefix('p').is_some_and(digits) =>
        {
            pid[1..].parse().ok().map(Creator::Named)
        }
        _ => None,
    }
}

/// Removes, from `dir`, this user's segments and boards older than `older_than` whose
/// creator is gone; returns how many.
pub fn sweep(dir: &Path, older_than: Duration) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let euid = nix::unistd::geteuid().as_raw();
    let now = SystemTime::now();
    let mut removed = 0;
    for entry in entries.flatten() {
        let Some(kind) = entry.file_name().to_str().and_then(creator_of) else {
            continue;
        };
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let old = meta
            .modified()
            .ok()
            .and_then(|m| now.duration_since(m).ok())
            .is_some_and(|age| age >= older_than);
        if !meta.is_file() || meta.uid() != euid || !old {
            continue;
        }
        let creator = match kind {
            Creator::Named(pid) => pid,
            Creator::FirstWord => {
                let mut word = [0u8; 8];
                std::fs::File::open(&path)
                    .and_then(|f| f.read_exact_at(&mut word, 0))
                    .map(|()| u64::from_le_bytes(word))
                    .unwrap_or(0)
            }
        };
        if (creator == 0 || !crate::process::process_alive(creator))
            && std::fs::remove_file(&path).is_ok()
        {
            tracing::debug!("removed {}, left by a job that died", path.display());
            removed += 1;
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &Path, name: &str, pid: u64, age: Duration) -> std::path::PathBuf {
        let path = dir.join(name);
        let mut bytes = pid.to_le_bytes().to_vec();
        bytes.resize(64, 0);
        std::fs::write(&path, bytes).unwrap();
        let f = std::fs::File::options().write(true).open(&path).unwrap();
        f.set_modified(SystemTime::now() - age).unwrap();
        path
    }

    #[test]
    fn only_old_files_of_ours_whose_creator_is_gone_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = u64::from(child.id());
        child.wait().unwrap();
        let me = u64::from(std::process::id());
        let old = STALE_AFTER + Duration::from_secs(5);
        let d = dir.path();
        let gone = [
            file(d, "accelerate-rs-0123456789abcdef", dead, old),
            file(d, "accelerate-rs-0000000000000000", 0, old),
            file(
                d,
                &format!("accelerate-rs-0123456789abcdef-b3-r1-p{dead}"),
                me,
                old,
            ),
            file(
                d,
                &format!("accelerate-rs-mpi-{}", "ab".repeat(16)),
                dead,
                old,
            ),
        ];
        let kept = [
            file(d, "accelerate-rs-1123456789abcdef", me, old),
            file(d, "accelerate-rs-2123456789abcdef", dead, Duration::ZERO),
            file(d, "accelerate-rs-0123456789abcdef-b0-r1", dead, old),
            file(
                d,
                &format!("accelerate-rs-0123456789abcdef-b0-r1-p{me}"),
                dead,
                old,
            ),
            file(d, "someone-elses-0123456789abcdef", dead, old),
        ];
        assert_eq!(sweep(d, STALE_AFTER), gone.len());
        assert!(gone.iter().all(|p| !p.exists()));
        assert!(kept.iter().all(|p| p.exists()));
    }
}
