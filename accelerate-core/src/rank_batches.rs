//! One rank's batches of an epoch, made as they are asked for: an iterator that holds where it
//! is in the epoch order, not the batches (nor, for data read in pieces, the order itself).
//!
//! [`DistributedSampler`](crate::DistributedSampler) decides what a rank reads (which positions
//! of the epoch order are left, how they are cut); this module turns that into batches.

use std::sync::Arc;

use crate::piece_order::{PieceCursor, Positions};
use crate::sampler::KeyedOrder;

/// One batch of one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankBatch {
    /// Data-set indices, in order.
    pub indices: Vec<usize>,
    /// How many of the trailing indices repeat earlier samples to even out the last round
    /// (`gather_for_metrics` drops them).
    pub padding: usize,
    /// True for this rank's last batch of the epoch.
    pub last: bool,
}

/// An epoch's order of data-set indices, read by position.
#[derive(Debug, Clone)]
pub(crate) enum EpochItems {
    /// The whole order (a shuffled map-style data set), kept in the vector it was drawn in:
    /// a slice `Arc` would copy it.
    Listed(Arc<Vec<usize>>),
    /// The data-set order.
    InOrder,
    /// A shuffled order computed at each position.
    Keyed(KeyedOrder),
    /// The piece order, made block by block.
    Pieces(PieceCursor),
}

impl EpochItems {
    /// The data-set index at `position` (below the epoch's length).
    fn at(&mut self, position: usize) -> usize {
        match self {
            Self::Listed(order) => order.get(position).copied().unwrap_or(position),
            Self::InOrder => position,
            Self::Keyed(order) => order.at(position),
            Self::Pieces(cursor) => cursor.at(position),
        }
    }
}

/// How a rank's batches are cut from what is left of the epoch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cut {
    /// This rank.
    pub rank: usize,
    /// Items per rank and batch.
    pub batch: usize,
    /// Ranks.
    pub world: usize,
    /// Batches this rank gets.
    pub count: usize,
    /// Complete rounds are contiguous shares (data read in pieces), not dealt round-robin.
    pub contiguous: bool,
    /// A short last round is filled by cycling from the epoch's start.
    pub pads: bool,
}

/// One rank's batches over what is left of an epoch, in order.
#[derive(Debug, Clone)]
pub struct RankBatches {
    cut: Cut,
    /// Positions of the epoch order still to read.
    rest: Positions,
    rest_len: usize,
    /// Items of the epoch order (the padding cycles over all of them).
    order_len: usize,
    /// Reads the positions of `rest`.
    items: EpochItems,
    /// Reads the padding, from the epoch's start.
    padding_items: EpochItems,
    /// The range of `rest` holding the last index read, and the index of its first position.
    located: (usize, usize),
    /// The next batch, and the one after the last.
    next: usize,
}

impl RankBatches {
    /// The batches of `cut` over the positions `rest` of an epoch order of `order_len` items.
    pub(crate) fn new(cut: Cut, items: EpochItems, rest: Positions, order_len: usize) -> Self {
        Self {
            cut,
            rest_len: rest.len(),
            rest,
            order_len,
            padding_items: items.clone(),
            items,
            located: (0, 0),
            next: 0,
        }
    }

    /// Without the first `skip` batches (none are made).
    pub(crate) fn skipping(mut self, skip: usize) -> Self {
        self.next = skip.min(self.cut.count);
        self
    }

    /// The data-set index at index `index` of the rest (indices asked for in increasing order
    /// are found without a search).
    fn rest_item(&mut self, index: usize) -> usize {
        let ranges = self.rest.ranges();
        let (mut range, mut first) = self.located;
        if index < first {
            (range, first) = (0, 0);
        }
        while let Some(r) = ranges.get(range)
            && index >= first + r.len()
        {
            first += r.len();
            range += 1;
        }
        self.located = (range, first);
        let position = ranges.get(range).map_or(index, |r| r.start + index - first);
        self.items.at(position)
    }
}

impl Iterator for RankBatches {
    type Item = RankBatch;

    fn next(&mut self) -> Option<RankBatch> {
        let Cut {
            rank,
            batch: b,
            world,
            count,
            contiguous,
            pads,
        } = self.cut;
        if self.next >= count {
            return None;
        }
        let k = self.next;
        self.next += 1;
        let full = self.rest_len / (world * b);
        let start = if contiguous && k < full {
            // A contiguous share of the complete rounds, then the last round.
            rank * full * b + k * b
        } else {
            k * world * b + rank * b
        };
        let end = start + b;
        let (indices, padding) = if end <= self.rest_len {
            ((start..end).map(|i| self.rest_item(i)).collect(), 0)
        } else if pads && self.order_len > 0 {
            // Cycle from the epoch's start (several times if the data is tiny).
            let indices = (start..end)
                .map(|i| match i.checked_sub(self.rest_len) {
                    None => self.rest_item(i),
                    Some(past) => self.padding_items.at(past % self.order_len),
                })
                .collect();
            let real = self.rest_len.saturating_sub(start).min(b);
            (indices, b - real)
        } else {
            let from = start.min(self.rest_len);
            (
                (from..self.rest_len).map(|i| self.rest_item(i)).collect(),
                0,
            )
        };
        Some(RankBatch {
            indices,
            padding,
            last: k + 1 == count,
        })
    }

    /// Skips `n` batches without making them (the positions are read lazily, so nothing is
    /// lost): prefetch threads walking every `workers`-th batch pay only for their own.
    fn nth(&mut self, n: usize) -> Option<RankBatch> {
        self.next = self.next.saturating_add(n).min(self.cut.count);
        self.next()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.cut.count - self.next;
        (left, Some(left))
    }
}

impl ExactSizeIterator for RankBatches {}
