//! The progress board of one host: what each local rank of an MPI job is doing, in shared
//! memory, so that its peers (and their watchdogs) can see it without asking MPI. The only
//! unsafe code of the engine besides the calls into MPI.
//!
//! # Layout
//!
//! One [`LINE`]-byte line per local rank, every field an atomic u64 written by its rank only:
//!
//! | offset | field |
//! |---|---|
//! | 0 | pid |
//! | 8 | heartbeat: bumped by the rank's watchdog every tick |
//! | 16 | `seq + 1` of the call the rank entered last (0: none) |
//! | 24 | `seq + 1` of the call it left last |
//! | 64 | the last [`HISTORY`] calls: `seq + 1` then the 4 packed words, at `seq % HISTORY` |
//!
//! A call is written before its rank enters MPI, into its own line only: nothing on the hot
//! path touches another core's cache line (reading a peer's line after every call would cost
//! two cross-core misses, a fifth of a 4 KiB all-reduce). The watchdogs compare the lines. A
//! reader takes a history entry only when its sequence word reads the same before and after
//! the call words (a seqlock): the writer zeroes it, fences (`Release`), writes the words,
//! then publishes the sequence with `Release`. An entry is overwritten [`HISTORY`] calls later; an entry already
//! overwritten is simply not compared.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering, fence};

use memmap2::MmapMut;

use crate::comm::call::CallDesc;

/// Calls each rank keeps on the board.
pub const HISTORY: usize = 1024;
const ENTRY: usize = 40;
/// Bytes of a rank's line.
pub const LINE: usize = 64 + HISTORY * ENTRY + 64;
const PID: usize = 0;
const HEARTBEAT: usize = 8;
const ENTERED: usize = 16;
const LEFT: usize = 24;
const CALLS: usize = 64;

/// Where the board's words live: a mapping shared by the ranks of this host, or, without
/// shared memory, this process's own copy (one line: only this rank is on it).
enum Memory {
    Shared(MmapMut),
    Private(Box<[AtomicU64]>),
}

/// One host's progress board.
pub struct Board {
    memory: Memory,
    /// This rank's line.
    mine: usize,
    /// Global rank of each line.
    ranks: Vec<usize>,
}

impl Board {
    /// Bytes of a board for `local` ranks.
    pub fn bytes(local: usize) -> usize {
        local * LINE
    }

    /// Maps the board file of this host (created by its first local rank), on line `mine` of
    /// the lines of global ranks `ranks`.
    pub fn map(file: &std::fs::File, mine: usize, ranks: Vec<usize>) -> std::io::Result<Self> {
        // SAFETY: a private file (0600, ours, checked by `open_private`) sized once before
        // mapping and never truncated; every access below is atomic.
        let map = unsafe { MmapMut::map_mut(file) }?;
        if map.len() < Self::bytes(ranks.len()) || mine >= ranks.len() {
            return Err(std::io::Error::other("the progress board is too small"));
        }
        Ok(Self::with(Memory::Shared(map), mine, ranks))
    }

    /// A board of this rank alone, in its own memory (no shared memory on this host).
    pub fn private(rank: usize) -> Self {
        let words = (0..LINE / 8).map(|_| AtomicU64::new(0)).collect();
        Self::with(Memory::Private(words), 0, vec![rank])
    }

    fn with(memory: Memory, mine: usize, ranks: Vec<usize>) -> Self {
        let board = Self {
            memory,
            mine,
            ranks,
        };
        board
            .word(mine, PID)
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        board
    }

    /// Whether the peers of this rank on this host can see the board.
    pub fn is_shared(&self) -> bool {
        matches!(self.memory, Memory::Shared(_))
    }

    /// Global ranks on the board, in line order.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// This rank's line.
    pub fn mine(&self) -> usize {
        self.mine
    }

    fn word(&self, line: usize, offset: usize) -> &AtomicU64 {
        let at = line * LINE + offset;
        match &self.memory {
            Memory::Shared(map) => {
                assert!(at + 8 <= map.len(), "board offset out of range");
                // SAFETY: in bounds (checked above), 8-aligned (the mapping is page-aligned,
                // lines and fields are multiples of 8 bytes), and only ever accessed
                // atomically, by every process that maps it.
                unsafe { &*map.as_ptr().add(at).cast::<AtomicU64>() }
            }
            Memory::Private(words) => &words[at / 8],
        }
    }

    /// Records `call` as entered (before MPI sees it).
    pub fn enter(&self, call: &CallDesc) {
        let entry = CALLS + (call.seq as usize % HISTORY) * ENTRY;
        let seq = self.word(self.mine, entry);
        seq.store(0, Ordering::Relaxed);
        // The seqlock's writer fence: a reader that sees any of the new words (and then its
        // Acquire fence) also sees the zeroed sequence, so it never takes new words under the
        // old sequence. Without it a weakly ordered CPU (ARM) may publish the words first.
        fence(Ordering::Release);
        for (i, w) in call.pack().iter().enumerate() {
            self.word(self.mine, entry + 8 * (i + 1))
                .store(*w, Ordering::Relaxed);
        }
        seq.store(call.seq + 1, Ordering::Release);
        self.word(self.mine, ENTERED)
            .store(call.seq + 1, Ordering::Release);
    }

    /// Records `call` as finished.
    pub fn leave(&self, call: &CallDesc) {
        self.word(self.mine, LEFT)
            .store(call.seq + 1, Ordering::Release);
    }

    /// Bumps this rank's heartbeat.
    pub fn beat(&self) {
        self.word(self.mine, HEARTBEAT)
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Line `line`'s heartbeat.
    pub fn heartbeat(&self, line: usize) -> u64 {
        self.word(line, HEARTBEAT).load(Ordering::Relaxed)
    }

    /// `seq + 1` of the call line `line` entered last.
    pub fn entered(&self, line: usize) -> u64 {
        self.word(line, ENTERED).load(Ordering::Acquire)
    }

    /// `seq + 1` of the call line `line` left last.
    pub fn left(&self, line: usize) -> u64 {
        self.word(line, LEFT).load(Ordering::Acquire)
    }

    /// Line `line`'s pid.
    pub fn pid(&self, line: usize) -> u64 {
        self.word(line, PID).load(Ordering::Relaxed)
    }

    /// The packed call line `line` made as call `seq`, if the board still holds it.
    pub fn call(&self, line: usize, seq: u64) -> Option<[u64; 4]> {
        let entry = CALLS + (seq as usize % HISTORY) * ENTRY;
        let word = |i: usize| self.word(line, entry + 8 * i);
        if word(0).load(Ordering::Acquire) != seq + 1 {
            return None;
        }
        let words = [1, 2, 3, 4].map(|i| word(i).load(Ordering::Relaxed));
        fence(Ordering::Acquire);
        (word(0).load(Ordering::Relaxed) == seq + 1).then_some(words)
    }

    /// This rank's call `seq`, if the board still holds it.
    pub fn my_call(&self, seq: u64) -> Option<CallDesc> {
        self.call(self.mine, seq).and_then(CallDesc::unpack)
    }

    /// The first of this rank's calls `seqs` (those still on the board) that a peer on this
    /// host made differently, as the mismatch error of this rank.
    pub fn first_mismatch(&self, seqs: std::ops::Range<u64>) -> Option<crate::error::CommError> {
        let oldest = seqs.end.saturating_sub(HISTORY as u64 / 2);
        (seqs.start.max(oldest)..seqs.end).find_map(|seq| {
            let call = self.my_call(seq)?;
            let (peer, theirs) = self.differing(&call)?;
            Some(super::agreement::named_mismatch(
                self.ranks[self.mine],
                &call,
                peer,
                theirs,
            ))
        })
    }

    /// The first other rank on this host whose call `call.seq` differs from `call`: its rank
    /// and its packed call.
    pub fn differing(&self, call: &CallDesc) -> Option<(usize, [u64; 4])> {
        let mine = call.pack();
        (0..self.ranks.len())
            .filter(|&line| line != self.mine)
            .find_map(|line| {
                let theirs = self.call(line, call.seq)?;
                (theirs != mine).then(|| (self.ranks[line], theirs))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::call::OpKind;

    #[test]
    fn calls_are_read_back_and_a_different_one_is_found() {
        let board = Board::private(3);
        let mut call = CallDesc::new(OpKind::AllReduce, 5);
        call.count = 7;
        board.enter(&call);
        assert_eq!(board.call(0, 5), Some(call.pack()));
        assert_eq!(board.call(0, 5 + HISTORY as u64), None);
        assert_eq!(board.entered(0), 6);
        board.leave(&call);
        assert_eq!(board.left(0), 6);
        // Alone on the board: nobody differs.
        assert_eq!(board.differing(&CallDesc::new(OpKind::Barrier, 5)), None);
    }
}
