//! The engine of a group spanning hosts with several ranks per host. Only one copy of the
//! data crosses the network per host instead of every rank's, in one of two ways:
//!
//! - **Rails** (every host has the same number L of ranks, and the buffer splits into L equal
//!   slices): a shared-memory reduce-scatter inside each host leaves local rank i with its
//!   host's sum of slice i; local rank i of every host all-reduces that slice over TCP with
//!   the others of index i (L TCP all-reduces of 1/L of the data each, in parallel, so every
//!   rank works, as NCCL's rings do across nodes); a shared-memory all-gather puts the slices
//!   back together.
//! - **Leaders** (otherwise): a shared-memory all-reduce inside each host, a TCP all-reduce
//!   among one leader per host (its lowest rank), and a shared-memory broadcast from it.
//!
//! Small all-reduces (up to 64 KiB, latency-bound) and the other collectives run flat over TCP
//! between every pair. Every value is reduced once, in one order, and then copied, so all
//! ranks end with identical bits.

use std::time::Duration;

use accelerate_kernels::reduce::scale_bytes;

use super::call::CallDesc;
use super::collective::{AllReduceAlgorithm, MessageEngine};
use super::engine::{Engine, Split, even_counts, part_of};
use super::link::Link;
use super::sub_link::SubLink;
use super::transport::shm::ShmEngine;
use super::transport::tcp::TcpLink;
use crate::error::CommError;

/// Buffers up to this size are all-reduced flat (recursive doubling over TCP).
const SMALL_BYTES: usize = 64 << 10;

/// Shared memory inside the host, TCP among the hosts' leaders or along rails, TCP between
/// all for the rest.
pub struct HierarchicalEngine<L: Link = TcpLink> {
    flat: MessageEngine<SubLink<L>>,
    /// Global ranks on this rank's host (its own alone when no other shares it).
    host: Vec<usize>,
    /// This rank.
    rank: usize,
    leaders: Option<MessageEngine<SubLink<L>>>,
    /// This rank's rail: the ranks of its local index on every host (equal hosts only).
    rail: Option<MessageEngine<SubLink<L>>>,
    local: Option<ShmEngine>,
    /// This rank's slice between the reduce-scatter and the all-gather.
    slice: Vec<u8>,
}

/// How a hierarchical engine is put together.
pub struct Layout {
    /// Global ranks on each host, hosts in order of their lowest rank.
    pub hosts: Vec<Vec<usize>>,
    /// This rank.
    pub rank: usize,
}

impl<L: Link> HierarchicalEngine<L> {
    /// The engine of `rank` over `link` (every pair connected) and `local` (this host's
    /// shared-memory group, `None` when alone on its host).
    pub fn new(
        link: L,
        layout: &Layout,
        local: Option<ShmEngine>,
        timeout: Duration,
        algorithm: AllReduceAlgorithm,
        segment_bytes: usize,
    ) -> Self {
        let whole = SubLink::whole(link);
        let engine = |view| MessageEngine::new(view, timeout, algorithm, segment_bytes);
        let leader_ranks: Vec<usize> = layout.hosts.iter().map(|h| h[0]).collect();
        let leaders = whole.view(&leader_ranks).map(engine);
        let host = layout
            .hosts
            .iter()
            .find(|h| h.contains(&layout.rank))
            .cloned()
            .unwrap_or_else(|| vec![layout.rank]);
        let local_size = host.len();
        let equal_hosts = layout.hosts.iter().all(|h| h.len() == local_size);
        let rail = (equal_hosts && local_size > 1 && local.is_some())
            .then(|| {
                let index = host.iter().position(|&r| r == layout.rank).unwrap_or(0);
                let members: Vec<usize> = layout.hosts.iter().map(|h| h[index]).collect();
                whole.view(&members).map(engine)
            })
            .flatten();
        Self {
            flat: engine(whole),
            host,
            rank: layout.rank,
            leaders,
            rail,
            local,
            slice: Vec::new(),
        }
    }
}

impl<L: Link + 'static> Engine for HierarchicalEngine<L> {
    fn name(&self) -> &'static str {
        "tcp+shm"
    }

    fn all_reduce(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        // Small buffers are latency-bound: one flat exchange beats three stages. The size is
        // the same on every rank, so every rank makes the same choice.
        if buf.len() <= SMALL_BYTES {
            return self.flat.all_reduce(call, buf, scale);
        }
        let (dtype, _) = call.reduction(self.flat.rank())?;
        let elements = buf.len() / dtype.size();
        if let (Some(rail), Some(local)) = (self.rail.as_mut(), self.local.as_mut())
            && elements.is_multiple_of(self.host.len())
        {
            // Every rank sees the same length, so every rank takes this path or none does.
            self.slice.resize(buf.len() / self.host.len(), 0);
            let counts = even_counts(elements, self.host.len());
            local.reduce_scatter(call, buf, &mut self.slice, &counts)?;
            rail.all_reduce(call, &mut self.slice, None)?;
            if let Some(factor) = scale {
                scale_bytes(dtype, &mut self.slice, factor);
            }
            local.all_gather(call, &self.slice, buf)?;
            return Ok(());
        }
        if let Some(local) = self.local.as_mut() {
            local.all_reduce(call, buf, None)?;
        }
        if let Some(leaders) = self.leaders.as_mut() {
            leaders.all_reduce(call, buf, None)?;
        }
        if let Some(local) = self.local.as_mut() {
            local.broadcast(call, buf, 0)?;
        }
        if let Some(factor) = scale {
            scale_bytes(dtype, buf, factor);
        }
        Ok(())
    }

    fn broadcast(&mut self, call: &CallDesc, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        self.flat.broadcast(call, buf, root)
    }

    fn all_gather(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), CommError> {
        self.flat.all_gather(call, input, output)
    }

    fn reduce_scatter(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
    ) -> Result<(), CommError> {
        self.flat.reduce_scatter(call, input, output, counts)
    }

    fn barrier(&mut self, call: &CallDesc) -> Result<(), CommError> {
        self.flat.barrier(call)
    }

    fn abort(&mut self, reason: &str) {
        if let Some(local) = self.local.as_mut() {
            local.abort(reason);
        }
        self.flat.abort(reason);
    }

    fn abort_notice(&self) -> Option<std::sync::Arc<dyn crate::comm::engine::AbortNotice>> {
        // This host's ranks; those of other hosts learn over TCP when this rank's own groups
        // tell them, or see its connections close.
        self.local.as_ref().and_then(|local| local.abort_notice())
    }

    fn split(&mut self, call: &CallDesc, parts: &[Vec<usize>]) -> Result<Split, CommError> {
        let host = &self.host;
        let on_host = |part: &[usize]| part.iter().all(|r| host.contains(r));
        let local_index = |rank: usize| host.iter().position(|&r| r == rank);
        // Every rank of this host splits the host's shared memory at once, whatever its own
        // part: the parts inside the host get a segment (by local index); a rank whose part
        // spans hosts is alone there.
        let local_parts: Vec<Vec<usize>> = host
            .iter()
            .map(|&rank| {
                let part = part_of(parts, rank);
                if on_host(part) {
                    part.iter().filter_map(|&r| local_index(r)).collect()
                } else {
                    local_index(rank).into_iter().collect()
                }
            })
            .collect();
        let shm = match self.local.as_mut() {
            Some(local) => local.split_part(call, &local_parts)?,
            None => None,
        };
        let mine = part_of(parts, self.rank);
        match shm {
            Some(engine) => Ok(Split::Formed(Box::new(engine))),
            None if mine.len() <= 1 => Ok(Split::Alone),
            // A part across hosts: TCP between its ranks, over the same connections.
            None => self.flat.split(call, parts),
        }
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.flat.set_timeout(timeout);
        if let Some(leaders) = self.leaders.as_mut() {
            leaders.set_timeout(timeout);
        }
        if let Some(rail) = self.rail.as_mut() {
            rail.set_timeout(timeout);
        }
        if let Some(local) = self.local.as_mut() {
            local.set_timeout(timeout);
        }
    }
}
