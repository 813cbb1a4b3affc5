//! The shared mapping and every raw access to it: the only unsafe code of the shared-memory
//! transport.
//!
//! # Layout
//!
//! ```text
//! [ control block rank 0 | ... | control block rank n-1 | slots rank 0 (2 x slot) | ... ]
//! ```
//!
//! A control block is [`CONTROL_BYTES`] bytes, each field on its own cache line where another
//! rank polls it:
//!
//! | offset | field | written by | read by |
//! |---|---|---|---|
//! | 0 | `pid` | its rank, once at set-up | peers' liveness checks |
//! | 8 | `pid_namespace` | its rank, once at set-up, before `pid` | peers, to know whether `pid` is theirs to check |
//! | 64 | `arrived` (barrier counter) | its rank, `Release` | all ranks, `Acquire` |
//! | 128 | `call[2]` (4 words each, by call parity) | its rank, before `arrived` | all ranks, after `arrived` |
//! | 192 | `doorbell` (rank 0's block only, a futex) | any rank that arrives while someone sleeps | sleeping ranks |
//! | 196 | `sleepers` (rank 0's block only) | ranks about to sleep, and after | arriving ranks |
//! | 224 | `cookie` (rank 0's block only, 16 bytes) | rank 0, before the segment is mapped | the rendezvous probe |
//! | 256 | `aborted` flag (0, then 2 while posting, then 1) | its rank, `Release`, after `reason` | all ranks |
//! | 320 | `reason` length + bytes | its rank | all ranks, after `aborted` |
//!
//! Data slots are plain bytes. The barrier protocol (see the module `engine`) guarantees that a
//! slot region is never written while another rank reads it: a rank writes only its own slots,
//! and readers read a slot only between two barriers that its writer also passes.

// This module is where the transport touches shared memory; see each SAFETY comment.
#![allow(unsafe_code)]

use std::fs::File;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::{Mmap, MmapMut, MmapOptions};

/// Bytes of one rank's control block.
pub const CONTROL_BYTES: usize = 1024;
const PID: usize = 0;
const PID_NAMESPACE: usize = 8;
const ARRIVED: usize = 64;
const CALL: usize = 128;
const DOORBELL: usize = 192;
const SLEEPERS: usize = 196;
/// Rank 0's block: 16 random bytes rank 0 writes before anyone maps the segment, which the
/// others read back to prove they opened the same segment.
pub const COOKIE: usize = 224;
const ABORTED: usize = 256;
/// The abort flag's values: a reason is posted (readable), or being written.
const POSTED: u64 = 1;
const POSTING: u64 = 2;
const REASON_LEN: usize = 320;
const REASON: usize = 328;
/// Longest abort reason kept, in bytes.
pub const REASON_CAPACITY: usize = CONTROL_BYTES - REASON;

/// A mapped shared-memory segment of `ranks` control blocks and `ranks x 2` slots.
pub struct Region {
    map: MmapMut,
    ranks: usize,
    slot_bytes: usize,
}

impl Region {
    /// Total bytes of a segment for `ranks` ranks and slots of `slot_bytes`; an error where
    /// that overflows (a world size or slot size no machine has), so that no slot offset can
    /// wrap past the mapping.
    pub fn size(ranks: usize, slot_bytes: usize) -> std::io::Result<usize> {
        ranks
            .checked_mul(CONTROL_BYTES)
            .zip(ranks.checked_mul(2).and_then(|s| s.checked_mul(slot_bytes)))
            .and_then(|(control, slots)| control.checked_add(slots))
            .filter(|&len| isize::try_from(len).is_ok())
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!(
                        "a segment for {ranks} ranks with slots of {slot_bytes} bytes does not fit \
                         in memory; hint: lower ACCELERATE_SHM_SLOT_BYTES"
                    ),
                )
            })
    }

    /// Maps `file`, which must be [`Region::size`] bytes long.
    pub fn map(file: &File, ranks: usize, slot_bytes: usize) -> std::io::Result<Self> {
        // SAFETY: the file is a private /dev/shm segment of this group; it is never truncated
        // while mapped (its size is set once, before any rank maps it), so the mapping stays
        // valid for the lifetime of `map`.
        let expected = Self::size(ranks, slot_bytes)?;
        let map = unsafe { MmapMut::map_mut(file)? };
        if map.len() < expected {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("the segment has {} bytes, {expected} expected", map.len()),
            ));
        }
        Ok(Self {
            map,
            ranks,
            slot_bytes,
        })
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn word(&self, rank: usize, offset: usize) -> &AtomicU64 {
        assert!(rank < self.ranks);
        control_word(&self.map, rank, offset)
    }

    fn word32(&self, offset: usize) -> &AtomicU32 {
        assert!(offset + 4 <= CONTROL_BYTES && offset.is_multiple_of(4));
        // SAFETY: `offset` is 4-aligned and inside rank 0's control block, which `map` covers;
        // the word is only ever accessed atomically, by every process.
        unsafe { &*(self.map.as_ptr().add(offset) as *const AtomicU32) }
    }

    /// The group's doorbell: bumped (and woken) when a rank arrives while others sleep.
    pub fn doorbell(&self) -> &AtomicU32 {
        self.word32(DOORBELL)
    }

    /// How many ranks are sleeping on the doorbell, or about to.
    pub fn sleepers(&self) -> &AtomicU32 {
        self.word32(SLEEPERS)
    }

    /// Rank `rank`'s process id.
    pub fn pid(&self, rank: usize) -> &AtomicU64 {
        self.word(rank, PID)
    }

    /// Rank `rank`'s PID namespace (the inode of its `/proc/self/ns/pid`; 0 when unknown):
    /// its pid means something to this process only when the namespaces match. Written
    /// before the pid.
    pub fn pid_namespace(&self, rank: usize) -> &AtomicU64 {
        self.word(rank, PID_NAMESPACE)
    }

    /// Rank `rank`'s barrier counter.
    pub fn arrived(&self, rank: usize) -> &AtomicU64 {
        self.word(rank, ARRIVED)
    }

    /// Word `i` (0..4) of the call rank `rank` published for parity `parity`.
    pub fn call_word(&self, rank: usize, parity: usize, i: usize) -> &AtomicU64 {
        self.word(rank, CALL + (parity % 2) * 32 + i * 8)
    }

    /// Rank `rank`'s abort reason, if it raised its flag.
    pub fn abort_reason(&self, rank: usize) -> Option<String> {
        if self.word(rank, ABORTED).load(Ordering::Acquire) != POSTED {
            return None;
        }
        let len =
            (self.word(rank, REASON_LEN).load(Ordering::Relaxed) as usize).min(REASON_CAPACITY);
        let mut bytes = Vec::with_capacity(len + 8);
        for i in 0..len.div_ceil(8) {
            bytes.extend_from_slice(
                &self
                    .word(rank, REASON + i * 8)
                    .load(Ordering::Relaxed)
                    .to_le_bytes(),
            );
        }
        bytes.truncate(len);
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn slot_offset(&self, rank: usize, buffer: usize, offset: usize, len: usize) -> usize {
        assert!(rank < self.ranks && buffer < 2 && offset + len <= self.slot_bytes);
        self.ranks * CONTROL_BYTES + (rank * 2 + buffer) * self.slot_bytes + offset
    }

    /// Bytes `offset..offset + len` of slot `buffer` of rank `rank`, to read.
    ///
    /// Callers uphold the barrier protocol: the slot's owner does not write this range until
    /// every rank has passed the barrier that follows this read.
    pub fn slot(&self, rank: usize, buffer: usize, offset: usize, len: usize) -> &[u8] {
        let at = self.slot_offset(rank, buffer, offset, len);
        // SAFETY: in bounds (checked in `slot_offset`); by the barrier protocol no process
        // writes these bytes while this shared borrow lives (see the module docs).
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at), len) }
    }

    /// Copies `bytes` into this rank's own slot `buffer` at `offset`.
    ///
    /// `&mut self`: no [`slot`](Self::slot) borrow of this process is alive meanwhile. Callers
    /// uphold the barrier protocol for the other processes: `rank` is the calling rank, and no
    /// rank reads this range until the next barrier.
    pub fn write_slot(&mut self, rank: usize, buffer: usize, offset: usize, bytes: &[u8]) {
        let at = self.slot_offset(rank, buffer, offset, bytes.len());
        // SAFETY: in bounds (checked in `slot_offset`); a raw copy into the slot's range only,
        // never a `&mut` over the mapping, whose control blocks other processes write; `bytes`
        // is this process's memory, so the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.map.as_mut_ptr().add(at),
                bytes.len(),
            );
        }
    }
}

/// Control word `offset` of rank `rank`'s block in `map`, which must cover that block.
fn control_word(map: &MmapMut, rank: usize, offset: usize) -> &AtomicU64 {
    assert!(offset + 8 <= CONTROL_BYTES && offset.is_multiple_of(8));
    let at = rank * CONTROL_BYTES + offset;
    assert!(at + 8 <= map.len());
    // SAFETY: `at` is 8-aligned (the mapping is page-aligned, CONTROL_BYTES and `offset`
    // are multiples of 8) and in bounds (checked above). Control words are only ever accessed
    // atomically, by every process and by both mappings of a segment.
    unsafe { &*(map.as_ptr().add(at) as *const AtomicU64) }
}

/// Where this rank posts why it failed, in a segment: a second mapping of the control blocks
/// alone, shared by the process's threads, so that a failure in another group of the job can
/// be told to this group's peers while this group's engine (owner of the whole mapping) is
/// busy in a collective.
pub struct AbortBoard {
    map: MmapMut,
    rank: usize,
}

impl AbortBoard {
    /// Maps the control blocks of `file`, a segment of `ranks` ranks, for rank `rank`.
    pub fn map(file: &File, ranks: usize, rank: usize) -> std::io::Result<Self> {
        let len = ranks
            .checked_mul(CONTROL_BYTES)
            .filter(|_| rank < ranks)
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("rank {rank} of a segment of {ranks} ranks"),
                )
            })?;
        // SAFETY: as in `Region::map`: the segment's size never changes while it is mapped,
        // and it is at least `len` bytes (checked by the caller's `Region::map` of it).
        let map = unsafe { MmapOptions::new().len(len).map_mut(file)? };
        Ok(Self { map, rank })
    }
}

impl crate::comm::engine::AbortNotice for AbortBoard {
    /// Posts this rank's reason and raises its flag, unless a reason is posted already: the
    /// peers read the first failure, which the later ones follow from.
    fn tell(&self, reason: &str) {
        let flag = control_word(&self.map, self.rank, ABORTED);
        if flag
            .compare_exchange(0, POSTING, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        let bytes = &reason.as_bytes()[..reason.len().min(REASON_CAPACITY)];
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            control_word(&self.map, self.rank, REASON + i * 8)
                .store(u64::from_le_bytes(word), Ordering::Relaxed);
        }
        control_word(&self.map, self.rank, REASON_LEN).store(bytes.len() as u64, Ordering::Relaxed);
        flag.store(POSTED, Ordering::Release);
    }
}

/// Maps this rank's shared buffer file, writable.
pub fn map_own_buffer(file: &File) -> std::io::Result<MmapMut> {
    // SAFETY: the file is this rank's private buffer file, sized once before mapping and
    // never truncated. Peers map it read-only and read it only between barriers at which
    // this rank does not write the bytes they read (see `ShmEngine::all_reduce_shared`).
    unsafe { MmapMut::map_mut(file) }
}

/// Maps a peer's shared buffer file, read-only.
pub fn map_peer_buffer(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: as for `map_own_buffer`: the file's size never changes while mapped, and this
    // rank reads a range of it only while its owner, by the barrier protocol, leaves that
    // range alone.
    unsafe { Mmap::map(file) }
}
