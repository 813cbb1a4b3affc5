//! One link shared by several engines: [`SubLink`], a view of it restricted to some ranks.
//! A group formed over TCP (or channels) keeps its link behind a view of every rank, so that
//! the hierarchical engine's stages and the groups split from it
//! ([`ProcessGroup::split`](super::ProcessGroup::split)) reuse its connections. Engines take
//! turns on it: every rank makes its collectives in one order, and two ranks exchange the
//! messages of the collectives they share in that order, so each view reads its own.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::call::Header;
use super::link::{Link, LinkError};
use super::transport::tcp::TcpLink;

/// A view of a shared link restricted to some of its ranks, renumbered from 0 in the order
/// of `members` (so an engine over it sees a group of `members.len()` ranks). `L` is the TCP
/// link in a job (channels in tests, any [`Link`] in the fuzz tests).
pub struct SubLink<L = TcpLink> {
    link: Arc<Mutex<L>>,
    /// Ranks of the shared link, in this view's order.
    members: Vec<usize>,
    /// This rank in the view.
    me: usize,
}

impl<L: Link> SubLink<L> {
    /// A view of every rank of `link`, from which narrower ones are taken.
    pub fn whole(link: L) -> Self {
        let (rank, world) = (link.rank(), link.world_size());
        Self {
            link: Arc::new(Mutex::new(link)),
            members: (0..world).collect(),
            me: rank,
        }
    }
}

impl<L> SubLink<L> {
    fn lock(&self) -> MutexGuard<'_, L> {
        self.link.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<L: Link> Link for SubLink<L> {
    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.members.len()
    }

    fn name(&self) -> &'static str {
        self.lock().name()
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
        let flushed = self.lock().flush(deadline);
        flushed.map_err(|(peer, e)| {
            // Name the peer in this view when it is a member (it always is for our sends).
            let index = self.members.iter().position(|&m| m == peer);
            (index.unwrap_or(peer), e)
        })
    }

    fn view(&self, members: &[usize]) -> Option<Self> {
        let me = members.iter().position(|&m| m == self.me)?;
        let members = members
            .iter()
            .map(|&m| self.members.get(m).copied())
            .collect::<Option<Vec<usize>>>()?;
        Some(Self {
            link: Arc::clone(&self.link),
            members,
            me,
        })
    }
}
