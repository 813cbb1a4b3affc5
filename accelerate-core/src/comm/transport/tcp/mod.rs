//! TCP transport: one connection per pair of ranks, for ranks on different hosts.
//!
//! The higher rank of each pair connects to the lower one's listener (advertised through the
//! rendezvous) and opens with the job's challenge-response ([`crate::comm::auth`], set up in `connect`),
//! which also authenticates its rank, so a stray connection is closed. A host that vanished
//! is reported within the heartbeat timeout: idle connections are probed by the kernel
//! (keepalive), and a rank that waits checks, about once a second, whether data it sent has
//! gone unacknowledged for that long (`TCP_INFO`). A peer that is alive but not reading (late
//! to a large broadcast, busy evaluating) still acknowledges what it received and answers
//! the kernel's zero-window probes, so it is waited for, up to the collective timeout: there
//! is no `TCP_USER_TIMEOUT`, which since Linux 5.11 also aborts a connection whose receiver
//! advertised a zero window for that long.
//!
//! Data moves on the caller's thread, as Open MPI's TCP transport does: sockets are
//! non-blocking, a send writes straight from the caller's buffer and keeps only what the kernel
//! did not take, and every wait (for a peer's bytes, or for the end of a collective) is one
//! `poll` that also drains those leftovers. A send therefore never waits for its receiver (ring
//! schedules send before they receive), yet there is no writer thread to wake per message and
//! no copy of what the kernel accepts at once. A closed or reset connection is reported as the
//! peer being gone at once. Small reads go through a read-ahead buffer, so a small message
//! (header and payload) arrives in one `read`. A read that finds nothing retries briefly
//! before it sleeps in `poll` (`Spin`): a peer on another core answers within
//! microseconds, and a wake-up from `poll` costs more than that.

use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout};

use crate::comm::call::{HEADER_BYTES, Header};
use crate::comm::link::{Link, LinkError};

mod connect;

/// How long dropping a link waits for its last bytes to reach the kernel (a peer that reads
/// nothing for 30 s is stuck or gone).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a waiting rank checks that what it sent is being acknowledged.
const DELIVERY_CHECK: Duration = Duration::from_secs(1);
/// How long a read that finds nothing keeps retrying before it sleeps in `poll`: a peer's
/// reply usually lands within tens of microseconds, and waking from `poll` costs a scheduler
/// round trip (several microseconds, more on a virtual machine) on every message.
const SPIN: Duration = Duration::from_micros(50);
/// While spinning does not pay, one wait in this many still tries it.
const SPIN_PROBE_EVERY: u32 = 64;
/// Reads of less than this go through a per-peer buffer that also takes whatever follows (the
/// payload behind a header, the next message), so a small message costs one `read`, not two.
const READ_AHEAD: usize = 64 << 10;

struct Peer {
    stream: TcpStream,
    addr: SocketAddr,
    /// Bytes sent but not yet taken by the kernel, from `out_pos` on.
    out: Vec<u8>,
    out_pos: usize,
    /// The first write error: the peer is gone.
    failed: Option<LinkError>,
    /// Bytes read ahead, not yet asked for: `inbox[in_pos..in_end]`.
    inbox: Vec<u8>,
    in_pos: usize,
    in_end: usize,
}

impl Peer {
    fn pending(&self) -> bool {
        self.failed.is_none() && self.out_pos < self.out.len()
    }

    /// Writes what the kernel takes now of the leftovers; an error marks the peer failed.
    fn drain(&mut self, heartbeat: Duration) {
        while self.pending() {
            match self.stream.write(&self.out[self.out_pos..]) {
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    self.failed = Some(describe_loss(self.addr, heartbeat)(e));
                    return;
                }
            }
        }
        self.out.clear();
        self.out_pos = 0;
    }
}

/// One rank's connections to every other rank.
pub struct TcpLink {
    rank: usize,
    peers: Vec<Option<Peer>>,
    heartbeat: Duration,
    /// When the delivery of sent data was last checked.
    checked_delivery: Instant,
    /// How long an empty read retries before sleeping.
    spin: Spin,
}

/// How long an empty read retries before it sleeps, adapted to what retrying achieves. When
/// the peer shares this rank's core (the scheduler put both there, or there are more ranks
/// than cores) its reply cannot come while we spin, so every spin runs out: the budget
/// halves on each miss down to nothing, is tried again now and then, and returns in full as
/// soon as a reply lands within it.
struct Spin {
    /// The budget after a hit: [`SPIN`], or zero when this host has more ranks than cores.
    full: Duration,
    now: Duration,
    /// Waits since the budget fell to zero.
    idle: u32,
}

impl Spin {
    fn new(full: Duration) -> Self {
        Self {
            full,
            now: full,
            idle: 0,
        }
    }

    /// The budget of the next wait.
    fn budget(&mut self) -> Duration {
        if !self.now.is_zero() {
            return self.now;
        }
        self.idle = self.idle.wrapping_add(1);
        if self.idle.is_multiple_of(SPIN_PROBE_EVERY) {
            self.full
        } else {
            Duration::ZERO
        }
    }

    /// The bytes came while spinning.
    fn hit(&mut self) {
        self.now = self.full;
    }

    /// The spin ran out.
    fn miss(&mut self) {
        self.now /= 2;
        if self.now < Duration::from_micros(2) {
            self.now = Duration::ZERO;
        }
    }
}

impl TcpLink {
    fn peer(&mut self, peer: usize) -> Result<&mut Peer, LinkError> {
        let p = self
            .peers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| LinkError::Lost("no connection".into()))?;
        match &p.failed {
            Some(e) => Err(e.clone()),
            None => Ok(p),
        }
    }
}

impl TcpLink {
    /// One wait: until `reading` (if any) has bytes or an error, or until `deadline`, draining
    /// every peer's leftovers as their sockets accept more.
    fn wait(&mut self, reading: Option<usize>, deadline: Instant) -> Result<(), LinkError> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(LinkError::Timeout);
        }
        self.check_delivery();
        if let Some(e) = reading.and_then(|i| self.peers[i].as_ref()?.failed.clone()) {
            return Err(e);
        }
        // Short enough for the delivery check to run about once a second while we wait.
        let left = left.min(DELIVERY_CHECK);
        let heartbeat = self.heartbeat;
        let mut who = Vec::with_capacity(self.peers.len());
        let mut fds = Vec::with_capacity(self.peers.len());
        for (i, peer) in self.peers.iter().enumerate() {
            let Some(peer) = peer else { continue };
            let mut events = PollFlags::empty();
            if reading == Some(i) {
                events |= PollFlags::POLLIN;
            }
            if peer.pending() {
                events |= PollFlags::POLLOUT;
            }
            if !events.is_empty() {
                who.push(i);
                fds.push(PollFd::new(peer.stream.as_fd(), events));
            }
        }
        let ms = u16::try_from(left.as_millis().max(1)).unwrap_or(u16::MAX);
        match nix::poll::poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(LinkError::Lost(format!("poll: {e}"))),
        }
        let writable: Vec<usize> = fds
            .iter()
            .zip(&who)
            .filter(|(fd, _)| {
                fd.revents().is_some_and(|r| {
                    r.intersects(PollFlags::POLLOUT | PollFlags::POLLERR | PollFlags::POLLHUP)
                })
            })
            .map(|(_, &i)| i)
            .collect();
        drop(fds);
        for i in writable {
            if let Some(peer) = self.peers[i].as_mut() {
                peer.drain(heartbeat);
            }
        }
        Ok(())
    }

    /// Marks lost every peer to which data has gone unacknowledged for the heartbeat timeout
    /// (its host is gone or the network is cut); at most once per [`DELIVERY_CHECK`].
    fn check_delivery(&mut self) {
        if self.checked_delivery.elapsed() < DELIVERY_CHECK {
            return;
        }
        self.checked_delivery = Instant::now();
        let heartbeat = self.heartbeat;
        for peer in self.peers.iter_mut().flatten() {
            if peer.failed.is_some() {
                continue;
            }
            let Some(delivery) = super::tcp_info::delivery(&peer.stream) else {
                continue;
            };
            if delivery.unacked > 0 && delivery.since_last_ack >= heartbeat {
                peer.failed = Some(host_vanished(
                    peer.addr,
                    delivery.since_last_ack,
                    "what this rank sent there is unacknowledged",
                ));
            }
        }
    }

    /// Hands the kernel what it takes now of every peer's leftovers, without waiting.
    fn drain_all(&mut self) {
        let heartbeat = self.heartbeat;
        for peer in self.peers.iter_mut().flatten() {
            peer.drain(heartbeat);
        }
    }

    /// Fills `buf` from `peer` before `deadline`, draining leftovers while it waits.
    fn read_full(
        &mut self,
        peer: usize,
        buf: &mut [u8],
        deadline: Instant,
    ) -> Result<(), LinkError> {
        let heartbeat = self.heartbeat;
        // Set at the first empty read; `None` inside once the spin ran out.
        let mut spin_until: Option<Option<Instant>> = None;
        let p = self.peer(peer)?;
        let mut filled = (p.in_end - p.in_pos).min(buf.len());
        buf[..filled].copy_from_slice(&p.inbox[p.in_pos..p.in_pos + filled]);
        p.in_pos += filled;
        while filled < buf.len() {
            let p = self.peer(peer)?;
            let want = buf.len() - filled;
            // The inbox is empty here: everything in it was taken above.
            let read = if want >= READ_AHEAD {
                p.stream.read(&mut buf[filled..])
            } else {
                p.stream.read(&mut p.inbox).inspect(|&n| {
                    let take = n.min(want);
                    buf[filled..filled + take].copy_from_slice(&p.inbox[..take]);
                    (p.in_pos, p.in_end) = (take, n);
                })
            };
            match read {
                Ok(0) => return Err(LinkError::Lost("its connection closed".into())),
                Ok(n) => {
                    if let Some(Some(_)) = spin_until.take() {
                        self.spin.hit();
                    }
                    filled += n.min(want);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let spin = &mut self.spin;
                    let until = spin_until.get_or_insert_with(|| {
                        let budget = spin.budget();
                        (!budget.is_zero()).then(|| Instant::now() + budget)
                    });
                    match until {
                        Some(t) if Instant::now() < *t => {
                            self.drain_all();
                            std::hint::spin_loop();
                        }
                        Some(_) => {
                            self.spin.miss();
                            spin_until = Some(None);
                            self.wait(Some(peer), deadline)?;
                        }
                        None => self.wait(Some(peer), deadline)?,
                    }
                }
                Err(e) => return Err(describe_loss(p.addr, heartbeat)(e)),
            }
        }
        Ok(())
    }
}

impl Link for TcpLink {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.peers.len()
    }

    fn name(&self) -> &'static str {
        "tcp"
    }

    fn send(&mut self, peer: usize, header: &Header, payload: &[u8]) -> Result<(), LinkError> {
        let heartbeat = self.heartbeat;
        let p = self.peer(peer)?;
        let head = header.encode();
        let mut written = 0;
        if !p.pending() {
            // Straight from the caller's buffers, for as long as the kernel takes them.
            let total = HEADER_BYTES + payload.len();
            while written < total {
                let slices = if written < HEADER_BYTES {
                    [IoSlice::new(&head[written..]), IoSlice::new(payload)]
                } else {
                    [
                        IoSlice::new(&payload[written - HEADER_BYTES..]),
                        IoSlice::new(&[]),
                    ]
                };
                match p.stream.write_vectored(&slices) {
                    Ok(n) => written += n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => {
                        let lost = describe_loss(p.addr, heartbeat)(e);
                        p.failed = Some(lost.clone());
                        return Err(lost);
                    }
                }
            }
        }
        // Whatever the kernel did not take waits for the next `poll` (ours, in this or the
        // next call); only this part is copied.
        if written < HEADER_BYTES {
            p.out.extend_from_slice(&head[written..]);
            p.out.extend_from_slice(payload);
        } else if written < HEADER_BYTES + payload.len() {
            p.out.extend_from_slice(&payload[written - HEADER_BYTES..]);
        }
        Ok(())
    }

    fn recv_header(&mut self, peer: usize, deadline: Instant) -> Result<Header, LinkError> {
        let mut raw = [0u8; HEADER_BYTES];
        self.read_full(peer, &mut raw, deadline)?;
        Header::decode(&raw)
            .ok_or_else(|| LinkError::Lost("it sent bytes that are not a message header".into()))
    }

    fn recv_payload(
        &mut self,
        peer: usize,
        buf: &mut Vec<u8>,
        len: usize,
        deadline: Instant,
    ) -> Result<(), LinkError> {
        // Every byte is overwritten: only growth needs zeroing (fresh large allocations per
        // message would cost a page fault per 4 KiB).
        if buf.len() < len {
            buf.resize(len, 0);
        }
        buf.truncate(len);
        self.read_full(peer, buf, deadline)
    }

    fn flush(&mut self, deadline: Instant) -> Result<(), (usize, LinkError)> {
        loop {
            if let Some((i, e)) = self
                .peers
                .iter()
                .enumerate()
                .find_map(|(i, p)| p.as_ref().and_then(|p| p.failed.clone().map(|e| (i, e))))
            {
                return Err((i, e));
            }
            let Some(first) = self
                .peers
                .iter()
                .position(|p| p.as_ref().is_some_and(Peer::pending))
            else {
                return Ok(());
            };
            self.wait(None, deadline).map_err(|e| (first, e))?;
        }
    }
}

/// How a failed read from the peer at `addr` is reported.
fn describe_loss(addr: SocketAddr, heartbeat: Duration) -> impl Fn(std::io::Error) -> LinkError {
    move |e| {
        // The kernel gave up on the peer: its keepalive probes went unanswered (TimedOut), or
        // the network said the host cannot be reached while they were being sent.
        let vanished = matches!(
            e.kind(),
            ErrorKind::TimedOut | ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable
        );
        match vanished {
            true => host_vanished(addr, heartbeat, e),
            false => LinkError::Lost(format!("connection to {addr}: {e}")),
        }
    }
}

/// The peer at `addr` showed no sign of life for `silent` (`why`: what showed it).
fn host_vanished(addr: SocketAddr, silent: Duration, why: impl std::fmt::Display) -> LinkError {
    LinkError::Lost(format!(
        "no sign of life from its host {addr} for {} s ({why}): the host is down or the \
         network between is cut (ACCELERATE_HEARTBEAT_TIMEOUT)",
        silent.as_secs()
    ))
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        // The last messages of the last collective reach the kernel before the connections
        // close (bounded: a peer that reads nothing is stuck or gone), so a normal exit never
        // truncates a peer's final message.
        let _ = self.flush(Instant::now() + DRAIN_TIMEOUT);
        for peer in self.peers.iter().flatten() {
            let _ = peer.stream.shutdown(Shutdown::Write);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::connect::set_heartbeat;
    use super::*;

    #[test]
    fn spinning_stops_when_it_never_pays_and_returns_when_it_does() {
        let mut spin = Spin::new(SPIN);
        assert_eq!(spin.budget(), SPIN);
        // A peer sharing our core: every spin runs out, so the budget halves to nothing.
        let mut misses = 0;
        while !spin.budget().is_zero() {
            spin.miss();
            misses += 1;
        }
        assert!(misses <= 6, "{misses} misses before giving up");
        // Then one wait in SPIN_PROBE_EVERY tries the full spin again...
        let probes = (0..SPIN_PROBE_EVERY * 3)
            .filter(|_| spin.budget() == SPIN)
            .count();
        assert_eq!(probes, 3);
        // ...and a reply within it brings the budget back for every wait.
        spin.hit();
        assert_eq!(spin.budget(), SPIN);
        assert_eq!(spin.budget(), SPIN);
    }

    /// Every heartbeat the options accept (up to 30 days) sets up a connection: keepalive
    /// values stay within what Linux takes.
    #[test]
    fn any_accepted_heartbeat_sets_up_keepalive() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        for secs in [
            0,
            4,
            30,
            98_301,
            98_302,
            100_000,
            crate::wait::MAX_WAIT.as_secs(),
        ] {
            set_heartbeat(&stream, Duration::from_secs(secs))
                .unwrap_or_else(|e| panic!("heartbeat {secs} s: {e}"));
        }
    }

    #[test]
    fn more_ranks_than_cores_never_spin() {
        let mut spin = Spin::new(Duration::ZERO);
        assert!((0..SPIN_PROBE_EVERY * 2).all(|_| spin.budget().is_zero()));
        spin.hit();
        assert!(spin.budget().is_zero());
    }
}
