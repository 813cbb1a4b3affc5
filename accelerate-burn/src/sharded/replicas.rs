//! Hybrid sharding's second average: each shard's gradient, reduce-scattered over its shard
//! group inside backward, averaged with its counterparts in the other shard groups on a
//! thread of its own while backward goes on. The shard group's collectives run on shared
//! memory and the replicas' over TCP, two engines that never share a connection, so the two
//! may run at once; the job's own collectives wait until the thread is done.

use std::sync::mpsc;
use std::thread::JoinHandle;

use accelerate_core::{CommError, Reduction};
use burn::module::ParamId;

use crate::group::Comm;

/// A shard's gradient averaged across the replicas, by its parameter's id.
pub(crate) type Averaged = Vec<(ParamId, Vec<f32>)>;

/// The thread that averages one backward pass's shard gradients across the replicas, in the
/// order backward hands them over (the same on every process).
pub(crate) struct ReplicaThread {
    jobs: mpsc::Sender<(ParamId, Vec<f32>)>,
    done: JoinHandle<Result<Averaged, CommError>>,
}

impl ReplicaThread {
    /// A thread averaging over `replicas`.
    pub fn start(replicas: Comm) -> std::io::Result<Self> {
        let (jobs, queue) = mpsc::channel::<(ParamId, Vec<f32>)>();
        let done = std::thread::Builder::new()
            .name("accelerate-replicas".into())
            .spawn(move || {
                let mut averaged = Vec::new();
                for (id, mut shard) in queue {
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
