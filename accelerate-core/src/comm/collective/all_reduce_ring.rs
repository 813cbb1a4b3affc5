//! Ring all-reduce: reduce-scatter then all-gather around the ring, in windows of at most
//! `segment_bytes` per chunk so that large buffers pipeline through the writer queues.

use accelerate_kernels::reduce::scale_bytes;
use accelerate_kernels::{DType, ReduceOp};

use super::engine::MessageEngine;
use crate::comm::call::CallDesc;
use crate::comm::engine::chunk_bytes;
use crate::comm::link::Link;
use crate::error::CommError;

impl<L: Link> MessageEngine<L> {
    pub(super) fn all_reduce_ring(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        let (n, rank) = (self.world_size(), self.rank());
        let elem = dtype.size();
        // Saturating: a segment larger than any buffer makes one window of the whole buffer.
        let window = (self.segment_bytes / elem)
            .max(1)
            .saturating_mul(elem)
            .saturating_mul(n);
        let deadline = self.deadline();
        for part in buf.chunks_mut(window) {
            self.ring_reduce_scatter_in_place(call, part, dtype, op, deadline, &[])?;
            if let Some(factor) = scale {
                let mine = chunk_bytes(part.len(), elem, n, rank);
                scale_bytes(dtype, &mut part[mine], factor);
            }
            self.ring_all_gather_in_place(call, part, elem, deadline)?;
        }
        Ok(())
    }
}
