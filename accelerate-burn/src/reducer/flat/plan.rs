//! How a fused optimizer's flat buffers are cut: one segment per trainable parameter, padded
//! to equal shards, this rank's shard, and each segment's update count.

use std::ops::Range;

use accelerate_core::comm::Reduction;
use accelerate_kernels::schedule::chunk_range;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::module::ParamId;

use super::cut::Cut;
use super::state_file::Segment;
use crate::error::AccelerateError;
use crate::params::{ParamLayout, ParamList};

/// What each process holds of the flat buffers (the fused optimizer's ZeRO stage, where
/// there is more than one process to split across).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sharding {
    /// Every process holds everything (no ZeRO, or one process).
    Whole,
    /// ZeRO-1: the master parameters, the averaged gradients, the optimizer state and the
    /// update are split; a window's gradients are reduce-scattered once.
    State,
    /// ZeRO-2: as ZeRO-1, but each micro-batch is averaged into this rank's shard of the
    /// window's sum; the model's own parameters stay whole.
    Gradients,
}

impl Sharding {
    /// The sharding of ZeRO stage `stage` over `world` processes (`forced`: NCCL was
    /// required, so the device path shards one process too, as it would over N GPUs).
    pub fn of(stage: u8, world: usize, forced: bool) -> Self {
        match stage {
            _ if world <= 1 && !forced => Self::Whole,
            0 => Self::Whole,
            1 => Self::State,
            _ => Self::Gradients,
        }
    }

    /// True when each process holds only its shard of something.
    pub fn splits(self) -> bool {
        self != Self::Whole
    }
}

/// What the flat buffers are cut into: segments (trainable parameters in visit order), the
/// padded length and this rank's shard.
pub(crate) struct FlatPlan {
    /// One per trainable parameter.
    pub segments: Vec<Segment>,
    /// The layout entry of each segment.
    pub entries: Vec<usize>,
    /// Trainable elements.
    pub len: usize,
    /// `len` rounded up to a multiple of the world size, so every shard is equal.
    pub padded: usize,
    /// This rank's shard of the padded range (everything without ZeRO).
    pub shard: Range<usize>,
    /// Updates applied to each segment (Burn counts per parameter).
    pub times: Vec<i32>,
    /// Which segments got a gradient in the window being applied, on any rank (after
    /// [`agree_grads`](Self::agree_grads); before it, on this rank).
    pub has_grad: Vec<bool>,
}

impl FlatPlan {
    pub(super) fn new(layout: &ParamLayout, sharded: bool, rank: usize, world: usize) -> Self {
        let mut segments = Vec::new();
        let mut entries = Vec::new();
        let mut len = 0;
        for (index, entry) in layout.entries.iter().enumerate() {
            if !entry.trainable {
                continue;
            }
            segments.push(Segment {
                id: entry.id.val(),
                path: entry.path.clone(),
                shape: entry.shape.clone(),
                offset: len,
                len: entry.numel,
            });
            entries.push(index);
            len += entry.numel;
        }
        let parts = if sharded { world } else { 1 };
        let padded = len.div_ceil(parts) * parts;
        let shard = if sharded {
            chunk_range(padded, world, rank)
        } else {
            0..padded
        };
        let n = segments.len();
        Self {
            segments,
            entries,
            len,
            padded,
            shard,
            times: vec![0; n],
            has_grad: vec![false; n],
        }
    }

    /// Records which segments have a gradient in `grads` (layout order): afresh when `first`
    /// (a window's first micro-batch), else added to what the window had so far.
    pub fn note_grads(&mut self, grads: &ParamList, first: bool) {
        for (index, &entry) in self.entries.iter().enumerate() {
            let has = grads.get(entry).is_some_and(Option::is_some);
            self.has_grad[index] = has || !first && self.has_grad[index];
        }
    }

    /// Makes `has_grad` the same on every rank: a segment got a gradient in the window when
    /// any rank's backward gave it one (the others averaged zeros in), so every rank updates
    /// it and advances its count, as one process over the global batch would. Decided alone,
    /// a parameter that only some ranks' batches reach (a head chosen by the data) would be
    /// updated on those ranks only and the replicas (or the shard's parts) would drift apart.
    /// `rider` (a sum of squares measured per shard) travels in the same all-reduce and comes
    /// back summed over the ranks; under hybrid sharding over the shard group alone, in a
    /// second one (the other groups hold the same shards).
    pub fn agree_grads(
        &mut self,
        cut: Cut<'_>,
        rider: Option<f64>,
    ) -> Result<Option<f64>, AccelerateError> {
        let comm = cut.job;
        if !comm.is_distributed() {
            return Ok(rider);
        }
        // Under hybrid sharding the other shard groups hold the same shards: the rider is
        // summed over this shard group alone, in a call of its own.
        let (riding, apart) = match cut.replicas {
            Some(_) => (None, rider),
            None => (rider, None),
        };
        let mut counts: Vec<f32> = self
            .has_grad
            .iter()
            .map(|&has| f32::from(u8::from(has)))
            .collect();
        counts.extend(riding.map(|value| value as f32));
        comm.timed(|group| group.all_reduce(&mut counts, Reduction::Sum))?;
        for (has, &count) in self.has_grad.iter_mut().zip(&counts) {
            *has = count > 0.0;
        }
        // Infinities and NaN survive the sum: fp16's overflow test reads them.
        let summed = riding.and(counts.get(self.has_grad.len()).map(|&sum| f64::from(sum)));
        match apart {
            Some(value) if cut.shard.is_distributed() => {
                let mut sum = [value as f32];
                cut.shard
                    .timed(|group| group.all_reduce(&mut sum, Reduction::Sum))?;
                Ok(Some(f64::from(sum[0])))
            }
            apart => Ok(summed.or(apart)),
        }
    }

    /// Where the segments meet the flat range `range`, in order: each one's index, the part of
    /// the segment, and where that part lies within `range`.
    pub fn pieces(
        &self,
        range: Range<usize>,
    ) -> impl Iterator<Item = (usize, Range<usize>, Range<usize>)> + '_ {
        let first = self
            .segments
            .partition_point(|s| s.offset + s.len <= range.start);
        self.segments
            .iter()
            .enumerate()
            .skip(first)
            .take_while(move |(_, s)| s.offset < range.end)
            .map(move |(index, s)| {
                let start = s.offset.max(range.start);
                let end = (s.offset + s.len).min(range.end);
                (
                    index,
                    start - s.offset..end - s.offset,
                    start - range.start..end - range.start,
                )
            })
    }

    /// Where segment `index` meets this rank's shard, as a range of the segment; `None` where
    /// it does not.
    pub fn shard_part(&self, index: usize) -> Option<Range<usize>> {
        let segment = self.segments.get(index)?;
        let start = segment.offset.max(self.shard.start);
        let end = (segment.offset + segment.len).min(self.shard.end);
        (start < end).then(|| start - segment.offset..end - segment.offset)
    }

    /// The learning rate of segment `index` under `lr`.
    pub fn rate(&self, index: usize, lr: &ModuleLearningRate) -> f64 {
        let segment = &self.segments[index];
        lr.lr_from_param(ParamId::from(segment.id), Some(&segment.path))
    }
}
