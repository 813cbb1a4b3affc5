//! The engine of a group spanning hosts with several ranks per host: an all-reduce is a
//! shared-memory all-reduce inside each host, a TCP all-reduce among one leader per host (the
//! host's lowest rank), and a shared-memory broadcast from the leader; so only one copy of the
//! data crosses the network per host instead of every rank's. Small all-reduces (up to 64 KiB,
//! latency-bound) and the other collectives run flat over TCP between every pair, as before.
//!
//! Every rank reduces the same values in the same order (its host's sum, then the leaders'
//! combination, then the leader's bits copied), so all ranks end with identical bits.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use accelerate_kernels::reduce::scale_bytes;
use accelerate_kernels::{DType, ReduceOp};

use super::call::{CallDesc, Header};
use super::collective::{AllReduceAlgorithm, MessageEngine};
use super::engine::Engine;
use super::link::{Link, LinkError};
use super::transport::shm::ShmEngine;
use super::transport::tcp::TcpLink;
use crate::error::CommError;

/// Buffers up to this size are all-reduced flat (recursive doubling over TCP).
const SMALL_BYTES: usize = 64 << 10;

/// A view of a shared TCP link restricted to some ranks, renumbered from 0 in the order of
/// `members` (so an engine over it sees a group of `members.len()` ranks).
pub struct SubLink {
    link: Arc<Mutex<TcpLink>>,
    members: Vec<usize>,
    me: usize,
}

impl SubLink {
    fn lock(&self) -> std::sync::MutexGuard<'_, TcpLink> {
        self.link.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Link for SubLink {
    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn name(&self) -> &'static str {
        "tcp"
    }

    fn send(&mut self, peer: usize, header: &Header, payload: &[u8]) -> Result<(), LinkError> {
        let to = self.members[peer];
        self.lock().send(to, header, payload)
    }

    fn recv_header(&mut self, peer: usize, deadline: Instant) -> Result<Header, LinkError> {
        let from = self.members[peer];
        self.lock().recv_header(from, deadline)
    }

    fn recv_payload(
        &mut self,
        peer: usize,
        buf: &mut Vec<u8>,
        len: usize,
        deadline: Instant,
    ) -> Result<(), LinkError> {
        let from = self.members[peer];
        self.lock().recv_payload(from, buf, len, deadline)
    }

    fn flush(&mut self, deadline: Instant) -> Result<(), (usize, LinkError)> {
        let members = self.members.clone();
        self.lock().flush(deadline).map_err(|(peer, e)| {
            // Name the peer in this view when it is a member (it always is for our sends).
            (members.iter().position(|&m| m == peer).unwrap_or(peer), e)
        })
    }
}

/// Shared memory inside the host, TCP among the hosts' leaders, TCP between all for the rest.
pub struct HierarchicalEngine {
    flat: MessageEngine<SubLink>,
    leaders: Option<MessageEngine<SubLink>>,
    local: Option<ShmEngine>,
}

/// How a hierarchical engine is put together.
pub struct Layout {
    /// Global ranks on each host, hosts in order of their lowest rank.
    pub hosts: Vec<Vec<usize>>,
    /// This rank.
    pub rank: usize,
}

impl HierarchicalEngine {
    /// The engine of `rank` over `link` (every pair connected) and `local` (this host's
    /// shared-memory group, `None` when alone on its host).
    pub fn new(
        link: TcpLink,
        layout: &Layout,
        local: Option<ShmEngine>,
        timeout: Duration,
        algorithm: AllReduceAlgorithm,
        segment_bytes: usize,
    ) -> Self {
        let world_size: usize = layout.hosts.iter().map(Vec::len).sum();
        let link = Arc::new(Mutex::new(link));
        let view = |members: Vec<usize>, me: usize| SubLink {
            link: Arc::clone(&link),
            members,
            me,
        };
        let flat = MessageEngine::new(
            view((0..world_size).collect(), layout.rank),
            timeout,
            algorithm,
            segment_bytes,
        );
        let leader_ranks: Vec<usize> = layout.hosts.iter().map(|h| h[0]).collect();
        let leaders = leader_ranks
            .iter()
            .position(|&r| r == layout.rank)
            .map(|me| {
                MessageEngine::new(
                    view(leader_ranks.clone(), me),
                    timeout,
                    algorithm,
                    segment_bytes,
                )
            });
        Self {
            flat,
            leaders,
            local,
        }
    }
}

impl Engine for HierarchicalEngine {
    fn name(&self) -> &'static str {
        "tcp+shm"
    }

    fn all_reduce(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        // Small buffers are latency-bound: one flat exchange beats three stages. The size is
        // the same on every rank, so every rank makes the same choice.
        if buf.len() <= SMALL_BYTES {
            return self.flat.all_reduce(call, buf, dtype, op, scale);
        }
        if let Some(local) = self.local.as_mut() {
            local.all_reduce(call, buf, dtype, op, None)?;
        }
        if let Some(leaders) = self.leaders.as_mut() {
            leaders.all_reduce(call, buf, dtype, op, None)?;
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
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.flat.reduce_scatter(call, input, output, dtype, op)
    }

    fn barrier(&mut self, call: &CallDesc) -> Result<(), CommError> {
        self.flat.barrier(call)
    }

    fn abort(&mut self, error: &CommError) {
        if let Some(local) = self.local.as_mut() {
            local.abort(error);
        }
        self.flat.abort(error);
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.flat.set_timeout(timeout);
        if let Some(leaders) = self.leaders.as_mut() {
            leaders.set_timeout(timeout);
        }
        if let Some(local) = self.local.as_mut() {
            local.set_timeout(timeout);
        }
    }
}
