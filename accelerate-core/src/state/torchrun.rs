//! The reader of `accelerate-rs launch`'s and torchrun's variables (the process contract's
//! names, [`contract`](super::contract)), with torchrun's agent store and restart attempts.

use super::ProcessState;
use super::contract::{LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, NODE_RANK, RANK, WORLD_SIZE};
use super::launcher::Launcher;
use super::reader::Reader;
use crate::env_vars::EnvSource;
use crate::error::StateError;

impl<E: EnvSource + ?Sized> Reader<'_, E> {
    pub(super) fn torchrun(&self) -> Result<ProcessState, StateError> {
        let launcher = Launcher::Torchrun;
        let rank = self.usize_req(RANK, launcher)?;
        let world_size = self.usize_req(WORLD_SIZE, launcher)?;
        let local_world_size = self.usize_opt(LOCAL_WORLD_SIZE)?;
        let local_rank = self.usize_opt(LOCAL_RANK)?;
        let (local_rank, local_world_size) = match (local_rank, local_world_size) {
            (Some(lr), Some(lws)) => (lr, lws),
            // torchrun always sets both; a hand-written environment with neither is one node.
            (None, None) => (rank, world_size),
            (Some(_), None) => {
                return Err(StateError::Missing {
                    var: LOCAL_WORLD_SIZE,
                    launcher,
                    why: "LOCAL_RANK is set, so the number of processes on this node is needed too",
                });
            }
            (None, Some(_)) => {
                return Err(StateError::Missing {
                    var: LOCAL_RANK,
                    launcher,
                    why: "LOCAL_WORLD_SIZE is set, so this process's index on the node is needed too",
                });
            }
        };
        let node_rank = match self.first_usize(&[NODE_RANK, "GROUP_RANK"])? {
            Some(n) => n,
            None => rank / local_world_size.max(1),
        };
        let (mut master_addr, mut master_port) = self.master()?;
        // torchrun restarts every worker under the same run id: each attempt is its own job.
        let mut job_id = self.env.var("TORCHELASTIC_RUN_ID").map(|id| {
            let attempt = self.env.var("TORCHELASTIC_RESTART_COUNT");
            format!("{id}.{}", attempt.as_deref().unwrap_or("0").trim())
        });
        let uses_agent_store = self
            .env
            .var("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
        let mut agent_store = None;
        if uses_agent_store && world_size > 1 {
            let Some(host) = master_addr.take() else {
                return Err(StateError::Missing {
                    var: MASTER_ADDR,
                    launcher,
                    why: "TORCHELASTIC_USE_AGENT_STORE says torchrun's store is there",
                });
            };
            agent_store = Some(if host.contains(':') {
                format!("[{host}]:{master_port}")
            } else {
                format!("{host}:{master_port}")
            });
            master_addr = Some(if local_world_size == world_size {
                "127.0.0.1".into()
            } else {
                host
            });
            master_port = 0;
        }
        if let (Some(id), Some(store)) = (&mut job_id, &agent_store) {
            // torchrun gives every job started with `--master-port` the run id `none`: two
            // such jobs of one user on one host would share the private rendezvous file. The
            // agent store's address is this launcher instance's own (two live stores cannot
            // share a port), and the same for every rank of the job on every host.
            id.push('@');
            id.push_str(store);
        }
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
            agent_store,
        })
    }
}
