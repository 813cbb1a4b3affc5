//! This machine's processes as files and peers see them: whether a process is alive, this
//! process's PID namespace, and the identity of the place where process ids mean something
//! (host, boot and PID namespace), so that what a dead process left behind can be told from
//! what a live one, here or on another host sharing the file system, is still using.

/// This machine's identity: the host name and the kernel's boot id.
pub fn host_identity() -> String {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    format!(
        "{}/{}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id")
    )
}

/// This process's PID namespace: the inode of `/proc/self/ns/pid`, 0 where it cannot be read.
pub fn pid_namespace() -> u64 {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
    }
    #[cfg(not(unix))]
    0
}

/// Where this process's id names this process: its host, boot and PID namespace, as a short
/// stable tag (12 hex digits). Processes with the same tag can check each other's liveness.
pub fn pid_scope() -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("{}/{}", host_identity(), pid_namespace()));
    digest.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

/// True while process `pid` (of this PID namespace) exists and is not a zombie.
pub fn process_alive(pid: u64) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            // The state letter follows the command name, which is in parentheses.
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next());
            !matches!(state, Some('Z' | 'X'))
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_reaped_child_is_not() {
        assert!(process_alive(u64::from(std::process::id())));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = u64::from(child.id());
        child.wait().unwrap();
        assert!(!process_alive(pid));
        assert_eq!(pid_scope().len(), 12);
        assert_eq!(pid_scope(), pid_scope());
    }
}
