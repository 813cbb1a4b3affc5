//! The no-hang promise on MPI, which has no timeouts: a watchdog thread per engine looks at
//! this host's progress board ([`Board`]) every [`TICK`] and ends the job with `MPI_Abort`,
//! naming the rank, when
//! - a call this rank made (finished since the last look, or in flight) differs from the same
//!   call of a peer on this host (mismatched collectives often never complete in MPI; those
//!   that do, say two all-reduces of one size with different operations, returned wrong
//!   values), or when the call in flight
//! - waits for a peer on this host that shows no sign of life for the heartbeat timeout (a
//!   stopped or hung process stops its heartbeat; a slow one keeps it going), or
//! - outlasts the collective timeout: the error names the local ranks that never entered the
//!   call, or the ranks on other hosts when every local rank did.
//!
//! Finished calls are compared here, off the calls' path, because comparing them in the call
//! would cost cross-core cache misses on every call (see [`super::board`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::board::Board;
use crate::comm::call::CallDesc;
use crate::error::CommError;

/// How often the watchdog beats and looks.
pub const TICK: Duration = Duration::from_millis(100);

/// What the watchdog needs to know about its rank.
pub struct Identity {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub world_size: usize,
    /// How long a local peer may show no sign of life while this rank waits for it.
    pub heartbeat_timeout: Duration,
}

struct Shared {
    stop: AtomicBool,
    /// The collective timeout, in milliseconds.
    timeout_ms: AtomicU64,
    board: Arc<Board>,
}

/// Watches one engine's calls; stops with it.
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching the calls `board` records for `who`.
    pub fn start(who: Identity, board: Arc<Board>, timeout: Duration) -> Self {
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            timeout_ms: AtomicU64::new(millis(timeout)),
            board,
        });
        let watched = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("accelerate-mpi-watchdog-{}", who.rank))
            .spawn(move || watch(&watched, &who))
            .ok();
        if thread.is_none() {
            tracing::warn!("no watchdog thread: a stuck MPI call will not time out");
        }
        Self { shared, thread }
    }

    /// Sets the collective timeout.
    pub fn set_timeout(&self, timeout: Duration) {
        self.shared
            .timeout_ms
            .store(millis(timeout), Ordering::Relaxed);
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The watchdog's loop: beat, and end the job when the call in flight is stuck.
fn watch(shared: &Shared, who: &Identity) {
    let board = &*shared.board;
    // Per line: the heartbeat last seen and when it last changed.
    let mut seen: Vec<(u64, Instant)> = vec![(0, Instant::now()); board.ranks().len()];
    // The call in flight (seq + 1) and since when.
    let mut waiting: (u64, Instant) = (0, Instant::now());
    // Calls below this (seq + 1) were compared with the peers'.
    let mut compared = 0u64;
    while !shared.stop.load(Ordering::Relaxed) {
        std::thread::sleep(TICK);
        let now = Instant::now();
        board.beat();
        for (line, last) in seen.iter_mut().enumerate() {
            let beat = board.heartbeat(line);
            if beat != last.0 {
                *last = (beat, now);
            }
        }
        let (entered, left) = (board.entered(board.mine()), board.left(board.mine()));
        if let Some(error) = board.first_mismatch(compared..left) {
            end_job(who.rank, &error);
        }
        compared = left;
        if entered == 0 || entered == left {
            continue;
        }
        if waiting.0 != entered {
            waiting = (entered, now);
        }
        let Some(call) = board
            .call(board.mine(), entered - 1)
            .and_then(CallDesc::unpack)
        else {
            continue;
        };
        let timeout = Duration::from_millis(shared.timeout_ms.load(Ordering::Relaxed));
        let waited = now.duration_since(waiting.1);
        if let Some(error) = verdict(board, who, &seen, &call, waited, timeout) {
            end_job(who.rank, &error);
        }
    }
}

/// Reports `error` of `rank` and ends every process of the job.
pub fn end_job(rank: usize, error: &CommError) -> ! {
    // Straight to stderr, not through `tracing`: MPI_Abort ends this process (and the job)
    // at once, and these lines are the only account of why. A subscriber may be absent, may
    // filter errors out or buffer them, and nothing after the abort would flush it.
    eprintln!("{error}");
    eprintln!(
        "rank {rank}: ending the MPI job (MPI_Abort) so that no rank goes on with wrong values \
         or waits forever"
    );
    super::runtime::abort(1)
}

/// The error that ends the job, if the call in flight (`waited` so far) is stuck.
fn verdict(
    board: &Board,
    who: &Identity,
    seen: &[(u64, Instant)],
    call: &CallDesc,
    waited: Duration,
    timeout: Duration,
) -> Option<CommError> {
    if let Some((peer, theirs)) = board.differing(call) {
        return Some(super::agreement::named_mismatch(
            who.rank, call, peer, theirs,
        ));
    }
    let want = call.seq + 1;
    // A local peer that has not finished this call and shows no sign of life.
    for (line, &(_, changed)) in seen.iter().enumerate() {
        let silent = changed.elapsed();
        if line != board.mine()
            && board.left(line) < want
            && silent >= who.heartbeat_timeout
            && waited >= who.heartbeat_timeout.min(timeout)
        {
            return Some(CommError::PeerLost {
                call: call.to_string(),
                rank: who.rank,
                peer: board.ranks()[line],
                detail: format!(
                    "its process (pid {}) on this host has shown no sign of life for {:.1} s: \
                     stopped or hung (ACCELERATE_HEARTBEAT_TIMEOUT)",
                    board.pid(line),
                    silent.as_secs_f64()
                ),
            });
        }
    }
    if waited < timeout {
        return None;
    }
    // Local ranks that never entered this call; if all did, the ranks on other hosts.
    let local = board.ranks();
    let absent: Vec<usize> = (0..local.len())
        .filter(|&line| board.entered(line) < want)
        .map(|line| local[line])
        .collect();
    let elsewhere: Vec<usize> = (0..who.world_size).filter(|r| !local.contains(r)).collect();
    let missing = if !absent.is_empty() {
        absent
    } else if !elsewhere.is_empty() && board.is_shared() {
        elsewhere
    } else {
        (0..who.world_size).filter(|&r| r != who.rank).collect()
    };
    Some(CommError::Timeout {
        call: call.to_string(),
        rank: who.rank,
        world_size: who.world_size,
        missing,
        elapsed_s: waited.as_secs_f64(),
    })
}

/// Where a host's board lives while its ranks map it (removed right after).
pub fn board_path(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from("/dev/shm").join(format!("accelerate-rs-mpi-{name}"))
}
