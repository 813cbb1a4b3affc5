//! Waiting for the other ranks: the barrier every collective goes through (spin, then sleep
//! on a futex in the segment), the published call descriptors it compares, and the liveness
//! checks that turn a dead or aborted peer into an error within milliseconds.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{LIVENESS_INTERVAL, NAP, Region, ShmEngine};
use crate::comm::call::CallDesc;
use crate::error::CommError;

impl ShmEngine {
    pub(super) fn next_buffer(&mut self) -> usize {
        self.segments += 1;
        (self.segments % 2) as usize
    }

    pub(super) fn publish(&self, call: &CallDesc) {
        for (i, word) in call.pack().iter().enumerate() {
            self.region
                .call_word(self.rank, call.seq as usize, i)
                .store(*word, Ordering::Relaxed);
        }
    }

    /// Arrives at the next barrier and waits for every rank; with `check`, then compares the
    /// call every rank published for `call.seq`.
    pub(super) fn barrier_wait(&mut self, call: &CallDesc, check: bool) -> Result<(), CommError> {
        self.arrivals += 1;
        let target = self.arrivals;
        // SeqCst on this store and on the sleepers load below, against the sleeper's SeqCst
        // increment and re-check: either it sees this arrival, or this rank sees it sleeping.
        self.region
            .arrived(self.rank)
            .store(target, Ordering::SeqCst);
        if self.region.sleepers().load(Ordering::SeqCst) > 0 {
            self.region.doorbell().fetch_add(1, Ordering::SeqCst);
            wake_all(self.region.doorbell());
        }
        let all_arrived = |region: &Region| {
            (0..self.world_size).all(|r| region.arrived(r).load(Ordering::Acquire) >= target)
        };
        let started = Instant::now();
        let deadline = started + self.timeout;
        let mut next_liveness = started + LIVENESS_INTERVAL;
        let mut spins: u32 = 0;
        while !all_arrived(&self.region) {
            spins = spins.saturating_add(1);
            if spins < self.spin_limit {
                std::hint::spin_loop();
                if !spins.is_multiple_of(64) {
                    continue;
                }
            } else {
                let sleepers = self.region.sleepers();
                sleepers.fetch_add(1, Ordering::SeqCst);
                let bell = self.region.doorbell().load(Ordering::SeqCst);
                if !all_arrived(&self.region) {
                    sleep_on(self.region.doorbell(), bell, NAP);
                }
                sleepers.fetch_sub(1, Ordering::SeqCst);
            }
            if let Err(err) = self.check_peers(call, target, started, deadline, &mut next_liveness)
            {
                // The last rank may have arrived since the loop looked, and a rank failed in
                // what it did next (a collective of another group, which told this one too):
                // this barrier is passed, and this rank meets that failure at its next call.
                if all_arrived(&self.region) {
                    break;
                }
                return Err(err);
            }
        }
        if check {
            self.check_calls(call)?;
        }
        Ok(())
    }

    pub(super) fn check_peers(
        &self,
        call: &CallDesc,
        target: u64,
        started: Instant,
        deadline: Instant,
        next_liveness: &mut Instant,
    ) -> Result<(), CommError> {
        let told = |peer: usize| {
            self.region
                .abort_reason(peer)
                .map(|reason| CommError::PeerFailed {
                    call: call.to_string(),
                    rank: self.rank,
                    peer,
                    reason,
                })
        };
        for peer in (0..self.world_size).filter(|&p| p != self.rank) {
            if let Some(failed) = told(peer) {
                return Err(failed);
            }
        }
        let now = Instant::now();
        let missing = || -> Vec<usize> {
            (0..self.world_size)
                .filter(|&r| self.region.arrived(r).load(Ordering::Acquire) < target)
                .collect()
        };
        if now >= *next_liveness {
            *next_liveness = now + LIVENESS_INTERVAL;
            let own_namespace = crate::process::pid_namespace();
            for peer in missing() {
                let pid = self.region.pid(peer).load(Ordering::Acquire);
                // A peer in another PID namespace (another container of the pod sharing
                // /dev/shm) has a pid this process cannot look up: the collective timeout and
                // the peer's own abort word answer for it instead.
                let comparable = own_namespace != 0
                    && self.region.pid_namespace(peer).load(Ordering::Relaxed) == own_namespace;
                if pid != 0 && comparable && !crate::process::process_alive(pid) {
                    // It may have posted why just before it exited, after the check above.
                    return Err(told(peer).unwrap_or_else(|| CommError::PeerLost {
                        call: call.to_string(),
                        rank: self.rank,
                        peer,
                        detail: format!("process {pid} exited"),
                    }));
                }
            }
        }
        if now >= deadline {
            return Err(CommError::Timeout {
                call: call.to_string(),
                rank: self.rank,
                world_size: self.world_size,
                missing: missing(),
                elapsed_s: started.elapsed().as_secs_f64(),
            });
        }
        Ok(())
    }

    pub(super) fn check_calls(&self, call: &CallDesc) -> Result<(), CommError> {
        for peer in (0..self.world_size).filter(|&p| p != self.rank) {
            let words: [u64; 4] = std::array::from_fn(|i| {
                self.region
                    .call_word(peer, call.seq as usize, i)
                    .load(Ordering::Relaxed)
            });
            let theirs = CallDesc::unpack(words);
            if theirs != Some(*call) {
                return Err(CommError::Mismatch {
                    rank: self.rank,
                    ours: format!("called {call}"),
                    peer,
                    theirs: theirs.map_or_else(
                        || "called an unknown call".to_string(),
                        |c| format!("called {c}"),
                    ),
                });
            }
        }
        Ok(())
    }

    /// Publishes `call` and passes its first barrier, checking every rank's call.
    pub(super) fn begin(&mut self, call: &CallDesc) -> Result<(), CommError> {
        self.publish(call);
        self.barrier_wait(call, true)
    }
}

/// Sleeps until `word` no longer holds `seen`, a wake-up, or `nap` passes.
#[cfg(target_os = "linux")]
fn sleep_on(word: &std::sync::atomic::AtomicU32, seen: u32, nap: Duration) {
    use linux_futex::{AsFutex, Shared};
    let futex: &linux_futex::Futex<Shared> = word.as_futex();
    let _ = futex.wait_for(seen, nap);
}

/// Wakes every rank sleeping on `word`.
#[cfg(target_os = "linux")]
fn wake_all(word: &std::sync::atomic::AtomicU32) {
    use linux_futex::{AsFutex, Shared};
    let futex: &linux_futex::Futex<Shared> = word.as_futex();
    futex.wake(i32::MAX);
}

#[cfg(not(target_os = "linux"))]
fn sleep_on(_word: &std::sync::atomic::AtomicU32, _seen: u32, _nap: Duration) {
    std::thread::sleep(Duration::from_micros(50));
}

#[cfg(not(target_os = "linux"))]
fn wake_all(_word: &std::sync::atomic::AtomicU32) {}
