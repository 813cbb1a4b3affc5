//! The process group as the accelerator and what it prepared share it: locked, timed, and the
//! one collective that makes every rank agree on every rank's outcome.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use accelerate_core::comm::ProcessGroup;

use crate::error::AccelerateError;
use crate::nccl::DeviceCollectives;

/// The process group of one accelerator, shared with its reducer and prepared optimizer.
#[derive(Clone)]
pub(crate) struct Comm {
    group: Arc<Mutex<ProcessGroup>>,
    /// Nanoseconds spent averaging gradients.
    spent_ns: Arc<AtomicU64>,
    rank: usize,
    world_size: usize,
    /// NCCL on this process's GPU, when the job agreed to use it.
    device: Option<DeviceCollectives>,
}

impl Comm {
    pub fn new(group: ProcessGroup) -> Self {
        let (rank, world_size) = (group.rank(), group.world_size());
        Self {
            group: Arc::new(Mutex::new(group)),
            spent_ns: Arc::new(AtomicU64::new(0)),
            rank,
            world_size,
            device: None,
        }
    }

    /// The group, with NCCL's collectives on the GPU for the reducers to use.
    pub fn with_device_collectives(mut self, device: Option<DeviceCollectives>) -> Self {
        self.device = device;
        self
    }

    /// NCCL's collectives on this process's GPU, when the job uses them.
    pub fn device_collectives(&self) -> Option<&DeviceCollectives> {
        self.device.as_ref()
    }

    /// The group, locked (a panic elsewhere cannot leave it half-updated: a failed
    /// collective poisons the group itself).
    pub fn lock(&self) -> MutexGuard<'_, ProcessGroup> {
        self.group.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Processes in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// True with more than one process.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// Runs `communicate` on the locked group and adds its duration to
    /// [`communication_time`](Self::communication_time).
    pub fn timed<R>(&self, communicate: impl FnOnce(&mut ProcessGroup) -> R) -> R {
        self.timed_device(|| communicate(&mut self.lock()))
    }

    /// Runs `communicate` (collectives that do not use the host group: NCCL's) and adds its
    /// duration to [`communication_time`](Self::communication_time).
    pub fn timed_device<R>(&self, communicate: impl FnOnce() -> R) -> R {
        let started = Instant::now();
        let result = communicate();
        let spent = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.spent_ns.fetch_add(spent, Ordering::Relaxed);
        result
    }

    /// Time spent in [`timed`](Self::timed) so far.
    pub fn communication_time(&self) -> Duration {
        Duration::from_nanos(self.spent_ns.load(Ordering::Relaxed))
    }

    /// Every rank's outcome, on every rank: `Ok` when all succeeded, else every failure with
    /// its rank, so that no process carries on alone and waits for peers that gave up.
    pub fn agree(
        &self,
        mine: Result<(), impl std::fmt::Display>,
    ) -> Result<Result<(), RankFailures>, AccelerateError> {
        // A peer's error crosses processes as its message: what travels is the text.
        let mine: Option<String> = mine.err().map(|e| e.to_string());
        let all = if self.is_distributed() {
            self.lock().all_gather_object(&mine)?
        } else {
            vec![mine]
        };
        let failed: Vec<(usize, String)> = all
            .into_iter()
            .enumerate()
            .filter_map(|(r, failure)| failure.map(|e| (r, e)))
            .collect();
        Ok(if failed.is_empty() {
            Ok(())
        } else {
            Err(RankFailures(failed))
        })
    }
}

/// The ranks whose part failed, each with its error's message ([`Comm::agree`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", describe(.0))]
pub(crate) struct RankFailures(pub Vec<(usize, String)>);

/// "rank 1: ...; rank 3: ...".
fn describe(failures: &[(usize, String)]) -> String {
    failures
        .iter()
        .map(|(rank, e)| format!("rank {rank}: {e}"))
        .collect::<Vec<_>>()
        .join("; ")
}
