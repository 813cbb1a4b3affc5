//! Who may be authenticated while a group forms. Servers that accept ranks (rank 0's
//! rendezvous, every rank's peer listener) authenticate each connection on a thread of its
//! own; [`Admission`] caps how many are in flight at once, and how many of those come from one
//! address, so that silent or flooding connections from one host cannot hold every slot. A
//! silent connection holds its slot at most [`ANSWER_DEADLINE`](super::auth::ANSWER_DEADLINE),
//! and a connection turned away is closed before any byte is read: the rank behind a real one
//! retries until its deadline.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

/// Connections being authenticated at once.
pub const MAX_IN_FLIGHT: usize = 256;
/// Of those, from one address: enough for every rank of a large host at once (they retry
/// when turned away), few enough that one host cannot fill the others' slots.
pub const MAX_PER_SOURCE: usize = 64;
/// Connections one pass of an accept loop takes before it looks at its deadline and at what
/// was authenticated, so that a connect flood cannot keep it accepting.
pub const ACCEPTS_PER_PASS: usize = 32;

#[derive(Default)]
struct Counts {
    total: usize,
    per_source: HashMap<IpAddr, usize>,
}

/// The in-flight handshakes of one server.
#[derive(Clone, Default)]
pub struct Admission {
    counts: Arc<Mutex<Counts>>,
}

/// A handshake slot; released when dropped (the handshake ended, however).
pub struct Ticket {
    counts: Arc<Mutex<Counts>>,
    source: IpAddr,
}

impl Admission {
    /// A server with no handshake in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// A slot for a connection from `source`, or `None` when the server or that source is at
    /// its cap (the caller closes the connection).
    pub fn admit(&self, source: IpAddr) -> Option<Ticket> {
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
        let flooder: IpAddr = "10.0.0.9".parse().unwrap();
        let tickets: Vec<Ticket> = std::iter::from_fn(|| admission.admit(flooder)).collect();
        assert_eq!(tickets.len(), MAX_PER_SOURCE);
        // Another host still gets in.
        let other = admission.admit("127.0.0.1".parse().unwrap());
        assert!(other.is_some());
        drop(tickets);
        assert!(admission.admit(flooder).is_some());
    }
}
