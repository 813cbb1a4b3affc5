//! Where a job's secret comes from: the job token every connection proves it knows.
//!
//! - `ACCELERATE_JOB_TOKEN` when set (`accelerate-rs launch` sets a fresh 128-bit one for a job on
//!   one machine; jobs spanning machines need it set to the same value on every machine).
//! - Otherwise, for a job on one host (other launchers: torchrun, mpirun, srun, by hand), rank 0
//!   draws 256 random bits and writes them to a file only this user can read,
//!   `$XDG_RUNTIME_DIR/accelerate-rs/job-<addr>-<port>.secret` (or `/tmp/accelerate-rs-<uid>/`
//!   when there is no runtime directory), and the other ranks read it from there. Rank 0
//!   removes the file once the group formed or failed.
//! - A job spanning hosts without a token refuses to start: nothing both hosts know is secret.
//!   Under torchrun such a job finds rank 0's address (never the secret) in torchrun's store
//!   ([`super::torch_store`]), signed with the job token: anyone who reaches the store can
//!   write there, so an address without the job's signature is refused, and rank 0 checks
//!   while the group forms that its own is still the one there.

use std::fs::{DirBuilder, OpenOptions};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use sha2::{Digest, Sha256};

use super::auth::{random_bytes, sign_published, verify_published};
use super::torch_store::{StoreError, TorchStore};
use crate::env_vars;

/// Longest secret file read, in bytes (a hex token is 64).
const MAX_SECRET_BYTES: u64 = 1024;

/// The job's secret, and where the other ranks find what rank 0 chose: the secret (when no
/// token was given) and the rendezvous port (when it is 0: rank 0 picks one). Its `Debug`
/// output never shows the token.
#[derive(Clone)]
pub struct JobSecret {
    /// `ACCELERATE_JOB_TOKEN` (or a token given in code).
    given: Option<Vec<u8>>,
    /// Rank 0's private file for the other ranks of its host.
    file: Option<PathBuf>,
    /// torchrun's store, where rank 0 publishes its address for a job spanning hosts.
    store: Option<StoreBoard>,
}

impl std::fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobSecret")
            .field("given", &self.given.as_ref().map(|_| REDACTED))
            .field("file", &self.file)
            .field("store", &self.store)
            .finish()
    }
}

/// What `Debug` output shows instead of a secret.
pub const REDACTED: &str = "<redacted>";

/// A key in torchrun's store and the connection to it.
#[derive(Debug, Clone)]
struct StoreBoard {
    key: String,
    store: Arc<Mutex<TorchStore>>,
}

impl StoreBoard {
    /// What rank 0 writes under the key: its address and the job's signature of it.
    fn signed(&self, token: &[u8], listen: SocketAddr) -> Vec<u8> {
        let addr = listen.to_string();
        let signature = sign_published(token, &self.key, addr.as_bytes());
        format!("{addr} {}", hex(&signature)).into_bytes()
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut TorchStore) -> Result<T, StoreError>,
    ) -> Result<T, SecretError> {
        // A poisoned lock means another thread panicked mid-request: the stream is unusable.
        let mut store = self.store.lock().map_err(|_| SecretError::File {
            path: self.key.clone(),
            reason: "the connection to torchrun's store broke".into(),
        })?;
        Ok(f(&mut store)?)
    }
}

/// What a rank other than 0 found: the secret, and where rank 0 listens.
pub type Found = (Vec<u8>, SocketAddr);

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
    /// No port and no job name to find rank 0's port by.
    #[error(
        "MASTER_PORT is 0 and the launcher names no job, so the ranks cannot find rank 0's port. \
         hint: set MASTER_PORT to a free port on every rank"
    )]
    NoPort,
    /// The token is empty.
    #[error(
        "{} is empty. hint: unset it, or give every rank the same non-empty secret",
        env_vars::JOB_TOKEN
    )]
    Empty,
    /// torchrun's store could not be used.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// torchrun's store holds an address under the job's key that rank 0 did not sign.
    #[error(
        "torchrun's store holds {found} under {key}, which is not rank 0's address signed with \
         this job's {var}: another process that reaches the store wrote it, so the job does not \
         start. hint: let only the job's hosts reach torchrun's store port (a firewall, a \
         private network)",
        var = env_vars::JOB_TOKEN
    )]
    Forged {
        /// The key in the store.
        key: String,
        /// What is there.
        found: String,
    },
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
    /// The secret of a job whose rank 0 serves at `master_addr`:`port` (0: a port rank 0
    /// picks, found through the file named after `job_id`), with `local_world_size` of its
    /// `world_size` ranks on this host, given `token` (from `ACCELERATE_JOB_TOKEN`).
    pub fn resolve(
        token: Option<&str>,
        master_addr: &str,
        port: u16,
        (local_world_size, world_size): (usize, usize),
        job_id: Option<&str>,
    ) -> Result<Self, SecretError> {
        let given = match token {
            Some("") => return Err(SecretError::Empty),
            Some(token) => Some(token.as_bytes().to_vec()),
            None => None,
        };
        let name = |s: &str| s.replace(|c: char| !c.is_ascii_alphanumeric() && c != '.', "_");
        if port == 0 {
            let job = job_id.ok_or(SecretError::NoPort)?;
            let file = private_dir()?.join(format!("job-{}.rendezvous", name(job)));
            return Ok(Self {
                given,
                file: Some(file),
                store: None,
            });
        }
        if given.is_some() {
            return Ok(Self {
                given,
                file: None,
                store: None,
            });
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
        let file = private_dir()?.join(format!("job-{}-{port}.secret", name(master_addr)));
        Ok(Self {
            given: None,
            file: Some(file),
            store: None,
        })
    }

    /// The secret of a job that torchrun runs on `hosts` hosts: `token` is required, and rank
    /// 0's address goes under `key` in torchrun's store at `store` (`host:port`), reached
    /// before `deadline`.
    pub fn through_store(
        token: Option<&str>,
        hosts: usize,
        store: &str,
        key: String,
        deadline: Instant,
    ) -> Result<Self, SecretError> {
        let given = match token {
            Some("") => return Err(SecretError::Empty),
            Some(token) => token.as_bytes().to_vec(),
            None => {
                return Err(SecretError::SpansHosts {
                    why: format!("torchrun runs it on {hosts} hosts"),
                });
            }
        };
        let store = TorchStore::connect(store, deadline)?;
        Ok(Self {
            given: Some(given),
            file: None,
            store: Some(StoreBoard {
                key,
                store: Arc::new(Mutex::new(store)),
            }),
        })
    }

    /// Where rank 0 listens, when that is not at the job's address: under torchrun across
    /// hosts, the address of this host that reaches torchrun's store.
    pub fn listen_ip(&self) -> Result<Option<IpAddr>, SecretError> {
        match &self.store {
            Some(board) => board.with(|store| store.local_ip()).map(Some),
            None => Ok(None),
        }
    }

    /// Rank 0's side, once it listens at `listen`: the secret itself, and what the other ranks
    /// read: the private file (the port, and the secret unless it was given) or the address in
    /// torchrun's store.
    pub fn create(&self, listen: SocketAddr) -> Result<Vec<u8>, SecretError> {
        let port = listen.port();
        let token = match &self.given {
            Some(token) => token.clone(),
            None => {
                let bytes: [u8; 32] = random_bytes()
                    .map_err(|e| file_error(self.file.as_deref().unwrap_or(Path::new("")), e))?;
                hex(&bytes).into_bytes()
            }
        };
        if let Some(path) = &self.file {
            let secret = if self.given.is_some() {
                String::new()
            } else {
                String::from_utf8_lossy(&token).into_owned()
            };
            write_private(path, format!("{port}\n{secret}").as_bytes())?;
        }
        if let Some(board) = &self.store {
            let value = board.signed(&token, listen);
            board.with(|store| store.set(&board.key, &value))?;
        }
        Ok(token)
    }

    /// Rank 0's side, while the group forms: an error when torchrun's store no longer holds
    /// the address rank 0 published at `listen` (someone who reaches the store overwrote it).
    pub fn check_published(&self, token: &[u8], listen: SocketAddr) -> Result<(), SecretError> {
        let Some(board) = &self.store else {
            return Ok(());
        };
        let value = board.with(|store| store.try_get(&board.key))?;
        if value.as_deref() == Some(board.signed(token, listen).as_slice()) {
            return Ok(());
        }
        Err(SecretError::Forged {
            key: board.key.clone(),
            found: value.map_or_else(
                || "nothing".into(),
                |v| format!("{:?}", String::from_utf8_lossy(&v)),
            ),
        })
    }

    /// Another rank's side: the secret and where rank 0 listens, as they are now (`None` while
    /// rank 0 has not published them); `rank0` is the job's address, where rank 0 listens
    /// unless it chose otherwise.
    pub fn current(&self, rank0: SocketAddr) -> Result<Option<Found>, SecretError> {
        if let Some(board) = &self.store {
            let Some(value) = board.with(|store| store.try_get(&board.key))? else {
                return Ok(None);
            };
            let Some(token) = self.given.clone() else {
                return Ok(None);
            };
            let forged = || SecretError::Forged {
                key: board.key.clone(),
                found: format!("{:?}", String::from_utf8_lossy(&value)),
            };
            let text = std::str::from_utf8(&value).map_err(|_| forged())?;
            let (addr, signature) = text.split_once(' ').ok_or_else(forged)?;
            let signature = unhex(signature).ok_or_else(forged)?;
            if !verify_published(&token, &board.key, addr.as_bytes(), &signature) {
                return Err(forged());
            }
            let listen = addr.parse::<SocketAddr>().map_err(|_| forged())?;
            return Ok(Some((token, listen)));
        }
        let Some(path) = &self.file else {
            return Ok(self.given.clone().map(|token| (token, rank0)));
        };
        let Some(contents) = read_private(path)? else {
            return Ok(None);
        };
        let text = String::from_utf8_lossy(&contents);
        let Some((port, secret)) = parse_job_file(&text) else {
            return Err(file_error(
                path,
                "not a job file (no port). hint: remove it",
            ));
        };
        let token = match &self.given {
            Some(token) => token.clone(),
            None if secret.is_empty() => {
                return Err(file_error(
                    path,
                    "not a job file (no secret). hint: remove it",
                ));
            }
            None => secret.as_bytes().to_vec(),
        };
        Ok(Some((token, SocketAddr::new(rank0.ip(), port))))
    }

    /// Whether a failed proof may be a stale file that rank 0 is about to replace.
    pub fn may_change(&self) -> bool {
        self.file.is_some()
    }

    /// Removes the file rank 0 wrote.
    pub fn remove(&self) {
        if let Some(path) = &self.file {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Where the secret comes from, for logs.
    pub fn describe(&self) -> String {
        match (&self.file, &self.store) {
            (Some(path), _) => path.display().to_string(),
            (None, Some(board)) => format!("{} in torchrun's store", board.key),
            (None, None) => env_vars::JOB_TOKEN.to_string(),
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

/// A job file's port (rank 0's, never 0) and secret (empty when the token was given): its
/// first line and the rest, trimmed. `None` without a port.
fn parse_job_file(text: &str) -> Option<(u16, &str)> {
    let (port, secret) = text.split_once('\n').unwrap_or((text, ""));
    let port = port.trim().parse::<u16>().ok().filter(|&p| p != 0)?;
    Some((port, secret.trim()))
}

/// The bytes of lowercase or uppercase hex text; `None` for anything else.
pub(crate) fn unhex(text: &str) -> Option<Vec<u8>> {
    // Hex digits only: `from_str_radix` alone would also take a sign.
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
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
        let err = JobSecret::resolve(None, "127.0.0.1", 1234, (2, 4), None).unwrap_err();
        assert!(err.to_string().contains("openssl rand"), "{err}");
        let err = JobSecret::resolve(None, "192.0.2.1", 1234, (2, 2), None).unwrap_err();
        assert!(
            err.to_string().contains("not an address of this host"),
            "{err}"
        );
        assert_eq!(
            JobSecret::resolve(Some(""), "192.0.2.1", 1, (1, 2), None).unwrap_err(),
            SecretError::Empty
        );
        let given = JobSecret::resolve(Some("t"), "192.0.2.1", 1, (1, 2), None).unwrap();
        let rank0 = addr("192.0.2.1:1");
        assert_eq!(given.current(rank0).unwrap(), Some((b"t".to_vec(), rank0)));
        assert_eq!(
            JobSecret::resolve(None, "127.0.0.1", 0, (2, 2), None).unwrap_err(),
            SecretError::NoPort
        );
        let err = JobSecret::through_store(None, 2, "127.0.0.1:1", "k".into(), Instant::now())
            .unwrap_err();
        assert!(
            err.to_string().contains("torchrun runs it on 2 hosts"),
            "{err}"
        );
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_local_job_shares_a_private_file() {
        let secret = JobSecret::resolve(None, "127.0.0.1", 1, (2, 2), None).unwrap();
        let path = secret.file.clone().expect("a file secret");
        let rank0 = addr("127.0.0.1:1");
        let token = secret.create(rank0).unwrap();
        assert_eq!(token.len(), 64);
        assert_eq!(secret.current(rank0).unwrap(), Some((token.clone(), rank0)));
        let mode = std::fs::metadata(&path).unwrap().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_ne!(
            secret.create(rank0).unwrap(),
            token,
            "each job draws a new secret"
        );
        secret.remove();
        assert_eq!(secret.current(rank0).unwrap(), None);
    }

    #[test]
    fn a_port_rank_0_picked_reaches_the_other_ranks_with_the_secret() {
        let job = format!("test-{}", std::process::id());
        for token in [None, Some("given")] {
            let secret = JobSecret::resolve(token, "127.0.0.1", 0, (2, 2), Some(&job)).unwrap();
            let job_addr = addr("127.0.0.1:0");
            assert_eq!(secret.current(job_addr).unwrap(), None);
            let created = secret.create(addr("127.0.0.1:40123")).unwrap();
            assert_eq!(
                secret.current(job_addr).unwrap(),
                Some((created, addr("127.0.0.1:40123")))
            );
            secret.remove();
        }
    }

    proptest::proptest! {
        /// Whatever a job file holds (another program's, a truncated one), reading it never
        /// panics, and what it yields is a port and a trimmed secret.
        #[test]
        fn job_files_never_panic(text in "\\PC{0,80}") {
            if let Some((port, secret)) = parse_job_file(&text) {
                proptest::prop_assert!(port != 0);
                proptest::prop_assert_eq!(secret, secret.trim());
            }
        }

        #[test]
        fn hex_reads_back_and_never_panics(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40), junk in "\\PC{0,40}") {
            proptest::prop_assert_eq!(unhex(&hex(&bytes)), Some(bytes));
            let _ = unhex(&junk);
        }
    }

    #[test]
    fn a_job_file_gives_its_port_and_secret() {
        assert_eq!(parse_job_file("4242\nabc\n"), Some((4242, "abc")));
        assert_eq!(parse_job_file("4242"), Some((4242, "")));
        assert_eq!(parse_job_file("0\nabc"), None);
        assert_eq!(parse_job_file("x\nabc"), None);
    }
}
