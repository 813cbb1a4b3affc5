//! Forming a group: rank 0 serves a small TCP store at `MASTER_ADDR:MASTER_PORT`, every other
//! rank connects (retrying until the rendezvous timeout) and says who it is; rank 0 checks the
//! job token, the world size and that no rank appears twice, then answers everyone with the
//! table of peers and the transport they will use.
//!
//! Messages are one JSON line each way. A rank that presents the wrong token, a wrong world
//! size or a duplicate rank is refused with a message saying so, and rank 0 remembers the
//! refusal: if the group then times out, the error lists the missing ranks, the address that
//! was tried, and what was refused.

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::CommError;

/// What one rank tells rank 0.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Hello {
    token: String,
    rank: usize,
    world_size: usize,
    host: String,
    listen: SocketAddr,
}

/// Rank 0's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Reply {
    Welcome {
        peers: Vec<PeerInfo>,
        shared_memory: bool,
    },
    Refused {
        reason: String,
    },
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

/// Everything a rank needs to join.
#[derive(Debug, Clone)]
pub struct RendezvousConfig {
    /// `host:port` of rank 0's store.
    pub addr: String,
    /// This rank.
    pub rank: usize,
    /// Ranks expected.
    pub world_size: usize,
    /// The job token every rank must present.
    pub token: String,
    /// Give up after this long.
    pub timeout: Duration,
    /// Whether shared memory may be used when every rank is on one host.
    pub allow_shared_memory: bool,
    /// Whether shared memory is required (an error when ranks span hosts).
    pub require_shared_memory: bool,
}

/// The outcome: the peer table (indexed by rank), this rank's peer listener, and whether the
/// group uses shared memory.
#[derive(Debug)]
pub struct Rendezvous {
    /// Every rank, in rank order.
    pub peers: Vec<PeerInfo>,
    /// The listener this rank advertised (peers of the TCP transport connect to it).
    pub listener: TcpListener,
    /// True when all ranks share a host and shared memory was allowed.
    pub shared_memory: bool,
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

    /// Joins the group; `on_shared_memory` runs on rank 0 before it answers, when the group
    /// will use shared memory (to create the segment the others will open).
    pub fn join(
        &self,
        on_shared_memory: impl FnOnce() -> Result<(), CommError>,
    ) -> Result<Rendezvous, CommError> {
        let addr = self.resolve()?;
        if self.rank == 0 {
            self.serve(addr, on_shared_memory)
        } else {
            self.connect(addr)
        }
    }

    fn bind_listener(&self, ip: IpAddr) -> Result<TcpListener, CommError> {
        TcpListener::bind((ip, 0))
            .map_err(|e| self.err(format!("cannot listen for peers on {ip}: {e}")))
    }

    fn serve(
        &self,
        addr: SocketAddr,
        on_shared_memory: impl FnOnce() -> Result<(), CommError>,
    ) -> Result<Rendezvous, CommError> {
        let store = TcpListener::bind(addr).map_err(|e| {
            self.err(format!(
                "rank 0 cannot listen there: {e}. hint: MASTER_ADDR must be an address of rank 0's \
                 machine and MASTER_PORT a free port"
            ))
        })?;
        store
            .set_nonblocking(true)
            .map_err(|e| self.err(format!("store socket: {e}")))?;
        let listener = self.bind_listener(addr.ip())?;
        let listen = listener
            .local_addr()
            .map_err(|e| self.err(format!("peer listener: {e}")))?;
        tracing::info!(%addr, world_size = self.world_size, "rank 0 serves the rendezvous");

        let deadline = Instant::now() + self.timeout;
        let mut hellos: Vec<Option<(Hello, Option<TcpStream>)>> =
            (0..self.world_size).map(|_| None).collect();
        hellos[0] = Some((
            Hello {
                token: self.token.clone(),
                rank: 0,
                world_size: self.world_size,
                host: host_identity(),
                listen,
            },
            None,
        ));
        let mut refused: Vec<String> = Vec::new();
        while hellos.iter().any(Option::is_none) {
            if Instant::now() >= deadline {
                let missing: Vec<String> = hellos
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
                reason.push_str(
                    ". hint: start every rank with the same MASTER_ADDR, MASTER_PORT and \
                     WORLD_SIZE, or raise ACCELERATE_RENDEZVOUS_TIMEOUT",
                );
                refuse_all(&mut hellos, &reason);
                return Err(self.err(reason));
            }
            let (stream, peer_addr) = match store.accept() {
                Ok(conn) => conn,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) => return Err(self.err(format!("accepting a rank: {e}"))),
            };
            let mut stream = stream;
            let hello: Hello =
                match read_line(&mut stream, Instant::now() + Duration::from_secs(10)) {
                    Ok(hello) => hello,
                    Err(e) => {
                        refused.push(format!(
                            "a connection from {peer_addr} sent no valid hello ({e})"
                        ));
                        continue;
                    }
                };
            let refusal = if hello.token != self.token {
                Some(format!(
                    "job token mismatch for rank {} from {peer_addr}. hint: every rank must have \
                     the same ACCELERATE_JOB_TOKEN (accelerate launch sets it)",
                    hello.rank
                ))
            } else if hello.world_size != self.world_size {
                Some(format!(
                    "rank {} from {peer_addr} expects a world size of {}, rank 0 expects {}",
                    hello.rank, hello.world_size, self.world_size
                ))
            } else if hello.rank >= self.world_size || hello.rank == 0 {
                Some(format!(
                    "rank {} from {peer_addr} is not a valid rank of a group of {}",
                    hello.rank, self.world_size
                ))
            } else if hellos[hello.rank].is_some() {
                Some(format!(
                    "rank {} arrived twice (again from {peer_addr}). hint: give every process a \
                     distinct RANK",
                    hello.rank
                ))
            } else {
                None
            };
            match refusal {
                Some(reason) => {
                    let _ = send_line(
                        &mut stream,
                        &Reply::Refused {
                            reason: reason.clone(),
                        },
                    );
                    tracing::warn!("rendezvous refused: {reason}");
                    refused.push(reason);
                }
                None => {
                    let rank = hello.rank;
                    hellos[rank] = Some((hello, Some(stream)));
                }
            }
        }

        let peers: Vec<PeerInfo> = hellos
            .iter()
            .flatten()
            .map(|(h, _)| PeerInfo {
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
            refuse_all(&mut hellos, &reason);
            return Err(self.err(reason));
        }
        let mut shared_memory = one_host && self.allow_shared_memory;
        if shared_memory && let Err(e) = on_shared_memory() {
            if self.require_shared_memory {
                refuse_all(
                    &mut hellos,
                    &format!("rank 0 could not create the shared memory segment: {e}"),
                );
                return Err(e);
            }
            // Automatic choice: TCP works wherever shared memory does not.
            tracing::warn!("shared memory unavailable ({e}); the group uses TCP");
            shared_memory = false;
        }
        let welcome = Reply::Welcome {
            peers: peers.clone(),
            shared_memory,
        };
        for (hello, stream) in hellos.iter_mut().flatten() {
            if let Some(stream) = stream {
                send_line(stream, &welcome)
                    .map_err(|e| self.err(format!("answering rank {}: {e}", hello.rank)))?;
            }
        }
        Ok(Rendezvous {
            peers,
            listener,
            shared_memory,
        })
    }

    fn connect(&self, addr: SocketAddr) -> Result<Rendezvous, CommError> {
        let deadline = Instant::now() + self.timeout;
        let mut last_error = String::from("no attempt");
        let mut stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.err(format!(
                    "timed out after {:.1} s: rank 0 never answered (last error: {last_error}). \
                     hint: start rank 0, check MASTER_ADDR/MASTER_PORT and the firewall, or raise \
                     ACCELERATE_RENDEZVOUS_TIMEOUT",
                    self.timeout.as_secs_f64()
                )));
            }
            match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2))) {
                Ok(stream) => break stream,
                Err(e) => {
                    last_error = e.to_string();
                    std::thread::sleep(Duration::from_millis(50).min(left));
                }
            }
        };
        let local_ip = stream
            .local_addr()
            .map_err(|e| self.err(format!("local address: {e}")))?
            .ip();
        let listener = self.bind_listener(local_ip)?;
        let listen = listener
            .local_addr()
            .map_err(|e| self.err(format!("peer listener: {e}")))?;
        let hello = Hello {
            token: self.token.clone(),
            rank: self.rank,
            world_size: self.world_size,
            host: host_identity(),
            listen,
        };
        send_line(&mut stream, &hello).map_err(|e| self.err(format!("sending hello: {e}")))?;
        // Rank 0 answers once every rank arrived, or when its own timeout expires; allow a
        // little more so that its explanation, not ours, is what we report.
        let reply: Reply =
            read_line(&mut stream, deadline + Duration::from_secs(5)).map_err(|e| {
                self.err(format!(
                    "rank 0 accepted this rank but gave no answer ({e}). hint: another rank is \
                 probably missing"
                ))
            })?;
        match reply {
            Reply::Welcome {
                peers,
                shared_memory,
            } => Ok(Rendezvous {
                peers,
                listener,
                shared_memory,
            }),
            Reply::Refused { reason } => Err(self.err(format!("rank 0 refused: {reason}"))),
        }
    }
}

/// Tells every rank that already said hello that the group will not form, and why.
fn refuse_all(hellos: &mut [Option<(Hello, Option<TcpStream>)>], reason: &str) {
    for stream in hellos.iter_mut().flatten().filter_map(|(_, s)| s.as_mut()) {
        let refused = Reply::Refused {
            reason: reason.to_string(),
        };
        let _ = send_line(stream, &refused);
    }
}

fn send_line<T: Serialize>(stream: &mut TcpStream, value: &T) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    line.push(b'\n');
    stream.set_nonblocking(false)?;
    stream.write_all(&line)?;
    stream.flush()
}

fn read_line<T: for<'de> Deserialize<'de>>(
    stream: &mut TcpStream,
    deadline: Instant,
) -> std::io::Result<T> {
    stream.set_nonblocking(false)?;
    let left = deadline.saturating_duration_since(Instant::now());
    stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    let mut line = String::new();
    let mut reader = BufReader::new(&*stream);
    let n = reader.read_line(&mut line)?;
    if n == 0 {
        return Err(std::io::Error::new(
            ErrorKind::UnexpectedEof,
            "connection closed",
        ));
    }
    serde_json::from_str(&line).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
}
