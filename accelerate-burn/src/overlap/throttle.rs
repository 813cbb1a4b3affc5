//! [`Throttle`]: how far backward may run ahead of the communication thread when the taps let
//! their gradients go (ZeRO-2). Each unit's anchor is a gate in backward, between the unit's
//! taps (its gradients handed over) and the operations before the unit (which would make the
//! next unit's gradients): there backward waits while more than `limit` bytes of handed-over
//! gradients are not yet sent, so that one unit's gradients at a time exist beside the shards
//! instead of whatever a busy machine lets pile up. It never waits while the thread waits for
//! gradients (a bucket that needs a gradient only the end of backward hands over), so a bucket
//! can always complete.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Bytes handed to the communication thread and not yet sent, against a limit.
pub(crate) struct Throttle {
    limit: usize,
    state: Mutex<ThrottleState>,
    changed: Condvar,
}

#[derive(Default)]
struct ThrottleState {
    in_flight: usize,
    /// Gradients the taps handed over so far.
    handed: u64,
    /// The communication thread has nothing to send and waits for gradients, having received
    /// this many from the taps: stalled for real only while no tap handed over more since.
    stalled_at: Option<u64>,
    /// The communication thread stopped: nobody waits any more.
    closed: bool,
}

impl Throttle {
    /// Backward waits at a gate while more than `limit` bytes wait to be sent.
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            state: Mutex::new(ThrottleState::default()),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, ThrottleState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A tap handed `bytes` over.
    pub fn handed(&self, bytes: usize) {
        let mut state = self.lock();
        state.in_flight = state.in_flight.saturating_add(bytes);
        state.handed += 1;
    }

    /// A unit's gate: waits while more than the limit waits for a thread that can send it.
    pub fn gate(&self) {
        let mut state = self.lock();
        while !state.closed
            && state.in_flight > self.limit
            && state.stalled_at != Some(state.handed)
        {
            state = self
                .changed
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// The thread sent `bytes` the taps handed over.
    pub fn sent(&self, bytes: usize) {
        let mut state = self.lock();
        state.in_flight = state.in_flight.saturating_sub(bytes);
        self.changed.notify_all();
    }

    /// The thread waits for gradients, having received `received` from the taps (`Some`), or
    /// has some again (`None`).
    pub fn stall(&self, received: Option<u64>) {
        let mut state = self.lock();
        state.stalled_at = received;
        self.changed.notify_all();
    }

    /// The thread stopped (done, or failed): no gate waits for it again.
    pub fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    /// Runs a gate on a thread of its own; whether it is still waiting after 50 ms.
    fn blocks(throttle: &Arc<Throttle>) -> std::thread::JoinHandle<()> {
        let throttle = Arc::clone(throttle);
        let gate = std::thread::spawn(move || throttle.gate());
        std::thread::sleep(Duration::from_millis(50));
        gate
    }

    #[test]
    fn a_gate_waits_past_the_limit_unless_the_thread_waits_for_gradients() {
        let throttle = Arc::new(Throttle::new(100));
        throttle.handed(60);
        throttle.gate();
        throttle.handed(60);
        let gate = blocks(&throttle);
        assert!(
            !gate.is_finished(),
            "120 bytes over a limit of 100 must wait"
        );
        throttle.sent(60);
        gate.join().unwrap();
        // A thread that waits for gradients lets backward go on, whatever is in flight, unless
        // a tap handed one over since it looked (three so far).
        throttle.handed(500);
        let gate = blocks(&throttle);
        assert!(!gate.is_finished());
        throttle.stall(Some(2));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !gate.is_finished(),
            "the third gradient is not received yet"
        );
        throttle.stall(Some(3));
        gate.join().unwrap();
        throttle.stall(None);
        let gate = blocks(&throttle);
        throttle.close();
        gate.join().unwrap();
    }
}
