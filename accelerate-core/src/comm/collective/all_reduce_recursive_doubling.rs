//! Recursive-doubling all-reduce: `log2 n` pairwise exchanges of the whole buffer, the
//! latency-optimal choice for small buffers. Every pair combines the same two values, and the
//! reductions are commutative, so all ranks end with identical bits.

use accelerate_kernels::reduce::{reduce_bytes, scale_bytes};
use accelerate_kernels::schedule::{DoublingRole, recursive_doubling};
use accelerate_kernels::{DType, ReduceOp};

use super::engine::MessageEngine;
use crate::comm::call::CallDesc;
use crate::comm::link::Link;
use crate::error::CommError;

impl<L: Link> MessageEngine<L> {
    pub(super) fn all_reduce_recursive_doubling(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        let deadline = self.deadline();
        match recursive_doubling(self.rank(), self.world_size()) {
            DoublingRole::Folded { partner } => {
                self.send(partner, call, buf)?;
                let result = self.recv(partner, call, buf.len(), deadline)?;
                buf.copy_from_slice(result);
            }
            DoublingRole::Active { folded, rounds } => {
                if let Some(folded) = folded {
                    let theirs = self.recv(folded, call, buf.len(), deadline)?;
                    reduce_bytes(dtype, op, buf, theirs);
                }
                for peer in rounds {
                    let theirs = self.exchange(call, peer, buf, peer, buf.len(), deadline)?;
                    reduce_bytes(dtype, op, buf, theirs);
                }
                if let Some(factor) = scale {
                    scale_bytes(dtype, buf, factor);
                }
                if let Some(folded) = folded {
                    self.send(folded, call, buf)?;
                }
            }
        }
        Ok(())
    }
}
