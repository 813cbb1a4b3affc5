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

mod region;

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use accelerate_kernels::reduce::{reduce_bytes, scale_bytes};
use accelerate_kernels::{DType, ReduceOp};

use crate::comm::call::{CallDesc, OpKind};
use crate::comm::engine::{Engine, chunk_bytes};
use crate::error::CommError;
use memmap2::{Mmap, MmapMut};
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

    fn next_buffer(&mut self) -> usize {
        self.segments += 1;
        (self.segments % 2) as usize
    }

    fn publish(&self, call: &CallDesc) {
        for (i, word) in call.pack().iter().enumerate() {
            self.region
                .call_word(self.rank, call.seq as usize, i)
                .store(*word, Ordering::Relaxed);
        }
    }

    /// Arrives at the next barrier and waits for every rank; with `check`, then compares the
    /// call every rank published for `call.seq`.
    fn barrier_wait(&mut self, call: &CallDesc, check: bool) -> Result<(), CommError> {
        self.arrivals += 1;
        let target = self.arrivals;
        // SeqCst on this store and on the sleepers load below, against the sleeper's SeqCst
        // increment and re-check: either it sees this arrival, or this rank sees it sleeping.
        self.region
            .arrived(self.rank)
            .store(target, Ordering::SeqCst);
        if self.region.sleepers().load(Ordering::SeqCst) > 0 {
            self.region.doorbell().fetch_add(1, Ordering::SeqCst);
            wake_all(self.region.doorbell());
        }
        let all_arrived = |region: &Region| {
            (0..self.world_size).all(|r| region.arrived(r).load(Ordering::Acquire) >= target)
        };
        let started = Instant::now();
        let deadline = started + self.timeout;
        let mut next_liveness = started + LIVENESS_INTERVAL;
        let mut spins: u32 = 0;
        while !all_arrived(&self.region) {
            spins = spins.saturating_add(1);
            if spins < self.spin_limit {
                std::hint::spin_loop();
                if !spins.is_multiple_of(64) {
                    continue;
                }
            } else {
                let sleepers = self.region.sleepers();
                sleepers.fetch_add(1, Ordering::SeqCst);
                let bell = self.region.doorbell().load(Ordering::SeqCst);
                if !all_arrived(&self.region) {
                    sleep_on(self.region.doorbell(), bell, NAP);
                }
                sleepers.fetch_sub(1, Ordering::SeqCst);
            }
            self.check_peers(call, target, started, deadline, &mut next_liveness)?;
        }
        if check {
            self.check_calls(call)?;
        }
        Ok(())
    }

    fn check_peers(
        &self,
        call: &CallDesc,
        target: u64,
        started: Instant,
        deadline: Instant,
        next_liveness: &mut Instant,
    ) -> Result<(), CommError> {
        for peer in (0..self.world_size).filter(|&p| p != self.rank) {
            if let Some(reason) = self.region.abort_reason(peer) {
                return Err(CommError::PeerFailed {
                    call: call.to_string(),
                    rank: self.rank,
                    peer,
                    reason,
                });
            }
        }
        let now = Instant::now();
        let missing = || -> Vec<usize> {
            (0..self.world_size)
                .filter(|&r| self.region.arrived(r).load(Ordering::Acquire) < target)
                .collect()
        };
        if now >= *next_liveness {
            *next_liveness = now + LIVENESS_INTERVAL;
            for peer in missing() {
                let pid = self.region.pid(peer).load(Ordering::Acquire);
                if pid != 0 && !process_alive(pid) {
                    return Err(CommError::PeerLost {
                        call: call.to_string(),
                        rank: self.rank,
                        peer,
                        detail: format!("process {pid} exited"),
                    });
                }
            }
        }
        if now >= deadline {
            return Err(CommError::Timeout {
                call: call.to_string(),
                rank: self.rank,
                world_size: self.world_size,
                missing: missing(),
                elapsed_s: started.elapsed().as_secs_f64(),
            });
        }
        Ok(())
    }

    fn check_calls(&self, call: &CallDesc) -> Result<(), CommError> {
        for peer in (0..self.world_size).filter(|&p| p != self.rank) {
            let words: [u64; 4] = std::array::from_fn(|i| {
                self.region
                    .call_word(peer, call.seq as usize, i)
                    .load(Ordering::Relaxed)
            });
            let theirs = CallDesc::unpack(words);
            if theirs != Some(*call) {
                return Err(CommError::Mismatch {
                    rank: self.rank,
                    ours: call.to_string(),
                    peer,
                    theirs: theirs.map_or_else(|| "an unknown call".to_string(), |c| c.to_string()),
                });
            }
        }
        Ok(())
    }

    /// Publishes `call` and passes its first barrier, checking every rank's call.
    fn begin(&mut self, call: &CallDesc) -> Result<(), CommError> {
        self.publish(call);
        self.barrier_wait(call, true)
    }
}

/// Sleeps until `word` no longer holds `seen`, a wake-up, or `nap` passes.
#[cfg(target_os = "linux")]
fn sleep_on(word: &std::sync::atomic::AtomicU32, seen: u32, nap: Duration) {
    use linux_futex::{AsFutex, Shared};
    let futex: &linux_futex::Futex<Shared> = word.as_futex();
    let _ = futex.wait_for(seen, nap);
}

/// Wakes every rank sleeping on `word`.
#[cfg(target_os = "linux")]
fn wake_all(word: &std::sync::atomic::AtomicU32) {
    use linux_futex::{AsFutex, Shared};
    let futex: &linux_futex::Futex<Shared> = word.as_futex();
    futex.wake(i32::MAX);
}

#[cfg(not(target_os = "linux"))]
fn sleep_on(_word: &std::sync::atomic::AtomicU32, _seen: u32, _nap: Duration) {
    std::thread::sleep(Duration::from_micros(50));
}

#[cfg(not(target_os = "linux"))]
fn wake_all(_word: &std::sync::atomic::AtomicU32) {}

impl ShmEngine {
    fn buffer_path(&self, id: u32, rank: usize) -> PathBuf {
        let mut name = self.base.clone().into_os_string();
        name.push(format!("-b{id}-r{rank}"));
        PathBuf::from(name)
    }

    fn create_shared_inner(
        &mut self,
        call: &CallDesc,
        id: u32,
        bytes: usize,
    ) -> Result<Option<MmapMut>, CommError> {
        let rank = self.rank;
        let own_path = self.buffer_path(id, rank);
        let own = if bytes == 0 {
            None
        } else {
            let _ = std::fs::remove_file(&own_path);
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&own_path)
                .map_err(|e| CommError::io(rank, format!("creating {}", own_path.display()), e))?;
            file.set_len(bytes as u64)
                .map_err(|e| CommError::io(rank, format!("sizing {}", own_path.display()), e))?;
            Some(
                region::map_own_buffer(&file).map_err(|e| {
                    CommError::io(rank, format!("mapping {}", own_path.display()), e)
                })?,
            )
        };
        // Every rank has created its file.
        self.begin(call)?;
        let mut peers = Vec::with_capacity(self.world_size);
        for peer in 0..self.world_size {
            if peer == rank || bytes == 0 {
                peers.push(None);
                continue;
            }
            let path = self.buffer_path(id, peer);
            let file = OpenOptions::new().read(true).open(&path).map_err(|e| {
                CommError::io(rank, format!("opening rank {peer}'s {}", path.display()), e)
            })?;
            peers.push(Some(region::map_peer_buffer(&file).map_err(|e| {
                CommError::io(rank, format!("mapping rank {peer}'s {}", path.display()), e)
            })?));
        }
        self.buffers.insert(id, Arc::new(peers));
        // Every rank has mapped every file: the names can go.
        self.barrier_wait(call, false)?;
        Ok(own)
    }
}

/// True while process `pid` exists and is not a zombie.
fn process_alive(pid: u64) -> bool {
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

impl Engine for ShmEngine {
    fn name(&self) -> &'static str {
        "shm"
    }

    fn all_reduce(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        self.publish(call);
        let (n, rank) = (self.world_size, self.rank);
        let elem = dtype.size();
        let segment = (self.region.slot_bytes() / elem).max(1) * elem;
        if buf.is_empty() {
            return self.barrier_wait(call, true);
        }
        let mut first = true;
        for start in (0..buf.len()).step_by(segment) {
            let end = (start + segment).min(buf.len());
            let part = &mut buf[start..end];
            let len = part.len();
            let b = self.next_buffer();
            // Stage only the parts the peers reduce: this rank's own part is read from `part`.
            for peer in (0..n).filter(|&p| p != rank) {
                let theirs = chunk_bytes(len, elem, n, peer);
                self.region
                    .slot_mut(rank, b, theirs.start, theirs.len())
                    .copy_from_slice(&part[theirs]);
            }
            self.barrier_wait(call, first)?;
            first = false;
            let mine = chunk_bytes(len, elem, n, rank);
            for peer in (0..n).filter(|&p| p != rank) {
                let theirs = self.region.slot(peer, b, mine.start, mine.len());
                reduce_bytes(dtype, op, &mut part[mine.clone()], theirs);
            }
            if let Some(factor) = scale {
                scale_bytes(dtype, &mut part[mine.clone()], factor);
            }
            self.region
                .slot_mut(rank, b, mine.start, mine.len())
                .copy_from_slice(&part[mine.clone()]);
            self.barrier_wait(call, false)?;
            for peer in (0..n).filter(|&p| p != rank) {
                let theirs = chunk_bytes(len, elem, n, peer);
                part[theirs.clone()].copy_from_slice(self.region.slot(
                    peer,
                    b,
                    theirs.start,
                    theirs.len(),
                ));
            }
        }
        Ok(())
    }

    fn broadcast(&mut self, call: &CallDesc, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.publish(call);
        if buf.is_empty() {
            return self.barrier_wait(call, true);
        }
        let segment = self.region.slot_bytes();
        let mut first = true;
        for start in (0..buf.len()).step_by(segment) {
            let end = (start + segment).min(buf.len());
            let b = self.next_buffer();
            if self.rank == root {
                self.region
                    .slot_mut(root, b, 0, end - start)
                    .copy_from_slice(&buf[start..end]);
            }
            self.barrier_wait(call, first)?;
            first = false;
            if self.rank != root {
                buf[start..end].copy_from_slice(self.region.slot(root, b, 0, end - start));
            }
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), CommError> {
        self.publish(call);
        let block = input.len();
        output[self.rank * block..(self.rank + 1) * block].copy_from_slice(input);
        if block == 0 {
            return self.barrier_wait(call, true);
        }
        let segment = self.region.slot_bytes();
        let mut first = true;
        for start in (0..block).step_by(segment) {
            let end = (start + segment).min(block);
            let b = self.next_buffer();
            self.region
                .slot_mut(self.rank, b, 0, end - start)
                .copy_from_slice(&input[start..end]);
            self.barrier_wait(call, first)?;
            first = false;
            for peer in (0..self.world_size).filter(|&p| p != self.rank) {
                output[peer * block + start..peer * block + end].copy_from_slice(self.region.slot(
                    peer,
                    b,
                    0,
                    end - start,
                ));
            }
        }
        Ok(())
    }

    fn reduce_scatter(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.publish(call);
        let (n, rank) = (self.world_size, self.rank);
        let elem = dtype.size();
        let parts: Vec<_> = (0..n)
            .map(|p| chunk_bytes(input.len(), elem, n, p))
            .collect();
        let longest = parts.iter().map(|p| p.len()).max().unwrap_or(0);
        output.copy_from_slice(&input[parts[rank].clone()]);
        if longest == 0 {
            return self.barrier_wait(call, true);
        }
        // Each slot holds one sub-block of every part.
        let step = (self.region.slot_bytes() / n / elem).max(1) * elem;
        let mut first = true;
        for offset in (0..longest).step_by(step) {
            let b = self.next_buffer();
            for (p, part) in parts.iter().enumerate().filter(|&(p, _)| p != rank) {
                let end = (offset + step).min(part.len());
                if offset < end {
                    self.region
                        .slot_mut(rank, b, p * step, end - offset)
                        .copy_from_slice(&input[part.start + offset..part.start + end]);
                }
            }
            self.barrier_wait(call, first)?;
            first = false;
            let end = (offset + step).min(parts[rank].len());
            if offset < end {
                for peer in (0..n).filter(|&p| p != rank) {
                    let theirs = self.region.slot(peer, b, rank * step, end - offset);
                    reduce_bytes(dtype, op, &mut output[offset..end], theirs);
                }
            }
        }
        Ok(())
    }

    fn barrier(&mut self, call: &CallDesc) -> Result<(), CommError> {
        self.begin(call)
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn create_shared(
        &mut self,
        call: &CallDesc,
        bytes: usize,
    ) -> Result<Option<MmapMut>, CommError> {
        let id = call.buffer.unwrap_or(u32::MAX);
        let result = self.create_shared_inner(call, id, bytes);
        // Whatever happened, no name stays in /dev/shm: mappings keep the memory alive.
        let _ = std::fs::remove_file(self.buffer_path(id, self.rank));
        result
    }

    fn all_reduce_shared(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        let (n, rank) = (self.world_size, self.rank);
        let peers = match call.buffer.and_then(|id| self.buffers.get(&id)) {
            Some(peers) => Arc::clone(peers),
            None => {
                return Err(CommError::Usage {
                    op: call.op.name(),
                    rank,
                    reason: "this buffer was not allocated by this group".into(),
                });
            }
        };
        if buf.len() <= IN_PLACE_MIN_BYTES {
            // Latency-bound: two barriers through the slots beat three in place.
            return self.all_reduce(call, buf, dtype, op, scale);
        }
        // Phase 1: every rank's input is in place.
        self.begin(call)?;
        if buf.is_empty() {
            return Ok(());
        }
        let len = buf.len();
        let elem = dtype.size();
        let peer = |p: usize, range: std::ops::Range<usize>| -> &[u8] {
            peers[p].as_ref().map_or(&[][..], |map| &map[range])
        };
        // Phase 2: reduce this rank's part from every peer's buffer, in place.
        let mine = chunk_bytes(len, elem, n, rank);
        for p in (0..n).filter(|&p| p != rank) {
            reduce_bytes(dtype, op, &mut buf[mine.clone()], peer(p, mine.clone()));
        }
        if let Some(factor) = scale {
            scale_bytes(dtype, &mut buf[mine], factor);
        }
        self.barrier_wait(call, false)?;
        // Phase 3: copy the other parts from their owners.
        for p in (0..n).filter(|&p| p != rank) {
            let theirs = chunk_bytes(len, elem, n, p);
            buf[theirs.clone()].copy_from_slice(peer(p, theirs));
        }
        // Phase 4: nobody reads this rank's buffer any more, so the caller may write it.
        self.barrier_wait(call, false)
    }

    fn abort(&mut self, error: &CommError) {
        self.region.set_abort(self.rank, &error.to_string());
    }
}
