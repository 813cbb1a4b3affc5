//! The process contract between `accelerate-rs launch` and its workers: the variables the
//! launcher writes for each worker ([`WorkerIdentity::vars`]) and the torchrun reader reads back
//! ([`ProcessState::from_source`](super::ProcessState::from_source)), named once here so that
//! the two sides cannot drift apart. torchrun writes the same names, so a worker reads both
//! launchers alike. The job's secret and the launcher's pid travel as `ACCELERATE_*` variables
//! ([`crate::env_vars`]).

/// Global rank of the worker.
pub const RANK: &str = "RANK";
/// Processes in the job.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank among the processes of this machine.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Processes on this machine.
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Index of this machine.
pub const NODE_RANK: &str = "NODE_RANK";
/// Host of rank 0's rendezvous store.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Port of rank 0's rendezvous store.
pub const MASTER_PORT: &str = "MASTER_PORT";

/// Port rank 0 listens on when the launcher sets no `MASTER_PORT` (PyTorch's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// What a launcher tells one worker about its place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerIdentity {
    /// Global rank.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// Rank among the processes of this machine.
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// Index of this machine.
    pub node_rank: usize,
    /// Host of rank 0's rendezvous store.
    pub master_addr: String,
    /// Port of rank 0's rendezvous store.
    pub master_port: u16,
}

impl WorkerIdentity {
    /// The variables to set in the worker's environment.
    pub fn vars(&self) -> [(&'static str, String); 7] {
        [
            (RANK, self.rank.to_string()),
            (WORLD_SIZE, self.world_size.to_string()),
            (LOCAL_RANK, self.local_rank.to_string()),
            (LOCAL_WORLD_SIZE, self.local_world_size.to_string()),
            (NODE_RANK, self.node_rank.to_string()),
            (MASTER_ADDR, self.master_addr.clone()),
            (MASTER_PORT, self.master_port.to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Launcher, ProcessState};

    /// What the launcher writes, the worker reads back unchanged, for every place in a job of
    /// two machines.
    #[test]
    fn what_the_launcher_writes_the_worker_reads() {
        for node_rank in 0..2 {
            for local_rank in 0..3 {
                let written = WorkerIdentity {
                    rank: node_rank * 3 + local_rank,
                    world_size: 6,
                    local_rank,
                    local_world_size: 3,
                    node_rank,
                    master_addr: "10.0.0.1".into(),
                    master_port: 29_611,
                };
                let vars = written.vars();
                let env: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let read = ProcessState::from_source(&env[..]).unwrap();
                assert_eq!(read.launcher, Launcher::Torchrun);
                let back = WorkerIdentity {
                    rank: read.rank,
                    world_size: read.world_size,
                    local_rank: read.local_rank,
                    local_world_size: read.local_world_size,
                    node_rank: read.node_rank,
                    master_addr: read.master_addr.unwrap(),
                    master_port: read.master_port,
                };
                assert_eq!(back, written);
            }
        }
    }
}
