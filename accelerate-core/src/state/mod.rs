//! Who this process is: rank, world size, local rank, node, and where rank 0 listens.
//!
//! The state is read from the environment that a launcher leaves behind. Recognised, in this
//! order of precedence (the first whose rank variable is set wins):
//!
//! | launcher | rank / size | local rank / size | node |
//! |---|---|---|---|
//! | `accelerate-rs launch`, torchrun | `RANK`, `WORLD_SIZE` | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | `NODE_RANK` (or `GROUP_RANK`) |
//! | Open MPI | `OMPI_COMM_WORLD_RANK`, `_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK`, `_LOCAL_SIZE` | `OMPI_COMM_WORLD_NODE_RANK` |
//! | MPICH / Intel MPI / Cray (PMI) | `PMI_RANK`, `PMI_SIZE` | `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` or `PMI_LOCAL_RANK`, `PMI_LOCAL_SIZE` | derived |
//! | SLURM (`srun`) | `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` or `SLURM_NTASKS` | `SLURM_LOCALID`, `SLURM_STEP_TASKS_PER_NODE` or `SLURM_TASKS_PER_NODE` | `SLURM_NODEID` |
//!
//! `MASTER_ADDR` and `MASTER_PORT` name rank 0's rendezvous address for every launcher. Under
//! SLURM the address defaults to the first host of the step's node list and the port to one
//! derived from the job id ([`slurm_port`]); elsewhere the port defaults to
//! [`DEFAULT_MASTER_PORT`]. Under torchrun (`TORCHELASTIC_USE_AGENT_STORE=True`) they name the
//! agent's own store instead ([`ProcessState::agent_store`]), and rank 0 picks its port. With
//! none of these variables set the process is rank 0 of 1.
//!
//! Inconsistent values are errors that name the variable, never a silent guess: a rank outside
//! the world, a world size without a rank, a multi-process job without a master address.

use std::fmt;

pub use crate::env_vars::{EnvSource, ProcessEnv};
use crate::error::StateError;
use crate::settings::TransportChoice;

pub mod contract;
#[cfg(unix)]
mod follow;
mod launcher;
mod mpi;
mod reader;
mod slurm;
mod torchrun;

pub use contract::DEFAULT_MASTER_PORT;
#[cfg(unix)]
pub use follow::follow_launcher;
pub use launcher::Launcher;
use reader::Reader;
pub use slurm::{first_slurm_host, parse_slurm_tasks_per_node, slurm_port};

/// The identity of this process within a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessState {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes on this node, `0..local_world_size`; selects the device.
    pub local_rank: usize,
    /// Number of processes on this node.
    pub local_world_size: usize,
    /// Index of this node, `0..` number of nodes.
    pub node_rank: usize,
    /// Host of rank 0's rendezvous store; `None` for a single process.
    pub master_addr: Option<String>,
    /// Port of rank 0's rendezvous store; 0 when rank 0 picks a free one and tells the ranks
    /// on its host through the job's private file (jobs on one host started by a launcher that
    /// names the job, such as `mpirun` or `srun`, without `MASTER_PORT`).
    pub master_port: u16,
    /// Which launcher's variables were read.
    pub launcher: Launcher,
    /// The launcher's name for this job (`PMIX_NAMESPACE`, `SLURM_JOB_ID.SLURM_STEP_ID`,
    /// `TORCHELASTIC_RUN_ID.TORCHELASTIC_RESTART_COUNT`), when it gives one.
    pub job_id: Option<String>,
    /// torchrun's agent store (`host:port`): with `TORCHELASTIC_USE_AGENT_STORE=True`,
    /// `MASTER_ADDR:MASTER_PORT` is a PyTorch TCPStore the launcher hosts, not a port rank 0
    /// may listen on. Rank 0 then picks its own port: on one host it tells the others through
    /// the job's private file, across hosts through this store.
    pub agent_store: Option<String>,
}

impl Default for ProcessState {
    fn default() -> Self {
        Self::single()
    }
}

impl ProcessState {
    /// Rank 0 of 1, the state of a process started without a launcher.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            node_rank: 0,
            master_addr: None,
            master_port: DEFAULT_MASTER_PORT,
            launcher: Launcher::None,
            job_id: None,
            agent_store: None,
        }
    }

    /// Reads the state from the process environment. A worker of `accelerate-rs launch` also
    /// ties itself to the launcher here, so that it ends when the launcher does
    /// ([`follow_launcher`]).
    pub fn from_env() -> Result<Self, StateError> {
        #[cfg(unix)]
        follow_launcher();
        Self::from_source(&ProcessEnv)
    }

    /// Reads the state from `env` (see the module docs for the variables and their precedence).
    pub fn from_source(env: &(impl EnvSource + ?Sized)) -> Result<Self, StateError> {
        let reader = Reader { env };
        let state = if env.var(contract::RANK).is_some() || env.var(contract::WORLD_SIZE).is_some()
        {
            reader.torchrun()?
        } else if env.var("OMPI_COMM_WORLD_RANK").is_some() {
            reader.open_mpi()?
        } else if env.var("PMI_RANK").is_some() {
            reader.pmi()?
        } else if env.var("SLURM_PROCID").is_some() {
            reader.slurm()?
        } else {
            return Ok(Self::single());
        };
        // The MPI engine finds its peers through MPI, without a rendezvous of ours.
        let mpi = env
            .var(crate::env_vars::TRANSPORT)
            .map_or(Ok(TransportChoice::Auto), |v| v.parse())
            .is_ok_and(|t: TransportChoice| t.uses_mpi(env));
        state.validate(mpi)?;
        Ok(state)
    }

    /// True on global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.rank == 0
    }

    /// True on local rank 0 (the first process of each node).
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }

    /// True when more than one process takes part in the job.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// Checks the invariants between the fields; errors name the variable to fix. `mpi`: the
    /// group will be MPI's, which needs no rendezvous address.
    fn validate(&self, mpi: bool) -> Result<(), StateError> {
        let vars = self.launcher.identity_vars();
        if self.world_size == 0 || self.world_size > MAX_WORLD_SIZE {
            return Err(StateError::invalid(
                vars.world_size,
                self.world_size,
                format!("must be from 1 to {MAX_WORLD_SIZE}"),
            ));
        }
        if self.rank >= self.world_size {
            return Err(StateError::invalid(
                vars.rank,
                self.rank,
                format!("must be below the world size {}", self.world_size),
            ));
        }
        if self.local_world_size == 0 || self.local_world_size > self.world_size {
            return Err(StateError::invalid(
                vars.local_world_size,
                self.local_world_size,
                format!("must be between 1 and the world size {}", self.world_size),
            ));
        }
        if self.local_rank >= self.local_world_size {
            return Err(StateError::invalid(
                vars.local_rank,
                self.local_rank,
                format!(
                    "must be below the local world size {}",
                    self.local_world_size
                ),
            ));
        }
        if self.world_size > 1 && self.master_addr.is_none() && !mpi {
            return Err(StateError::Missing {
                var: contract::MASTER_ADDR,
                launcher: self.launcher,
                why: "a job of several processes needs rank 0's address for the rendezvous",
            });
        }
        Ok(())
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} of {} (local rank {} of {}, node {}), launcher {}",
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.node_rank,
            self.launcher
        )?;
        if let Some(addr) = &self.master_addr {
            write!(f, ", master {addr}:{}", self.master_port)?;
        }
        Ok(())
    }
}

/// The most processes a job may have (about a million): world sizes and node lists beyond it
/// are configuration errors, refused before anything is sized by them.
pub const MAX_WORLD_SIZE: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Result<ProcessState, StateError> {
        ProcessState::from_source(vars)
    }

    #[test]
    fn no_env_is_rank_zero_of_one() {
        let s = parse(&[]).unwrap();
        assert_eq!(s, ProcessState::single());
        assert!(s.is_main_process() && s.is_local_main_process() && !s.is_distributed());
    }

    #[test]
    fn torchrun_env() {
        let s = parse(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("NODE_RANK", "1"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            (
                s.rank,
                s.world_size,
                s.local_rank,
                s.local_world_size,
                s.node_rank
            ),
            (5, 8, 1, 4, 1)
        );
        assert_eq!(s.master_addr.as_deref(), Some("10.1.2.3"));
        assert_eq!(s.master_port, 1234);
        assert_eq!(s.launcher, Launcher::Torchrun);
        assert!(!s.is_main_process() && !s.is_local_main_process());
    }

    /// What torchrun's agent sets: MASTER_PORT is its store; each attempt is its own job.
    #[test]
    fn two_torchrun_jobs_with_master_ports_are_two_jobs() {
        // torchrun sets TORCHELASTIC_RUN_ID=none whenever --master-port is given.
        let job = |port: &str| {
            parse(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("LOCAL_RANK", "0"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port),
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
                ("TORCHELASTIC_RUN_ID", "none"),
            ])
            .unwrap()
            .job_id
        };
        assert_ne!(job("29501"), job("29502"));
        assert_eq!(job("29501"), job("29501"));
    }

    #[test]
    fn torchrun_agent_store_is_not_rank_0s_port() {
        let agent = |local: &str, attempt: &str| {
            parse(&[
                ("RANK", "1"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_RANK", "1"),
                ("LOCAL_WORLD_SIZE", local),
                ("GROUP_RANK", "0"),
                ("MASTER_ADDR", "node0.cluster"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
                ("TORCHELASTIC_RUN_ID", "abc"),
                ("TORCHELASTIC_RESTART_COUNT", attempt),
            ])
            .unwrap()
        };
        let one_host = agent("4", "0");
        assert_eq!(one_host.master_addr.as_deref(), Some("127.0.0.1"));
        assert_eq!(one_host.master_port, 0);
        assert_eq!(
            one_host.job_id.as_deref(),
            Some("abc.0@node0.cluster:29500")
        );
        assert_eq!(one_host.agent_store.as_deref(), Some("node0.cluster:29500"));
        let two_hosts = agent("2", "3");
        assert_eq!(two_hosts.master_addr.as_deref(), Some("node0.cluster"));
        assert_eq!(two_hosts.master_port, 0);
        assert_eq!(
            two_hosts.job_id.as_deref(),
            Some("abc.3@node0.cluster:29500")
        );
        // Without the agent store (older torchrun, static setups) MASTER_PORT is rank 0's.
        let plain = parse(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29501"),
            ("TORCHELASTIC_RUN_ID", "abc"),
        ])
        .unwrap();
        assert_eq!((plain.master_port, plain.agent_store), (29501, None));
    }

    #[test]
    fn torchrun_without_local_vars_is_one_node_and_default_port() {
        let s = parse(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
        ])
        .unwrap();
        assert_eq!((s.local_rank, s.local_world_size, s.node_rank), (1, 2, 0));
        assert_eq!(s.master_port, DEFAULT_MASTER_PORT);
    }

    #[test]
    fn torchrun_errors_name_the_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("RANK", "0")], "WORLD_SIZE"),
            (&[("WORLD_SIZE", "2")], "RANK"),
            (
                &[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
                "RANK",
            ),
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "18446744073709551615"),
                    ("MASTER_ADDR", "h"),
                ],
                "WORLD_SIZE",
            ),
            (&[("RANK", "0"), ("WORLD_SIZE", "2")], "MASTER_ADDR"),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("LOCAL_RANK", "0"),
                ],
                "LOCAL_WORLD_SIZE",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "4"),
                    ("MASTER_ADDR", "h"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                "LOCAL_RANK",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("LOCAL_RANK", "0"),
                    ("LOCAL_WORLD_SIZE", "3"),
                ],
                "LOCAL_WORLD_SIZE",
            ),
        ];
        for (vars, var) in cases {
            let err = parse(vars).unwrap_err().to_string();
            assert!(
                err.starts_with(var),
                "{vars:?}: expected an error naming {var}, got: {err}"
            );
            assert!(!err.contains('\n'), "one-line error: {err}");
        }
    }

    #[test]
    fn open_mpi_env() {
        let s = parse(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "node0"),
        ])
        .unwrap();
        assert_eq!(
            (
                s.rank,
                s.world_size,
                s.local_rank,
                s.local_world_size,
                s.node_rank
            ),
            (3, 4, 1, 2, 1)
        );
        assert_eq!(s.launcher, Launcher::OpenMpi);
        let err = parse(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("OMPI_COMM_WORLD_LOCAL_RANK"), "{err}");
        // Across hosts without MASTER_ADDR: an error for our transports, fine for MPI's.
        let across = [
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ];
        let tcp = [across.as_slice(), &[("ACCELERATE_TRANSPORT", "tcp")]].concat();
        let err = parse(&tcp).unwrap_err().to_string();
        assert!(err.starts_with("MASTER_ADDR"), "{err}");
        let mpi = parse(&[across.as_slice(), &[("ACCELERATE_TRANSPORT", "mpi")]].concat()).unwrap();
        assert_eq!((mpi.rank, mpi.master_addr), (3, None));
    }

    #[test]
    fn pmi_env() {
        let s = parse(&[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "4"),
            ("MPI_LOCALRANKID", "0"),
            ("MPI_LOCALNRANKS", "2"),
            ("MASTER_ADDR", "h"),
        ])
        .unwrap();
        assert_eq!(
            (s.rank, s.local_rank, s.local_world_size, s.node_rank),
            (2, 0, 2, 1)
        );
        let cray = parse(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("PMI_LOCAL_RANK", "1"),
            ("PMI_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ])
        .unwrap();
        assert_eq!((cray.local_rank, cray.local_world_size), (1, 2));
        let err = parse(&[
            ("PMI_RANK", "4"),
            ("PMI_SIZE", "4"),
            ("PMI_LOCAL_RANK", "0"),
            ("PMI_LOCAL_SIZE", "1"),
            ("MASTER_ADDR", "h"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("PMI_RANK"), "{err}");
        let err = parse(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "0"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("MPI_LOCALNRANKS"), "{err}");
        // No local information on several processes: an error with the fix, not a guess that
        // every rank shares one node.
        let err = parse(&[("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("MASTER_ADDR", "h")])
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("MPI_LOCALRANKID/MPI_LOCALNRANKS is not set"),
            "{err}"
        );
        assert!(err.contains("hint: launch with MPICH's mpiexec"), "{err}");
        let alone = parse(&[("PMI_RANK", "0"), ("PMI_SIZE", "1")]).unwrap();
        assert_eq!((alone.local_rank, alone.local_world_size), (0, 1));
    }

    #[test]
    fn slurm_env_with_compressed_lists() {
        let s = parse(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_NTASKS", "11"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2),3"),
            ("SLURM_JOB_NODELIST", "gpu[07-09],cpu1"),
        ])
        .unwrap();
        assert_eq!(
            (
                s.rank,
                s.world_size,
                s.local_rank,
                s.local_world_size,
                s.node_rank
            ),
            (9, 11, 1, 3, 2)
        );
        assert_eq!(s.master_addr.as_deref(), Some("gpu07"));
        assert_eq!(s.launcher, Launcher::Slurm);
        // No job id: PyTorch's default port; with one, the same derived port on every rank.
        assert_eq!(s.master_port, DEFAULT_MASTER_PORT);
        let with_job = |rank: &'static str, node: &'static str, local: &'static str| {
            parse(&[
                ("SLURM_PROCID", rank),
                ("SLURM_NTASKS", "4"),
                ("SLURM_LOCALID", local),
                ("SLURM_NODEID", node),
                ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
                ("SLURM_STEP_NODELIST", "n[1-2]"),
                ("SLURM_JOB_ID", "4242"),
                ("SLURM_STEP_ID", "1"),
            ])
            .unwrap()
            .master_port
        };
        let port = with_job("0", "0", "0");
        assert!((20_000..32_000).contains(&port), "{port}");
        assert_eq!(with_job("3", "1", "1"), port);
        assert_ne!(slurm_port(Some("4243".into()), Some("1".into())), port);
        let err = parse(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "3"),
            ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
            ("SLURM_JOB_NODELIST", "n[1-2]"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("SLURM_NODEID"), "{err}");
        let err = parse(&[("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0")])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("SLURM_NTASKS"), "{err}");
    }

    #[test]
    fn precedence_is_torchrun_then_mpi_then_pmi_then_slurm() {
        let both = [
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("SLURM_PROCID", "3"),
        ];
        assert_eq!(parse(&both).unwrap().launcher, Launcher::Torchrun);
        let mpi_in_slurm = [
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "1"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "1"),
            ("PMI_RANK", "0"),
            ("SLURM_PROCID", "3"),
        ];
        assert_eq!(parse(&mpi_in_slurm).unwrap().launcher, Launcher::OpenMpi);
    }

    #[test]
    fn slurm_list_helpers() {
        assert_eq!(parse_slurm_tasks_per_node("2"), Some(vec![2]));
        assert_eq!(parse_slurm_tasks_per_node("4(x2),3"), Some(vec![4, 4, 3]));
        assert_eq!(parse_slurm_tasks_per_node("4(x"), None);
        assert_eq!(parse_slurm_tasks_per_node(""), None);
        // Refused before anything is allocated for it.
        assert_eq!(parse_slurm_tasks_per_node("4(x1000000000000)"), None);
        assert_eq!(parse_slurm_tasks_per_node("4(x1048575),1,1"), None);
        assert_eq!(first_slurm_host("node1").as_deref(), Some("node1"));
        assert_eq!(first_slurm_host("a,b").as_deref(), Some("a"));
        assert_eq!(first_slurm_host("n[003,5]").as_deref(), Some("n003"));
    }
}
