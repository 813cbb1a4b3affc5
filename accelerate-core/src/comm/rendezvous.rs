//! Forming a group: rank 0 serves a small TCP store at `MASTER_ADDR:MASTER_PORT`, every other
//! rank connects (retrying until the rendezvous timeout), proves it knows the job secret
//! ([`super::auth`]) and says who it is; rank 0 checks the world size, the settings every
//! rank must share and that no rank appears twice, probes shared memory when every rank is on
//! its host, then answers everyone with the table of peers and the transport they will use.
//!
//! Rank 0 cannot be stalled: every connection is served on its own thread under one deadline
//! (authentication and hello together), lines are bounded, and a connection that fails any of
//! that is closed and logged at debug level while the others proceed. Authenticated ranks that
//! are misconfigured (a wrong world size, a duplicate rank) are refused with a message; ranks
//! whose settings differ make the whole group fail with [`CommError::Mismatch`] on every rank.
//! If the group times out, the error lists the missing ranks, the address, and what was
//! refused.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::mpsc::{self, Sender};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::admission::{ACCEPTS_PER_PASS, Admission};
use super::auth::{self, AuthError, Claim, Purpose, SessionKey};
use super::secret::{JobSecret, SecretError};
use crate::error::CommError;

/// Hex digits of a line's tag.
const TAG_HEX: usize = 64;
/// Longest line of the rendezvous protocol a rank accepts from a client (a hello is ~200 B).
pub const MAX_HELLO_BYTES: usize = 16 << 10;
/// Longest answer a rank accepts from rank 0 (the peer table: about 150 B per rank).
const MAX_REPLY_BYTES: usize = 64 << 20;
/// How often rank 0 checks that torchrun's store still holds the address it published.
const STORE_CHECK_INTERVAL: Duration = Duration::from_millis(200);
/// How long one connection may take to authenticate and say hello.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);

/// The settings every rank of a group must share; compared at the rendezvous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSettings {
    /// `ACCELERATE_SHM_SLOT_BYTES`.
    pub shm_slot_bytes: u64,
    /// `ACCELERATE_RING_SEGMENT_BYTES`.
    pub segment_bytes: u64,
}

impl GroupSettings {
    /// The first setting that differs, as (ours, theirs).
    fn difference(&self, theirs: &Self) -> Option<(String, String)> {
        let pair = |name: &str, a: u64, b: u64| {
            (
                format!("runs with {name}={a}"),
                format!("runs with {name}={b}"),
            )
        };
        if self.shm_slot_bytes != theirs.shm_slot_bytes {
            return Some(pair(
                crate::env_vars::SHM_SLOT_BYTES,
                self.shm_slot_bytes,
                theirs.shm_slot_bytes,
            ));
        }
        if self.segment_bytes != theirs.segment_bytes {
            return Some(pair(
                crate::env_vars::RING_SEGMENT_BYTES,
                self.segment_bytes,
                theirs.segment_bytes,
            ));
        }
        None
    }
}

/// What one rank tells rank 0 once authenticated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Its rank.
    pub rank: usize,
    /// The world size it expects.
    pub world_size: usize,
    /// Its host identity.
    pub host: String,
    /// Where it accepts peer connections.
    pub listen: SocketAddr,
    /// Its settings.
    pub settings: GroupSettings,
}

/// Rank 0's messages to a rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// Open the shared-memory segment and check it holds this cookie (hex).
    Probe {
        /// Random bytes rank 0 wrote into the segment.
        cookie: String,
    },
    /// The group formed.
    Welcome {
        /// Every rank, in rank order.
        peers: Vec<PeerInfo>,
        /// Whether the group uses shared memory.
        shared_memory: bool,
    },
    /// The group will not form, or not with this rank.
    Refused {
        /// Why, with a hint.
        reason: String,
    },
    /// Ranks differ in a setting they must share.
    Mismatch {
        /// The rank whose setting differs from rank 0's.
        rank: usize,
        /// Rank 0's side.
        rank0: String,
        /// That rank's side.
        theirs: String,
    },
}

/// A rank's answer to [`Reply::Probe`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeResult {
    /// `None` when the segment is there and holds the cookie; else why not.
    pub failure: Option<String>,
}

/// Another member of the group, as the rendezvous reported it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// Its rank.
    pub rank: usize,
    /// Its host identity (host name and boot id): equal identities share a machine.
    pub host: String,
    /// Where it accepts peer connections.
    pub listen: SocketAddr,
}

/// How the rendezvous sets up and checks shared memory, supplied by the transport.
pub trait SharedMemoryHooks {
    /// Rank 0: creates the group's segment, with its space reserved, and returns the random
    /// cookie written into it.
    fn create(&self, token: &[u8]) -> Result<[u8; 16], CommError>;
    /// Other ranks: `None` when this rank sees rank 0's segment holding `cookie`, else why not.
    fn check(&self, token: &[u8], cookie: &[u8; 16]) -> Option<String>;
    /// Rank 0: removes the segment (the group will not use it, or failed).
    fn remove(&self, token: &[u8]);
}

/// Everything a rank needs to join.
#[derive(Debug, Clone)]
pub struct RendezvousConfig {
    /// `host:port` of rank 0's store.
    pub addr: String,
    /// This rank.
    pub rank: usize,
    /// Ranks expected.
    pub world_size: usize,
    /// The job secret every rank must prove it knows.
    pub secret: JobSecret,
    /// Give up after this long.
    pub timeout: Duration,
    /// Whether shared memory may be used when every rank is on one host.
    pub allow_shared_memory: bool,
    /// Whether shared memory is required (an error when ranks span hosts).
    pub require_shared_memory: bool,
    /// Settings every rank must share.
    pub settings: GroupSettings,
}

/// The outcome: the peer table (indexed by rank), this rank's peer listener, whether the
/// group uses shared memory, and the secret its links authenticate with (never shown by
/// `Debug`).
pub struct Rendezvous {
    /// Every rank, in rank order.
    pub peers: Vec<PeerInfo>,
    /// The listener this rank advertised (peers of the TCP transport connect to it).
    pub listener: TcpListener,
    /// True when all ranks share a host and shared memory was allowed and works.
    pub shared_memory: bool,
    /// The job secret.
    pub token: Vec<u8>,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("peers", &self.peers)
            .field("listener", &self.listener)
            .field("shared_memory", &self.shared_memory)
            .field("token", &crate::comm::secret::REDACTED)
            .finish()
    }
}

/// This machine's identity: the host name and the kernel's boot id.
pub fn host_identity() -> String {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    };
    format!(
        "{}/{}",
        read("/proc/sys/kernel/hostname"),
        read("/proc/sys/kernel/random/boot_id")
    )
}

/// A connection with the bytes read past the last line.
struct Conn {
    stream: TcpStream,
    pending: Vec<u8>,
    seal: LineSeal,
}

/// The tags of one connection's lines: every line carries the tag of the handshake's key over
/// its number and sender, so a relay cannot alter, drop, reorder or replay a line (the peer
/// table above all) without the receiver noticing. Pure: the fuzz tests drive it with bytes.
struct LineSeal {
    session: SessionKey,
    /// Which end this is.
    side: Side,
    /// Lines sealed and opened so far (each line's tag covers its number).
    sent: u64,
    received: u64,
}

impl LineSeal {
    fn new(session: SessionKey, side: Side) -> Self {
        Self {
            session,
            side,
            sent: 0,
            received: 0,
        }
    }

    /// `message`, a space, its tag in hex, and the newline.
    fn seal(&mut self, message: &[u8]) -> Vec<u8> {
        let tag = self.session.tag(self.side.label(), self.sent, message);
        self.sent += 1;
        let mut line = message.to_vec();
        line.push(b' ');
        line.extend_from_slice(super::secret::hex(&tag).as_bytes());
        line.push(b'\n');
        line
    }

    /// The message of the next line from the other end (newline removed), or an error when
    /// its tag is not the one that end would have written for it at this point.
    fn open<'a>(&mut self, line: &'a [u8]) -> std::io::Result<&'a [u8]> {
        let unauthentic = || {
            std::io::Error::new(
                ErrorKind::InvalidData,
                "a line this connection's handshake does not authenticate (altered, replayed or \
                 out of order: something between the two ranks changed it)",
            )
        };
        let split = line
            .iter()
            .rposition(|&b| b == b' ')
            .ok_or_else(unauthentic)?;
        let (message, tag) = (&line[..split], &line[split + 1..]);
        let tag = super::secret::unhex(std::str::from_utf8(tag).map_err(|_| unauthentic())?)
            .ok_or_else(unauthentic)?;
        if !self
            .session
            .verify(self.side.other().label(), self.received, message, &tag)
        {
            return Err(unauthentic());
        }
        self.received += 1;
        Ok(message)
    }
}

/// Takes the first complete line (newline removed) out of `pending`; `Ok(None)` while none is
/// complete and `pending` holds at most `max` bytes, an error once it holds more.
fn take_line(pending: &mut Vec<u8>, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    if let Some(end) = pending.iter().position(|&b| b == b'\n') {
        let rest = pending.split_off(end + 1);
        let mut line = std::mem::replace(pending, rest);
        line.pop();
        return Ok(Some(line));
    }
    if pending.len() > max {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a line longer than {max} bytes"),
        ));
    }
    Ok(None)
}

/// The two ends of a rendezvous connection, as they sign their lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// Rank 0.
    Server,
    /// Another rank.
    Client,
}

impl Side {
    fn label(self) -> &'static [u8] {
        match self {
            Side::Server => b"accelerate-rs rendezvous rank 0",
            Side::Client => b"accelerate-rs rendezvous rank",
        }
    }

    fn other(self) -> Self {
        match self {
            Side::Server => Side::Client,
            Side::Client => Side::Server,
        }
    }
}

impl Conn {
    fn new(stream: TcpStream, session: SessionKey, side: Side) -> Self {
        Self {
            stream,
            pending: Vec::new(),
            seal: LineSeal::new(session, side),
        }
    }

    /// The next line, at most `max` bytes, complete before `deadline` however slowly it comes,
    /// with its tag checked and removed.
    fn read_line(&mut self, deadline: Instant, max: usize) -> std::io::Result<Vec<u8>> {
        let line = self.read_raw_line(deadline, max.saturating_add(1 + 2 * TAG_HEX))?;
        self.seal.open(&line).map(<[u8]>::to_vec)
    }

    /// The next raw line, at most `max` bytes, complete before `deadline`.
    fn read_raw_line(&mut self, deadline: Instant, max: usize) -> std::io::Result<Vec<u8>> {
        self.stream.set_nonblocking(false)?;
        loop {
            if let Some(line) = take_line(&mut self.pending, max)? {
                return Ok(line);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(
                    ErrorKind::TimedOut,
                    "no complete line before the deadline",
                ));
            }
            self.stream.set_read_timeout(Some(left))?;
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn recv<T: for<'de> Deserialize<'de>>(
        &mut self,
        deadline: Instant,
        max: usize,
    ) -> std::io::Result<T> {
        let line = self.read_line(deadline, max)?;
        serde_json::from_slice(&line).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
    }

    /// `value` as one line: JSON, a space, the line's tag in hex, and the newline.
    fn frame<T: Serialize>(&mut self, value: &T) -> std::io::Result<Vec<u8>> {
        let line = serde_json::to_vec(value).map_err(std::io::Error::other)?;
        Ok(self.seal.seal(&line))
    }

    fn send<T: Serialize>(&mut self, value: &T, deadline: Instant) -> std::io::Result<()> {
        let line = self.frame(value)?;
        self.stream.set_nonblocking(false)?;
        let left = deadline.saturating_duration_since(Instant::now());
        self.stream
            .set_write_timeout(Some(left.max(Duration::from_millis(100))))?;
        self.stream.write_all(&line)?;
        self.stream.flush()
    }
}

/// Decodes a hello line from a client (what rank 0 accepts; never panics).
pub fn decode_hello(line: &[u8]) -> Result<Hello, String> {
    if line.len() > MAX_HELLO_BYTES {
        return Err(format!("a hello of {} bytes", line.len()));
    }
    serde_json::from_slice(line).map_err(|e| format!("not a hello: {e}"))
}

/// Decodes rank 0's reply and checks a peer table against the expected world size (what
/// other ranks accept; never panics).
pub fn decode_reply(line: &[u8], world_size: usize) -> Result<Reply, String> {
    let reply: Reply = serde_json::from_slice(line).map_err(|e| format!("not a reply: {e}"))?;
    if let Reply::Welcome { peers, .. } = &reply {
        if peers.len() != world_size {
            return Err(format!(
                "a peer table of {} ranks for a group of {world_size}",
                peers.len()
            ));
        }
        if let Some((i, p)) = peers.iter().enumerate().find(|(i, p)| p.rank != *i) {
            return Err(format!("entry {i} of the peer table is rank {}", p.rank));
        }
    }
    Ok(reply)
}

/// A client that authenticated and said hello, or why a connection was dropped.
type Arrival = Result<(Hello, Conn, SocketAddr), (SocketAddr, String)>;

impl RendezvousConfig {
    fn err(&self, reason: impl Into<String>) -> CommError {
        CommError::Rendezvous {
            addr: self.addr.clone(),
            rank: self.rank,
            world_size: self.world_size,
            reason: reason.into(),
        }
    }

    fn resolve(&self) -> Result<SocketAddr, CommError> {
        self.addr
            .to_socket_addrs()
            .map_err(|e| {
                self.err(format!(
                    "cannot resolve the address: {e}. hint: check MASTER_ADDR"
                ))
            })?
            .next()
            .ok_or_else(|| self.err("the address resolves to nothing. hint: check MASTER_ADDR"))
    }

    /// Joins the group; `shm` creates (rank 0) and checks (others) the shared-memory segment
    /// when every rank is on one host.
    pub fn join(&self, shm: &dyn SharedMemoryHooks) -> Result<Rendezvous, CommError> {
        let addr = self.resolve()?;
        if self.rank == 0 {
            let bind = match self.secret.listen_ip() {
                Ok(Some(ip)) => SocketAddr::new(ip, 0),
                Ok(None) => addr,
                Err(e) => return Err(self.err(e.to_string())),
            };
            let store = TcpListener::bind(bind).map_err(|e| {
                self.err(format!(
                    "rank 0 cannot listen there: {e}. hint: MASTER_ADDR must be an address of \
                     rank 0's machine and MASTER_PORT a free port"
                ))
            })?;
            let listen = store
                .local_addr()
                .map_err(|e| self.err(format!("store socket: {e}")))?;
            let token = self
                .secret
                .create(listen)
                .map_err(|e| self.err(e.to_string()))?;
            let served = self.serve(store, &token, shm);
            // The other ranks have read the secret by now, or never will.
            self.secret.remove();
            served.map(|(peers, listener, shared_memory)| Rendezvous {
                peers,
                listener,
                shared_memory,
                token,
            })
        } else {
            self.connect(addr, shm)
        }
    }

    fn bind_listener(&self, ip: IpAddr) -> Result<TcpListener, CommError> {
        TcpListener::bind((ip, 0))
            .map_err(|e| self.err(format!("cannot listen for peers on {ip}: {e}")))
    }

    fn hello(&self, listen: SocketAddr) -> Hello {
        Hello {
            rank: self.rank,
            world_size: self.world_size,
            host: host_identity(),
            listen,
            settings: self.settings,
        }
    }

    fn serve(
        &self,
        store: TcpListener,
        token: &[u8],
        shm: &dyn SharedMemoryHooks,
    ) -> Result<(Vec<PeerInfo>, TcpListener, bool), CommError> {
        let addr = store
            .local_addr()
            .map_err(|e| self.err(format!("store socket: {e}")))?;
        store
            .set_nonblocking(true)
            .map_err(|e| self.err(format!("store socket: {e}")))?;
        let listener = self.bind_listener(addr.ip())?;
        let listen = listener
            .local_addr()
            .map_err(|e| self.err(format!("peer listener: {e}")))?;
        tracing::info!(%addr, world_size = self.world_size, "rank 0 serves the rendezvous");

        let deadline = crate::wait::deadline_after(self.timeout);
        let mut arrived: Vec<Option<(Hello, Option<Conn>)>> =
            (0..self.world_size).map(|_| None).collect();
        arrived[0] = Some((self.hello(listen), None));
        let mut refused: Vec<String> = Vec::new();
        let mut dropped = 0usize;
        let (arrivals, incoming) = mpsc::channel::<Arrival>();
        let admission = Admission::new();
        let token: Arc<[u8]> = Arc::from(token);
        let mut next_store_check = Instant::now();
        while arrived.iter().any(Option::is_none) {
            if Instant::now() >= next_store_check {
                next_store_check = Instant::now() + STORE_CHECK_INTERVAL;
                self.still_published(&token, addr, &mut arrived)?;
            }
            if Instant::now() >= deadline {
                let missing: Vec<String> = arrived
                    .iter()
                    .enumerate()
                    .filter(|(_, h)| h.is_none())
                    .map(|(r, _)| r.to_string())
                    .collect();
                let mut reason = format!(
                    "timed out after {:.1} s: ranks {} never arrived",
                    self.timeout.as_secs_f64(),
                    missing.join(", ")
                );
                if !refused.is_empty() {
                    reason.push_str(&format!("; refused: {}", refused.join("; ")));
                }
                if dropped > 0 {
                    reason.push_str(&format!(
                        "; {dropped} connections failed to authenticate (a different \
                         {} or not an accelerate-rs rank)",
                        crate::env_vars::JOB_TOKEN
                    ));
                }
                reason.push_str(
                    ". hint: start every rank with the same MASTER_ADDR, MASTER_PORT, WORLD_SIZE \
                     and job token, or raise ACCELERATE_RENDEZVOUS_TIMEOUT",
                );
                self.refuse_all(
                    &mut arrived,
                    &Reply::Refused {
                        reason: reason.clone(),
                    },
                );
                return Err(self.err(reason));
            }
            self.accept_some(&store, &arrivals, &admission, &token, deadline);
            match incoming.recv_timeout(Duration::from_millis(5)) {
                Ok(Ok((hello, conn, from))) => {
                    if let Some((rank0, theirs)) = self.settings.difference(&hello.settings) {
                        let rank = hello.rank;
                        let mut conn = conn;
                        let mismatch = Reply::Mismatch {
                            rank,
                            rank0: rank0.clone(),
                            theirs: theirs.clone(),
                        };
                        let _ = conn.send(&mismatch, Instant::now() + Duration::from_secs(1));
                        self.refuse_all(&mut arrived, &mismatch);
                        return Err(CommError::Mismatch {
                            rank: 0,
                            ours: rank0,
                            peer: rank,
                            theirs,
                        });
                    }
                    match self.check_hello(&hello, &arrived, from) {
                        Some(reason) => {
                            let mut conn = conn;
                            let reply = Reply::Refused {
                                reason: reason.clone(),
                            };
                            let _ = conn.send(&reply, Instant::now() + Duration::from_secs(1));
                            tracing::warn!("rendezvous refused: {reason}");
                            refused.push(reason);
                        }
                        None => {
                            let rank = hello.rank;
                            arrived[rank] = Some((hello, Some(conn)));
                        }
                    }
                }
                Ok(Err((from, why))) => {
                    dropped += 1;
                    tracing::debug!(%from, "rendezvous connection dropped: {why}");
                }
                Err(_) => {}
            }
        }

        let hellos: Vec<&Hello> = arrived.iter().flatten().map(|(h, _)| h).collect();
        let peers: Vec<PeerInfo> = hellos
            .iter()
            .map(|h| PeerInfo {
                rank: h.rank,
                host: h.host.clone(),
                listen: h.listen,
            })
            .collect();
        let one_host = peers.iter().all(|p| p.host == peers[0].host);
        if self.require_shared_memory && !one_host {
            let reason = "shared memory was requested (ACCELERATE_TRANSPORT=shm) but the ranks \
                          span several hosts. hint: use ACCELERATE_TRANSPORT=auto or tcp"
                .to_string();
            self.refuse_all(
                &mut arrived,
                &Reply::Refused {
                    reason: reason.clone(),
                },
            );
            return Err(self.err(reason));
        }
        let shared_memory = if one_host && self.allow_shared_memory {
            match self.probe_shared_memory(&mut arrived, &token, shm, deadline) {
                Ok(()) => true,
                Err(why) if self.require_shared_memory => {
                    shm.remove(&token);
                    let reason =
                        format!("shared memory was requested (ACCELERATE_TRANSPORT=shm) but {why}");
                    self.refuse_all(
                        &mut arrived,
                        &Reply::Refused {
                            reason: reason.clone(),
                        },
                    );
                    return Err(self.err(reason));
                }
                Err(why) => {
                    shm.remove(&token);
                    // Automatic choice: TCP works wherever shared memory does not.
                    tracing::warn!("shared memory unavailable ({why}); the group uses TCP");
                    false
                }
            }
        } else {
            false
        };
        // Once more before the peer table goes out: ranks may have read a forged address.
        if let Err(e) = self.still_published(&token, addr, &mut arrived) {
            if shared_memory {
                shm.remove(&token);
            }
            return Err(e);
        }
        let welcome = Reply::Welcome {
            peers: peers.clone(),
            shared_memory,
        };
        let answer_by = Instant::now() + HELLO_DEADLINE;
        for (hello, conn) in arrived.iter_mut().flatten() {
            if let Some(conn) = conn
                && let Err(e) = conn.send(&welcome, answer_by)
            {
                if shared_memory {
                    shm.remove(&token);
                }
                return Err(self.err(format!("answering rank {}: {e}", hello.rank)));
            }
        }
        Ok((peers, listener, shared_memory))
    }

    /// Accepts the waiting connections, at most [`ACCEPTS_PER_PASS`] and not past `deadline`
    /// (a connect flood cannot keep rank 0 here), each admitted one served on its own thread.
    fn accept_some(
        &self,
        store: &TcpListener,
        arrivals: &Sender<Arrival>,
        admission: &Admission,
        token: &Arc<[u8]>,
        deadline: Instant,
    ) {
        for _ in 0..ACCEPTS_PER_PASS {
            if Instant::now() >= deadline {
                return;
            }
            let (stream, from) = match store.accept() {
                Ok(conn) => conn,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::debug!("accepting a rendezvous connection failed: {e}");
                    return;
                }
            };
            let Some(ticket) = admission.admit(from.ip()) else {
                tracing::debug!(%from, "too many connections in flight; closed");
                continue;
            };
            let (arrivals, token) = (arrivals.clone(), token.clone());
            let by = deadline.min(Instant::now() + HELLO_DEADLINE);
            // A thread that cannot start drops its closure: the ticket and the connection go.
            let _ = std::thread::Builder::new()
                .name("accelerate-rendezvous-conn".into())
                .spawn(move || {
                    let arrival = greet(stream, &token, by)
                        .map(|(hello, conn)| (hello, conn, from))
                        .map_err(|why| (from, why));
                    drop(ticket);
                    let _ = arrivals.send(arrival);
                });
        }
    }

    /// Why an authenticated hello is refused, if it is.
    fn check_hello(
        &self,
        hello: &Hello,
        arrived: &[Option<(Hello, Option<Conn>)>],
        from: SocketAddr,
    ) -> Option<String> {
        if hello.world_size != self.world_size {
            Some(format!(
                "rank {} from {from} expects a world size of {}, rank 0 expects {}",
                hello.rank, hello.world_size, self.world_size
            ))
        } else if hello.rank >= self.world_size || hello.rank == 0 {
            Some(format!(
                "rank {} from {from} is not a valid rank of a group of {}",
                hello.rank, self.world_size
            ))
        } else if arrived[hello.rank].is_some() {
            Some(format!(
                "rank {} arrived twice (again from {from}). hint: give every process a distinct \
                 RANK",
                hello.rank
            ))
        } else {
            None
        }
    }

    /// Creates the segment and asks every rank whether it sees it: hosts that share a name and
    /// boot id (containers) may still have separate `/dev/shm`s.
    fn probe_shared_memory(
        &self,
        arrived: &mut [Option<(Hello, Option<Conn>)>],
        token: &[u8],
        shm: &dyn SharedMemoryHooks,
        deadline: Instant,
    ) -> Result<(), String> {
        let cookie = shm.create(token).map_err(|e| e.to_string())?;
        let probe = Reply::Probe {
            cookie: super::secret::hex(&cookie),
        };
        let by = deadline.max(Instant::now() + HELLO_DEADLINE);
        for (hello, conn) in arrived.iter_mut().flatten() {
            let Some(conn) = conn else { continue };
            let answer = conn
                .send(&probe, by)
                .and_then(|()| conn.recv::<ProbeResult>(by, MAX_HELLO_BYTES));
            match answer {
                Ok(ProbeResult { failure: None }) => {}
                Ok(ProbeResult { failure: Some(why) }) => {
                    return Err(format!("rank {} cannot use it: {why}", hello.rank));
                }
                Err(e) => return Err(format!("rank {} did not answer the probe: {e}", hello.rank)),
            }
        }
        Ok(())
    }

    /// Tells every rank that already said hello that the group will not form, and why.
    /// Fails the rendezvous (telling every arrived rank why) when torchrun's store no longer
    /// holds the address rank 0 published at `addr`.
    fn still_published(
        &self,
        token: &[u8],
        addr: SocketAddr,
        arrived: &mut [Option<(Hello, Option<Conn>)>],
    ) -> Result<(), CommError> {
        match self.secret.check_published(token, addr) {
            Ok(()) => Ok(()),
            Err(e @ SecretError::Forged { .. }) => {
                let reason = e.to_string();
                self.refuse_all(
                    arrived,
                    &Reply::Refused {
                        reason: reason.clone(),
                    },
                );
                Err(self.err(reason))
            }
            // Unreachable store: the ranks that read it will say so.
            Err(e) => {
                tracing::debug!("checking torchrun's store: {e}");
                Ok(())
            }
        }
    }

    fn refuse_all(&self, arrived: &mut [Option<(Hello, Option<Conn>)>], reply: &Reply) {
        let by = Instant::now() + Duration::from_secs(1);
        for conn in arrived.iter_mut().flatten().filter_map(|(_, c)| c.as_mut()) {
            let _ = conn.send(reply, by);
        }
    }

    fn connect(
        &self,
        addr: SocketAddr,
        shm: &dyn SharedMemoryHooks,
    ) -> Result<Rendezvous, CommError> {
        let deadline = crate::wait::deadline_after(self.timeout);
        let mut last_error = String::from("no attempt");
        let (mut conn, token) = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.err(format!(
                    "timed out after {:.1} s: rank 0 never accepted this rank (last error: \
                     {last_error}). hint: start rank 0, check MASTER_ADDR/MASTER_PORT, the \
                     firewall and the job token, or raise ACCELERATE_RENDEZVOUS_TIMEOUT",
                    self.timeout.as_secs_f64()
                )));
            }
            let retry = Duration::from_millis(50).min(left);
            let (token, addr) = match self.secret.current(addr) {
                Ok(Some(found)) => found,
                Ok(None) => {
                    last_error = format!("rank 0 has not published {} yet", self.secret.describe());
                    std::thread::sleep(retry);
                    continue;
                }
                Err(e) => return Err(self.err(e.to_string())),
            };
            let mut stream =
                match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2))) {
                    Ok(stream) => stream,
                    Err(e) => {
                        last_error = e.to_string();
                        std::thread::sleep(retry);
                        continue;
                    }
                };
            let claim = Claim {
                purpose: Purpose::Rendezvous,
                rank: u32::try_from(self.rank).unwrap_or(u32::MAX),
                world_size: u32::try_from(self.world_size).unwrap_or(u32::MAX),
            };
            let by = deadline.min(Instant::now() + HELLO_DEADLINE);
            match auth::join(&mut stream, &token, claim, by) {
                Ok(session) => break (Conn::new(stream, session, Side::Client), token),
                Err(AuthError::BadProof) if !self.secret.may_change() => {
                    return Err(self.err(format!(
                        "rank 0 did not accept this rank's job token, or the server at {addr} \
                         is not this job's rank 0. hint: every rank must have the same {}",
                        crate::env_vars::JOB_TOKEN
                    )));
                }
                Err(e) => {
                    // A stale secret file from an earlier job, or a server that is not ours
                    // (yet): try again until the deadline.
                    last_error = format!("authentication: {e}");
                    std::thread::sleep(retry);
                }
            }
        };
        let local_ip = conn
            .stream
            .local_addr()
            .map_err(|e| self.err(format!("local address: {e}")))?
            .ip();
        let listener = self.bind_listener(local_ip)?;
        let listen = listener
            .local_addr()
            .map_err(|e| self.err(format!("peer listener: {e}")))?;
        conn.send(&self.hello(listen), deadline)
            .map_err(|e| self.err(format!("sending hello: {e}")))?;
        // Rank 0 answers once every rank arrived, or when its own timeout expires; allow a
        // little more so that its explanation, not ours, is what we report.
        let answer_by = deadline + Duration::from_secs(5);
        loop {
            let line = match conn.read_line(answer_by, MAX_REPLY_BYTES) {
                Ok(line) => line,
                Err(e) => {
                    // Rank 0 ends a rendezvous whose published address was overwritten before
                    // it could tell the ranks still in their handshake: the store says why.
                    if let Err(forged @ SecretError::Forged { .. }) = self.secret.current(addr) {
                        return Err(self.err(forged.to_string()));
                    }
                    return Err(self.err(format!(
                        "rank 0 accepted this rank but gave no answer ({e}). hint: another rank \
                         is probably missing"
                    )));
                }
            };
            let reply = decode_reply(&line, self.world_size)
                .map_err(|e| self.err(format!("rank 0's answer is invalid: {e}")))?;
            match reply {
                Reply::Probe { cookie } => {
                    let failure = match parse_cookie(&cookie) {
                        Some(cookie) => shm.check(&token, &cookie),
                        None => Some("a malformed cookie".into()),
                    };
                    conn.send(&ProbeResult { failure }, answer_by)
                        .map_err(|e| self.err(format!("answering the probe: {e}")))?;
                }
                Reply::Welcome {
                    peers,
                    shared_memory,
                } => {
                    return Ok(Rendezvous {
                        peers,
                        listener,
                        shared_memory,
                        token,
                    });
                }
                Reply::Refused { reason } => {
                    return Err(self.err(format!("rank 0 refused: {reason}")));
                }
                Reply::Mismatch {
                    rank,
                    rank0,
                    theirs,
                } => {
                    return Err(if rank == self.rank {
                        CommError::Mismatch {
                            rank,
                            ours: theirs,
                            peer: 0,
                            theirs: rank0,
                        }
                    } else {
                        CommError::Mismatch {
                            rank: self.rank,
                            ours: rank0,
                            peer: rank,
                            theirs,
                        }
                    });
                }
            }
        }
    }
}

fn parse_cookie(hex: &str) -> Option<[u8; 16]> {
    super::secret::unhex(hex)?.try_into().ok()
}

/// Authenticates a new connection and reads its hello, all before `by`.
fn greet(stream: TcpStream, token: &[u8], by: Instant) -> Result<(Hello, Conn), String> {
    let mut stream = stream;
    let (claim, session) = auth::serve(&mut stream, token, by).map_err(|e| e.to_string())?;
    if claim.purpose != Purpose::Rendezvous {
        return Err("a peer-link handshake sent to the rendezvous".into());
    }
    let mut conn = Conn::new(stream, session, Side::Server);
    let line = conn
        .read_line(by, MAX_HELLO_BYTES)
        .map_err(|e| format!("no hello: {e}"))?;
    let hello = decode_hello(&line)?;
    // The claim was authenticated; the hello must agree with it.
    if u32::try_from(hello.rank).ok() != Some(claim.rank)
        || u32::try_from(hello.world_size).ok() != Some(claim.world_size)
    {
        return Err("the hello contradicts the authenticated claim".into());
    }
    Ok((hello, conn))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ends of one connection on 127.0.0.1, sharing a session key as a handshake leaves
    /// them.
    fn connected() -> (Conn, Conn) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let key = || {
            SessionKey::derive(
                b"token",
                &[1; auth::CHALLENGE_BYTES],
                &[2; auth::ANSWER_BYTES],
            )
        };
        (
            Conn::new(server, key(), Side::Server),
            Conn::new(client, key(), Side::Client),
        )
    }

    #[test]
    fn a_relay_cannot_alter_or_replay_a_rendezvous_line() {
        let (mut rank0, mut rank1) = connected();
        let by = Instant::now() + Duration::from_secs(5);
        let welcome = Reply::Welcome {
            peers: vec![
                PeerInfo {
                    rank: 0,
                    host: "h".into(),
                    listen: "127.0.0.1:4000".parse().unwrap(),
                },
                PeerInfo {
                    rank: 1,
                    host: "h".into(),
                    listen: "127.0.0.1:4001".parse().unwrap(),
                },
            ],
            shared_memory: false,
        };
        rank0.send(&welcome, by).unwrap();
        let line = rank1.read_line(by, MAX_REPLY_BYTES).unwrap();
        assert!(decode_reply(&line, 2).is_ok());

        // The peer table pointed elsewhere on the way: refused.
        let framed = rank0.frame(&welcome).unwrap();
        let text = String::from_utf8(framed.clone()).unwrap();
        let altered = text.replace("127.0.0.1:4001", "127.0.0.1:6666");
        rank0.stream.write_all(altered.as_bytes()).unwrap();
        let err = rank1.read_line(by, MAX_REPLY_BYTES).unwrap_err();
        assert!(err.to_string().contains("does not authenticate"), "{err}");
        // The genuine line is still accepted in its place; the same line again is not.
        rank0.stream.write_all(&framed).unwrap();
        rank1.read_line(by, MAX_REPLY_BYTES).unwrap();
        rank0.stream.write_all(&framed).unwrap();
        assert!(rank1.read_line(by, MAX_REPLY_BYTES).is_err());
        // A line rank 1 signed cannot be passed off as rank 0's.
        let (mut rank0, mut rank1) = connected();
        let own = rank1.frame(&welcome).unwrap();
        rank1.stream.write_all(&own).unwrap();
        let mut echo = rank0.read_raw_line(by, MAX_REPLY_BYTES).unwrap();
        echo.push(b'\n');
        rank0.stream.write_all(&echo).unwrap();
        assert!(rank1.read_line(by, MAX_REPLY_BYTES).is_err());
    }

    #[test]
    fn replies_with_a_wrong_peer_table_are_refused() {
        let peer = |rank| PeerInfo {
            rank,
            host: "h".into(),
            listen: "127.0.0.1:1".parse().unwrap(),
        };
        let line = |peers| {
            serde_json::to_vec(&Reply::Welcome {
                peers,
                shared_memory: false,
            })
            .unwrap()
        };
        assert!(decode_reply(&line(vec![peer(0), peer(1)]), 2).is_ok());
        assert!(decode_reply(&line(vec![peer(0)]), 2).is_err());
        assert!(decode_reply(&line(vec![peer(1), peer(0)]), 2).is_err());
        assert!(decode_reply(b"{", 2).is_err());
        assert_eq!(parse_cookie(&"ab".repeat(16)), Some([0xab; 16]));
        assert_eq!(parse_cookie("zz"), None);
    }

    fn seals() -> (LineSeal, LineSeal) {
        let key = || {
            SessionKey::derive(
                b"token",
                &[1; auth::CHALLENGE_BYTES],
                &[2; auth::ANSWER_BYTES],
            )
        };
        (
            LineSeal::new(key(), Side::Server),
            LineSeal::new(key(), Side::Client),
        )
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Rank 0's lines as a relay may deliver them: cut into any chunks, with bytes flipped,
        /// lines dropped or repeated, random bytes in between. The framing never panics nor
        /// holds more than its limit; the receiver opens exactly the lines rank 0 sealed, in
        /// order, up to the first one that was tampered with, and nothing after it.
        #[test]
        fn rendezvous_framing_opens_only_sealed_lines_in_order(
            messages in proptest::collection::vec(
                proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40), 1..5),
            tamper in proptest::collection::vec(
                (0u8..4, proptest::prelude::any::<usize>(), 1u8..), 0..3),
            noise in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..60),
            cuts in proptest::collection::vec(1usize..50, 1..8),
            max in 1usize..200,
        ) {
            // Messages never hold a newline (they are JSON): the framing relies on that.
            let messages: Vec<Vec<u8>> = messages
                .into_iter()
                .map(|m| m.into_iter().map(|b| if b == b'\n' { b'x' } else { b }).collect())
                .collect();
            let (mut server, mut client) = seals();
            let mut lines: Vec<Vec<u8>> = messages.iter().map(|m| server.seal(m)).collect();
            let pristine = lines.clone();
            for &(kind, at, x) in &tamper {
                let i = at % lines.len();
                match kind {
                    0 if lines[i].len() > 1 => { let n = lines[i].len() - 1; lines[i][at % n] ^= x; } // flip a byte
                    1 => { lines.remove(i); } // drop
                    2 => { let again = lines[i].clone(); lines.insert(i, again); } // replay
                    _ => lines.insert(i, noise.clone()), // noise (maybe without a newline)
                }
                if lines.is_empty() { break; }
            }
            let stream: Vec<u8> = lines.concat();
            let mut pending = Vec::new();
            let mut opened = Vec::new();
            let mut failed = false;
            let mut fed = 0;
            let mut cut = cuts.iter().cycle();
            while fed < stream.len() && !failed {
                let n = (*cut.next().unwrap_or(&1)).min(stream.len() - fed);
                pending.extend_from_slice(&stream[fed..fed + n]);
                fed += n;
                loop {
                    match take_line(&mut pending, max) {
                        Ok(Some(line)) => match client.open(&line) {
                            Ok(message) => opened.push(message.to_vec()),
                            Err(_) => { failed = true; break; }
                        },
                        Ok(None) => { proptest::prop_assert!(pending.len() <= max); break; }
                        Err(_) => { failed = true; break; }
                    }
                }
            }
            // What was opened is a prefix of what rank 0 sent, line for line.
            proptest::prop_assert!(opened.len() <= messages.len());
            proptest::prop_assert_eq!(&opened[..], &messages[..opened.len()]);
            if lines == pristine && pristine.iter().all(|l| l.len() <= max + 1) {
                proptest::prop_assert_eq!(opened.len(), messages.len());
            }
        }

        /// A cookie from rank 0 that is not 32 hex digits is refused, never a panic (multi-byte
        /// characters included: the slicing is by byte).
        #[test]
        fn cookies_never_panic(text in "\\PC{0,40}") {
            if let Some(cookie) = parse_cookie(&text) {
                proptest::prop_assert_eq!(super::super::secret::hex(&cookie), text.to_ascii_lowercase());
            }
        }
    }
}
