//! TCP transport: one connection per pair of ranks, for ranks on different hosts.
//!
//! The higher rank of each pair connects to the lower one's listener (advertised through the
//! rendezvous) and opens with the job's challenge-response ([`crate::comm::auth`]),
//! which also authenticates its rank, so a stray connection is closed. Idle connections are
//! probed by the kernel (keepalive, and a limit on unacknowledged data), so a host that
//! vanished is reported within the heartbeat timeout. Each connection has a writer thread fed by a queue, so a send
//! never waits for the peer to read (ring schedules send before they receive); reads happen on
//! the caller's thread with a deadline, and a closed or reset connection is reported as the
//! peer being gone at once.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::comm::auth::{self, AuthError, Claim, Purpose};
use crate::comm::call::{HEADER_BYTES, Header};
use crate::comm::link::{Link, LinkError};
use crate::comm::rendezvous::PeerInfo;
use crate::error::CommError;

/// A writer that cannot hand bytes to the kernel for this long gives up on its peer (a peer
/// that reads nothing for 30 s is stuck or gone; this also bounds how long dropping a link
/// waits for its queues to drain).
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one incoming connection may take to authenticate.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// Incoming connections authenticated at once; more are closed at once.
const MAX_PENDING: usize = 64;

struct Peer {
    reader: TcpStream,
    addr: SocketAddr,
    queue: Option<Sender<Vec<u8>>>,
    writer: Option<JoinHandle<()>>,
    write_error: Arc<Mutex<Option<String>>>,
}

/// One rank's connections to every other rank.
pub struct TcpLink {
    rank: usize,
    peers: Vec<Option<Peer>>,
    heartbeat: Duration,
}

impl TcpLink {
    /// Connects to every peer: connects to lower ranks, accepts higher ones on `listener`;
    /// every connection proves knowledge of `token` both ways. A vanished peer is reported
    /// after `heartbeat` without a sign of life from its host.
    pub fn connect(
        rank: usize,
        table: &[PeerInfo],
        listener: &TcpListener,
        token: &[u8],
        deadline: Instant,
        heartbeat: Duration,
    ) -> Result<Self, CommError> {
        let world_size = table.len();
        let mut streams: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        let claim = Claim {
            purpose: Purpose::PeerLink,
            rank: rank as u32,
            world_size: world_size as u32,
        };
        for peer in table.iter().filter(|p| p.rank < rank) {
            let context = || format!("connecting to rank {} at {}", peer.rank, peer.listen);
            let mut stream = loop {
                match TcpStream::connect_timeout(&peer.listen, Duration::from_secs(2)) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(peer = peer.rank, "connect failed, retrying: {e}");
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => return Err(CommError::io(rank, context(), e)),
                }
            };
            auth::join(&mut stream, token, claim, deadline).map_err(|e| CommError::Io {
                rank,
                context: context(),
                detail: match e {
                    AuthError::BadProof => format!(
                        "{e}: the rendezvous advertised a listener that is not rank {}'s",
                        peer.rank
                    ),
                    e => format!("authentication failed: {e}"),
                },
            })?;
            streams[peer.rank] = Some(stream);
        }
        accept_higher(rank, world_size, listener, token, deadline, &mut streams)?;
        let peers = streams
            .into_iter()
            .enumerate()
            .map(|(peer, stream)| {
                stream
                    .map(|s| spawn_peer(rank, peer, s, heartbeat))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            rank,
            peers,
            heartbeat,
        })
    }

    fn peer(&mut self, peer: usize) -> Result<&mut Peer, LinkError> {
        self.peers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| LinkError::Lost("no connection".into()))
    }
}

/// Accepts the connections of every higher rank, authenticating each on its own thread so
/// that a silent or garbage connection delays nobody; connections that fail are closed and
/// logged at debug level.
fn accept_higher(
    rank: usize,
    world_size: usize,
    listener: &TcpListener,
    token: &[u8],
    deadline: Instant,
    streams: &mut [Option<TcpStream>],
) -> Result<(), CommError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| CommError::io(rank, "peer listener", e))?;
    let (done, arrivals) = mpsc::channel::<(usize, TcpStream)>();
    let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let token: Arc<[u8]> = Arc::from(token);
    let mut expected = world_size - 1 - rank;
    while expected > 0 {
        while let Ok((peer, stream)) = arrivals.try_recv() {
            if streams[peer].is_none() {
                streams[peer] = Some(stream);
                expected -= 1;
            }
        }
        if expected == 0 {
            break;
        }
        match listener.accept() {
            Ok((stream, from)) => {
                use std::sync::atomic::Ordering;
                if pending.load(Ordering::Acquire) >= MAX_PENDING {
                    tracing::debug!(%from, "too many peer connections in flight; closed");
                    continue;
                }
                pending.fetch_add(1, Ordering::AcqRel);
                let (done, in_flight, token) = (done.clone(), pending.clone(), token.clone());
                let by = deadline.min(Instant::now() + HANDSHAKE_DEADLINE);
                let spawned = std::thread::Builder::new()
                    .name("accelerate-tcp-accept".into())
                    .spawn(move || {
                        let mut stream = stream;
                        match auth::serve(&mut stream, &token, by) {
                            Ok(claim)
                                if claim.purpose == Purpose::PeerLink
                                    && claim.world_size as usize == world_size
                                    && (claim.rank as usize) > rank
                                    && (claim.rank as usize) < world_size =>
                            {
                                let _ = done.send((claim.rank as usize, stream));
                            }
                            Ok(claim) => {
                                tracing::debug!(%from, ?claim, "peer connection with a wrong claim closed");
                            }
                            Err(e) => tracing::debug!(%from, "peer connection closed: {e}"),
                        }
                        in_flight.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    pending.fetch_sub(1, Ordering::AcqRel);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (rank + 1..world_size)
                        .filter(|r| streams[*r].is_none())
                        .collect();
                    return Err(CommError::Timeout {
                        call: "setup (tcp connections)".into(),
                        rank,
                        world_size,
                        missing,
                        elapsed_s: 0.0,
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(CommError::io(rank, "accepting a peer", e)),
        }
    }
    Ok(())
}

/// Asks the kernel to probe an idle connection and to give up on unacknowledged data, both
/// within `heartbeat`: a host that vanished without closing its sockets shows up as a failed
/// read or write instead of a wait for the long collective timeout.
fn set_heartbeat(stream: &TcpStream, heartbeat: Duration) -> nix::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    let secs = heartbeat.as_secs().clamp(4, u64::from(u32::MAX / 1000)) as u32;
    setsockopt(stream, sockopt::KeepAlive, &true)?;
    // Idle for a third, then four probes a sixth apart: the whole budget.
    setsockopt(stream, sockopt::TcpKeepIdle, &(secs / 3).max(1))?;
    setsockopt(stream, sockopt::TcpKeepInterval, &(secs / 6).max(1))?;
    setsockopt(stream, sockopt::TcpKeepCount, &4)?;
    setsockopt(stream, sockopt::TcpUserTimeout, &(secs * 1000))
}

fn spawn_peer(
    rank: usize,
    peer: usize,
    stream: TcpStream,
    heartbeat: Duration,
) -> Result<Peer, CommError> {
    let setup = |e| CommError::io(rank, format!("connection to rank {peer}"), e);
    stream.set_nodelay(true).map_err(setup)?;
    set_heartbeat(&stream, heartbeat).map_err(|e| setup(e.into()))?;
    let addr = stream.peer_addr().map_err(setup)?;
    let mut writer_stream = stream.try_clone().map_err(setup)?;
    writer_stream
        .set_write_timeout(Some(WRITE_TIMEOUT))
        .map_err(setup)?;
    let (queue, frames) = mpsc::channel::<Vec<u8>>();
    let write_error = Arc::new(Mutex::new(None));
    let error_slot = Arc::clone(&write_error);
    let writer = std::thread::Builder::new()
        .name(format!("accelerate-tcp-{rank}-to-{peer}"))
        .spawn(move || {
            for frame in frames {
                if let Err(e) = writer_stream.write_all(&frame) {
                    *error_slot.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some(e.to_string());
                    return;
                }
            }
            let _ = writer_stream.shutdown(Shutdown::Write);
        })
        .map_err(setup)?;
    Ok(Peer {
        reader: stream,
        addr,
        queue: Some(queue),
        writer: Some(writer),
        write_error,
    })
}

/// Reads exactly `buf.len()` bytes before `deadline`. The socket's own read timeout shows as
/// `WouldBlock` (a tick of the wait); `TimedOut` is the kernel giving up on the peer's host.
fn read_full(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
    lost: &dyn Fn(std::io::Error) -> LinkError,
) -> Result<(), LinkError> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(LinkError::Timeout);
        }
        stream
            .set_read_timeout(Some(left.min(Duration::from_millis(200))))
            .map_err(|e| LinkError::Lost(e.to_string()))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(LinkError::Lost("its connection closed".into())),
            Ok(n) => filled += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => return Err(lost(e)),
        }
    }
    Ok(())
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
        let p = self.peer(peer)?;
        if let Some(e) = p
            .write_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            return Err(LinkError::Lost(format!("writing to it failed: {e}")));
        }
        let mut frame = Vec::with_capacity(HEADER_BYTES + payload.len());
        frame.extend_from_slice(&header.encode());
        frame.extend_from_slice(payload);
        p.queue
            .as_ref()
            .ok_or_else(|| LinkError::Lost("closed".into()))?
            .send(frame)
            .map_err(|_| LinkError::Lost("its writer stopped".into()))
    }

    fn recv_header(&mut self, peer: usize, deadline: Instant) -> Result<Header, LinkError> {
        let heartbeat = self.heartbeat;
        let p = self.peer(peer)?;
        let lost = describe_loss(p.addr, heartbeat);
        let mut raw = [0u8; HEADER_BYTES];
        read_full(&mut p.reader, &mut raw, deadline, &lost)?;
        Header::decode(&raw)
            .ok_or_else(|| LinkError::Lost("it sent bytes that are not a message header".into()))
    }

    fn recv_payload(
        &mut self,
        peer: usize,
        len: usize,
        deadline: Instant,
    ) -> Result<Vec<u8>, LinkError> {
        let heartbeat = self.heartbeat;
        let p = self.peer(peer)?;
        let lost = describe_loss(p.addr, heartbeat);
        let mut payload = vec![0u8; len];
        read_full(&mut p.reader, &mut payload, deadline, &lost)?;
        Ok(payload)
    }
}

/// How a failed read from the peer at `addr` is reported.
fn describe_loss(addr: SocketAddr, heartbeat: Duration) -> impl Fn(std::io::Error) -> LinkError {
    move |e| {
        LinkError::Lost(if e.kind() == ErrorKind::TimedOut {
            format!(
                "no sign of life from its host {addr} for {} s: the host is down or the network \
                 between is cut (ACCELERATE_HEARTBEAT_TIMEOUT)",
                heartbeat.as_secs()
            )
        } else {
            format!("connection to {addr}: {e}")
        })
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        // Closing the queues lets each writer flush what is queued (the last messages of the
        // last collective) and shut its direction down; wait for that, bounded by the write
        // timeout, so a normal exit never truncates a peer's final message.
        for peer in self.peers.iter_mut().flatten() {
            peer.queue.take();
        }
        for peer in self.peers.iter_mut().flatten() {
            if let Some(writer) = peer.writer.take() {
                let _ = writer.join();
            }
        }
    }
}
