//! The epoch order of a data set read in pieces (Parquet row groups, files): items of a piece
//! are cheap to read together and dear to read apart, so the order keeps them close.
//!
//! The pieces are shuffled with `(seed, epoch)`; consecutive pieces of that order form blocks
//! of at least `shuffle_rows` items (the shuffle buffer), and each block's items are shuffled
//! among themselves. With [`DistributedSampler`](crate::DistributedSampler) each rank then
//! reads a contiguous stretch of this order, so it reads its own pieces (and at most the two
//! it shares with its neighbours) instead of every piece. A pure function, like
//! [`epoch_order`]: part of the resume contract.

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
    pub fn epoch_order(&self, shuffle: bool, seed: u64, epoch: u64) -> Vec<usize> {
        let mut starts = Vec::with_capacity(self.lens.len());
        let mut total = 0usize;
        for &len in self.lens.iter() {
            starts.push(total);
            total = total.saturating_add(len);
        }
        if !shuffle {
            return (0..total).collect();
        }
        let pieces = epoch_order(self.lens.len(), true, seed, epoch);
        // A stream of its own: the items' shuffle never changes the pieces' order.
        let mut rng = epoch_rng(seed ^ 0x5851_F42D_4C95_7F2D, epoch);
        let mut order = Vec::with_capacity(total);
        let mut block_start = 0;
        for piece in pieces {
            order.extend(starts[piece]..starts[piece] + self.lens[piece]);
            if order.len() - block_start >= self.shuffle_rows {
                shuffle_tail(&mut order[block_start..], &mut rng);
                block_start = order.len();
            }
        }
        shuffle_tail(&mut order[block_start..], &mut rng);
        order
    }
}

/// Fisher-Yates over `items`.
fn shuffle_tail(items: &mut [usize], rng: &mut SplitMix64) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
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
    /// What `order` has left once the ranks consumed their batches: the unread rest of each
    /// rank's contiguous share, in rank order, then the last round's items (unread, since a
    /// run that read its last round finished the epoch).
    pub fn remainder(&self, order: &[usize]) -> Vec<usize> {
        let (world, b) = (self.world_size.max(1), self.rank_batch_size.max(1));
        let full = order.len() / (world * b);
        let share = full * b;
        let read = self.batches.min(full) * b;
        let mut rest = Vec::with_capacity(order.len() - world * read);
        for rank in 0..world {
            rest.extend_from_slice(&order[rank * share + read..(rank + 1) * share]);
        }
        rest.extend_from_slice(&order[world * share..]);
        rest
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
        let order: Vec<usize> = (0..23).collect();
        let consumed = ConsumedShares {
            world_size: 2,
            rank_batch_size: 3,
            batches: 2,
        };
        // Shares of 9 (3 full batches each): ranks read 0..6 and 9..15; the last round is
        // 18..23.
        assert_eq!(
            consumed.remainder(&order),
            [6, 7, 8, 15, 16, 17, 18, 19, 20, 21, 22]
        );
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
