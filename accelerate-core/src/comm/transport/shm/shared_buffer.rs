//! Shared buffers: memory every rank of the group maps, so that a collective reads the peers'
//! values where they are, without staging copies through the slots.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use accelerate_kernels::reduce::{reduce_bytes, scale_bytes};
use accelerate_kernels::{DType, ReduceOp};
use memmap2::MmapMut;

use super::{IN_PLACE_MIN_BYTES, ShmEngine, create_private, open_private, region};
use crate::comm::call::CallDesc;
use crate::comm::engine::{Engine, chunk_bytes};
use crate::error::CommError;

impl ShmEngine {
    /// The name of `rank`'s file of buffer `id`; it ends with that rank's pid, so that a file
    /// left by a crash is swept once its creator is gone (see `stale`).
    fn buffer_path(&self, id: u32, rank: usize) -> PathBuf {
        let pid = self.region.pid(rank).load(Ordering::Acquire);
        let mut name = self.base.clone().into_os_string();
        name.push(format!("-b{id}-r{rank}-p{pid}"));
        PathBuf::from(name)
    }

    fn create_shared_inner(
        &mut self,
        call: &CallDesc,
        id: u32,
        bytes: usize,
    ) -> Result<Option<MmapMut>, CommError> {
        let rank = self.rank;
        let own_path = self.buffer_path(id, rank);
        let own = if bytes == 0 {
            None
        } else {
            let _ = std::fs::remove_file(&own_path);
            let file = create_private(&own_path, bytes)
                .map_err(|e| CommError::io(rank, format!("creating {}", own_path.display()), e))?;
            Some(
                region::map_own_buffer(&file).map_err(|e| {
                    CommError::io(rank, format!("mapping {}", own_path.display()), e)
                })?,
            )
        };
        // Every rank has created its file.
        self.begin(call)?;
        let mut peers = Vec::with_capacity(self.world_size);
        for peer in 0..self.world_size {
            if peer == rank || bytes == 0 {
                peers.push(None);
                continue;
            }
            let path = self.buffer_path(id, peer);
            let file = open_private(&path, false, bytes).map_err(|e| {
                CommError::io(rank, format!("opening rank {peer}'s {}", path.display()), e)
            })?;
            peers.push(Some(region::map_peer_buffer(&file).map_err(|e| {
                CommError::io(rank, format!("mapping rank {peer}'s {}", path.display()), e)
            })?));
        }
        self.buffers.insert(id, Arc::new(peers));
        // Every rank has mapped every file: the names can go.
        self.barrier_wait(call, false)?;
        Ok(own)
    }

    /// Creates this rank's file of shared buffer `call.buffer`, maps every peer's, and
    /// removes the names (the mappings keep the memory alive).
    pub(super) fn create_shared_buffer(
        &mut self,
        call: &CallDesc,
        bytes: usize,
    ) -> Result<Option<MmapMut>, CommError> {
        let id = call.buffer.unwrap_or(u32::MAX);
        let result = self.create_shared_inner(call, id, bytes);
        // Whatever happened, no name stays in /dev/shm: mappings keep the memory alive.
        let _ = std::fs::remove_file(self.buffer_path(id, self.rank));
        result
    }

    /// All-reduces a shared buffer in place: each rank reduces its part straight from the
    /// peers' mappings, then copies the other parts from their owners.
    pub(super) fn all_reduce_in_shared(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        let (n, rank) = (self.world_size, self.rank);
        let peers = match call.buffer.and_then(|id| self.buffers.get(&id)) {
            Some(peers) => Arc::clone(peers),
            None => {
                return Err(CommError::Usage {
                    op: call.op.name(),
                    rank,
                    reason: "this buffer was not allocated by this group".into(),
                });
            }
        };
        if buf.len() <= IN_PLACE_MIN_BYTES {
            // Latency-bound: two barriers through the slots beat three in place.
            return Engine::all_reduce(self, call, buf, scale);
        }
        // Phase 1: every rank's input is in place.
        self.begin(call)?;
        if buf.is_empty() {
            return Ok(());
        }
        let len = buf.len();
        let elem = dtype.size();
        let peer = |p: usize, range: std::ops::Range<usize>| -> &[u8] {
            peers[p].as_ref().map_or(&[][..], |map| &map[range])
        };
        // Phase 2: reduce this rank's part from every peer's buffer, in place.
        let mine = chunk_bytes(len, elem, n, rank);
        for p in (0..n).filter(|&p| p != rank) {
            reduce_bytes(dtype, op, &mut buf[mine.clone()], peer(p, mine.clone()));
        }
        if let Some(factor) = scale {
            scale_bytes(dtype, &mut buf[mine], factor);
        }
        self.barrier_wait(call, false)?;
        // Phase 3: copy the other parts from their owners.
        for p in (0..n).filter(|&p| p != rank) {
            let theirs = chunk_bytes(len, elem, n, p);
            buf[theirs.clone()].copy_from_slice(peer(p, theirs));
        }
        // Phase 4: nobody reads this rank's buffer any more, so the caller may write it.
        self.barrier_wait(call, false)
    }
}
