//! The message-passing engine: a [`Link`] plus timeouts, header checks and failure reporting.

use std::time::{Duration, Instant};

use crate::comm::call::{CallDesc, Header, OpKind};
use crate::comm::engine::{Engine, Split, part_of};
use crate::comm::link::{Link, LinkError};
use crate::error::CommError;

/// Longest abort reason read from a peer, in bytes.
const MAX_ABORT_BYTES: usize = 64 << 10;

pub use crate::settings::AllReduceAlgorithm;

/// Collectives over a message link.
pub struct MessageEngine<L: Link> {
    pub(super) link: L,
    timeout: Duration,
    algorithm: AllReduceAlgorithm,
    /// Elements per ring chunk at most; larger buffers go round in several windows.
    pub(super) segment_bytes: usize,
    /// The last payload received, kept so that its allocation serves the next one.
    inbox: Vec<u8>,
}

impl<L: Link> MessageEngine<L> {
    /// Buffers up to this size use recursive doubling under [`AllReduceAlgorithm::Auto`].
    pub const SMALL_BYTES: usize = 64 * 1024;

    /// An engine over `link`; every wait gives up after `timeout`.
    pub fn new(
        link: L,
        timeout: Duration,
        algorithm: AllReduceAlgorithm,
        segment_bytes: usize,
    ) -> Self {
        Self {
            link,
            timeout,
            algorithm,
            segment_bytes: segment_bytes.max(1),
            inbox: Vec::new(),
        }
    }

    /// The link back, for another engine to take over.
    pub fn into_link(self) -> L {
        self.link
    }

    pub(crate) fn rank(&self) -> usize {
        self.link.rank()
    }

    pub(super) fn world_size(&self) -> usize {
        self.link.world_size()
    }

    pub(super) fn deadline(&self) -> Instant {
        crate::wait::deadline_after(self.timeout)
    }

    pub(super) fn send(
        &mut self,
        peer: usize,
        call: &CallDesc,
        payload: &[u8],
    ) -> Result<(), CommError> {
        let header = Header {
            call: *call,
            sender: self.rank() as u32,
            payload_len: payload.len() as u64,
        };
        self.link
            .send(peer, &header, payload)
            .map_err(|e| self.link_error(call, peer, e, Instant::now()))
    }

    /// The next message from `peer`, which must belong to `call` and carry `expect` bytes.
    /// Every field of the header is checked before anything is allocated for the payload.
    pub(super) fn recv(
        &mut self,
        peer: usize,
        call: &CallDesc,
        expect: usize,
        deadline: Instant,
    ) -> Result<&[u8], CommError> {
        let started = deadline - self.timeout;
        let lost = |this: &Self, e| this.link_error(call, peer, e, started);
        let header = self
            .link
            .recv_header(peer, deadline)
            .map_err(|e| lost(self, e))?;
        if header.sender as usize != peer {
            return Err(lost(
                self,
                LinkError::Lost(format!(
                    "its message claims to come from rank {}",
                    header.sender
                )),
            ));
        }
        if header.call.op == OpKind::Abort {
            let reason = match usize::try_from(header.payload_len) {
                Ok(len) if len <= MAX_ABORT_BYTES => {
                    let mut bytes = Vec::new();
                    self.link
                        .recv_payload(peer, &mut bytes, len, deadline)
                        .map_err(|e| lost(self, e))?;
                    String::from_utf8_lossy(&bytes).into_owned()
                }
                _ => format!("(a reason of {} bytes, not read)", header.payload_len),
            };
            return Err(CommError::PeerFailed {
                call: call.to_string(),
                rank: self.rank(),
                peer,
                reason,
            });
        }
        if header.call != *call {
            return Err(CommError::Mismatch {
                rank: self.rank(),
                ours: format!("called {call}"),
                peer,
                theirs: format!("called {}", header.call),
            });
        }
        if header.payload_len != expect as u64 {
            return Err(CommError::Mismatch {
                rank: self.rank(),
                ours: format!("expects {expect} bytes of {call} from it"),
                peer,
                theirs: format!("sent {} bytes", header.payload_len),
            });
        }
        let mut inbox = std::mem::take(&mut self.inbox);
        let received = self.link.recv_payload(peer, &mut inbox, expect, deadline);
        self.inbox = inbox;
        received.map_err(|e| lost(self, e))?;
        Ok(&self.inbox)
    }

    /// Sends `payload` to `to`, then receives `expect` bytes from `from`.
    pub(super) fn exchange(
        &mut self,
        call: &CallDesc,
        to: usize,
        payload: &[u8],
        from: usize,
        expect: usize,
        deadline: Instant,
    ) -> Result<&[u8], CommError> {
        self.send(to, call, payload)?;
        self.recv(from, call, expect, deadline)
    }

    fn link_error(
        &self,
        call: &CallDesc,
        peer: usize,
        error: LinkError,
        started: Instant,
    ) -> CommError {
        match error {
            LinkError::Timeout => CommError::Timeout {
                call: call.to_string(),
                rank: self.rank(),
                world_size: self.world_size(),
                missing: vec![peer],
                elapsed_s: started.elapsed().as_secs_f64(),
            },
            LinkError::Lost(detail) => CommError::PeerLost {
                call: call.to_string(),
                rank: self.rank(),
                peer,
                detail,
            },
        }
    }

    /// Ends a collective: what this rank sent has left the process (its peers are reading it,
    /// in the same call), so nothing of it waits for this rank's next call.
    fn finish(&mut self, call: &CallDesc, result: Result<(), CommError>) -> Result<(), CommError> {
        result?;
        let started = Instant::now();
        let deadline = started + self.timeout;
        self.link
            .flush(deadline)
            .map_err(|(peer, e)| self.link_error(call, peer, e, started))
    }

    fn use_ring(&self, bytes: usize) -> bool {
        match self.algorithm {
            AllReduceAlgorithm::Ring => true,
            AllReduceAlgorithm::RecursiveDoubling => false,
            AllReduceAlgorithm::Auto => bytes > Self::SMALL_BYTES,
        }
    }
}

impl<L: Link + 'static> Engine for MessageEngine<L> {
    fn name(&self) -> &'static str {
        self.link.name()
    }

    fn all_reduce(
        &mut self,
        call: &CallDesc,
        buf: &mut [u8],
        scale: Option<f32>,
    ) -> Result<(), CommError> {
        let (dtype, op) = call.reduction(self.rank())?;
        let result = if self.use_ring(buf.len()) {
            self.all_reduce_ring(call, buf, dtype, op, scale)
        } else {
            self.all_reduce_recursive_doubling(call, buf, dtype, op, scale)
        };
        self.finish(call, result)
    }

    fn broadcast(&mut self, call: &CallDesc, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        let result = self.broadcast_tree(call, buf, root);
        self.finish(call, result)
    }

    fn all_gather(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
    ) -> Result<(), CommError> {
        let result = self.all_gather_ring(call, input, output);
        self.finish(call, result)
    }

    fn reduce_scatter(
        &mut self,
        call: &CallDesc,
        input: &[u8],
        output: &mut [u8],
        counts: &[usize],
    ) -> Result<(), CommError> {
        let (dtype, op) = call.reduction(self.rank())?;
        let result = self.reduce_scatter_ring(call, input, output, dtype, op, counts);
        self.finish(call, result)
    }

    fn barrier(&mut self, call: &CallDesc) -> Result<(), CommError> {
        let result = self.barrier_dissemination(call);
        self.finish(call, result)
    }

    fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    fn split(&mut self, _call: &CallDesc, parts: &[Vec<usize>]) -> Result<Split, CommError> {
        // Over the same connections: a view of the part's ranks, when the link is shared.
        let mine = part_of(parts, self.rank());
        Ok(match self.link.view(mine) {
            None => Split::Unsupported,
            Some(_) if mine.len() == 1 => Split::Alone,
            Some(view) => Split::Formed(Box::new(MessageEngine::new(
                view,
                self.timeout,
                self.algorithm,
                self.segment_bytes,
            ))),
        })
    }

    fn abort(&mut self, reason: &str) {
        let call = CallDesc::new(OpKind::Abort, u64::MAX);
        for peer in 0..self.world_size() {
            if peer != self.rank() {
                let _ = self.send(peer, &call, reason.as_bytes());
            }
        }
        // Briefly: the peers that are still there read it at once.
        let _ = self.link.flush(Instant::now() + Duration::from_secs(2));
    }
}
