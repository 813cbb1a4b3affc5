//! What every sharded unit of one accelerator shares: the process group its gathers use (the
//! job, or under hybrid sharding this process's shard group and its replicas), the first
//! failure of one of them, and which parameters are shards (their gradients arrive averaged,
//! so the reducer does not average them again).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use accelerate_core::{CommError, ProcessGroup};
use burn::module::ParamId;

use super::replicas::{Averaged, ReplicaThread};
use crate::error::AccelerateError;
use crate::group::{Comm, Hybrid};
use crate::params::ParamLayout;

/// The sharded units' process group and bookkeeping (one per accelerator).
pub(crate) struct ShardGroup {
    /// The processes a shard is cut across: the job, or this process's shard group.
    comm: Comm,
    /// Hybrid sharding's groups: the shards' gradients are averaged across the replicas
    /// after the reduce-scatter in the shard group.
    hybrid: Option<Hybrid>,
    /// The whole job (rank 0's values reach every shard group through it).
    job: Comm,
    /// Whether the averages across the replicas run on a thread while backward goes on
    /// (`overlap_communication`, with shard groups on shared memory, whose collectives never
    /// share the replicas' connections), or at once.
    overlap_replicas: bool,
    /// The thread of this backward pass's averages across the replicas, once one started.
    replica_thread: Mutex<Option<ReplicaThread>>,
    /// Each shard's id now, by the id it was cut with (a checkpoint's load renames them).
    current_ids: Mutex<HashMap<ParamId, ParamId>>,
    /// The first collective or read that failed inside a gather: a read that failed takes
    /// part with zeros, a failed collective gives zeros (its group refuses every later call at
    /// once), and `backward` makes every rank report it.
    failure: Mutex<Option<Failure>>,
    /// Every shard parameter made by this accelerator: its id, the shape of the whole
    /// parameter it is cut from, and its unit.
    shard_ids: Mutex<HashMap<ParamId, ShardOf>>,
    /// Units sharded so far (each unit's number).
    units: AtomicU64,
    /// Gathers run so far (forward and again in backward).
    gathers: AtomicU64,
}

/// What a shard parameter is cut from.
#[derive(Clone, Debug)]
struct ShardOf {
    shape: Vec<usize>,
    unit: u64,
}

#[derive(Clone)]
enum Failure {
    Comm(CommError),
    Other(String),
}

impl std::fmt::Debug for ShardGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardGroup")
            .field("shards", &self.ids().len())
            .field("gathers", &self.gathers())
            .finish_non_exhaustive()
    }
}

impl ShardGroup {
    /// The units' group over `job`, or over `hybrid`'s shard groups; `overlap`: average
    /// across the replicas while backward goes on, where the shard groups allow it.
    pub fn new(job: Comm, hybrid: Option<&Hybrid>, overlap: bool) -> Self {
        let on_shared_memory = |h: &Hybrid| h.shard.lock().transport() == "shm";
        Self {
            comm: hybrid.map_or_else(|| job.clone(), |h| h.shard.clone()),
            hybrid: hybrid.cloned(),
            job,
            overlap_replicas: overlap && hybrid.is_some_and(on_shared_memory),
            replica_thread: Mutex::new(None),
            current_ids: Mutex::new(HashMap::new()),
            failure: Mutex::new(None),
            shard_ids: Mutex::new(HashMap::new()),
            units: AtomicU64::new(0),
            gathers: AtomicU64::new(0),
        }
    }

    /// The processes a shard is cut across (timed, locked).
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// The whole job.
    pub fn job(&self) -> &Comm {
        &self.job
    }

    /// This process's shard of every unit and how many there are: (rank, size) in the
    /// shard group; the job's without hybrid sharding.
    pub fn shard_job(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.world_size())
    }

    /// Whether this process writes its shards in a checkpoint: without hybrid sharding every
    /// process, with it the first shard group's (the others hold the same shards).
    pub fn writes_shards(&self) -> bool {
        self.hybrid.as_ref().is_none_or(Hybrid::writes_shards)
    }

    /// Averages this rank's part of a reduce-scatter (`shard`, the shard group's mean, of the
    /// shard cut as `id`) across the replicas into the job's mean; nothing without hybrid
    /// sharding. With the thread, `shard` stays the group's mean and the job's comes from
    /// [`finish_replicas`](Self::finish_replicas). `None` (recorded) when it failed.
    pub fn average_replicas(&self, id: ParamId, shard: &mut [f32]) -> Option<()> {
        let Some(hybrid) = &self.hybrid else {
            return Some(());
        };
        if self.overlap_replicas {
            let mut thread = self
                .replica_thread
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if thread.is_none() {
                match ReplicaThread::start(hybrid.replicas.clone(), self.job.rank()) {
                    Ok(started) => *thread = Some(started),
                    Err(e) => {
                        drop(thread);
                        self.record_other(format!("starting the replicas' thread failed: {e}"));
                        return None;
                    }
                }
            }
            if let Some(thread) = thread.as_ref() {
                thread.send(self.current_id(id), shard.to_vec());
            }
            return Some(());
        }
        match hybrid
            .replicas
            .timed(|g| g.all_reduce(shard, accelerate_core::Reduction::Mean))
        {
            Ok(()) => Some(()),
            Err(e) => {
                self.record(Failure::Comm(e));
                None
            }
        }
    }

    /// The shards' gradients the replicas' thread averaged in this backward pass (none
    /// without one), once it is done: call it before any collective of the job's. A failure
    /// is recorded, as a gather's.
    pub fn finish_replicas(&self) -> Averaged {
        let thread = self
            .replica_thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match thread.map(ReplicaThread::finish) {
            None => Vec::new(),
            Some(Some(Ok(averaged))) => averaged,
            Some(Some(Err(e))) => {
                self.record(Failure::Comm(e));
                Vec::new()
            }
            Some(None) => {
                self.record_other("the thread averaging across the replicas panicked".into());
                Vec::new()
            }
        }
    }

    /// Shard `id`'s id now (`id` itself unless a checkpoint's load renamed it).
    fn current_id(&self, id: ParamId) -> ParamId {
        let ids = self
            .current_ids
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        ids.get(&id).copied().unwrap_or(id)
    }

    /// Ranks of the group.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// True once a gather failed (NCCL's gathers then stop communicating: see `on_gpus`).
    #[cfg(feature = "device-kernels")]
    pub fn failed(&self) -> bool {
        self.failure_slot().is_some()
    }

    /// Runs a collective on the group; `None` (recorded) when it failed.
    pub fn run(
        &self,
        collective: impl FnOnce(&mut ProcessGroup) -> Result<(), CommError>,
    ) -> Option<()> {
        match self.comm.timed(collective) {
            Ok(()) => Some(()),
            Err(e) => {
                self.record(Failure::Comm(e));
                None
            }
        }
    }

    /// `result`'s value; `None` (recorded) for an error.
    pub fn check<T, E: std::fmt::Debug>(&self, result: Result<T, E>) -> Option<T> {
        result
            .map_err(|e| self.record(Failure::Other(format!("{e:?}"))))
            .ok()
    }

    /// Records a failure that is not a collective's.
    pub fn record_other(&self, what: String) {
        self.record(Failure::Other(what));
    }

    fn record(&self, failure: Failure) {
        self.failure_slot().get_or_insert(failure);
    }

    fn failure_slot(&self) -> MutexGuard<'_, Option<Failure>> {
        self.failure.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The recorded failure as this process's error, if a gather failed.
    pub fn error(&self) -> Option<AccelerateError> {
        let failure = self.failure_slot().clone()?;
        Some(match failure {
            Failure::Comm(e) => AccelerateError::Comm(e),
            Failure::Other(detail) => AccelerateError::Tensor {
                rank: self.comm.rank(),
                op: "gathering a sharded parameter",
                detail,
            },
        })
    }

    /// Counts one gather.
    pub fn count_gather(&self) {
        self.gathers.fetch_add(1, Ordering::Relaxed);
    }

    /// Gathers run so far.
    pub fn gathers(&self) -> u64 {
        self.gathers.load(Ordering::Relaxed)
    }

    /// True once this accelerator made a sharded unit.
    pub fn has_units(&self) -> bool {
        self.units.load(Ordering::Relaxed) > 0
    }

    /// A number for a new unit.
    pub fn new_unit(&self) -> u64 {
        self.units.fetch_add(1, Ordering::Relaxed)
    }

    /// Remembers `id` as a shard of a parameter of shape `shape` in unit `unit`.
    pub fn register(&self, id: ParamId, shape: Vec<usize>, unit: u64) {
        self.ids().insert(id, ShardOf { shape, unit });
    }

    /// Remembers `id` as the shard that `old` was (a checkpoint's saved id for it).
    pub fn rename(&self, old: ParamId, id: ParamId) {
        let mut ids = self.ids();
        if let Some(shard) = ids.get(&old).cloned() {
            ids.insert(id, shard);
        }
        drop(ids);
        let mut current = self
            .current_ids
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for now in current.values_mut().filter(|now| **now == old) {
            *now = id;
        }
        current.entry(old).or_insert(id);
    }

    /// The unit of shard `id`; `None` for other ids.
    pub fn unit_of(&self, id: ParamId) -> Option<u64> {
        self.ids().get(&id).map(|shard| shard.unit)
    }

    /// True when `id` is a shard parameter's.
    pub fn is_shard(&self, id: ParamId) -> bool {
        self.ids().contains_key(&id)
    }

    /// Elements of the whole parameter that `id` is a shard of; `None` for other ids.
    pub fn whole_numel(&self, id: ParamId) -> Option<usize> {
        self.ids()
            .get(&id)
            .map(|shard| shard.shape.iter().product())
    }

    /// For each parameter of `layout`, the elements of the whole parameter when it is a
    /// shard; `None` for a parameter left whole.
    pub fn numels(&self, layout: &ParamLayout) -> Vec<Option<usize>> {
        layout
            .entries
            .iter()
            .map(|entry| self.whole_numel(entry.id))
            .collect()
    }

    /// The shape of the whole parameter that `id` is a shard of; `None` for other ids.
    pub fn whole_shape(&self, id: ParamId) -> Option<Vec<usize>> {
        self.ids().get(&id).map(|shard| shard.shape.clone())
    }

    fn ids(&self) -> MutexGuard<'_, HashMap<ParamId, ShardOf>> {
        self.shard_ids
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}
