//! ZeRO-2's shard of the window's gradient sum, lent to the gradient pipe for one backward
//! pass: each bucket of gradients the pipe completes is reduce-scattered straight onto the
//! ranks whose shards it covers and added to this rank's part, and the gradients are let go,
//! so that whole gradients never all exist at once (4P + 12P/N).
//!
//! Rank `r`'s shard is the padded flat range `[r*S, (r+1)*S)`; a bucket's parameters are
//! consecutive in that range, so the bucket meets one or a few ranks' shards, and each piece
//! of it is reduce-scattered onto the ranks that own its parts (the others' counts are zero).
//! Each element has the owner it has in the column-by-column reduce-scatter after backward,
//! which reduces it in the same order: the two give the same bits. (With contiguous shards a
//! piece mostly has one owner: over a ring that sends every byte through each link, as a
//! reduce does; the bytes each rank receives per step are those of the column path.)

use std::ops::Range;

use accelerate_kernels::reduce::{ReduceOp, reduce_f32};

use crate::error::AccelerateError;
use crate::group::Comm;
use crate::overlap::throttle::Throttle;
use crate::reducer::wire::Wire;

/// f32 elements of one piece of a bucket, over all the ranks together (1 MiB): what reducing a
/// bucket holds beside its gradients.
const PIECE_ELEMENTS: usize = 1 << 18;

/// One trained entry of a complete bucket, as the gradient pipe hands it on.
pub(crate) struct BucketGrad {
    /// Its layout entry.
    pub entry: usize,
    /// Its gradient (f32, its length); `None` where this process has none.
    pub grad: Option<Vec<f32>>,
    /// Bytes a tap counted on the throttle for it (0 if none).
    pub counted: usize,
}

/// This rank's shard of the window's sum and what reducing a bucket into it needs.
pub(crate) struct ShardSink {
    /// The flat range of each layout entry (`None`: not trained).
    flat: Vec<Option<Range<usize>>>,
    /// Elements of every rank's shard (`S`).
    shard_len: usize,
    /// This rank's shard of the window's sum (replaced by a window's first micro-batch).
    sum: Vec<f32>,
    /// The window's first micro-batch: its buckets replace the sum instead of adding to it.
    first: bool,
    /// Per layout entry: this process had a gradient for it in this micro-batch.
    had: Vec<bool>,
    /// The processes the shards are cut across.
    shard: Comm,
    /// Hybrid sharding: this process's counterparts in the other shard groups.
    replicas: Option<Comm>,
    wire: Wire,
    /// This rank's part of the latest bucket (kept between buckets).
    mine: Vec<f32>,
}

/// How a [`ShardSink`] is made (by the reducer that lends its shard).
pub(crate) struct ShardSinkParts {
    pub flat: Vec<Option<Range<usize>>>,
    pub shard_len: usize,
    pub sum: Vec<f32>,
    pub first: bool,
    pub shard: Comm,
    pub replicas: Option<Comm>,
    pub wire: Wire,
}

impl ShardSink {
    pub fn new(parts: ShardSinkParts) -> Self {
        let entries = parts.flat.len();
        Self {
            flat: parts.flat,
            shard_len: parts.shard_len,
            sum: parts.sum,
            first: parts.first,
            had: vec![false; entries],
            shard: parts.shard,
            replicas: parts.replicas,
            wire: parts.wire,
            mine: Vec::new(),
        }
    }

    /// The rank errors name.
    pub fn rank(&self) -> usize {
        self.shard.rank()
    }

    /// Reduces one bucket into the shards: `grads` are the bucket's trained layout entries
    /// (consecutive, in layout order), each with its gradient or none (zeros go in its
    /// place). Every rank calls it with the same entries. The bucket goes in pieces of at
    /// most [`PIECE_ELEMENTS`], each gradient let go (and its bytes counted off `throttle`)
    /// once its last piece is sent: beside the gradients, a bucket holds one piece.
    pub fn reduce(
        &mut self,
        mut grads: Vec<BucketGrad>,
        throttle: Option<&Throttle>,
    ) -> Result<(), AccelerateError> {
        let rank = self.rank();
        let mut ranges: Vec<Range<usize>> = Vec::with_capacity(grads.len());
        for bucket_grad in &grads {
            let range = self.flat.get(bucket_grad.entry).cloned().flatten();
            let follows = match (ranges.last(), &range) {
                (Some(previous), Some(range)) => previous.end == range.start,
                (None, Some(_)) => true,
                (_, None) => false,
            };
            match range {
                Some(range) if follows => ranges.push(range),
                _ => return Err(AccelerateError::UnexpectedGradients { rank }),
            }
            if let Some(had) = self.had.get_mut(bucket_grad.entry) {
                *had = bucket_grad.grad.is_some();
            }
        }
        let (Some(first), Some(last)) = (ranges.first(), ranges.last()) else {
            return Ok(());
        };
        let bucket = first.start..last.end;
        let mut piece = Vec::new();
        // The first gradient not yet let go.
        let mut kept = 0;
        let mut start = bucket.start;
        while start < bucket.end {
            let end = start.saturating_add(PIECE_ELEMENTS).min(bucket.end);
            piece.clear();
            piece.resize(end - start, 0.0);
            for (range, bucket_grad) in ranges.iter().zip(&grads).skip(kept) {
                if range.start >= end {
                    break;
                }
                let (from, to) = (range.start.max(start), range.end.min(end));
                if let Some(grad) = bucket_grad.grad.as_ref().filter(|_| from < to) {
                    piece[from - start..to - start]
                        .copy_from_slice(&grad[from - range.start..to - range.start]);
                }
            }
            let mut freed = 0;
            while kept < grads.len() && ranges[kept].end <= end {
                grads[kept].grad = None;
                freed += grads[kept].counted;
                kept += 1;
            }
            let reduced = self.reduce_piece(start..end, &mut piece);
            if let Some(throttle) = throttle {
                throttle.sent(freed);
            }
            reduced?;
            start = end;
        }
        Ok(())
    }

    /// Reduce-scatters `values`, the flat range `piece`, onto the ranks whose shards it
    /// meets, and adds this rank's part to its shard of the sum (replaces it, in a window's
    /// first micro-batch).
    fn reduce_piece(
        &mut self,
        piece: Range<usize>,
        values: &mut [f32],
    ) -> Result<(), AccelerateError> {
        let world = self.shard.world_size().max(1);
        // Where rank r's shard meets the piece (empty where it does not).
        let owned = |r: usize| {
            let start = piece.start.max(r * self.shard_len).min(piece.end);
            start..piece.end.min((r + 1) * self.shard_len).max(start)
        };
        let me = if self.shard.is_distributed() {
            self.shard.rank()
        } else {
            0
        };
        let ours = owned(me);
        self.mine.resize(ours.len(), 0.0);
        if self.shard.is_distributed() {
            let counts: Vec<usize> = (0..world).map(|r| owned(r).len()).collect();
            let (wire, mine) = (&mut self.wire, &mut self.mine);
            self.shard
                .timed(|group| wire.reduce_scatter_mean(values, mine, Some(&counts), group))?;
        } else {
            let within = ours.start - piece.start..ours.end - piece.start;
            self.mine.copy_from_slice(&values[within]);
        }
        if let Some(replicas) = &self.replicas {
            let (wire, mine) = (&mut self.wire, &mut self.mine);
            replicas.timed(|group| wire.all_reduce_mean(mine, group))?;
        }
        if ours.is_empty() {
            return Ok(());
        }
        let base = me * self.shard_len;
        let target = &mut self.sum[ours.start - base..ours.end - base];
        if self.first {
            target.copy_from_slice(&self.mine);
        } else {
            reduce_f32(target, &self.mine, ReduceOp::Sum);
        }
        Ok(())
    }

    /// The shard of the window's sum, which entries had gradients here, the wire, and
    /// whether the micro-batch began its window.
    pub(super) fn into_parts(self) -> (Vec<f32>, Vec<bool>, Wire, bool) {
        (self.sum, self.had, self.wire, self.first)
    }
}
