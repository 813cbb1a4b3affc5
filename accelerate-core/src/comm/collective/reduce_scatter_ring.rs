//! Ring reduce-scatter: `n - 1` steps in which each rank passes one partially reduced chunk
//! to its right neighbour; rank `r` ends with the fully reduced chunk `r`. The chunks may
//! differ in length (each rank's count); an element is reduced in the order its chunk's
//! place in the ring sets, whatever the other chunks hold.

use std::time::Instant;

use accelerate_kernels::reduce::reduce_bytes;
use accelerate_kernels::schedule::{ring_neighbours, ring_reduce_scatter_step};
use accelerate_kernels::{DType, ReduceOp};

use super::engine::MessageEngine;
use crate::comm::call::CallDesc;
use std::ops::Range;

use crate::comm::engine::{chunk_bytes, count_bytes};
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
        counts: &[usize],
    ) -> Result<(), CommError> {
        let mut work = input.to_vec();
        let deadline = self.deadline();
        let parts = count_bytes(counts, dtype.size());
        self.ring_reduce_scatter_in_place(call, &mut work, dtype, op, deadline, &parts)?;
        output.copy_from_slice(&work[parts[self.rank()].clone()]);
        Ok(())
    }

    /// The reduce-scatter steps on `work`, cut into the `n` chunks `parts` (byte ranges; all
    /// of equal length where `None`): afterwards chunk `rank` of `work` holds the reduction of
    /// every rank's chunk `rank` (other chunks hold partials).
    pub(super) fn ring_reduce_scatter_in_place(
        &mut self,
        call: &CallDesc,
        work: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        deadline: Instant,
        parts: &[Range<usize>],
    ) -> Result<(), CommError> {
        let (n, rank) = (self.world_size(), self.rank());
        let (left, right) = ring_neighbours(rank, n);
        let (len, elem) = (work.len(), dtype.size());
        let part = |index: usize| match parts.get(index) {
            Some(range) => range.clone(),
            None => chunk_bytes(len, elem, n, index),
        };
        for step in 0..n - 1 {
            let (send, recv) = ring_reduce_scatter_step(rank, n, step);
            let expect = part(recv).len();
            let incoming = self.exchange(call, right, &work[part(send)], left, expect, deadline)?;
            reduce_bytes(dtype, op, &mut work[part(recv)], incoming);
        }
        Ok(())
    }
}
