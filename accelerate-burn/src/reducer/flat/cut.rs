//! Who the flat buffers' collectives run among: the processes a shard is cut across (the
//! job, or under hybrid sharding this process's shard group), the replicas a shard group's
//! average is completed across, and the job, which agrees on which parameters got gradients.

use crate::error::AccelerateError;
use crate::group::{Comm, Hybrid};
use crate::reducer::wire::Wire;

/// The groups of one flat reducer's collectives.
#[derive(Clone, Copy)]
pub(crate) struct Cut<'a> {
    /// The whole job.
    pub job: &'a Comm,
    /// The processes the shards are cut across.
    pub shard: &'a Comm,
    /// Hybrid sharding: this process's counterparts in the other shard groups.
    pub replicas: Option<&'a Comm>,
}

impl<'a> Cut<'a> {
    /// The job's groups: `job` alone, or `hybrid`'s.
    pub fn new(job: &'a Comm, hybrid: Option<&'a Hybrid>) -> Self {
        Self {
            job,
            shard: hybrid.map_or(job, |h| &h.shard),
            replicas: hybrid.map(|h| &h.replicas),
        }
    }

    /// Completes a shard group's average of `values` (this rank's part of a reduce-scatter)
    /// into the job's: the mean across the replicas (nothing without hybrid sharding).
    pub fn across_replicas(
        &self,
        values: &mut [f32],
        wire: &mut Wire,
    ) -> Result<(), AccelerateError> {
        if let Some(replicas) = self.replicas {
            replicas.timed(|group| wire.all_reduce_mean(values, group))?;
        }
        Ok(())
    }
}
