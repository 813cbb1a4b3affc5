//! Where a job's secret comes from: the job token every connection proves it knows.
//!
//! - `ACCELERATE_JOB_TOKEN` when set (`accelerate launch` sets a fresh 128-bit one for a job on
//!   one machine; jobs spanning machines need it set to the same value on every machine).
//! - Otherwise, for a job on one host (other launchers: torchrun, mpirun, srun, by hand), rank 0
//!   draws 256 random bits and writes them to a file only this user can read,
//!   `$XDG_RUNTIME_DIR/accelerate-rs/job-<addr>-<port>.secret` (or `/tmp/accelerate-rs-<uid>/`
//!   when there is no runtime directory), and the other ranks read it from there. Rank 0
//!   removes the file once the group formed or failed.
//! - A job spanning hosts without a token refuses to start: nothing both hosts know is secret.

use std::fs::{DirBuilder, OpenOptions};
use std::io::{Read, Write};
use std::net::{IpAddr, TcpListener, ToSocketAddrs};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::auth::random_bytes;
use crate::env_vars;

/// Longest secret file read, in bytes (a hex token is 64).
const MAX_SECRET_BYTES: u64 = 1024;

/// The job's secret, or where rank `k` will find it.
#[derive(Debug, Clone)]
pub enum JobSecret {
    /// `ACCELERATE_JOB_TOKEN` (or a token given in code).
    Given(Vec<u8>),
    /// Drawn by rank 0 and kept in a private file for the ranks on its host.
    File(PathBuf),
}

/// Why a job has no secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// The job spans hosts and no token was given.
    #[error(
        "this job spans hosts ({why}) and has no {var}: anyone who can reach the rendezvous port \
         could join it. hint: set the same secret on every host, e.g. \
         `export {var}=$(openssl rand -hex 16)`",
        var = env_vars::JOB_TOKEN
    )]
    SpansHosts {
        /// What shows that the job spans hosts.
        why: String,
    },
    /// The token is empty.
    #[error(
        "{} is empty. hint: unset it, or give every rank the same non-empty secret",
        env_vars::JOB_TOKEN
    )]
    Empty,
    /// The secret file or its directory is unusable.
    #[error("{path}: {reason}")]
    File {
        /// The file or directory.
        path: String,
        /// What is wrong, with a hint.
        reason: String,
    },
}

impl JobSecret {
    /// The secret of a job whose rank 0 serves at `master_addr`:`port`, with `local_world_size`
    /// of its `world_size` ranks on this host, given `token` (from `ACCELERATE_JOB_TOKEN`).
    pub fn resolve(
        token: Option<&str>,
        master_addr: &str,
        port: u16,
        local_world_size: usize,
        world_size: usize,
    ) -> Result<Self, SecretError> {
        if let Some(token) = token {
            if token.is_empty() {
                return Err(SecretError::Empty);
            }
            return Ok(Self::Given(token.as_bytes().to_vec()));
        }
        if local_world_size < world_size {
            return Err(SecretError::SpansHosts {
                why: format!(
                    "{local_world_size} of its {world_size} processes run on this host, says the \
                     launcher"
                ),
            });
        }
        if !is_local_address(master_addr) {
            return Err(SecretError::SpansHosts {
                why: format!("MASTER_ADDR={master_addr} is not an address of this host"),
            });
        }
        let name = format!(
            "job-{}-{port}.secret",
            master_addr.replace(|c: char| !c.is_ascii_alphanumeric() && c != '.', "_")
        );
        Ok(Self::File(private_dir()?.join(name)))
    }

    /// Rank 0's side: the secret itself, written to the file first when it lives in one.
    pub fn create(&self) -> Result<Vec<u8>, SecretError> {
        match self {
            Self::Given(token) => Ok(token.clone()),
            Self::File(path) => {
                let bytes: [u8; 32] = random_bytes().map_err(|e| file_error(path, e))?;
                let token = hex(&bytes).into_bytes();
                write_private(path, &token)?;
                Ok(token)
            }
        }
    }

    /// Another rank's side: the secret as it is now (`None` while rank 0 has not written it).
    pub fn current(&self) -> Result<Option<Vec<u8>>, SecretError> {
        match self {
            Self::Given(token) => Ok(Some(token.clone())),
            Self::File(path) => read_private(path),
        }
    }

    /// Whether a failed proof may be a stale file that rank 0 is about to replace.
    pub fn may_change(&self) -> bool {
        matches!(self, Self::File(_))
    }

    /// Removes the file rank 0 wrote (nothing for a given token).
    pub fn remove(&self) {
        if let Self::File(path) = self {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Where the secret comes from, for logs.
    pub fn describe(&self) -> String {
        match self {
            Self::Given(_) => env_vars::JOB_TOKEN.to_string(),
            Self::File(path) => path.display().to_string(),
        }
    }
}

/// A short public name derived from a secret (for shared-memory segment names): SHA-256, so
/// it reveals nothing about the secret.
pub fn public_name(secret: &[u8], addr: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"accelerate-rs segment name");
    hasher.update(secret);
    hasher.update(addr.as_bytes());
    hex(&hasher.finalize()[..8])
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `addr` (a host name or an IP) is an address of this machine: one can listen there.
fn is_local_address(addr: &str) -> bool {
    let Ok(resolved) = (addr, 0).to_socket_addrs() else {
        return false;
    };
    let ips: Vec<IpAddr> = resolved.map(|a| a.ip()).collect();
    !ips.is_empty()
        && ips
            .iter()
            .all(|ip| ip.is_loopback() || TcpListener::bind((*ip, 0)).is_ok())
}

fn euid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

fn file_error(path: &Path, reason: impl ToString) -> SecretError {
    SecretError::File {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// This user's private directory for job secrets, created `0700` when missing; refused when
/// another user owns it or others may read it.
fn private_dir() -> Result<PathBuf, SecretError> {
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| Path::new(d).is_dir()) {
        Some(runtime) => Path::new(&runtime).join("accelerate-rs"),
        None => std::env::temp_dir().join(format!("accelerate-rs-{}", euid())),
    };
    match DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(file_error(&dir, format!("cannot create it: {e}"))),
    }
    let meta = std::fs::symlink_metadata(&dir).map_err(|e| file_error(&dir, e))?;
    if !meta.is_dir() || meta.uid() != euid() || meta.mode() & 0o077 != 0 {
        return Err(file_error(
            &dir,
            format!(
                "must be a directory owned by uid {} that only its owner can open (it has uid {}, \
                 mode {:o}). hint: remove it, or set {}",
                euid(),
                meta.uid(),
                meta.mode() & 0o7777,
                env_vars::JOB_TOKEN
            ),
        ));
    }
    Ok(dir)
}

fn nofollow() -> i32 {
    nix::fcntl::OFlag::O_NOFOLLOW.bits()
}

/// Writes `bytes` to `path` readable by this user only, replacing an older file atomically.
fn write_private(path: &Path, bytes: &[u8]) -> Result<(), SecretError> {
    let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let written = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nofollow())
        .open(&tmp)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        file_error(path, format!("cannot write the job secret: {e}"))
    })
}

/// The contents of `path` if it exists, after checking that only this user can read it.
fn read_private(path: &Path) -> Result<Option<Vec<u8>>, SecretError> {
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(nofollow())
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(file_error(path, e)),
    };
    let meta = file.metadata().map_err(|e| file_error(path, e))?;
    if meta.uid() != euid() || meta.mode() & 0o077 != 0 {
        return Err(file_error(
            path,
            "the job secret must belong to this user and be private (mode 600). hint: remove it",
        ));
    }
    let mut token = Vec::new();
    file.take(MAX_SECRET_BYTES)
        .read_to_end(&mut token)
        .map_err(|e| file_error(path, e))?;
    Ok((!token.is_empty()).then_some(token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_spanning_hosts_without_a_token_is_refused() {
        let err = JobSecret::resolve(None, "127.0.0.1", 1234, 2, 4).unwrap_err();
        assert!(err.to_string().contains("openssl rand"), "{err}");
        let err = JobSecret::resolve(None, "192.0.2.1", 1234, 2, 2).unwrap_err();
        assert!(
            err.to_string().contains("not an address of this host"),
            "{err}"
        );
        assert_eq!(
            JobSecret::resolve(Some(""), "192.0.2.1", 1, 1, 2).unwrap_err(),
            SecretError::Empty
        );
        assert!(matches!(
            JobSecret::resolve(Some("t"), "192.0.2.1", 1, 1, 2),
            Ok(JobSecret::Given(_))
        ));
    }

    #[test]
    fn a_local_job_shares_a_private_file() {
        let secret = JobSecret::resolve(None, "127.0.0.1", 1, 2, 2).unwrap();
        let JobSecret::File(path) = &secret else {
            panic!("expected a file secret");
        };
        let token = secret.create().unwrap();
        assert_eq!(token.len(), 64);
        assert_eq!(secret.current().unwrap(), Some(token.clone()));
        let mode = std::fs::metadata(path).unwrap().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_ne!(
            secret.create().unwrap(),
            token,
            "each job draws a new secret"
        );
        secret.remove();
        assert_eq!(secret.current().unwrap(), None);
    }
}
