//! Ring all-reduce: reduce-scatter then all-gather around the ring, in windows of at most
//! `segment_bytes` per chunk so that large buffers pipeline through the writer queues.

use accelerate_kernels::reduce::{reduce_bytes, scale_bytes};
use accelerate_kernels::schedule::{
    ring_all_gather_step, ring_neighbours, ring_reduce_scatter_step,
};
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
        let (left, right) = ring_neighbours(rank, n);
        let elem = dtype.size();
        let window = (self.segment_bytes / elem).max(1) * elem * n;
        let deadline = self.deadline();
        for start in (0..buf.len()).step_by(window.max(1)) {
            let end = (start + window).min(buf.len());
            let part = &mut buf[start..end];
            let len = part.len();
            for step in 0..n - 1 {
                let (send, recv) = ring_reduce_scatter_step(rank, n, step);
                let incoming = self.exchange(
                    call,
                    right,
                    &part[chunk_bytes(len, elem, n, send)],
                    left,
                    deadline,
                )?;
                reduce_bytes(
                    dtype,
                    op,
                    &mut part[chunk_bytes(len, elem, n, recv)],
                    &incoming,
                );
            }
            if let Some(factor) = scale {
                scale_bytes(dtype, &mut part[chunk_bytes(len, elem, n, rank)], factor);
            }
            for step in 0..n - 1 {
                let (send, recv) = ring_all_gather_step(rank, n, step);
                let incoming = self.exchange(
                    call,
                    right,
                    &part[chunk_bytes(len, elem, n, send)],
                    left,
                    deadline,
                )?;
                part[chunk_bytes(len, elem, n, recv)].copy_from_slice(&incoming);
            }
        }
        Ok(())
    }
}
