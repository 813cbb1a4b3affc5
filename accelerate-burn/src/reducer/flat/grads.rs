//! Where a step's gradients wait for the fused update: each parameter's own tensor as backward
//! returned it, or a flat buffer all-reduced whole.

use std::ops::Range;

use accelerate_core::comm::SharedBuffer;

use super::columns::SegmentGrads;

/// Where the gradients of a step wait for the update.
pub(crate) enum GradBuffer {
    /// Each parameter's gradient as backward returned it, with no flat copy: one process
    /// (its gradients are the average), and ZeRO, which reduce-scatters them column by column
    /// into the shard and keeps none of them here.
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
