//! The side of every rank but 0: connecting to rank 0's store until the rendezvous timeout,
//! saying hello, answering the shared-memory probe and reading the peer table.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use super::auth::{self, AuthError, Claim, Purpose};
use super::conn::{Conn, Side};
use super::secret::SecretError;
use super::wire::{MAX_REPLY_BYTES, ProbeResult, Reply, decode_reply, parse_cookie};
use super::{HELLO_DEADLINE, Rendezvous, RendezvousConfig, SharedMemoryHooks};
use crate::error::{CommError, RendezvousWait};

impl RendezvousConfig {
    pub(super) fn connect(
        &self,
        addr: SocketAddr,
        shm: &dyn SharedMemoryHooks,
    ) -> Result<Rendezvous, CommError> {
        let deadline = crate::wait::deadline_after(self.timeout);
        let mut last_error = String::from("no attempt");
        let (mut conn, token) = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.timed_out(RendezvousWait::Accepted { last_error }));
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
