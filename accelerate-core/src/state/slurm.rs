//! The reader of SLURM's `srun` variables, and the helpers that decode SLURM's compressed
//! lists (tasks per node, node names) and derive a job's rendezvous port.

use super::MAX_WORLD_SIZE;
use super::ProcessState;
use super::contract::{DEFAULT_MASTER_PORT, MASTER_PORT};
use super::launcher::Launcher;
use super::reader::Reader;
use crate::env_vars::EnvSource;
use crate::error::StateError;

impl<E: EnvSource + ?Sized> Reader<'_, E> {
    pub(super) fn slurm(&self) -> Result<ProcessState, StateError> {
        let launcher = Launcher::Slurm;
        let rank = self.usize_req("SLURM_PROCID", launcher)?;
        let world_size = self
            .first_usize(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])?
            .ok_or(StateError::Missing {
                var: "SLURM_NTASKS",
                launcher,
                why: "SLURM_PROCID is set but the number of tasks is not",
            })?;
        let local_rank = self.usize_req("SLURM_LOCALID", launcher)?;
        let node_rank = self.usize_req("SLURM_NODEID", launcher)?;
        let (tasks_var, tasks) = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]
            .iter()
            .find_map(|var| self.env.var(var).map(|v| (*var, v)))
            .ok_or(StateError::Missing {
                var: "SLURM_STEP_TASKS_PER_NODE",
                launcher,
                why: "the number of tasks on this node is needed for the local world size",
            })?;
        let per_node = parse_slurm_tasks_per_node(&tasks).ok_or_else(|| {
            StateError::invalid(tasks_var, &tasks, "expected a list like 4(x2),3")
        })?;
        let local_world_size = *per_node.get(node_rank).ok_or_else(|| {
            StateError::invalid(
                "SLURM_NODEID",
                node_rank,
                format!(
                    "{tasks_var} = {tasks} describes only {} nodes",
                    per_node.len()
                ),
            )
        })?;
        let job_id = self
            .env
            .var("SLURM_JOB_ID")
            .map(|job| match self.env.var("SLURM_STEP_ID") {
                Some(step) => format!("{job}.{step}"),
                None => job,
            });
        let (mut master_addr, mut master_port) =
            self.master_or_local(local_world_size == world_size, &job_id)?;
        if self.env.var(MASTER_PORT).is_none() && master_port != 0 {
            // Two jobs whose first node is the same must not both want PyTorch's 29500.
            master_port = slurm_port(self.env.var("SLURM_JOB_ID"), self.env.var("SLURM_STEP_ID"));
        }
        if master_addr.is_none() {
            master_addr = [
                "SLURM_STEP_NODELIST",
                "SLURM_JOB_NODELIST",
                "SLURM_NODELIST",
            ]
            .iter()
            .find_map(|var| self.env.var(var))
            .and_then(|list| first_slurm_host(&list));
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
            agent_store: None,
        })
    }
}

/// Rank 0's port for a SLURM job spanning hosts without `MASTER_PORT`: derived from the job
/// and step ids, so that every rank computes the same one and jobs sharing a first node rarely
/// meet; 20000-31999, below Linux's ephemeral ports. Without a job id, [`DEFAULT_MASTER_PORT`].
pub fn slurm_port(job_id: Option<String>, step_id: Option<String>) -> u16 {
    let number = |v: Option<String>| v.and_then(|v| v.trim().parse::<u64>().ok());
    match number(job_id) {
        Some(job) => {
            let step = number(step_id).unwrap_or(0);
            // 12000 < u16::MAX, so the sum fits.
            20_000 + (job.wrapping_mul(31).wrapping_add(step) % 12_000) as u16
        }
        None => DEFAULT_MASTER_PORT,
    }
}

/// Expands SLURM's compressed tasks-per-node list: `"4(x2),3"` is `[4, 4, 3]`. `None` for a
/// list that does not parse or describes more than [`MAX_WORLD_SIZE`] nodes (it is never
/// expanded beyond that).
pub fn parse_slurm_tasks_per_node(list: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for item in list.split(',') {
        let item = item.trim();
        let (count, repeat) = match item.split_once("(x") {
            Some((count, rest)) => (count, rest.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (item, 1),
        };
        let count = count.parse::<usize>().ok()?;
        if repeat > MAX_WORLD_SIZE - out.len() {
            return None;
        }
        out.extend(std::iter::repeat_n(count, repeat));
    }
    (!out.is_empty()).then_some(out)
}

/// The first host of a SLURM node list: `"gpu[07-09,12],cpu1"` gives `"gpu07"`.
pub fn first_slurm_host(list: &str) -> Option<String> {
    let list = list.trim();
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inside = &list[end + 1..];
        let first = inside.split([',', '-', ']']).next()?;
        Some(format!("{prefix}{first}"))
    } else {
        (!prefix.is_empty()).then(|| prefix.to_string())
    }
}
