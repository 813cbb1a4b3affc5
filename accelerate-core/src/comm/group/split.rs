//! Groups of some of a group's ranks ([`ProcessGroup::split`]): hybrid sharding's groups
//! within a host and across hosts, formed from the group's own connections and shared
//! memory, with no rendezvous of their own.

use std::sync::Arc;

use super::{ProcessGroup, Reduction};
use crate::comm::call::OpKind;
use crate::comm::engine::{Split, part_of};
use crate::error::CommError;

impl ProcessGroup {
    /// The group of this rank's part of `parts`, a partition of this group's ranks into
    /// groups (each part's ranks in the order of their new ranks). Every rank of this group
    /// calls it at once with the same partition; a rank that passes another one makes every
    /// rank fail, naming it. The new group talks over this one's transport: a part within a
    /// host over shared memory, a part across hosts over this group's TCP connections. A group
    /// and the groups split from it take turns: their collectives run one at a time, in the
    /// same order on every rank. Under MPI this is an error for now.
    ///
    /// ```
    /// use accelerate_core::comm::{GroupOptions, ProcessGroup, Reduction};
    ///
    /// // Four ranks as threads of one process; groups {0, 1} and {2, 3}.
    /// let parts = vec![vec![0, 1], vec![2, 3]];
    /// let threads: Vec<_> = ProcessGroup::local(4, &GroupOptions::default())
    ///     .into_iter()
    ///     .map(|mut group| {
    ///         let parts = parts.clone();
    ///         std::thread::spawn(move || {
    ///             let mut pair = group.split(&parts).unwrap();
    ///             let mut value = [group.rank() as f32];
    ///             pair.all_reduce(&mut value, Reduction::Sum).unwrap();
    ///             value[0]
    ///         })
    ///     })
    ///     .collect();
    /// let sums: Vec<f32> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    /// assert_eq!(sums, [1.0, 1.0, 5.0, 5.0]);
    /// ```
    pub fn split(&mut self, parts: &[Vec<usize>]) -> Result<ProcessGroup, CommError> {
        let op = OpKind::Setup;
        check_partition(parts, self.world_size)
            .map_err(|problem| self.usage(op, problem.to_string()))?;
        if self.world_size > 1 {
            // The same partition everywhere: rank 0's, compared on each rank, agreed on all.
            let theirs: Vec<Vec<usize>> = self.broadcast_object(Some(&parts.to_vec()), 0)?;
            let mut same = [f32::from(u8::from(theirs == parts))];
            self.all_reduce(&mut same, Reduction::Min)?;
            if same[0] != 1.0 {
                return Err(self.usage(
                    op,
                    format!(
                        "the ranks split the group differently (rank 0: {theirs:?}, rank {}: \
                         {parts:?}); every rank must pass the same parts",
                        self.rank
                    ),
                ));
            }
        }
        let mine = part_of(parts, self.rank).to_vec();
        let rank = mine.iter().position(|&r| r == self.rank).unwrap_or(0);
        let call = self.call(op);
        let mut formed = None;
        self.run(&call, |engine| {
            formed = Some(engine.split(&call, parts)?);
            Ok(())
        })?;
        let engine = match formed {
            // A group of one (one process, or a part of one rank).
            None | Some(Split::Alone) => None,
            Some(Split::Formed(engine)) => Some(engine),
            Some(Split::Unsupported) => {
                return Err(self.usage(
                    op,
                    format!(
                        "the {} transport cannot form a group of some of its ranks (hybrid \
                         sharding). hint: run without ACCELERATE_TRANSPORT=mpi, or without \
                         hybrid sharding",
                        self.transport()
                    ),
                ));
            }
        };
        // One alarm for the job: a failure of this group is told to the job's other groups.
        let mut group = Self::with_engine_in(rank, mine.len(), engine, Arc::clone(&self.alarm));
        // Errors name the job's ranks: this group's own, as the job numbers them.
        let job = |r: usize| {
            self.members
                .as_ref()
                .map_or(r, |m| m.get(r).copied().unwrap_or(r))
        };
        group.members = Some(mine.iter().map(|&r| job(r)).collect());
        Ok(group)
    }
}

/// What is wrong with a partition of a group's ranks (each carries the partition).
#[derive(Debug, thiserror::Error)]
enum PartitionError {
    #[error("{0:?} has an empty part")]
    Empty(Vec<Vec<usize>>),
    #[error("{0:?} names rank {1}, outside the group")]
    Outside(Vec<Vec<usize>>, usize),
    #[error("{0:?} names rank {1} twice")]
    Twice(Vec<Vec<usize>>, usize),
    #[error("{0:?} leaves rank {1} out")]
    Missing(Vec<Vec<usize>>, usize),
}

/// Whether `parts` cuts ranks `0..world` into non-empty parts, each rank in exactly one.
fn check_partition(parts: &[Vec<usize>], world: usize) -> Result<(), PartitionError> {
    let mut seen = vec![false; world];
    for part in parts {
        if part.is_empty() {
            return Err(PartitionError::Empty(parts.to_vec()));
        }
        for &rank in part {
            match seen.get_mut(rank) {
                None => return Err(PartitionError::Outside(parts.to_vec(), rank)),
                Some(true) => return Err(PartitionError::Twice(parts.to_vec(), rank)),
                Some(slot) => *slot = true,
            }
        }
    }
    match seen.iter().position(|&s| !s) {
        Some(rank) => Err(PartitionError::Missing(parts.to_vec(), rank)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::GroupOptions;

    #[test]
    fn a_partition_must_name_every_rank_once() {
        assert!(check_partition(&[vec![0, 1], vec![2, 3]], 4).is_ok());
        assert!(check_partition(&[vec![3, 0], vec![2], vec![1]], 4).is_ok());
        let err = |parts: &[Vec<usize>]| check_partition(parts, 4).unwrap_err().to_string();
        assert!(err(&[vec![0, 1], vec![2]]).contains("leaves rank 3 out"));
        assert!(err(&[vec![0, 1], vec![1, 2, 3]]).contains("rank 1 twice"));
        assert!(err(&[vec![0, 1, 2, 3, 4]]).contains("names rank 4"));
        assert!(err(&[vec![0, 1, 2, 3], vec![]]).contains("empty part"));
    }

    /// Four thread ranks split two ways at once (pairs and the pairs' counterparts), with
    /// collectives of the three groups interleaved: each group's results are its own.
    #[test]
    fn split_groups_and_their_parent_take_turns_on_one_link() {
        let shards = vec![vec![0, 1], vec![2, 3]];
        let replicas = vec![vec![0, 2], vec![1, 3]];
        let threads: Vec<_> = ProcessGroup::local(4, &GroupOptions::default())
            .into_iter()
            .map(|mut world| {
                let (shards, replicas) = (shards.clone(), replicas.clone());
                std::thread::spawn(move || {
                    let mut shard = world.split(&shards).unwrap();
                    let mut replica = world.split(&replicas).unwrap();
                    let me = world.rank() as f32;
                    let mut results = Vec::new();
                    for round in 0..3 {
                        let mut a = vec![me + round as f32; 1000];
                        shard.all_reduce(&mut a, Reduction::Sum).unwrap();
                        let mut b = vec![me; 10];
                        world.all_reduce(&mut b, Reduction::Sum).unwrap();
                        let mut c = [me * 10.0];
                        replica.all_reduce(&mut c, Reduction::Sum).unwrap();
                        let mut gathered = vec![0.0; 2];
                        shard.all_gather(&[me], &mut gathered).unwrap();
                        results.push((a[999], b[0], c[0], gathered));
                    }
                    (shard.rank(), shard.world_size(), replica.rank(), results)
                })
            })
            .collect();
        let out: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        for (rank, (shard_rank, shard_world, replica_rank, results)) in out.iter().enumerate() {
            assert_eq!((*shard_rank, *shard_world), (rank % 2, 2));
            assert_eq!(*replica_rank, rank / 2);
            let pair = (rank / 2) * 2;
            for (round, (a, b, c, gathered)) in results.iter().enumerate() {
                let pair_sum = (pair + pair + 1) as f32 + 2.0 * round as f32;
                assert_eq!(*a, pair_sum, "rank {rank} round {round}");
                assert_eq!(*b, 6.0);
                let partner = if rank < 2 { rank + 2 } else { rank - 2 };
                assert_eq!(*c, 10.0 * (rank + partner) as f32);
                assert_eq!(gathered, &[pair as f32, (pair + 1) as f32]);
            }
        }
    }

    /// A peer of a split group that is gone is named by its rank in the job: the error a
    /// user reads, whatever group it happened in.
    #[test]
    fn a_split_groups_errors_name_the_jobs_ranks() {
        let threads: Vec<_> = ProcessGroup::local(4, &GroupOptions::default())
            .into_iter()
            .map(|mut world| {
                std::thread::spawn(move || {
                    let mut pair = world.split(&[vec![0, 2], vec![1, 3]]).unwrap();
                    if world.rank() == 2 {
                        // Rank 2 leaves; its group and the job go with it.
                        drop(pair);
                        drop(world);
                        return String::new();
                    }
                    let mut value = [1.0f32];
                    match pair.all_reduce(&mut value, Reduction::Sum) {
                        Ok(()) => String::new(),
                        Err(e) => e.to_string(),
                    }
                })
            })
            .collect();
        let errors: Vec<String> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert!(
            errors[0].contains("rank 2") && errors[0].contains("ranks [0, 2]"),
            "{}",
            errors[0]
        );
        assert!(errors[1].is_empty() && errors[3].is_empty(), "{errors:?}");
    }

    #[test]
    fn ranks_that_split_differently_all_fail() {
        let threads: Vec<_> = ProcessGroup::local(2, &GroupOptions::default())
            .into_iter()
            .map(|mut world| {
                std::thread::spawn(move || {
                    let parts = if world.rank() == 0 {
                        vec![vec![0, 1]]
                    } else {
                        vec![vec![0], vec![1]]
                    };
                    world.split(&parts).map(|_| ()).unwrap_err().to_string()
                })
            })
            .collect();
        for t in threads {
            let err = t.join().unwrap();
            assert!(err.contains("split the group differently"), "{err}");
        }
    }
}
