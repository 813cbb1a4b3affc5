//! The settings' value types, each with the one spelling that flags, variables and files use:
//! compute precision, NCCL use, transport, all-reduce algorithm, shard groups. A leaf:
//! everything that reads a setting (the process state, the config file, the accelerator's
//! config, the group options) imports these, and this imports nothing of the crate but the
//! environment reader.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::env_vars::EnvSource;

/// A setting's value that is not one of its spellings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?}: expected {expected}")]
pub struct ParseSettingError {
    /// The value as given.
    pub value: String,
    /// The spellings accepted.
    pub expected: &'static str,
}

impl ParseSettingError {
    /// `value` is none of `expected`.
    pub fn new(value: &str, expected: &'static str) -> Self {
        Self {
            value: value.to_string(),
            expected,
        }
    }
}

/// Which precision the forward and backward passes compute in; master weights, gradients
/// and optimizer state stay f32 in every mode.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MixedPrecision {
    /// f32 throughout (default).
    #[default]
    No,
    /// bfloat16 compute, no loss scaling (bf16 has f32's range).
    Bf16,
    /// float16 compute with dynamic loss scaling.
    Fp16,
}

impl MixedPrecision {
    /// The spellings [`FromStr`] accepts, as errors list them.
    pub const EXPECTED: &'static str = "no, fp16 or bf16";

    /// The spelling the config file and `ACCELERATE_MIXED_PRECISION` use.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::No => "no",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
        }
    }
}

impl std::fmt::Display for MixedPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for MixedPrecision {
    type Err = ParseSettingError;

    fn from_str(s: &str) -> Result<Self, ParseSettingError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "no" | "fp32" | "f32" => Ok(Self::No),
            "bf16" => Ok(Self::Bf16),
            "fp16" | "f16" => Ok(Self::Fp16),
            _ => Err(ParseSettingError::new(s, Self::EXPECTED)),
        }
    }
}

/// Whether gradients go through NCCL (`ACCELERATE_NCCL`, or the builder's `strict_nccl`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NcclMode {
    /// NCCL when every rank can load it (cuda backend, `nccl` feature); otherwise the host
    /// path, with one warning on the main process (default).
    #[default]
    Auto,
    /// Never NCCL: the host path.
    Off,
    /// NCCL or an error naming the ranks that cannot use it.
    Require,
}

impl NcclMode {
    /// The spellings [`FromStr`] accepts, as errors list them.
    pub const EXPECTED: &'static str = "auto, off or require";

    /// The spelling `ACCELERATE_NCCL` uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Off => "off",
            Self::Require => "require",
        }
    }
}

impl std::fmt::Display for NcclMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for NcclMode {
    type Err = ParseSettingError;

    fn from_str(s: &str) -> Result<Self, ParseSettingError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "off" | "false" | "0" | "no" => Ok(Self::Off),
            "require" | "required" | "strict" => Ok(Self::Require),
            _ => Err(ParseSettingError::new(s, Self::EXPECTED)),
        }
    }
}

/// Which transport a group uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory when every rank is on one host, TCP otherwise.
    Auto,
    /// Shared memory; an error when ranks span hosts.
    Shm,
    /// TCP, even on one host.
    Tcp,
    /// The MPI library the process was started with (a build with the `mpi` feature, under
    /// `mpirun` or `srun --mpi=pmix`).
    Mpi,
}

impl TransportChoice {
    /// The spellings accepted.
    pub const EXPECTED: &'static str = "auto, shm, tcp or mpi";

    /// Whether a group formed with this choice uses the MPI engine: `mpi` always, `auto` in
    /// a build with the `mpi` feature when an MPI launcher started the process (Open MPI's
    /// `mpirun` sets `OMPI_COMM_WORLD_SIZE`, a PMIx launcher such as `srun --mpi=pmix` sets
    /// `PMIX_RANK`). Under `srun` without PMIx, MPI could not start: `auto` keeps our own
    /// transports there.
    pub fn uses_mpi(self, env: &(impl EnvSource + ?Sized)) -> bool {
        match self {
            Self::Mpi => true,
            Self::Auto => {
                cfg!(feature = "mpi")
                    && (env.var("OMPI_COMM_WORLD_SIZE").is_some() || env.var("PMIX_RANK").is_some())
            }
            Self::Shm | Self::Tcp => false,
        }
    }
}

impl FromStr for TransportChoice {
    type Err = ParseSettingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "shm" => Ok(Self::Shm),
            "tcp" => Ok(Self::Tcp),
            "mpi" => Ok(Self::Mpi),
            _ => Err(ParseSettingError::new(s, Self::EXPECTED)),
        }
    }
}

/// Which all-reduce algorithm the message transports use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllReduceAlgorithm {
    /// Recursive doubling for small buffers (up to 64 KiB), the ring above.
    Auto,
    /// Always the ring.
    Ring,
    /// Always recursive doubling.
    RecursiveDoubling,
}

impl AllReduceAlgorithm {
    /// The spellings accepted.
    pub const EXPECTED: &'static str = "auto, ring or recursive_doubling";
}

impl FromStr for AllReduceAlgorithm {
    type Err = ParseSettingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "ring" => Ok(Self::Ring),
            "recursive_doubling" | "recursive-doubling" | "rd" => Ok(Self::RecursiveDoubling),
            _ => Err(ParseSettingError::new(s, Self::EXPECTED)),
        }
    }
}

/// Which processes ZeRO's shards are split across: the whole job, or groups of it (hybrid
/// sharding: shard within a group, replicate across groups, as FSDP's `HYBRID_SHARD` and
/// Accelerate's `ParallelismConfig(dp_shard_size, dp_replicate_size)` do).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub enum ShardGroupSize {
    /// Every process of the job (default).
    #[default]
    Job,
    /// The processes of each host: shards stay on a host's shared memory and only the
    /// averaged shard gradients cross between hosts.
    Host,
    /// Groups of this many consecutive ranks (a number that divides the job's processes).
    Processes(usize),
}

impl ShardGroupSize {
    /// The spellings [`FromStr`] accepts, as errors list them.
    pub const EXPECTED: &'static str = "job, host or a number of processes (at least 1)";

    /// True unless every shard spans the whole job whatever its size.
    pub fn is_hybrid(self) -> bool {
        self != Self::Job
    }
}

impl std::fmt::Display for ShardGroupSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Job => f.write_str("job"),
            Self::Host => f.write_str("host"),
            Self::Processes(n) => write!(f, "{n}"),
        }
    }
}

impl FromStr for ShardGroupSize {
    type Err = ParseSettingError;

    fn from_str(s: &str) -> Result<Self, ParseSettingError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "job" | "all" | "world" => Ok(Self::Job),
            "host" | "node" => Ok(Self::Host),
            number => match number.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(Self::Processes(n)),
                _ => Err(ParseSettingError::new(s, Self::EXPECTED)),
            },
        }
    }
}

impl From<ShardGroupSize> for String {
    fn from(size: ShardGroupSize) -> Self {
        size.to_string()
    }
}

/// A file may write a number of processes as a number (`shard_group_size = 2`) or as text.
impl<'de> Deserialize<'de> for ShardGroupSize {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Number(usize),
            Text(String),
        }
        match Written::deserialize(deserializer)? {
            Written::Number(n) => n.to_string().parse(),
            Written::Text(text) => text.parse(),
        }
        .map_err(serde::de::Error::custom)
    }
}
