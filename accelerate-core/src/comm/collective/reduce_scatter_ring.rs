//! Ring reduce-scatter: `n - 1` steps in which each rank passes one partially reduced chunk
//! to its right neighbour; rank `r` ends with the fully reduced chunk `r`.

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
        let (n, rank) = (self.world_size(), self.rank());
        let (left, right) = ring_neighbours(rank, n);
        let elem = dtype.size();
        let len = input.len();
        let mut work = input.to_vec();
        let deadline = self.deadline();
        for step in 0..n - 1 {
            let (send, recv) = ring_reduce_scatter_step(rank, n, step);
            let incoming = self.exchange(
                call,
                right,
                &work[chunk_bytes(len, elem, n, send)],
                left,
                deadline,
            )?;
            reduce_bytes(
                dtype,
                op,
                &mut work[chunk_bytes(len, elem, n, recv)],
                &incoming,
            );
        }
        output.copy_from_slice(&work[chunk_bytes(len, elem, n, rank)]);
        Ok(())
    }
}
