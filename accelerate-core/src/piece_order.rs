//! The epoch order of a data set read in pieces (Parquet row groups, files): items of a piece
//! are cheap to read together and dear to read apart, so the order keeps them close.
//!
//! The pieces are shuffled with `(seed, epoch)`; consecutive pieces of that order form blocks
//! of at least `shuffle_rows` items (the shuffle buffer), and each block's items are shuffled
//! among themselves. With [`DistributedSampler`](crate::DistributedSampler) each rank then
//! reads a contiguous stretch of this order, so it reads its own pieces (and at most the two
//! it shares with its neighbours) instead of every piece. A pure function, like
//! [`epoch_order`]: part of the resume contract.

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::sampler::{SplitMix64, epoch_order, epoch_rng};

/// How a data set is cut into pieces, and the shuffle buffer over them.
///
/// Saved in checkpoints as the number of pieces, a digest of their lengths and the buffer
/// size (not the lengths themselves), which is what a resume compares.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PieceLayout {
    /// Items per piece, in data-set order (empty when read back from a checkpoint).
    #[serde(skip)]
    lens: Arc<[usize]>,
    /// Pieces.
    pub count: usize,
    /// FNV-1a of the lengths.
    pub digest: u64,
    /// Items shuffled together at least (1: pieces shuffled, items in piece order).
    pub shuffle_rows: usize,
}

impl PartialEq for PieceLayout {
    fn eq(&self, other: &Self) -> bool {
        (self.count, self.digest, self.shuffle_rows)
            == (other.count, other.digest, other.shuffle_rows)
    }
}

impl Eq for PieceLayout {}

impl PieceLayout {
    /// Pieces of `lens` items each, in data-set order, shuffled in blocks of at least
    /// `shuffle_rows` items (at least 1).
    pub fn new(lens: impl Into<Arc<[usize]>>, shuffle_rows: usize) -> Self {
        let lens = lens.into();
        let digest = lens.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, &len| {
            (len as u64).to_le_bytes().iter().fold(hash, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
        });
        Self {
            count: lens.len(),
            digest,
            shuffle_rows: shuffle_rows.max(1),
            lens,
        }
    }

    /// Items per piece (empty for a layout read back from a checkpoint).
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Items in all pieces (`None` on overflow).
    pub fn total(&self) -> Option<usize> {
        self.lens.iter().try_fold(0usize, |n, &l| n.checked_add(l))
    }

    /// The items of epoch `epoch` in the order the pieces give them: pieces shuffled, items
    /// shuffled within blocks of consecutive pieces; all in data-set order without `shuffle`.
    /// The whole epoch in memory: loaders read it through [`cursor`](Self::cursor) instead.
    pub fn epoch_order(&self, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
        let mut cursor = self.cursor(shuffle, seed, epoch);
        let total = self.total().unwrap_or(0);
        (0..total).map(|position| cursor.at(position)).collect()
    }

    /// The order of [`epoch_order`](Self::epoch_order), made one block at a time as its
    /// positions are asked for.
    pub fn cursor(&self, shuffle: bool, seed: u64, epoch: u64) -> PieceCursor {
        let mut starts = Vec::with_capacity(self.lens.len());
        let mut total = 0usize;
        for &len in self.lens.iter() {
            starts.push(total);
            total = total.saturating_add(len);
        }
        PieceCursor {
            lens: Arc::clone(&self.lens),
            starts: starts.into(),
            pieces: epoch_order(self.lens.len(), shuffle, seed, epoch).into(),
            shuffle,
            shuffle_rows: self.shuffle_rows,
            epoch: (seed, epoch),
            rng: block_rng(seed, epoch),
            next_piece: 0,
            block_start: 0,
            block: Vec::new(),
        }
    }
}

/// The items' shuffle draws a stream of its own: it never changes the pieces' order.
fn block_rng(seed: u64, epoch: u64) -> SplitMix64 {
    epoch_rng(seed ^ 0x5851_F42D_4C95_7F2D, epoch)
}

/// One epoch's [piece order](PieceLayout::epoch_order), read by position: it holds the pieces'
/// order and the block being read, never the epoch, so its memory depends on the number of
/// pieces and the shuffle buffer, not on the number of items.
///
/// Reading forward is the fast way: a block before the one asked for is skipped by drawing
/// its random numbers without placing its items; reading backward starts the epoch again.
#[derive(Debug, Clone)]
pub struct PieceCursor {
    lens: Arc<[usize]>,
    /// The data-set index of each piece's first item.
    starts: Arc<[usize]>,
    /// The pieces in this epoch's order.
    pieces: Arc<[usize]>,
    shuffle: bool,
    shuffle_rows: usize,
    /// Seed and epoch, to start again.
    epoch: (u64, u64),
    rng: SplitMix64,
    /// The first piece (in `pieces`) after the current block.
    next_piece: usize,
    /// The epoch position of the current block's first item.
    block_start: usize,
    /// The current block's items, shuffled.
    block: Vec<usize>,
}

impl PieceCursor {
    /// The data-set index at `position` of the epoch's order (`position` is below the number of
    /// items; past them, `position` itself).
    pub fn at(&mut self, position: usize) -> usize {
        if !self.shuffle {
            return position;
        }
        if position < self.block_start {
            self.next_piece = 0;
            self.block_start = 0;
            self.block.clear();
            self.rng = block_rng(self.epoch.0, self.epoch.1);
        }
        loop {
            if let Some(&item) = self.block.get(position - self.block_start) {
                return item;
            }
            self.block_start += self.block.len();
            self.block.clear();
            if self.next_piece >= self.pieces.len() {
                return position;
            }
            // A block: consecutive pieces holding at least `shuffle_rows` items, or the rest.
            let first = self.next_piece;
            let mut len = 0usize;
            while let Some(&piece) = self.pieces.get(self.next_piece) {
                self.next_piece += 1;
                len = len.saturating_add(self.lens[piece]);
                if len >= self.shuffle_rows {
                    break;
                }
            }
            if position >= self.block_start.saturating_add(len) {
                // Not asked for: only its draws, so that the next block's are the same.
                for i in (1..len).rev() {
                    self.rng.below(i as u64 + 1);
                }
                self.block_start += len;
                continue;
            }
            for &piece in &self.pieces[first..self.next_piece] {
                let start = self.starts[piece];
                self.block.extend(start..start + self.lens[piece]);
            }
            shuffle_tail(&mut self.block, &mut self.rng);
        }
    }
}

/// Fisher-Yates over `items`.
fn shuffle_tail(items: &mut [usize], rng: &mut SplitMix64) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

/// Positions of an epoch's order, as increasing ranges that do not touch: what is left of an
/// epoch to read after a run stopped in it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Positions {
    ranges: Vec<Range<usize>>,
}

impl Positions {
    /// The positions `range`.
    pub fn range(range: Range<usize>) -> Self {
        let mut positions = Self::default();
        positions.push(range);
        positions
    }

    /// How many positions.
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// The positions, in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.ranges.iter().flat_map(Range::clone)
    }

    /// The ranges, in order.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// The positions at indices `indices` of this list.
    pub fn slice(&self, indices: Range<usize>) -> Self {
        let mut out = Self::default();
        let mut first = 0;
        for range in &self.ranges {
            let (from, to) = (
                indices.start.max(first),
                indices.end.min(first + range.len()),
            );
            if from < to {
                out.push(range.start + from - first..range.start + to - first);
            }
            first += range.len();
        }
        out
    }

    /// Appends `range` (after every position held).
    fn push(&mut self, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        match self.ranges.last_mut() {
            Some(last) if last.end == range.start => last.end = range.end,
            _ => self.ranges.push(range),
        }
    }
}

/// What the ranks of one run consumed of an epoch before it stopped: `batches` batches of
/// `rank_batch_size` items each, on each of `world_size` ranks. Kept in checkpoints of
/// loaders read in pieces that were resumed on another number of processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumedShares {
    /// Ranks of that run.
    pub world_size: usize,
    /// Items per batch and rank in that run.
    pub rank_batch_size: usize,
    /// Batches each rank consumed.
    pub batches: usize,
}

impl ConsumedShares {
    /// What the positions `rest` have left once the ranks consumed their batches: the unread
    /// rest of each rank's contiguous share, in rank order, then the last round's positions
    /// (unread, since a run that read its last round finished the epoch).
    pub fn remainder(&self, rest: &Positions) -> Positions {
        let (world, b) = (self.world_size.max(1), self.rank_batch_size.max(1));
        let len = rest.len();
        let full = len / (world * b);
        let share = full * b;
        let read = self.batches.min(full) * b;
        let mut left = Positions::default();
        let shares = (0..world).map(|rank| rank * share + read..(rank + 1) * share);
        for indices in shares.chain(std::iter::once(world * share..len)) {
            for range in rest.slice(indices).ranges {
                left.push(range);
            }
        }
        left
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_is_frozen() {
        // Part of the resume contract: changing these numbers breaks existing checkpoints.
        let layout = PieceLayout::new(vec![3, 2, 4], 4);
        // Pieces in the order 0, 2, 1: a block of pieces 0 and 2 (7 >= 4 items), then piece 1.
        assert_eq!(layout.epoch_order(true, 42, 0), [2, 7, 8, 5, 6, 0, 1, 4, 3]);
        assert_eq!(layout.epoch_order(false, 42, 0), (0..9).collect::<Vec<_>>());
    }

    #[test]
    fn blocks_keep_their_pieces_together_and_every_item_comes_once() {
        let lens: Vec<usize> = (0..40).map(|i| 1 + (i * 7) % 13).collect();
        let layout = PieceLayout::new(lens.clone(), 20);
        let total = layout.total().unwrap();
        let order = layout.epoch_order(true, 3, 5);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..total).collect::<Vec<_>>());
        // The order is the blocks of the shuffled pieces, one after the other, each block's
        // items (its whole pieces) among themselves.
        let starts: Vec<usize> = lens
            .iter()
            .scan(0, |total, &l| {
                *total += l;
                Some(*total - l)
            })
            .collect();
        let (mut at, mut block) = (0, Vec::new());
        let pieces = epoch_order(lens.len(), true, 3, 5);
        for (i, &piece) in pieces.iter().enumerate() {
            block.extend(starts[piece]..starts[piece] + lens[piece]);
            if block.len() >= 20 || i + 1 == pieces.len() {
                let mut segment = order[at..at + block.len()].to_vec();
                segment.sort_unstable();
                block.sort_unstable();
                assert_eq!(segment, block);
                at += block.len();
                block.clear();
            }
        }
        assert_eq!(at, total);
        assert_ne!(order, layout.epoch_order(true, 3, 6));
    }

    #[test]
    fn the_remainder_is_every_unread_item_once() {
        let consumed = ConsumedShares {
            world_size: 2,
            rank_batch_size: 3,
            batches: 2,
        };
        // Shares of 9 (3 full batches each): ranks read 0..6 and 9..15; the last round is
        // 18..23.
        let rest = consumed.remainder(&Positions::range(0..23));
        assert_eq!(rest.ranges(), [6..9, 15..23]);
        // Again over what is left: 11 positions, shares of 3 (1 batch each), both read; the
        // last round (positions 18..23) is left.
        let again = ConsumedShares {
            batches: 1,
            ..consumed
        };
        assert_eq!(
            again.remainder(&rest).iter().collect::<Vec<_>>(),
            [18, 19, 20, 21, 22]
        );
        assert_eq!(rest.slice(2..5).ranges(), [8..9, 15..17]);
    }

    /// The epoch order made whole, the way the cursor must reproduce it.
    fn whole_order(layout: &PieceLayout, seed: u64, epoch: u64) -> Vec<usize> {
        let lens = layout.lens();
        let starts: Vec<usize> = lens
            .iter()
            .scan(0, |total, &l| {
                *total += l;
                Some(*total - l)
            })
            .collect();
        let mut rng = block_rng(seed, epoch);
        let (mut order, mut block_start) = (Vec::new(), 0);
        for piece in epoch_order(lens.len(), true, seed, epoch) {
            order.extend(starts[piece]..starts[piece] + lens[piece]);
            if order.len() - block_start >= layout.shuffle_rows {
                shuffle_tail(&mut order[block_start..], &mut rng);
                block_start = order.len();
            }
        }
        shuffle_tail(&mut order[block_start..], &mut rng);
        order
    }

    #[test]
    fn the_cursor_reads_the_whole_order_at_any_positions() {
        let mut rng = SplitMix64::new(9);
        for case in 0..200u64 {
            let pieces = rng.below(12) as usize;
            let lens: Vec<usize> = (0..pieces).map(|_| rng.below(7) as usize).collect();
            let layout = PieceLayout::new(lens, 1 + rng.below(15) as usize);
            let order = whole_order(&layout, case, 3);
            let mut cursor = layout.cursor(true, case, 3);
            // Forward with gaps (skipped blocks), then backward (a new start).
            let mut position = 0;
            while position < order.len() {
                assert_eq!(cursor.at(position), order[position], "case {case}");
                position += 1 + rng.below(6) as usize;
            }
            for position in (0..order.len()).rev().step_by(3) {
                assert_eq!(cursor.at(position), order[position], "case {case}");
            }
        }
    }

    #[test]
    fn layouts_compare_by_what_a_checkpoint_keeps() {
        let a = PieceLayout::new(vec![1, 2, 3], 8);
        let back: PieceLayout = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        assert_eq!(a, back);
        assert!(back.lens().is_empty());
        assert_ne!(a, PieceLayout::new(vec![1, 3, 2], 8));
    }
}
