//! Rank 0's side of the rendezvous: accepting connections under one deadline each, checking
//! every hello, probing shared memory when every rank is on its host, and answering everyone
//! with the peer table (or the reason the group will not form).

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::mpsc::{self, Sender};
use std::time::{Duration, Instant};

use super::admission::{ACCEPTS_PER_PASS, Admission, Source};
use super::conn::{Conn, GreetError, greet};
use super::secret::SecretError;
use super::wire::{Hello, MAX_HELLO_BYTES, PeerInfo, ProbeResult, Reply};
use super::{HELLO_DEADLINE, RendezvousConfig, STORE_CHECK_INTERVAL, SharedMemoryHooks};
use crate::error::{CommError, RendezvousWait};

/// A client that authenticated and said hello, or why a connection was dropped.
type Arrival = Result<(Hello, Conn, SocketAddr), (SocketAddr, GreetError)>;

/// Why the group cannot use shared memory although every rank is on rank 0's host.
#[derive(Debug, thiserror::Error)]
enum ProbeFailure {
    /// Rank 0 could not create the segment.
    #[error("{0}")]
    Create(CommError),
    /// A rank cannot open it (another `/dev/shm`: a container).
    #[error("rank {rank} cannot use it: {why}")]
    Unusable {
        /// The rank.
        rank: usize,
        /// What it saw.
        why: String,
    },
    /// A rank did not answer the probe.
    #[error("rank {rank} did not answer the probe: {error}")]
    NoAnswer {
        /// The rank.
        rank: usize,
        /// The connection's error.
        error: std::io::Error,
    },
}

impl RendezvousConfig {
    pub(super) fn serve(
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
                let wait = RendezvousWait::Arrivals {
                    missing: (0..arrived.len())
                        .filter(|&r| arrived[r].is_none())
                        .collect(),
                    refused: std::mem::take(&mut refused),
                    failed_auth: dropped,
                };
                // The others hear it as rank 0's refusal, in the same words.
                let reason = format!(
                    "timed out after {:.1} s: {wait}",
                    self.timeout.as_secs_f64()
                );
                self.refuse_all(&mut arrived, &Reply::Refused { reason });
                return Err(self.timed_out(wait));
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
            let Some(ticket) = admission.admit(Source::of(&stream, from)) else {
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
    ) -> Result<(), ProbeFailure> {
        let cookie = shm.create(token).map_err(ProbeFailure::Create)?;
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
                    return Err(ProbeFailure::Unusable {
                        rank: hello.rank,
                        why,
                    });
                }
                Err(e) => {
                    return Err(ProbeFailure::NoAnswer {
                        rank: hello.rank,
                        error: e,
                    });
                }
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
}
