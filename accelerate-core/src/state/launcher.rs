//! Which launcher described this process, and the names it gives the four numbers of a
//! process's identity (so that an error names the variable the user's launcher set).

use std::fmt;

use super::contract;

/// Which launcher's variables described this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher: a single process.
    None,
    /// `accelerate-rs launch` or torchrun (`RANK`, `WORLD_SIZE`, ...).
    Torchrun,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// An MPICH-family launcher speaking PMI (`PMI_RANK`, `PMI_SIZE`).
    Pmi,
    /// SLURM's `srun` (`SLURM_PROCID`, ...).
    Slurm,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::None => "none (single process)",
            Launcher::Torchrun => "torchrun/accelerate",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Pmi => "PMI",
            Launcher::Slurm => "SLURM",
        })
    }
}

/// The variables holding rank, world size, local rank and local world size under one launcher.
pub(super) struct IdentityVars {
    pub(super) rank: &'static str,
    pub(super) world_size: &'static str,
    pub(super) local_rank: &'static str,
    pub(super) local_world_size: &'static str,
}

impl Launcher {
    /// The variables this launcher sets for a process's identity.
    pub(super) fn identity_vars(self) -> IdentityVars {
        match self {
            Launcher::None | Launcher::Torchrun => IdentityVars {
                rank: contract::RANK,
                world_size: contract::WORLD_SIZE,
                local_rank: contract::LOCAL_RANK,
                local_world_size: contract::LOCAL_WORLD_SIZE,
            },
            Launcher::OpenMpi => IdentityVars {
                rank: "OMPI_COMM_WORLD_RANK",
                world_size: "OMPI_COMM_WORLD_SIZE",
                local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
                local_world_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
            },
            Launcher::Pmi => IdentityVars {
                rank: "PMI_RANK",
                world_size: "PMI_SIZE",
                local_rank: "MPI_LOCALRANKID",
                local_world_size: "MPI_LOCALNRANKS",
            },
            Launcher::Slurm => IdentityVars {
                rank: "SLURM_PROCID",
                world_size: "SLURM_NTASKS",
                local_rank: "SLURM_LOCALID",
                local_world_size: "SLURM_STEP_TASKS_PER_NODE",
            },
        }
    }
}
