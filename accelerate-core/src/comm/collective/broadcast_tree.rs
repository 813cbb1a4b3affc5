//! Binomial-tree broadcast: `log2 n` rounds; each rank receives once from its parent and
//! forwards to its children.

use accelerate_kernels::schedule::binomial_tree;

use super::engine::MessageEngine;
use crate::comm::call::CallDesc;
use crate::comm::link::Link;
use crate::error::CommError;

impl<L: Link> MessageEngine<L> {
    pub(super) fn broadcast_tree(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        root: usize,
    ) -> Result<(), CommError> {
        let (parent, children) = binomial_tree(self.rank(), root, self.world_size());
        if let Some(parent) = parent {
            let deadline = self.deadline();
            let data = self.recv(parent, call, buf.len(), deadline)?;
            buf.copy_from_slice(data);
        }
        for child in children {
            self.send(child, call, buf)?;
        }
        Ok(())
    }
}
