//! Ring all-gather: each rank's block travels `n - 1` hops around the ring.

use accelerate_kernels::schedule::{ring_all_gather_step, ring_neighbours};

use super::engine::MessageEngine;
use crate::comm::call::CallDesc;
use crate::comm::link::Link;
use crate::error::CommError;

impl<L: Link> MessageEngine<L> {
    pub(super) fn all_gather_ring(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), CommError> {
        let (n, rank) = (self.world_size(), self.rank());
        let (left, right) = ring_neighbours(rank, n);
        let block = input.len();
        output[rank * block..(rank + 1) * block].copy_from_slice(input);
        let deadline = self.deadline();
        for step in 0..n - 1 {
            let (send, recv) = ring_all_gather_step(rank, n, step);
            let incoming = self.exchange(
                call,
                right,
                &output[send * block..(send + 1) * block],
                left,
                deadline,
            )?;
            output[recv * block..(recv + 1) * block].copy_from_slice(&incoming);
        }
        Ok(())
    }
}
