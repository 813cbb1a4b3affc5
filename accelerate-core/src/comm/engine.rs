//! The interface every transport's collectives implement, on raw bytes; the typed, checked
//! API on top of it is [`ProcessGroup`](super::ProcessGroup).

use std::sync::Arc;

use super::call::CallDesc;
use crate::error::CommError;

/// Tells a group's peers, from any thread, that this rank failed: how a group that fails warns
/// the peers of the job's other groups, which may be waiting for this rank in a collective of
/// their own (they read why, instead of seeing only this process exit and naming it).
pub trait AbortNotice: Send + Sync {
    /// Posts `reason` for the peers, unless one is posted already (the first failure stays).
    fn tell(&self, reason: &str);
}

/// Collectives on byte buffers. Callers have checked sizes and roots; every rank calls with
/// the same [`CallDesc`], which implementations verify against their peers'.
pub trait Engine: Send {
    /// Transport name ("local", "tcp", "shm").
    fn name(&self) -> &'static str;

    /// Reduces `buf` (elements of the call's dtype, by its reduction) across ranks in place,
    /// then multiplies by `scale` when given (a mean).
    fn all_reduce(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        scale: Option<f32>,
    ) -> Result<(), CommError>;

    /// Copies `root`'s `buf` into every rank's `buf`.
    fn broadcast(&mut self, call: &CallDesc, buf: &mut [u8], root: usize) -> Result<(), CommError>;

    /// Concatenates every rank's `input`, in rank order, into `output` (`world_size` times as
    /// long).
    fn all_gather(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), CommError>;

    /// Reduces `input` across ranks (the call's dtype and reduction) and leaves rank `r` with
    /// chunk `r` of the result in `output`: the chunks lie one after another in rank order,
    /// `counts[r]` elements each (the caller checked that they add up to `input` and that
    /// every rank gives the same; [`even_counts`] is the usual cut). Each element is reduced
    /// in an order set by the ranks and its chunk's owner alone, so a cut into other chunks
    /// leaves an element that keeps its owner with the same bits.
    fn reduce_scatter(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
    ) -> Result<(), CommError>;

    /// Returns once every rank has called it.
    fn barrier(&mut self, call: &CallDesc) -> Result<(), CommError>;

    /// Tells every peer that this rank failed, and why (best effort).
    fn abort(&mut self, reason: &str);

    /// A handle that tells this group's peers of a failure from any thread without waiting
    /// for this engine (shared memory's control words); `None` where telling would wait for a
    /// collective that another thread runs (message links, MPI).
    fn abort_notice(&self) -> Option<Arc<dyn AbortNotice>> {
        None
    }

    /// Sets how long any wait may last.
    fn set_timeout(&mut self, timeout: std::time::Duration);

    /// Allocates this rank's `bytes`-byte part of shared buffer `call.buffer`, readable by the
    /// peers. `None` when the transport has no shared memory (the caller uses the heap), or
    /// for an empty buffer.
    fn create_shared(
        &mut self,
        call: &CallDesc,
        bytes: usize,
    ) -> Result<Option<memmap2::MmapMut>, CommError> {
        let _ = (call, bytes);
        Ok(None)
    }

    /// All-reduces shared buffer `call.buffer`, whose bytes on this rank are `buf`. Without
    /// shared memory this is a plain all-reduce.
    fn all_reduce_shared(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        self.all_reduce(call, buf, scale)
    }

    /// Forms the engine of this rank's part of `parts`, a partition of the group's ranks
    /// (the same on every rank; the caller checked it). Every rank of the group calls it at
    /// once; `call` is the set-up call it may use among them.
    fn split(&mut self, call: &CallDesc, parts: &[Vec<usize>]) -> Result<Split, CommError> {
        let _ = (call, parts);
        Ok(Split::Unsupported)
    }
}

/// What [`Engine::split`] formed for this rank.
pub enum Split {
    /// This rank's part is this rank alone: a group of one, no engine.
    Alone,
    /// The engine of this rank's part.
    Formed(Box<dyn Engine>),
    /// This transport cannot form groups of some of its ranks.
    Unsupported,
}

/// Whether `ok` holds on every rank of `engine`'s group: a minimum over one f32, made as
/// set-up call `call` (its count, type and reduction are set here), so that no rank goes on
/// to wait for something a peer failed to set up.
pub(crate) fn all_agree(
    engine: &mut dyn Engine,
    mut call: CallDesc,
    ok: bool,
) -> Result<bool, CommError> {
    call.count = 1;
    call.dtype = Some(accelerate_kernels::DType::F32);
    call.reduce = Some(accelerate_kernels::ReduceOp::Min);
    let mut flag = if ok { 1.0f32 } else { 0.0 }.to_le_bytes();
    engine.all_reduce(&call, &mut flag, None)?;
    Ok(f32::from_le_bytes(flag) == 1.0)
}

/// The part of `parts` that holds `rank` (an empty slice when none does: the caller checked
/// that every rank is in one).
pub(crate) fn part_of(parts: &[Vec<usize>], rank: usize) -> &[usize] {
    parts
        .iter()
        .find(|part| part.contains(&rank))
        .map_or(&[], Vec::as_slice)
}

/// Elements of each rank's chunk when `count` elements are cut evenly over `world` ranks
/// (`accelerate_kernels::schedule::chunk_range`): what a reduce-scatter without explicit
/// counts scatters.
pub fn even_counts(count: usize, world: usize) -> Vec<usize> {
    (0..world)
        .map(|r| accelerate_kernels::schedule::chunk_range(count, world, r).len())
        .collect()
}

/// Byte ranges of chunks of `counts` elements of `elem` bytes, one after another.
pub(crate) fn count_bytes(counts: &[usize], elem: usize) -> Vec<std::ops::Range<usize>> {
    let mut start = 0;
    counts
        .iter()
        .map(|&count| {
            let range = start..start + count * elem;
            start = range.end;
            range
        })
        .collect()
}

/// Byte range of chunk `index` when `bytes` of `elem`-byte elements are cut into `parts`.
pub(crate) fn chunk_bytes(
    bytes: usize,
    elem: usize,
    parts: usize,
    index: usize,
) -> std::ops::Range<usize> {
    let r = accelerate_kernels::schedule::chunk_range(bytes / elem, parts, index);
    r.start * elem..r.end * elem
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_counts_cut_like_chunk_bytes_and_counts_lie_end_to_end() {
        assert_eq!(even_counts(10, 3), vec![4, 3, 3]);
        assert_eq!(even_counts(2, 4), vec![1, 1, 0, 0]);
        let ranges = count_bytes(&even_counts(10, 3), 4);
        let chunks: Vec<_> = (0..3).map(|i| chunk_bytes(40, 4, 3, i)).collect();
        assert_eq!(ranges, chunks);
        assert_eq!(count_bytes(&[0, 3, 1], 2), vec![0..0, 0..6, 6..8]);
    }
}
