//! Hybrid sharding's second average: each shard's gradient, reduce-scattered over its shard
//! group inside backward, averaged with its counterparts in the other shard groups on a
//! thread of its own while backward goes on. The shard group's collectives run on shared
//! memory and the replicas' over TCP, two engines that never share a connection, so the two
//! may run at once; the job's own collectives wait until the thread is done.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use accelerate_core::{CommError, Reduction};
use burn::module::ParamId;

use crate::group::Comm;

/// Fault injection for tests: `<rank>:<n>` aborts the job's rank `<rank>` on its replicas'
/// thread before the n-th average it runs there (counting from 1 over the process's life): a
/// rank that dies while its averages across the hosts overlap backward.
const FAULT_AT: &str = "ACCELERATE_FAULT_REPLICAS_AT";

/// Averages run by replicas' threads in this process so far.
static AVERAGED: AtomicU64 = AtomicU64::new(0);

/// A shard's gradient averaged across the replicas, by its parameter's id.
pub(crate) type Averaged = Vec<(ParamId, Vec<f32>)>;

/// The thread that averages one backward pass's shard gradients across the replicas, in the
/// order backward hands them over (the same on every process).
pub(crate) struct ReplicaThread {
    jobs: mpsc::Sender<(ParamId, Vec<f32>)>,
    done: JoinHandle<Result<Averaged, CommError>>,
}

impl ReplicaThread {
    /// A thread averaging over `replicas`, on the job's rank `rank`.
    pub fn start(replicas: Comm, rank: usize) -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::channel::<(ParamId, Vec<f32>)>();
        let fault = crate::fault::fault_at(FAULT_AT, rank);
        let done = std::thread::Builder::new()
            .name("accelerate-replicas".into())
            .spawn(move || {
                let mut averaged = Vec::new();
                for (id, mut shard) in queue {
                    let count = AVERAGED.fetch_add(1, Ordering::Relaxed) + 1;
                    if fault == Some(count) {
                        eprintln!("{FAULT_AT}: aborting before average {count}");
                        std::process::abort();
                    }
                    replicas.timed(|group| group.all_reduce(&mut shard, Reduction::Mean))?;
                    averaged.push((id, shard));
                }
                Ok(averaged)
            })?;
        Ok(Self { jobs, done })
    }

    /// Queues shard `id`'s gradient (the shard group's mean). A thread that stopped on an
    /// error takes no more; [`finish`](Self::finish) returns that error.
    pub fn send(&self, id: ParamId, shard: Vec<f32>) {
        let _ = self.jobs.send((id, shard));
    }

    /// Every queued gradient averaged across the replicas, once the thread has done them
    /// all, or the first collective that failed; `None` if the thread panicked.
    pub fn finish(self) -> Option<Result<Averaged, CommError>> {
        drop(self.jobs);
        self.done.join().ok()
    }
}
