//! How much memory this process may use, where a limit is set: the soft `RLIMIT_DATA` and
//! `RLIMIT_AS` resource limits, and the memory limit of its cgroup (v2 `memory.max`, v1
//! `memory.limit_in_bytes`). Training checks its estimate against it before it allocates, so a
//! model that cannot fit stops with an error saying so and what would fit, not with an
//! allocation failure in the middle of a step.
//!
//! ```
//! use accelerate_core::memory_limit::{MemoryLimit, process_memory_limit};
//!
//! // Without limits (as here, most likely) there is nothing to check against.
//! if let Some(MemoryLimit { bytes, source }) = process_memory_limit() {
//!     assert!(bytes > 0, "{source}");
//! }
//! ```

use std::path::{Path, PathBuf};

/// A limit on this process's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLimit {
    /// Bytes the process may use.
    pub bytes: u64,
    /// Where the limit comes from (`RLIMIT_DATA`, `RLIMIT_AS`, `cgroup memory.max at ...`).
    pub source: String,
}

/// The tightest memory limit on this process, if any is set.
pub fn process_memory_limit() -> Option<MemoryLimit> {
    let mut limits = resource_limits();
    limits.extend(cgroup_limit());
    limits.into_iter().min_by_key(|limit| limit.bytes)
}

#[cfg(unix)]
fn resource_limits() -> Vec<MemoryLimit> {
    use nix::sys::resource::{RLIM_INFINITY, Resource, getrlimit};
    [
        (Resource::RLIMIT_DATA, "RLIMIT_DATA"),
        (Resource::RLIMIT_AS, "RLIMIT_AS"),
    ]
    .into_iter()
    .filter_map(|(resource, name)| {
        let (soft, _) = getrlimit(resource).ok()?;
        (soft != RLIM_INFINITY).then(|| MemoryLimit {
            bytes: soft,
            source: name.to_string(),
        })
    })
    .collect()
}

#[cfg(not(unix))]
fn resource_limits() -> Vec<MemoryLimit> {
    Vec::new()
}

/// The memory limit of this process's cgroup, read from `/proc/self/cgroup`'s paths.
fn cgroup_limit() -> Option<MemoryLimit> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    limit_in(Path::new("/sys/fs/cgroup"), &membership)
}

/// The limit that `membership` (the text of `/proc/self/cgroup`) names under the cgroup file
/// systems mounted at `root`: v2's `memory.max`, or v1's `memory/.../memory.limit_in_bytes`;
/// "max" and v1's unlimited value (a page-rounded `i64::MAX`) are no limit.
fn limit_in(root: &Path, membership: &str) -> Option<MemoryLimit> {
    let candidates: Vec<PathBuf> = membership
        .lines()
        .filter_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            let path = path.trim_start_matches('/');
            if controllers.is_empty() {
                Some(root.join(path).join("memory.max"))
            } else if controllers.split(',').any(|c| c == "memory") {
                Some(root.join("memory").join(path).join("memory.limit_in_bytes"))
            } else {
                None
            }
        })
        .collect();
    candidates.into_iter().find_map(|file| {
        let text = std::fs::read_to_string(&file).ok()?;
        let bytes: u64 = text.trim().parse().ok()?;
        (bytes < (1 << 62)).then(|| MemoryLimit {
            bytes,
            source: format!("cgroup limit {}", file.display()),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_limits_are_read_from_v2_and_v1_and_unlimited_is_none() {
        let tmp = tempfile::tempdir().unwrap();
        let v2 = tmp.path().join("job/a");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("memory.max"), "1073741824\n").unwrap();
        let limit = limit_in(tmp.path(), "0::/job/a\n").unwrap();
        assert_eq!(limit.bytes, 1 << 30);
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        assert_eq!(limit_in(tmp.path(), "0::/job/a\n"), None);

        let v1 = tmp.path().join("memory/batch/7");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "536870912\n").unwrap();
        let membership = "5:cpu,cpuacct:/\n4:memory:/batch/7\n0::/\n";
        assert_eq!(limit_in(tmp.path(), membership).unwrap().bytes, 1 << 29);
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(limit_in(tmp.path(), membership), None);
    }
}
