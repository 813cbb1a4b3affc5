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
//! `region` the segment's memory layout.

mod barrier;
mod collectives;
mod region;
mod shared_buffer;

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::comm::call::{CallDesc, OpKind};
use crate::error::CommError;
use memmap2::Mmap;
use region::Region;

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

/// The segment path of a group: a hash of its job token and rendezvous address, so two jobs
/// never collide and a test can look for its own leftovers.
pub fn segment_path(token: &str, addr: &str) -> PathBuf {
    let mut hasher = DefaultHasher::new();
    token.hash(&mut hasher);
    addr.hash(&mut hasher);
    Path::new("/dev/shm").join(format!("accelerate-rs-{:016x}", hasher.finish()))
}

/// Creates a zeroed segment for `world_size` ranks at `path` (rank 0, before the others open
/// it). A stale file of a crashed earlier job with the same token and address is replaced.
pub fn create_segment(
    path: &Path,
    world_size: usize,
    slot_bytes: usize,
    rank: usize,
) -> Result<(), CommError> {
    let _ = std::fs::remove_file(path);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| CommError::io(rank, format!("creating {}", path.display()), e))?;
    file.set_len(Region::size(world_size, slot_bytes) as u64)
        .map_err(|e| CommError::io(rank, format!("sizing {}", path.display()), e))
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
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| CommError::io(rank, format!("opening {}", path.display()), e))?;
        let region = Region::map(&file, world_size, slot_bytes)
            .map_err(|e| CommError::io(rank, format!("mapping {}", path.display()), e))?;
        region
            .pid(rank)
            .store(u64::from(std::process::id()), Ordering::Release);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut engine = Self {
            rank,
            world_size,
            region,
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
