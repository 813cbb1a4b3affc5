//! Ring all-gather: each rank's block travels `n - 1` hops around the ring.

use std::time::Instant;

use accelerate_kernels::schedule::{ring_all_gather_step, ring_neighbours};

use super::engine::MessageEngine;
use crate::comm::call::CallDesc;
use crate::comm::engine::chunk_bytes;
use crate::comm::link::Link;
use crate::error::CommError;

impl<L: Link> MessageEngine<L> {
    pub(super) fn all_gather_ring(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), CommError> {
        let rank = self.rank();
        let block = input.len();
        output[rank * block..(rank + 1) * block].copy_from_slice(input);
        let deadline = self.deadline();
        // Bytes as elements: the blocks are equal, so the chunks are exactly the blocks.
        self.ring_all_gather_in_place(call, output, 1, deadline)
    }

    /// The all-gather steps on `work`, cut into `n` chunks of `elem`-byte elements, starting
    /// from each rank owning chunk `rank`: afterwards every chunk is every rank's.
    pub(super) fn ring_all_gather_in_place(
        &mut self,
        call: &CallDesc,
        work: &mut [u8],
        elem: usize,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let (n, rank) = (self.world_size(), self.rank());
        let (left, right) = ring_neighbours(rank, n);
        let len = work.len();
        for step in 0..n - 1 {
            let (send, recv) = ring_all_gather_step(rank, n, step);
            let expect = chunk_bytes(len, elem, n, recv).len();
            let incoming = self.exchange(
                call,
                right,
                &work[chunk_bytes(len, elem, n, send)],
                left,
                expect,
                deadline,
            )?;
            work[chunk_bytes(len, elem, n, recv)].copy_from_slice(incoming);
        }
        Ok(())
    }
}
