//! `reduce_scatter` and `reduce_scatter_counts`: a reduction whose result each rank keeps a
//! chunk of, cut evenly or into the counts the caller gives (ZeRO-2's owners of a bucket).

use accelerate_kernels::Element;
use accelerate_kernels::schedule::chunk_range;

use super::ProcessGroup;
use crate::comm::Reduction;
use crate::comm::call::OpKind;
use crate::comm::engine::even_counts;
use crate::error::CommError;

impl ProcessGroup {
    /// Reduces `input` across ranks and leaves this rank's chunk of the result in `output`:
    /// chunk `r` of `n` holds `len / n` elements, one more for the first `len % n` ranks
    /// ([`chunk_len`](Self::chunk_len) tells the size).
    pub fn reduce_scatter<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        reduction: Reduction,
    ) -> Result<(), CommError> {
        let counts = even_counts(input.len(), self.world_size);
        self.reduce_scatter_counts(input, output, &counts, reduction)
    }

    /// Reduces `input` across ranks and leaves this rank's chunk of the result in `output`,
    /// the chunks lying one after another in rank order with `counts[r]` elements for rank
    /// `r` (some may be empty): a reduce-scatter onto owners of unequal parts (ZeRO-2's
    /// shards of one bucket of gradients). Every rank gives the same counts; ranks that
    /// disagree fail with a mismatch. An element is reduced in the same order as by
    /// [`reduce_scatter`](Self::reduce_scatter) whenever its chunk has the same owner there.
    pub fn reduce_scatter_counts<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        counts: &[usize],
        reduction: Reduction,
    ) -> Result<(), CommError> {
        let total = counts.iter().try_fold(0usize, |sum, &c| sum.checked_add(c));
        let mine = counts.get(self.rank).copied();
        if counts.len() != self.world_size || total != Some(input.len()) {
            return Err(self.usage(
                OpKind::ReduceScatter,
                format!(
                    "{} counts adding up to {total:?} for {} ranks and {} elements",
                    counts.len(),
                    self.world_size,
                    input.len()
                ),
            ));
        }
        if mine != Some(output.len()) {
            return Err(self.usage(
                OpKind::ReduceScatter,
                format!(
                    "output holds {} elements, this rank's chunk of {} has {mine:?}",
                    output.len(),
                    input.len()
                ),
            ));
        }
        let mut call = self.call(OpKind::ReduceScatter);
        call.count = input.len() as u64;
        call.dtype = Some(T::DTYPE);
        call.reduce = Some(reduction.op());
        // Uneven counts travel as a fingerprint, so that ranks that cut differently fail as
        // a mismatch instead of reducing each other's chunks.
        let even = (0..self.world_size)
            .all(|r| counts[r] == chunk_range(input.len(), self.world_size, r).len());
        if !even {
            call.root = Some(counts_fingerprint(counts));
        }
        if self.engine.is_none() {
            output.copy_from_slice(input);
        }
        let n = self.world_size;
        self.run(&call, |e| {
            let out = bytemuck::cast_slice_mut(output);
            e.reduce_scatter(&call, bytemuck::cast_slice(input), out, counts)?;
            if reduction == Reduction::Mean {
                accelerate_kernels::reduce::scale_bytes(T::DTYPE, out, 1.0 / n as f32);
            }
            Ok(())
        })
    }
}

/// A 32-bit fingerprint of a reduce-scatter's counts (FNV-1a over their little-endian bytes;
/// never `u32::MAX`, which stands for "no root" in a packed call).
fn counts_fingerprint(counts: &[usize]) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in counts.iter().flat_map(|&c| (c as u64).to_le_bytes()) {
        hash = (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193);
    }
    hash.min(u32::MAX - 1)
}
