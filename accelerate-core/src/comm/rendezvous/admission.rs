//! Who may be authenticated while a group forms. Servers that accept ranks (rank 0's
//! rendezvous, every rank's peer listener) authenticate each connection on a thread of its
//! own; [`Admission`] caps how many are in flight at once, and how many of those come from one
//! [`Source`] (a remote host, or on loopback the local user behind the connection, since every
//! process of the host is 127.0.0.1 there), so that silent or flooding connections from one
//! host or one local user cannot hold every slot. A
//! silent connection holds its slot at most [`ANSWER_DEADLINE`](super::auth::ANSWER_DEADLINE),
//! and a connection turned away is closed before any byte is read: the rank behind a real one
//! retries until its deadline.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, PoisonError};

/// Connections being authenticated at once.
pub const MAX_IN_FLIGHT: usize = 256;
/// Of those, from one source: enough for every rank of a large host at once (they retry
/// when turned away), few enough that one host cannot fill the others' slots.
pub const MAX_PER_SOURCE: usize = 64;
/// Connections one pass of an accept loop takes before it looks at its deadline and at what
/// was authenticated, so that a connect flood cannot keep it accepting.
pub const ACCEPTS_PER_PASS: usize = 32;

/// What a connection's handshakes are counted against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// A host, by the connection's source address (and a loopback connection whose owner
    /// the kernel does not name).
    Host(IpAddr),
    /// A local user, by uid: the owner of a loopback connection's other end.
    LocalUser(u32),
}

impl Source {
    /// The source of `stream`, accepted from `from`: on loopback its owner's uid where the
    /// kernel lists it (Linux), else its address.
    pub fn of(stream: &TcpStream, from: SocketAddr) -> Self {
        stream
            .local_addr()
            .ok()
            .and_then(|ours| super::loopback_owner::owner(from, ours))
            .map_or(Self::Host(from.ip()), Self::LocalUser)
    }
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_source: HashMap<Source, usize>,
}

/// The in-flight handshakes of one server.
#[derive(Clone, Default)]
pub struct Admission {
    counts: Arc<Mutex<Counts>>,
}

/// A handshake slot; released when dropped (the handshake ended, however).
pub struct Ticket {
    counts: Arc<Mutex<Counts>>,
    source: Source,
}

impl Admission {
    /// A server with no handshake in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// A slot for a connection from `source`, or `None` when the server or that source is at
    /// its cap (the caller closes the connection).
    pub fn admit(&self, source: Source) -> Option<Ticket> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let from_source = counts.per_source.get(&source).copied().unwrap_or(0);
        if counts.total >= MAX_IN_FLIGHT || from_source >= MAX_PER_SOURCE {
            return None;
        }
        counts.total += 1;
        counts.per_source.insert(source, from_source + 1);
        Some(Ticket {
            counts: self.counts.clone(),
            source,
        })
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.total = counts.total.saturating_sub(1);
        if let Some(n) = counts.per_source.get_mut(&self.source) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.per_source.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_source_cannot_take_every_slot_and_slots_come_back() {
        let admission = Admission::new();
        let flooder = Source::Host("10.0.0.9".parse().unwrap());
        let tickets: Vec<Ticket> = std::iter::from_fn(|| admission.admit(flooder)).collect();
        assert_eq!(tickets.len(), MAX_PER_SOURCE);
        // Another host, and a local user, still get in.
        assert!(
            admission
                .admit(Source::Host("127.0.0.1".parse().unwrap()))
                .is_some()
        );
        assert!(admission.admit(Source::LocalUser(1000)).is_some());
        drop(tickets);
        assert!(admission.admit(flooder).is_some());
        // One local user cannot take another's slots.
        let local: Vec<Ticket> =
            std::iter::from_fn(|| admission.admit(Source::LocalUser(65534))).collect();
        assert_eq!(local.len(), MAX_PER_SOURCE);
        assert!(admission.admit(Source::LocalUser(0)).is_some());
    }
}
