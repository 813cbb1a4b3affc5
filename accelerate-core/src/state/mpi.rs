//! The readers of MPI launchers' variables: Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`) and the
//! MPICH family's PMI (`PMI_RANK`, `PMI_SIZE`, Hydra's local ranks).

use super::ProcessState;
use super::launcher::Launcher;
use super::reader::Reader;
use crate::env_vars::EnvSource;
use crate::error::StateError;

impl<E: EnvSource + ?Sized> Reader<'_, E> {
    pub(super) fn open_mpi(&self) -> Result<ProcessState, StateError> {
        let launcher = Launcher::OpenMpi;
        let rank = self.usize_req("OMPI_COMM_WORLD_RANK", launcher)?;
        let world_size = self.usize_req("OMPI_COMM_WORLD_SIZE", launcher)?;
        let local_rank = self.usize_req("OMPI_COMM_WORLD_LOCAL_RANK", launcher)?;
        let local_world_size = self.usize_req("OMPI_COMM_WORLD_LOCAL_SIZE", launcher)?;
        // OMPI_COMM_WORLD_NODE_RANK is the rank among the processes of a node (a local rank),
        // not the node's index; Open MPI maps ranks to nodes by slot unless told otherwise.
        let node_rank = rank / local_world_size.max(1);
        let job_id = self
            .env
            .var("PMIX_NAMESPACE")
            .or_else(|| self.env.var("OMPI_MCA_ess_base_jobid"));
        let (master_addr, master_port) =
            self.master_or_local(local_world_size == world_size, &job_id)?;
        Ok(ProcessState {
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            master_addr,
            master_port,
            launcher,
            job_id,
            agent_store: None,
        })
    }

    pub(super) fn pmi(&self) -> Result<ProcessState, StateError> {
        let launcher = Launcher::Pmi;
        let rank = self.usize_req("PMI_RANK", launcher)?;
        let world_size = self.usize_req("PMI_SIZE", launcher)?;
        let local_rank = self.first_usize(&["MPI_LOCALRANKID", "PMI_LOCAL_RANK"])?;
        let local_world_size = self.first_usize(&["MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"])?;
        let (local_rank, local_world_size) = match (local_rank, local_world_size) {
            (Some(lr), Some(lws)) => (lr, lws),
            // One process: it is alone on its node whatever the launcher says.
            (None, None) if world_size == 1 => (0, 1),
            // Without them the processes' placement on nodes (and so each one's device) would
            // be a guess: refuse rather than put every rank on one node.
            (None, None) => {
                return Err(StateError::Missing {
                    var: "MPI_LOCALRANKID/MPI_LOCALNRANKS",
                    launcher,
                    why: "the PMI launcher said nothing about which processes share a node. \
                          hint: launch with MPICH's mpiexec (Hydra sets MPI_LOCALRANKID and \
                          MPI_LOCALNRANKS), or set PMI_LOCAL_RANK and PMI_LOCAL_SIZE for each \
                          process",
                });
            }
            _ => {
                return Err(StateError::Missing {
                    var: "MPI_LOCALRANKID/MPI_LOCALNRANKS",
                    launcher,
                    why: "only one of the local rank and local size is set; set both",
                });
            }
        };
        let (master_addr, master_port) = self.master()?;
        Ok(ProcessState {
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank: rank / local_world_size.max(1),
            master_addr,
            master_port,
            launcher,
            job_id: None,
            agent_store: None,
        })
    }
}
