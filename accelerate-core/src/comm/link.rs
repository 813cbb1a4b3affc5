//! The interface of the message-passing transports: ordered, reliable messages between pairs
//! of ranks. Sends never wait for the receiver (what cannot go out yet is kept and goes out
//! while the rank waits), so schedules in which every rank sends before it receives cannot
//! deadlock; a collective ends with [`Link::flush`].

use std::time::Instant;

use super::call::Header;

/// Why a receive or send failed, before the collective adds its context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkError {
    /// Nothing arrived before the deadline.
    Timeout,
    /// The peer is gone (its end closed or reset).
    Lost(String),
}

/// Ordered, reliable messages to and from each peer.
pub trait Link: Send {
    /// This rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world_size(&self) -> usize;
    /// Short name of the transport ("local", "tcp").
    fn name(&self) -> &'static str;
    /// Queues a message for `peer`.
    fn send(&mut self, peer: usize, header: &Header, payload: &[u8]) -> Result<(), LinkError>;
    /// The header of the next message from `peer`, waiting until `deadline`.
    fn recv_header(&mut self, peer: usize, deadline: Instant) -> Result<Header, LinkError>;
    /// The payload of the message whose header [`recv_header`](Self::recv_header) just
    /// returned for `peer`, into `buf` (resized to `len`, its allocation reused): exactly `len`
    /// bytes, which the caller checked against the header and against what the call expects,
    /// so no length from the wire is trusted unchecked.
    fn recv_payload(
        &mut self,
        peer: usize,
        buf: &mut Vec<u8>,
        len: usize,
        deadline: Instant,
    ) -> Result<(), LinkError>;
    /// Waits until everything sent so far has left this process (for transports that keep
    /// what the kernel would not take yet); on failure, the peer at fault and why.
    fn flush(&mut self, _deadline: Instant) -> Result<(), (usize, LinkError)> {
        Ok(())
    }
    /// The same connections seen by `members` only (ranks of this link, this rank among
    /// them), renumbered from 0 in their order: the link of a group split from this one.
    /// `None` for a link that cannot be shared (one owned by a single engine).
    fn view(&self, members: &[usize]) -> Option<Self>
    where
        Self: Sized,
    {
        let _ = members;
        None
    }
}
