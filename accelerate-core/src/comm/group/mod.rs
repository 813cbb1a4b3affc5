//! [`ProcessGroup`]: the typed, checked collectives API over whichever transport the group
//! formed with (how it forms is `formation`'s).

use std::sync::Arc;
use std::time::Duration;

use accelerate_kernels::schedule::chunk_range;
use accelerate_kernels::{Element, ReduceOp};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::call::{CallDesc, OpKind};
use super::engine::Engine;
use super::shared_buffer::SharedBuffer;
use crate::error::CommError;

mod alarm;
mod formation;
mod reduce_scatter;
mod split;

/// Largest value [`ProcessGroup::broadcast_object`] and the object gathers carry, in bytes.
pub const MAX_OBJECT_BYTES: usize = 256 << 20;

/// Largest buffer an object gather receives (every rank's value padded to the longest), in
/// bytes: one rank's large value times a large world is refused, not allocated.
pub const MAX_GATHERED_OBJECT_BYTES: usize = 1 << 30;

/// How [`ProcessGroup::all_reduce`] and [`ProcessGroup::reduce_scatter`] combine values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the number of ranks.
    Mean,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

impl Reduction {
    fn op(self) -> ReduceOp {
        match self {
            Reduction::Sum | Reduction::Mean => ReduceOp::Sum,
            Reduction::Max => ReduceOp::Max,
            Reduction::Min => ReduceOp::Min,
        }
    }
}

/// The ranks of a job, able to run collectives together.
///
/// Every rank must make the same calls, in the same order, with the same sizes; a rank that
/// does not gets a [`CommError::Mismatch`] naming both calls (and so do its peers), never a hang
/// or a silently wrong result. After any error the group is unusable: every later call returns
/// the first error again.
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    engine: Option<Box<dyn Engine>>,
    seq: u64,
    failed: Option<CommError>,
    /// Shared buffers allocated so far (the next one's id).
    buffers: u32,
    /// Identifies this group among the others of the process, for its shared buffers.
    tag: u64,
    /// For a group split from the job: the job's rank of each of its ranks (errors name those).
    members: Option<Vec<usize>>,
    /// Shared with the job's other groups in this process: a failure here is told to their
    /// peers too.
    alarm: Arc<alarm::JobAlarm>,
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.alarm.leave(self.tag);
    }
}

impl ProcessGroup {
    fn set_timeout(&mut self, timeout: Duration) {
        if let Some(engine) = self.engine.as_mut() {
            engine.set_timeout(timeout);
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The transport in use: "single", "local", "shm" or "tcp".
    pub fn transport(&self) -> &'static str {
        self.engine.as_ref().map_or("single", |e| e.name())
    }

    fn call(&mut self, op: OpKind) -> CallDesc {
        let call = CallDesc::new(op, self.seq);
        self.seq += 1;
        call
    }

    fn usage(&self, op: OpKind, reason: String) -> CommError {
        CommError::Usage {
            op: op.name(),
            rank: self.rank,
            reason,
        }
    }

    /// True once a collective failed (a peer is gone, timed out or disagreed): every later
    /// call fails with that error.
    pub fn has_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Runs `f` on the engine for `call`; the first error poisons the group and is told to
    /// the peers. A `collective` span (the operation, its bytes per rank, its sequence number)
    /// covers it, for per-rank timelines (`crate::trace`).
    fn run(
        &mut self,
        call: &CallDesc,
        f: impl FnOnce(&mut dyn Engine) -> Result<(), CommError>,
    ) -> Result<(), CommError> {
        let bytes = call
            .count
            .saturating_mul(call.dtype.map_or(1, |d| d.size() as u64));
        let _span =
            tracing::info_span!("collective", op = call.op.name(), bytes, seq = call.seq).entered();
        if let Some(err) = &self.failed {
            return Err(err.clone());
        }
        let Some(engine) = self.engine.as_mut() else {
            return Ok(());
        };
        let mut result = f(engine.as_mut());
        if let (Err(err), Some(members)) = (&mut result, &self.members) {
            *err = err.clone().in_job(members);
        }
        if let Err(err) = &result {
            let reason = err.reason_for_peers();
            engine.abort(&reason);
            self.alarm.raise(self.tag, &reason);
            self.failed = Some(err.clone());
        }
        result
    }

    /// Combines `buf` across ranks, in place, with `reduction`. Half-precision values are
    /// combined in f32 and rounded once per combination.
    pub fn all_reduce<T: Element>(
        &mut self,
        buf: &mut [T],
        reduction: Reduction,
    ) -> Result<(), CommError> {
        let mut call = self.call(OpKind::AllReduce);
        call.count = buf.len() as u64;
        call.dtype = Some(T::DTYPE);
        call.reduce = Some(reduction.op());
        let scale = (reduction == Reduction::Mean).then(|| 1.0 / self.world_size as f32);
        self.run(&call, |e| {
            e.all_reduce(&call, bytemuck::cast_slice_mut(buf), scale)
        })
    }

    /// Copies `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        let count = buf.len();
        self.broadcast_bytes(bytemuck::cast_slice_mut(buf), root, Some(T::DTYPE), count)
    }

    fn broadcast_bytes(
        &mut self,
        buf: &mut [u8],
        root: usize,
        dtype: Option<accelerate_kernels::DType>,
        count: usize,
    ) -> Result<(), CommError> {
        if root >= self.world_size {
            return Err(self.usage(
                OpKind::Broadcast,
                format!(
                    "root {root} is not a rank of a group of {}",
                    self.world_size
                ),
            ));
        }
        let mut call = self.call(OpKind::Broadcast);
        call.count = count as u64;
        call.dtype = dtype;
        call.root = Some(root as u32);
        self.run(&call, |e| e.broadcast(&call, buf, root))
    }

    /// Concatenates every rank's `input`, in rank order, into `output`, which must be
    /// `world_size` times as long.
    pub fn all_gather<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
    ) -> Result<(), CommError> {
        if output.len() != input.len() * self.world_size {
            return Err(self.usage(
                OpKind::AllGather,
                format!(
                    "output holds {} elements, {} x {} ranks expected",
                    output.len(),
                    input.len(),
                    self.world_size
                ),
            ));
        }
        self.all_gather_bytes(
            bytemuck::cast_slice(input),
            bytemuck::cast_slice_mut(output),
            Some(T::DTYPE),
            input.len(),
        )
    }

    /// [`all_gather`](Self::all_gather) on raw bytes (any element type): every rank passes
    /// the same number of bytes.
    pub fn all_gather_raw(&mut self, input: &[u8], output: &mut [u8]) -> Result<(), CommError> {
        if output.len() != input.len() * self.world_size {
            return Err(self.usage(
                OpKind::AllGather,
                format!(
                    "output holds {} bytes, {} x {} ranks expected",
                    output.len(),
                    input.len(),
                    self.world_size
                ),
            ));
        }
        self.all_gather_bytes(input, output, None, input.len())
    }

    fn all_gather_bytes(
        &mut self,
        input: &[u8],
        output: &mut [u8],
        dtype: Option<accelerate_kernels::DType>,
        count: usize,
    ) -> Result<(), CommError> {
        let mut call = self.call(OpKind::AllGather);
        call.count = count as u64;
        call.dtype = dtype;
        if self.engine.is_none() {
            output.copy_from_slice(input);
        }
        self.run(&call, |e| e.all_gather(&call, input, output))
    }

    /// Allocates a zeroed buffer of `len` elements that [`all_reduce_shared`](Self::all_reduce_shared)
    /// reduces in place: on a shared-memory group every rank reads its peers' buffers directly,
    /// with no staging copy. Every rank must call this with the same `len`.
    pub fn shared_buffer<T: Element>(&mut self, len: usize) -> Result<SharedBuffer<T>, CommError> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .filter(|&b| isize::try_from(b).is_ok())
            .ok_or_else(|| {
                self.usage(
                    OpKind::CreateBuffer,
                    format!("{len} elements do not fit in memory"),
                )
            })?;
        let id = self.buffers;
        self.buffers += 1;
        let mut call = self.call(OpKind::CreateBuffer);
        call.count = len as u64;
        call.dtype = Some(T::DTYPE);
        call.buffer = Some(id);
        let mut mapped = None;
        self.run(&call, |e| {
            mapped = e.create_shared(&call, bytes)?;
            Ok(())
        })?;
        Ok(match mapped {
            Some(map) => SharedBuffer::mapped(map, len, id, self.tag),
            None => SharedBuffer::heap(len, id, self.tag),
        })
    }

    /// Combines `buf` across ranks, in place, with `reduction`, like
    /// [`all_reduce`](Self::all_reduce) but without staging copies on shared memory.
    pub fn all_reduce_shared<T: Element>(
        &mut self,
        buf: &mut SharedBuffer<T>,
        reduction: Reduction,
    ) -> Result<(), CommError> {
        if buf.group() != self.tag {
            return Err(self.usage(
                OpKind::AllReduceShared,
                "the buffer was allocated by another process group".into(),
            ));
        }
        let mut call = self.call(OpKind::AllReduceShared);
        call.count = buf.len() as u64;
        call.dtype = Some(T::DTYPE);
        call.reduce = Some(reduction.op());
        call.buffer = Some(buf.id());
        let scale = (reduction == Reduction::Mean).then(|| 1.0 / self.world_size as f32);
        let in_place = buf.is_shared_memory();
        self.run(&call, |e| {
            let bytes = bytemuck::cast_slice_mut(&mut buf[..]);
            if in_place {
                e.all_reduce_shared(&call, bytes, scale)
            } else {
                e.all_reduce(&call, bytes, scale)
            }
        })
    }

    /// Elements of this rank's chunk when `len` elements are scattered.
    pub fn chunk_len(&self, len: usize) -> usize {
        chunk_range(len, self.world_size, self.rank).len()
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<(), CommError> {
        let call = self.call(OpKind::Barrier);
        self.run(&call, |e| e.barrier(&call))
    }

    /// `root`'s value on every rank. `value` is required on the root and ignored elsewhere.
    /// Meant for small values (configurations, counters): it travels as JSON.
    pub fn broadcast_object<V: Serialize + DeserializeOwned>(
        &mut self,
        value: Option<&V>,
        root: usize,
    ) -> Result<V, CommError> {
        let mut bytes = if self.rank == root {
            let value = value.ok_or_else(|| {
                self.usage(OpKind::Broadcast, "the root must pass a value".into())
            })?;
            serde_json::to_vec(value).map_err(|e| self.usage(OpKind::Broadcast, e.to_string()))?
        } else {
            Vec::new()
        };
        let mut len = (bytes.len() as u64).to_le_bytes();
        self.broadcast_bytes(&mut len, root, None, 8)?;
        let len = self.object_len(OpKind::Broadcast, root, u64::from_le_bytes(len))?;
        bytes.resize(len, 0);
        let n = bytes.len();
        self.broadcast_bytes(&mut bytes, root, None, n)?;
        serde_json::from_slice(&bytes).map_err(|e| {
            self.usage(
                OpKind::Broadcast,
                format!("the value from rank {root} does not decode: {e}"),
            )
        })
    }

    /// Checks the length of a serialized object announced by `from`: objects are small
    /// values, and a length no honest rank sends is an error, not an allocation.
    fn object_len(&self, op: OpKind, from: usize, len: u64) -> Result<usize, CommError> {
        usize::try_from(len)
            .ok()
            .filter(|&len| len <= MAX_OBJECT_BYTES)
            .ok_or_else(|| {
                self.usage(
                    op,
                    format!(
                        "rank {from} announced a value of {len} bytes; objects are limited to \
                         {MAX_OBJECT_BYTES} bytes (use the typed collectives for tensors)"
                    ),
                )
            })
    }

    /// Every rank's value, in rank order, on `root` (`None` elsewhere). Meant for small
    /// values: it travels as JSON.
    pub fn gather_object<V: Serialize + DeserializeOwned>(
        &mut self,
        value: &V,
        root: usize,
    ) -> Result<Option<Vec<V>>, CommError> {
        if root >= self.world_size {
            return Err(self.usage(
                OpKind::AllGather,
                format!(
                    "root {root} is not a rank of a group of {}",
                    self.world_size
                ),
            ));
        }
        let all = self.all_gather_object(value)?;
        Ok((self.rank == root).then_some(all))
    }

    /// Every rank's value, in rank order, on every rank. Meant for small values: it travels
    /// as JSON.
    pub fn all_gather_object<V: Serialize + DeserializeOwned>(
        &mut self,
        value: &V,
    ) -> Result<Vec<V>, CommError> {
        let mut bytes =
            serde_json::to_vec(value).map_err(|e| self.usage(OpKind::AllGather, e.to_string()))?;
        let n = self.world_size;
        let mut lens = vec![0u8; 8 * n];
        self.all_gather_bytes(&(bytes.len() as u64).to_le_bytes(), &mut lens, None, 8)?;
        let lens: Vec<usize> = lens
            .chunks_exact(8)
            .enumerate()
            .map(|(r, c)| {
                let len = u64::from_le_bytes(c.try_into().unwrap_or_default());
                self.object_len(OpKind::AllGather, r, len)
            })
            .collect::<Result<_, _>>()?;
        let (longest_rank, longest) = lens
            .iter()
            .copied()
            .enumerate()
            .max_by_key(|&(_, len)| len)
            .unwrap_or((0, 0));
        bytes.resize(longest, 0);
        let total = longest
            .checked_mul(n)
            .filter(|&total| total <= MAX_GATHERED_OBJECT_BYTES)
            .ok_or_else(|| {
                self.usage(
                    OpKind::AllGather,
                    format!(
                        "rank {longest_rank}'s value of {longest} bytes, padded for each of {n} \
                         ranks, exceeds the {MAX_GATHERED_OBJECT_BYTES} bytes an object gather \
                         receives (gather smaller values, or use the typed collectives)"
                    ),
                )
            })?;
        let mut all = vec![0u8; total];
        self.all_gather_bytes(&bytes, &mut all, None, longest)?;
        lens.iter()
            .enumerate()
            .map(|(r, &len)| {
                serde_json::from_slice(&all[r * longest..r * longest + len]).map_err(|e| {
                    self.usage(
                        OpKind::AllGather,
                        format!("the value from rank {r} does not decode: {e}"),
                    )
                })
            })
            .collect::<Result<Vec<V>, _>>()
    }
}
