//! Ring reduce-scatter: `n - 1` steps in which each rank passes one partially reduced chunk
//! to its right neighbour; rank `r` ends with the fully reduced chunk `r`.

use std::time::Instant;

use accelerate_kernels::reduce::reduce_bytes;
use accelerate_kernels::schedule::{ring_neighbours, ring_reduce_scatter_step};
use accelerate_kernels::{DType, ReduceOp};

use super::engine::MessageEngine;
use crate::comm::call::CallDesc;
use crate::comm::engine::chunk_bytes;
use crate::comm::link::Link;
use crate::error::CommError;

impl<L: Link> MessageEngine<L> {
    pub(super) fn reduce_scatter_ring(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let mut work = input.to_vec();
        let deadline = self.deadline();
        self.ring_reduce_scatter_in_place(call, &mut work, dtype, op, deadline)?;
        let mine = chunk_bytes(work.len(), dtype.size(), self.world_size(), self.rank());
        output.copy_from_slice(&work[mine]);
        Ok(())
    }

    /// The reduce-scatter steps on `work`, cut into `n` chunks: afterwards chunk `rank` of
    /// `work` holds the reduction of every rank's chunk `rank` (other chunks hold partials).
    pub(super) fn ring_reduce_scatter_in_place(
        &mut self,
        call: &CallDesc,
        work: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (n, rank) = (self.world_size(), self.rank());
        let (left, right) = ring_neighbours(rank, n);
        let (len, elem) = (work.len(), dtype.size());
        for step in 0..n - 1 {
            let (send, recv) = ring_reduce_scatter_step(rank, n, step);
            let expect = chunk_bytes(len, elem, n, recv).len();
            let incoming = self.exchange(
                call,
                right,
                &work[chunk_bytes(len, elem, n, send)],
                left,
                expect,
                deadline,
            )?;
            reduce_bytes(
                dtype,
                op,
                &mut work[chunk_bytes(len, elem, n, recv)],
                incoming,
            );
        }
        Ok(())
    }
}
