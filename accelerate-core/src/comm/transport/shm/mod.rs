//! Shared-memory transport for ranks on one host: one segment per group under `/dev/shm`,
//! and direct collectives on it.
//!
//! Each rank owns two slots (double buffering) and a control block. A collective goes through
//! its buffer in segments of one slot: each rank copies into its slot what the peers need of
//! its segment, all ranks pass a barrier, and each rank then works straight from the peers'
//! slots. For an all-reduce, rank `r` reduces part `r` of the segment (its own copy plus every
//! peer's slot), publishes the result in its own slot, and after a second barrier copies the
//! other ranks' reduced parts. Consecutive segments
//! alternate slots, so no barrier is needed between a segment's last reads and the next
//! segment's writes: the next segment's first barrier already orders them.
//!
//! Waiting spins briefly (a peer on another core arrives within microseconds), then sleeps on a
//! futex in the segment that every arriving rank rings while someone sleeps: with more ranks
//! than cores, or while a peer is still computing, waiters leave the CPU to it. Sleeps last at
//! most a couple of milliseconds, so a rank keeps watching the peers' abort flags and whether
//! the processes it waits for still exist: a crashed peer is reported within milliseconds, and
//! a deadline bounds every wait.
//!
//! The segment file is removed as soon as every rank has mapped it, so nothing is left in
//! `/dev/shm` after a normal end or a crash of any rank.
//!
//! This file owns the segment and the engine's state; `barrier` the waiting, `collectives`
//! the collectives over the slots, `shared_buffer` the buffers ranks reduce in place, and
//! `region` the segment's memory layout, `split` the segments of groups split from this one.

mod barrier;
mod collectives;
mod region;
mod shared_buffer;
mod split;
pub(crate) mod stale;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::comm::call::{CallDesc, OpKind};
use crate::comm::rendezvous::SharedMemoryHooks;
use crate::error::CommError;
use memmap2::Mmap;
use region::{AbortBoard, Region};

/// Default bytes per slot (each rank has two).
pub const DEFAULT_SLOT_BYTES: usize = 4 << 20;
/// How often a waiting rank checks that the ranks it waits for are still alive.
const LIVENESS_INTERVAL: Duration = Duration::from_millis(5);
/// Shared buffers up to this size are all-reduced through the slots (fewer barriers).
const IN_PLACE_MIN_BYTES: usize = 256 << 10;
/// Longest single sleep on the doorbell (a missed wake-up costs at most this).
const NAP: Duration = Duration::from_millis(2);

/// The shared-memory engine of one rank.
pub struct ShmEngine {
    rank: usize,
    world_size: usize,
    region: Region,
    /// Where this rank posts why it failed, from any thread (see [`Engine::abort_notice`]).
    board: Arc<AbortBoard>,
    timeout: Duration,
    arrivals: u64,
    segments: u64,
    /// Spins before sleeping: long when every rank has a core, short when ranks share cores.
    spin_limit: u32,
    /// The group's segment path; shared buffer files are named after it.
    base: PathBuf,
    /// Every peer's mapping of each shared buffer (`None` at this rank's own index).
    buffers: HashMap<u32, Arc<Vec<Option<Mmap>>>>,
}

/// The segment path of a group: a name derived from its secret and rendezvous address
/// (SHA-256, revealing nothing), so two jobs never collide and a test can look for its own
/// leftovers.
pub fn segment_path(token: &[u8], addr: &str) -> PathBuf {
    Path::new("/dev/shm").join(format!(
        "accelerate-rs-{}",
        crate::comm::secret::public_name(token, addr)
    ))
}

/// Creates `path` for this user only (`0600`, never through a symlink, never an existing
/// file) with `len` bytes reserved: on a full tmpfs this fails with ENOSPC here, instead of a
/// SIGBUS at the first write into a sparse mapping.
pub(crate) fn create_private(path: &Path, len: usize) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)?;
    let reserved = i64::try_from(len)
        .map_err(std::io::Error::other)
        .and_then(|len| {
            nix::fcntl::fallocate(&file, nix::fcntl::FallocateFlags::empty(), 0, len)
                .map_err(std::io::Error::from)
        });
    if let Err(e) = reserved {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(file)
}

/// Opens a file a peer of this group created, after checking that this user owns it, that
/// nobody else may open it, and that it holds at least `len` bytes.
pub(crate) fn open_private(path: &Path, write: bool, len: usize) -> std::io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(path)?;
    let meta = file.metadata()?;
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != euid || meta.mode() & 0o077 != 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "it belongs to uid {} with mode {:o}; this job's files belong to uid {euid} with \
                 mode 600 (another user's file: not ours to use)",
                meta.uid(),
                meta.mode() & 0o777
            ),
        ));
    }
    if meta.len() < len as u64 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("it has {} bytes, {len} expected", meta.len()),
        ));
    }
    Ok(file)
}

/// Whether this rank can open the segment at `path` for `world_size` ranks (it exists, is
/// ours, private and big enough).
pub fn can_open(path: &Path, world_size: usize, slot_bytes: usize) -> bool {
    Region::size(world_size, slot_bytes)
        .and_then(|len| open_private(path, false, len))
        .is_ok()
}

/// Creates the segment of a group of `world_size` ranks at `path` (on `rank`, its creator)
/// and returns the cookie written in it, which tells it from another file of that name.
fn create_segment(
    path: &Path,
    world_size: usize,
    slot_bytes: usize,
    rank: usize,
) -> Result<[u8; 16], CommError> {
    let context = || format!("creating {}", path.display());
    let file = Region::size(world_size, slot_bytes)
        .and_then(|len| create_private(path, len))
        .map_err(|e| CommError::io(rank, context(), e))?;
    let cookie: [u8; 16] = crate::comm::auth::random_bytes()
        .map_err(|e| CommError::io(rank, context(), std::io::Error::other(e)))?;
    // The creator's pid where rank 0's control block keeps it: the file names its owner
    // until every rank has mapped it (see `stale`).
    let creator = u64::from(std::process::id()).to_le_bytes();
    let stamped = file
        .write_all_at(&creator, 0)
        .and_then(|()| file.write_all_at(&cookie, region::COOKIE as u64));
    if let Err(e) = stamped {
        let _ = std::fs::remove_file(path);
        return Err(CommError::io(rank, context(), e));
    }
    Ok(cookie)
}

/// How the rendezvous creates, checks and removes a group's segment.
pub struct SegmentHooks {
    /// The rendezvous address (part of the segment's name).
    pub addr: String,
    /// Ranks of the group.
    pub world_size: usize,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// This rank.
    pub rank: usize,
}

impl SharedMemoryHooks for SegmentHooks {
    fn create(&self, token: &[u8]) -> Result<[u8; 16], CommError> {
        let path = segment_path(token, &self.addr);
        // A stale file of a crashed earlier job with the same secret and address, and those of
        // jobs killed during their set-up.
        let _ = std::fs::remove_file(&path);
        if let Some(dir) = path.parent() {
            stale::sweep(dir, stale::STALE_AFTER);
        }
        create_segment(&path, self.world_size, self.slot_bytes, self.rank)
    }

    fn check(&self, token: &[u8], cookie: &[u8; 16]) -> Option<String> {
        let path = segment_path(token, &self.addr);
        let opened = Region::size(self.world_size, self.slot_bytes)
            .and_then(|len| open_private(&path, false, len));
        let file = match opened {
            Ok(file) => file,
            Err(e) => return Some(format!("{}: {e}", path.display())),
        };
        let mut seen = [0u8; 16];
        match file.read_exact_at(&mut seen, region::COOKIE as u64) {
            Ok(()) if &seen == cookie => None,
            Ok(()) => Some(format!(
                "{} is another segment (this host's /dev/shm is not rank 0's)",
                path.display()
            )),
            Err(e) => Some(format!("{}: {e}", path.display())),
        }
    }

    fn remove(&self, token: &[u8]) {
        let _ = std::fs::remove_file(segment_path(token, &self.addr));
    }
}

impl ShmEngine {
    /// Maps the segment rank 0 created at `path`, waits until every rank has mapped it, and
    /// removes the file.
    pub fn open(
        path: &Path,
        rank: usize,
        world_size: usize,
        slot_bytes: usize,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let result = Self::open_inner(path, rank, world_size, slot_bytes, timeout);
        // Whether set-up worked or not, the name is no longer needed: the mapping keeps the
        // memory alive for the ranks that have it.
        let _ = std::fs::remove_file(path);
        result
    }

    fn open_inner(
        path: &Path,
        rank: usize,
        world_size: usize,
        slot_bytes: usize,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let file = Region::size(world_size, slot_bytes)
            .and_then(|len| open_private(path, true, len))
            .map_err(|e| CommError::io(rank, format!("opening {}", path.display()), e))?;
        let mapping = |e| CommError::io(rank, format!("mapping {}", path.display()), e);
        let region = Region::map(&file, world_size, slot_bytes).map_err(mapping)?;
        let board = Arc::new(AbortBoard::map(&file, world_size, rank).map_err(mapping)?);
        region
            .pid_namespace(rank)
            .store(crate::process::pid_namespace(), Ordering::Relaxed);
        region
            .pid(rank)
            .store(u64::from(std::process::id()), Ordering::Release);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut engine = Self {
            rank,
            world_size,
            region,
            board,
            timeout,
            arrivals: 0,
            segments: 0,
            spin_limit: if world_size <= cores { 4_000 } else { 64 },
            base: path.to_path_buf(),
            buffers: HashMap::new(),
        };
        engine.barrier_wait(&CallDesc::new(OpKind::Setup, 0), false)?;
        Ok(engine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn segments_are_private_exclusive_and_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("segment");
        let file = create_private(&path, 8192).unwrap();
        let meta = file.metadata().unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        // Space reserved, not a sparse file that faults when written.
        assert!(meta.blocks() * 512 >= 8192, "{} blocks", meta.blocks());
        assert!(
            create_private(&path, 8192).is_err(),
            "an existing name is reused"
        );
        assert!(open_private(&path, true, 8192).is_ok());
        assert!(
            open_private(&path, true, 8193).is_err(),
            "a short file is accepted"
        );

        // Someone else's file (here: readable by others) under the expected name is refused.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = open_private(&path, false, 0).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");

        // A symlink planted at the name is never followed, to create or to open.
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(create_private(&link, 8192).is_err());
        assert!(open_private(&link, false, 0).is_err());
    }
}
