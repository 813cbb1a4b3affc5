//! Where a step's gradients wait for the fused update: each parameter's own tensor as backward
//! returned it, or a flat buffer all-reduced whole; under ZeRO, where this rank's averaged
//! shard of them is.

use std::ops::Range;

use accelerate_core::comm::SharedBuffer;

use super::columns::SegmentGrads;
use super::plan::FlatPlan;

/// This rank's averaged gradients under ZeRO-1 and ZeRO-2.
pub(crate) enum ShardGrads {
    /// In backward's own tensors, averaged where they are: each gradient's part of the shard
    /// holds the average; gradients with no part in it were let go (none between steps).
    InSegments(SegmentGrads),
    /// A vector of the shard's length: ZeRO-2's sum of a window of several micro-batches, made
    /// by the first such window and kept for the next ones (a window of one needs none).
    Buffer(Vec<f32>),
}

impl ShardGrads {
    /// None yet.
    pub fn none() -> Self {
        Self::InSegments(SegmentGrads::none())
    }

    /// The averaged gradient at `local`, a range of the shard inside segment `index`.
    pub fn part(&self, plan: &FlatPlan, index: usize, local: Range<usize>) -> Option<&[f32]> {
        match self {
            Self::Buffer(values) => values.get(local),
            Self::InSegments(grads) => {
                let offset = plan.segments.get(index)?.offset;
                let start = (plan.shard.start + local.start).checked_sub(offset)?;
                grads.segment(index)?.get(start..start + local.len())
            }
        }
    }

    /// The sum of the squares of the shard.
    pub fn sum_of_squares(&self, plan: &FlatPlan) -> f64 {
        match self {
            Self::Buffer(values) => accelerate_kernels::sum_of_squares(values),
            Self::InSegments(grads) => grads.shard_sum_of_squares(plan),
        }
    }

    /// Multiplies the shard by `factor`.
    pub fn scale(&mut self, plan: &FlatPlan, factor: f32) {
        match self {
            Self::Buffer(values) => accelerate_kernels::scale_in_place(values, factor),
            Self::InSegments(grads) => grads.scale_shard(plan, factor),
        }
    }

    /// Lets go of gradients kept in backward's tensors (a window's buffer stays).
    pub fn release(&mut self) {
        if let Self::InSegments(grads) = self {
            *grads = SegmentGrads::none();
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Buffer(values) => values.capacity() * 4,
            Self::InSegments(grads) => grads.bytes(),
        }
    }
}

/// Where the gradients of a step wait for the update.
pub(crate) enum GradBuffer {
    /// Each parameter's gradient as backward returned it, with no flat copy: one process
    /// (its gradients are the average), and ZeRO, which averages them column by column into
    /// [`ShardGrads`] and keeps none of them here.
    Segments(SegmentGrads),
    /// A flat vector all-reduced whole: several processes without ZeRO, after a load
    /// changed the model's size (the group's shared buffer has the old one's).
    Flat(Vec<f32>),
    /// The group's shared buffer, all-reduced in place (on shared memory the peers read the
    /// values where they are, with no staging copy).
    Group(SharedBuffer<f32>),
}

impl GradBuffer {
    /// The flat buffer, where the gradients are kept in one.
    fn flat(&self) -> Option<&[f32]> {
        match self {
            Self::Segments(_) => None,
            Self::Flat(values) => Some(values),
            Self::Group(buffer) => Some(buffer),
        }
    }

    /// The flat buffer, mutably.
    pub fn flat_mut(&mut self) -> Option<&mut [f32]> {
        match self {
            Self::Segments(_) => None,
            Self::Flat(values) => Some(values),
            Self::Group(buffer) => Some(buffer),
        }
    }

    /// Elements of the flat buffer (0 without one).
    pub fn flat_len(&self) -> usize {
        self.flat().map_or(0, <[f32]>::len)
    }

    /// The averaged gradient of segment `index` without ZeRO (`range`: its place in the flat
    /// buffer).
    pub fn whole(&self, index: usize, range: Range<usize>) -> Option<&[f32]> {
        match self {
            Self::Segments(grads) => grads.segment(index),
            flat => flat.flat()?.get(range),
        }
    }

    /// The sum of the squares of every gradient held.
    pub fn sum_of_squares(&self) -> f64 {
        match self {
            Self::Segments(grads) => grads.sum_of_squares(),
            flat => flat.flat().map_or(0.0, accelerate_kernels::sum_of_squares),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Segments(grads) => grads.bytes(),
            flat => flat.flat_len() * 4,
        }
    }
}
