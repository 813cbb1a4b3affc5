//! Dissemination barrier: in round `k` each rank signals rank `r + 2^k` and waits for rank
//! `r - 2^k`; after `ceil(log2 n)` rounds every rank has heard, indirectly, from all.

use super::engine::MessageEngine;
use crate::comm::call::CallDesc;
use crate::comm::link::Link;
use crate::error::CommError;

impl<L: Link> MessageEngine<L> {
    pub(super) fn barrier_dissemination(&mut self, call: &CallDesc) -> Result<(), CommError> {
        let (n, rank) = (self.world_size(), self.rank());
        let deadline = self.deadline();
        let mut distance = 1;
        while distance < n {
            self.exchange(
                call,
                (rank + distance) % n,
                &[],
                (rank + n - distance) % n,
                0,
                deadline,
            )?;
            distance *= 2;
        }
        Ok(())
    }
}
