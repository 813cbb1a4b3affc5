//! Setting up a [`TcpLink`]: each rank connects to the lower ranks and accepts the higher ones,
//! every connection authenticated both ways, then tunes each socket (no Nagle, non-blocking,
//! keepalive within the heartbeat timeout).

use std::io::ErrorKind;
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use super::{Peer, READ_AHEAD, SPIN, Spin, TcpLink};
use crate::comm::admission::{ACCEPTS_PER_PASS, Admission, Source};
use crate::comm::auth::{self, AuthError, Claim, Purpose};
use crate::comm::rendezvous::PeerInfo;
use crate::error::CommError;

/// How long one incoming connection may take to authenticate.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

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
            streams[peer.rank] = Some(join_peer(rank, peer, token, claim, deadline)?);
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
        let here = table.iter().find(|p| p.rank == rank).map(|p| &p.host);
        let local_ranks = table.iter().filter(|p| Some(&p.host) == here).count();
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(Self {
            rank,
            peers,
            heartbeat,
            checked_delivery: Instant::now(),
            spin: Spin::new(if local_ranks <= cores {
                SPIN
            } else {
                Duration::ZERO
            }),
        })
    }
}

/// Connects to the lower rank `peer` and authenticates, retrying on connection and I/O errors
/// until `deadline`: a listener busy with a flood closes a connection before its challenge,
/// and that is no reason to fail the group. A wrong proof is final (the listener is not
/// `peer`'s).
fn join_peer(
    rank: usize,
    peer: &PeerInfo,
    token: &[u8],
    claim: Claim,
    deadline: Instant,
) -> Result<TcpStream, CommError> {
    let context = || format!("connecting to rank {} at {}", peer.rank, peer.listen);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = TcpStream::connect_timeout(
            &peer.listen,
            left.clamp(Duration::from_millis(1), Duration::from_secs(2)),
        )
        .map_err(AuthError::from)
        .and_then(|mut stream| {
            let by = deadline.min(Instant::now() + HANDSHAKE_DEADLINE);
            // No session key on peer links: their frames are checked against the call, not
            // authenticated (the README's Security section says what that leaves open).
            auth::join(&mut stream, token, claim, by).map(|_| stream)
        });
        let e = match attempt {
            Ok(stream) => return Ok(stream),
            Err(AuthError::BadProof) => {
                return Err(CommError::Io {
                    rank,
                    context: context(),
                    detail: format!(
                        "{}: the rendezvous advertised a listener that is not rank {}'s",
                        AuthError::BadProof,
                        peer.rank
                    ),
                });
            }
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Err(CommError::Io {
                rank,
                context: context(),
                detail: format!("gave up at the set-up deadline: {e}"),
            });
        }
        tracing::debug!(peer = peer.rank, "connecting failed, retrying: {e}");
        std::thread::sleep(Duration::from_millis(20));
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
    let admission = Admission::new();
    let token: Arc<[u8]> = Arc::from(token);
    let mut expected = world_size - 1 - rank;
    let mut accepted_in_a_row = 0usize;
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
        // Checked here too, not only when nobody is waiting: a connect flood never leaves the
        // listener idle.
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
        if accepted_in_a_row >= ACCEPTS_PER_PASS {
            // Let the handshakes in flight finish and report before taking more.
            accepted_in_a_row = 0;
            std::thread::sleep(Duration::from_millis(1));
        }
        match listener.accept() {
            Ok((stream, from)) => {
                accepted_in_a_row += 1;
                let Some(ticket) = admission.admit(Source::of(&stream, from)) else {
                    tracing::debug!(%from, "too many peer connections in flight; closed");
                    continue;
                };
                let (done, token) = (done.clone(), token.clone());
                let by = deadline.min(Instant::now() + HANDSHAKE_DEADLINE);
                // A thread that cannot start drops its closure: the ticket and the stream go.
                let _ = std::thread::Builder::new()
                    .name("accelerate-tcp-accept".into())
                    .spawn(move || {
                        let mut stream = stream;
                        match auth::serve(&mut stream, &token, by).map(|(claim, _)| claim) {
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
                        drop(ticket);
                    });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                accepted_in_a_row = 0;
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(CommError::io(rank, "accepting a peer", e)),
        }
    }
    Ok(())
}

/// Asks the kernel to probe an idle connection within `heartbeat`: a host that vanished
/// without closing its sockets shows up as a failed read instead of a wait for the long
/// collective timeout. Unacknowledged data is watched by the transport itself
/// ([`TcpLink::check_delivery`]), not with `TCP_USER_TIMEOUT`, which would also abort a live
/// receiver's zero window.
/// The longest keepalive idle time and interval Linux accepts (`MAX_TCP_KEEPIDLE`).
const MAX_KEEPALIVE_SECS: u64 = 32_767;

pub(super) fn set_heartbeat(stream: &TcpStream, heartbeat: Duration) -> nix::Result<()> {
    use nix::sys::socket::{setsockopt, sockopt};
    // Linux refuses an idle time or interval above 32,767 s (EINVAL). Longer heartbeats probe
    // at that limit: a live peer answers probes whatever it is doing, so probing sooner only
    // notices a cut link sooner.
    let secs = heartbeat.as_secs().clamp(4, 3 * MAX_KEEPALIVE_SECS) as u32;
    setsockopt(stream, sockopt::KeepAlive, &true)?;
    // Idle for a third, then four probes a sixth apart: the whole budget.
    setsockopt(stream, sockopt::TcpKeepIdle, &(secs / 3).max(1))?;
    setsockopt(stream, sockopt::TcpKeepInterval, &(secs / 6).max(1))?;
    setsockopt(stream, sockopt::TcpKeepCount, &4)
}

fn spawn_peer(
    rank: usize,
    peer: usize,
    stream: TcpStream,
    heartbeat: Duration,
) -> Result<Peer, CommError> {
    let setup = |e| CommError::io(rank, format!("connection to rank {peer}"), e);
    stream.set_nodelay(true).map_err(setup)?;
    stream.set_nonblocking(true).map_err(setup)?;
    set_heartbeat(&stream, heartbeat).map_err(|e| setup(e.into()))?;
    let addr = stream.peer_addr().map_err(setup)?;
    Ok(Peer {
        stream,
        addr,
        out: Vec::new(),
        out_pos: 0,
        failed: None,
        inbox: vec![0; READ_AHEAD],
        in_pos: 0,
        in_end: 0,
    })
}
