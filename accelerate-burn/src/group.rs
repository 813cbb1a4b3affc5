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

    /// `group` (split from this one) timed into this one's
    /// [`communication_time`](Self::communication_time), without NCCL (a split group
    /// communicates on the host).
    pub fn derived(&self, group: ProcessGroup) -> Self {
        let (rank, world_size) = (group.rank(), group.world_size());
        Self {
            group: Arc::new(Mutex::new(group)),
            spent_ns: Arc::clone(&self.spent_ns),
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

/// Hybrid sharding's groups of this process: ZeRO's shards are cut within `shard` (a host,
/// or a number of processes), and each shard's gradients averaged across `replicas` (this
/// rank's counterparts in the other shard groups).
#[derive(Clone)]
pub(crate) struct Hybrid {
    pub shard: Comm,
    pub replicas: Comm,
}

impl Hybrid {
    /// Whether this process writes ZeRO's shards in a checkpoint: the first shard group's
    /// processes do, the others hold the same shards.
    pub fn writes_shards(&self) -> bool {
        self.replicas.rank() == 0
    }

    /// Splits `job` as `size` says over its processes (whose hosts are compared for
    /// `host`); `None` when a shard group is the whole job.
    pub fn form(
        job: &Comm,
        size: accelerate_core::ShardGroupSize,
    ) -> Result<Option<Self>, AccelerateError> {
        if !size.is_hybrid() || !job.is_distributed() {
            return Ok(None);
        }
        let host = accelerate_core::process::host_identity();
        let hosts: Vec<String> = job.lock().all_gather_object(&host)?;
        let groups = accelerate_core::comm::HybridGroups::new(size, &hosts).map_err(|why| {
            AccelerateError::Misuse {
                rank: job.rank(),
                what: format!("shard_group_size {size}: {why}"),
                hint: "set shard_group_size (ACCELERATE_SHARD_GROUP_SIZE, accelerate-rs launch \
                       --shard-group-size) to job, host or a divisor of the processes",
            }
        })?;
        let Some(groups) = groups else {
            return Ok(None);
        };
        let (shard, replicas) = {
            let mut group = job.lock();
            (group.split(&groups.shards)?, group.split(&groups.replicas)?)
        };
        Ok(Some(Self {
            shard: job.derived(shard),
            replicas: job.derived(replicas),
        }))
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
