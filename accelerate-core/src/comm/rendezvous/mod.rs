//! Forming a group (one file per concern: the messages in `wire`, a sealed connection in
//! `conn`, rank 0's side in `server`, the others' in `client`, the job secret and the
//! handshake in [`secret`] and [`auth`], torchrun's store in [`torch_store`]): rank 0 serves a small TCP store at `MASTER_ADDR:MASTER_PORT`, every other
//! rank connects (retrying until the rendezvous timeout), proves it knows the job secret
//! ([`auth`]) and says who it is; rank 0 checks the world size, the settings every
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

use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::time::Duration;

use crate::error::CommError;

pub mod admission;
pub mod auth;
mod client;
mod conn;
mod loopback_owner;
pub mod secret;
mod server;
pub mod torch_store;
mod wire;

use secret::JobSecret;
pub use wire::{
    GroupSettings, Hello, MAX_HELLO_BYTES, PeerInfo, ProbeResult, Reply, decode_hello, decode_reply,
};

/// How often rank 0 checks that torchrun's store still holds the address it published.
const STORE_CHECK_INTERVAL: Duration = Duration::from_millis(200);
/// How long one connection may take to authenticate and say hello.
const HELLO_DEADLINE: Duration = Duration::from_secs(10);

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
            .field("token", &secret::REDACTED)
            .finish()
    }
}

impl RendezvousConfig {
    pub(super) fn err(&self, reason: impl Into<String>) -> CommError {
        CommError::Rendezvous {
            addr: self.addr.clone(),
            rank: self.rank,
            world_size: self.world_size,
            reason: reason.into(),
        }
    }

    /// The rendezvous timed out waiting for `wait`.
    pub(super) fn timed_out(&self, wait: crate::error::RendezvousWait) -> CommError {
        CommError::RendezvousTimeout {
            addr: self.addr.clone(),
            rank: self.rank,
            world_size: self.world_size,
            waited_s: self.timeout.as_secs_f64(),
            wait,
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

    pub(super) fn bind_listener(&self, ip: IpAddr) -> Result<TcpListener, CommError> {
        TcpListener::bind((ip, 0))
            .map_err(|e| self.err(format!("cannot listen for peers on {ip}: {e}")))
    }

    pub(super) fn hello(&self, listen: SocketAddr) -> Hello {
        Hello {
            rank: self.rank,
            world_size: self.world_size,
            host: crate::process::host_identity(),
            listen,
            settings: self.settings,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpStream;
    use std::time::Instant;

    use super::auth::{self, SessionKey};
    use super::conn::{Conn, LineSeal, Side, take_line};
    use super::wire::*;
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
