//! Every `ACCELERATE_*` variable, named once: `accelerate-rs launch` writes them for its workers,
//! the workers and the launcher read them, and `accelerate-rs env` lists them. Also the reader
//! of variables itself ([`EnvSource`]: the process environment, or a map in tests), which every
//! part of the crate that reads a setting goes through.

use std::collections::HashMap;

/// Where a variable is read from: the process environment or, in tests, a map.
pub trait EnvSource {
    /// The value of `key`, or `None` when it is not set (an empty value counts as unset).
    fn var(&self, key: &str) -> Option<String>;
}

/// The process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, key: &str) -> Option<String> {
        std::env::var(key).ok().filter(|v| !v.trim().is_empty())
    }
}

impl EnvSource for HashMap<String, String> {
    fn var(&self, key: &str) -> Option<String> {
        self.get(key).filter(|v| !v.trim().is_empty()).cloned()
    }
}

impl EnvSource for [(&str, &str)] {
    fn var(&self, key: &str) -> Option<String> {
        self.iter()
            .find(|(k, v)| *k == key && !v.trim().is_empty())
            .map(|(_, v)| (*v).to_string())
    }
}

/// Worker processes per machine (launcher).
pub const NUM_PROCESSES: &str = "ACCELERATE_NUM_PROCESSES";
/// Machines in the job (launcher).
pub const NUM_MACHINES: &str = "ACCELERATE_NUM_MACHINES";
/// This machine's index (launcher).
pub const MACHINE_RANK: &str = "ACCELERATE_MACHINE_RANK";
/// Address of rank 0's machine (launcher).
pub const MAIN_PROCESS_IP: &str = "ACCELERATE_MAIN_PROCESS_IP";
/// Rank 0's rendezvous port (launcher).
pub const MAIN_PROCESS_PORT: &str = "ACCELERATE_MAIN_PROCESS_PORT";
/// GPUs the workers may use (launcher).
pub const GPU_IDS: &str = "ACCELERATE_GPU_IDS";
/// Train on the CPU even where a GPU is present: `true`/`false`, `1`/`0`, `yes`/`no`.
pub const USE_CPU: &str = "ACCELERATE_USE_CPU";
/// Restarts of the workers after a failure (launcher).
pub const MAX_RESTARTS: &str = "ACCELERATE_MAX_RESTARTS";
/// The config file the launcher used, for its workers (`none`: no file).
pub const CONFIG_FILE: &str = "ACCELERATE_CONFIG_FILE";
/// The job's secret, shared by the processes of one job.
pub const JOB_TOKEN: &str = "ACCELERATE_JOB_TOKEN";
/// Micro-batches per optimizer update (workers).
pub const GRADIENT_ACCUMULATION_STEPS: &str = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS";
/// Seed of the device's random streams (workers).
pub const SEED: &str = "ACCELERATE_SEED";
/// Compute precision: `no`, `fp16` or `bf16` (workers).
pub const MIXED_PRECISION: &str = "ACCELERATE_MIXED_PRECISION";
/// Precision gradients travel in between processes (workers).
pub const GRADIENT_COMMUNICATION: &str = "ACCELERATE_GRADIENT_COMMUNICATION";
/// ZeRO stage of a fused optimizer (workers).
pub const ZERO_STAGE: &str = "ACCELERATE_ZERO_STAGE";
/// Processes each ZeRO shard is split across: `job`, `host` or a number (workers; hybrid
/// sharding below the job).
pub const SHARD_GROUP_SIZE: &str = "ACCELERATE_SHARD_GROUP_SIZE";
/// Whether autodiff recomputes memory-bound activations in the backward pass instead of
/// keeping them (Burn's balanced gradient checkpointing): `true`/`false` (workers).
pub const GRADIENT_CHECKPOINTING: &str = "ACCELERATE_GRADIENT_CHECKPOINTING";
/// Whether `save_state` writes and commits checkpoints in the background (workers):
/// `true`/`false`.
pub const ASYNC_CHECKPOINTS: &str = "ACCELERATE_ASYNC_CHECKPOINTS";
/// Whether gradients are averaged during the backward pass for models that mark their units
/// (workers): `true`/`false`.
pub const OVERLAP_COMMUNICATION: &str = "ACCELERATE_OVERLAP_COMMUNICATION";
/// Whether Burn's kernel fusion runs on a GPU backend built with it: `true`/`false`
/// (workers; `false` keeps Burn's fused stream but takes out its fusers).
pub const FUSION: &str = "ACCELERATE_FUSION";
/// Gradient bucket size in MiB (workers).
pub const GRADIENT_BUCKET_MB: &str = "ACCELERATE_GRADIENT_BUCKET_MB";
/// Collective timeout in seconds.
pub const TIMEOUT: &str = "ACCELERATE_TIMEOUT";
/// Rendezvous timeout in seconds.
pub const RENDEZVOUS_TIMEOUT: &str = "ACCELERATE_RENDEZVOUS_TIMEOUT";
/// Seconds a TCP peer may show no sign of life before it is reported lost.
pub const HEARTBEAT_TIMEOUT: &str = "ACCELERATE_HEARTBEAT_TIMEOUT";
/// Pid of the `accelerate-rs launch` that started this worker (the worker ends with it).
pub const LAUNCHER_PID: &str = "ACCELERATE_LAUNCHER_PID";
/// Whether groups spanning hosts all-reduce hierarchically (shared memory inside each host).
pub const HIERARCHICAL: &str = "ACCELERATE_HIERARCHICAL";
/// Transport between processes: `auto`, `shm` or `tcp`.
pub const TRANSPORT: &str = "ACCELERATE_TRANSPORT";
/// All-reduce algorithm: `auto`, `ring` or `recursive_doubling`.
pub const ALL_REDUCE_ALGORITHM: &str = "ACCELERATE_ALL_REDUCE_ALGORITHM";
/// Bytes of one shared-memory slot.
pub const SHM_SLOT_BYTES: &str = "ACCELERATE_SHM_SLOT_BYTES";
/// Bytes of one ring segment.
pub const RING_SEGMENT_BYTES: &str = "ACCELERATE_RING_SEGMENT_BYTES";
/// Whether gradients go through NCCL on the cuda backend: `auto` (default), `off` or
/// `require` (workers).
pub const NCCL: &str = "ACCELERATE_NCCL";
/// The libnccl file (or its directory) to load, instead of searching for one.
pub const NCCL_LIBRARY: &str = "ACCELERATE_NCCL_LIBRARY";
/// Whether the accelerator keeps freed memory in the process (glibc's malloc thresholds):
/// `true`/`false` (default true).
pub const MALLOC_TUNING: &str = "ACCELERATE_MALLOC_TUNING";
/// A directory: each rank writes its timeline there (`trace_rank_<r>.json`).
pub const TRACE: &str = "ACCELERATE_TRACE";
/// Which steps a timeline keeps: `N` (the last N) or `K..M`.
pub const TRACE_STEPS: &str = "ACCELERATE_TRACE_STEPS";
/// Where the main process writes its progress for `accelerate-rs launch` (set by the launcher).
pub const PROGRESS_FILE: &str = "ACCELERATE_PROGRESS_FILE";
/// Seconds between the launcher's progress lines when its output is not a terminal.
pub const PROGRESS_EVERY: &str = "ACCELERATE_PROGRESS_EVERY";
/// One process's peak FLOPs per second, for MFU.
pub const PEAK_FLOPS: &str = "ACCELERATE_PEAK_FLOPS";

/// Reads a boolean setting: `true`/`false`, `1`/`0`, `yes`/`no` (any case). Anything else is
/// `None`, for the caller to report.
pub fn parse_bool(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" => Some(true),
        "0" | "false" | "no" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn booleans_are_read_strictly() {
        for yes in ["1", "true", "TRUE", " yes "] {
            assert_eq!(parse_bool(yes), Some(true), "{yes}");
        }
        for no in ["0", "false", "No"] {
            assert_eq!(parse_bool(no), Some(false), "{no}");
        }
        for unknown in ["on", "off", "y", "2", ""] {
            assert_eq!(parse_bool(unknown), None, "{unknown}");
        }
    }
}
