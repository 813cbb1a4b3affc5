//! Hybrid sharding's two partitions of a job: the shard groups (ZeRO's shards are cut within
//! each) and the replica groups (the ranks holding the same shard in every shard group, over
//! which its gradients are averaged).

use crate::settings::ShardGroupSize;

/// Why a job cannot be cut into the shard groups asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HybridError {
    /// A number of processes that does not divide the job's.
    #[error(
        "shard groups of {size} processes do not divide the job's {world}; give a divisor of \
         {world}, `host`, or `job`"
    )]
    Indivisible {
        /// Processes per group asked for.
        size: usize,
        /// Processes in the job.
        world: usize,
    },
    /// Hosts with different numbers of processes.
    #[error(
        "the hosts run different numbers of processes ({sizes:?}), and every shard group must \
         hold the same number; run as many on each host, or give a number of processes that \
         divides the job"
    )]
    UnequalHosts {
        /// Processes on each host.
        sizes: Vec<usize>,
    },
}

/// A job cut into equal shard groups, and the replica groups across them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HybridGroups {
    /// The shard groups, ranks in order (the i-th holds shard i).
    pub shards: Vec<Vec<usize>>,
    /// Replica group i: the i-th rank of every shard group.
    pub replicas: Vec<Vec<usize>>,
}

impl HybridGroups {
    /// The groups of `size` over a job whose rank r runs on host `hosts[r]`; `None` when one
    /// shard group is the whole job (plain ZeRO). An error says why the job cannot be cut so.
    pub fn new(size: ShardGroupSize, hosts: &[String]) -> Result<Option<Self>, HybridError> {
        let world = hosts.len();
        let shards: Vec<Vec<usize>> = match size {
            ShardGroupSize::Job => return Ok(None),
            ShardGroupSize::Host => {
                let mut groups: Vec<(&String, Vec<usize>)> = Vec::new();
                for (rank, host) in hosts.iter().enumerate() {
                    match groups.iter_mut().find(|(h, _)| *h == host) {
                        Some((_, ranks)) => ranks.push(rank),
                        None => groups.push((host, vec![rank])),
                    }
                }
                groups.into_iter().map(|(_, ranks)| ranks).collect()
            }
            ShardGroupSize::Processes(k) => {
                if k == 0 || !world.is_multiple_of(k) {
                    return Err(HybridError::Indivisible { size: k, world });
                }
                (0..world / k)
                    .map(|g| (g * k..(g + 1) * k).collect())
                    .collect()
            }
        };
        if shards.len() <= 1 {
            return Ok(None);
        }
        let k = shards[0].len();
        if shards.iter().any(|group| group.len() != k) {
            let sizes: Vec<usize> = shards.iter().map(Vec::len).collect();
            return Err(HybridError::UnequalHosts { sizes });
        }
        let replicas = (0..k)
            .map(|i| shards.iter().map(|group| group[i]).collect())
            .collect();
        Ok(Some(Self { shards, replicas }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(names: &[&str]) -> Vec<String> {
        names.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn hosts_and_numbers_cut_the_job_into_equal_groups() {
        let two_by_two = hosts(&["a", "a", "b", "b"]);
        let groups = HybridGroups::new(ShardGroupSize::Host, &two_by_two)
            .unwrap()
            .unwrap();
        assert_eq!(groups.shards, [vec![0, 1], vec![2, 3]]);
        assert_eq!(groups.replicas, [vec![0, 2], vec![1, 3]]);
        // Ranks need not be contiguous on a host.
        let interleaved = hosts(&["a", "b", "a", "b"]);
        let groups = HybridGroups::new(ShardGroupSize::Host, &interleaved)
            .unwrap()
            .unwrap();
        assert_eq!(groups.shards, [vec![0, 2], vec![1, 3]]);
        let groups = HybridGroups::new(ShardGroupSize::Processes(2), &interleaved)
            .unwrap()
            .unwrap();
        assert_eq!(groups.shards, [vec![0, 1], vec![2, 3]]);
        // One group is the whole job: plain ZeRO.
        let one_host = hosts(&["a"; 4]);
        assert_eq!(HybridGroups::new(ShardGroupSize::Host, &one_host), Ok(None));
        assert_eq!(
            HybridGroups::new(ShardGroupSize::Processes(4), &one_host),
            Ok(None)
        );
        assert_eq!(
            HybridGroups::new(ShardGroupSize::Job, &two_by_two),
            Ok(None)
        );
        // Groups of one: every rank holds everything (data parallelism).
        let ones = HybridGroups::new(ShardGroupSize::Processes(1), &one_host)
            .unwrap()
            .unwrap();
        assert_eq!(ones.replicas, [vec![0, 1, 2, 3]]);
    }

    #[test]
    fn unequal_groups_are_refused_saying_why() {
        let err = HybridGroups::new(ShardGroupSize::Processes(3), &hosts(&["a"; 4]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("do not divide the job's 4"), "{err}");
        let err = HybridGroups::new(ShardGroupSize::Host, &hosts(&["a", "a", "b"]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("different numbers of processes ([2, 1])"),
            "{err}"
        );
    }
}
