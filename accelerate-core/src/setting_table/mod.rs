//! Every setting that can come from more than one place, in one table, and the one resolver
//! that picks its value.
//!
//! A [`Setting`] row names the setting's key (as the config file and code spell it), its
//! command-line flag and its `ACCELERATE_*` variable, says what it accepts, parses the
//! variable's text and validates a value from any source. A [`Resolver`] applies the
//! precedence: a value given in code or by a flag, then the environment, then the config file
//! (ours or Hugging Face Accelerate's YAML, already read into [`ConfigFile`]), then the
//! default. Whatever the source, an invalid value is refused with the key as that source
//! spells it (`--num-processes`, `ACCELERATE_NUM_PROCESSES`, `num_processes`) and the source
//! itself (`flag`, `env`, `code`, the file's path).
//!
//! [`ConfigFile`]: crate::config_file::ConfigFile
//!
//! ```
//! use accelerate_core::setting_table::{GivenBy, Resolver, NUM_PROCESSES};
//!
//! let env = [("ACCELERATE_NUM_PROCESSES", "0")];
//! let resolver = Resolver::new(&env[..], GivenBy::Flag, None);
//! let err = resolver.get(&NUM_PROCESSES, None, None).unwrap_err();
//! assert_eq!(
//!     err.to_string(),
//!     "ACCELERATE_NUM_PROCESSES (env) = 0: expected a positive integer"
//! );
//! assert_eq!(resolver.get(&NUM_PROCESSES, Some(4), None).unwrap(), Some(4));
//! ```

use std::path::Path;
use std::time::Duration;

use crate::env_vars::{self, EnvSource};
use crate::error::ConfigError;
use crate::settings::{
    AllReduceAlgorithm, MixedPrecision, NcclMode, ShardGroupSize, TransportChoice,
};

mod group;
pub use group::*;

/// One setting: where it can come from and what it accepts.
pub struct Setting<T> {
    /// Its name in the config file and in code.
    pub key: &'static str,
    /// The `accelerate-rs launch` flag that sets it, if any.
    pub flag: Option<&'static str>,
    /// The environment variable that sets it.
    pub env: &'static str,
    /// What it accepts, as errors say it.
    pub expected: &'static str,
    /// Reads the variable's (trimmed) text.
    pub parse: fn(&str) -> Option<T>,
    /// Whether a value is accepted, whichever source gave it.
    pub valid: fn(&T) -> bool,
}

/// A value of a setting, as an error shows it.
pub trait SettingValue: Clone {
    /// The value as the user would have written it.
    fn show(&self) -> String;
}

macro_rules! shown_by_display {
    ($($t:ty),*) => {$(
        impl SettingValue for $t {
            fn show(&self) -> String {
                self.to_string()
            }
        }
    )*};
}

shown_by_display!(usize, u64, u16, u8, bool, String, ShardGroupSize);

impl SettingValue for Duration {
    fn show(&self) -> String {
        format!("{}", self.as_secs_f64())
    }
}

impl SettingValue for MixedPrecision {
    fn show(&self) -> String {
        self.as_str().to_string()
    }
}

macro_rules! shown_by_debug {
    ($($t:ty),*) => {$(
        impl SettingValue for $t {
            fn show(&self) -> String {
                format!("{self:?}").to_lowercase()
            }
        }
    )*};
}

shown_by_debug!(NcclMode, TransportChoice, AllReduceAlgorithm);

/// Where a value given directly (not read from the environment or a file) came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GivenBy {
    /// Set in code (a builder, `ConfigOverrides`).
    Code,
    /// A command-line flag.
    Flag,
}

/// Applies the precedence given (code or flag) > environment > config file > default to the
/// rows of the table. See the [module docs](self).
pub struct Resolver<'a, E: EnvSource + ?Sized> {
    env: &'a E,
    given_by: GivenBy,
    /// The config file the file values come from (`None`: unknown, or no file).
    file: Option<&'a Path>,
}

impl<'a, E: EnvSource + ?Sized> Resolver<'a, E> {
    /// A resolver reading `env`, for values `given_by` code or flags, with file values from
    /// the config file at `file`.
    pub fn new(env: &'a E, given_by: GivenBy, file: Option<&'a Path>) -> Self {
        Self {
            env,
            given_by,
            file,
        }
    }

    /// The value of `setting`: `given` if any, else its variable, else `from_file`; each
    /// validated. `None` when no source sets it (the caller's default applies).
    pub fn get<T: SettingValue>(
        &self,
        setting: &Setting<T>,
        given: Option<T>,
        from_file: Option<T>,
    ) -> Result<Option<T>, ConfigError> {
        if let Some(value) = given {
            let (key, source) = match (self.given_by, setting.flag) {
                (GivenBy::Flag, Some(flag)) => (flag, "flag"),
                (GivenBy::Flag, None) => (setting.key, "flag"),
                (GivenBy::Code, _) => (setting.key, "code"),
            };
            return checked(setting, value, key, source.to_string()).map(Some);
        }
        if let Some(text) = self.env.var(setting.env) {
            let parsed = (setting.parse)(text.trim()).filter(setting.valid);
            return match parsed {
                Some(value) => Ok(Some(value)),
                None => Err(ConfigError::Invalid {
                    key: setting.env,
                    source_name: "env".into(),
                    value: text,
                    expected: setting.expected,
                }),
            };
        }
        match from_file {
            Some(value) => {
                let source = self.file.map_or_else(
                    || "config file".to_string(),
                    |path| path.display().to_string(),
                );
                checked(setting, value, setting.key, source).map(Some)
            }
            None => Ok(None),
        }
    }

    /// [`get`](Self::get), or `default` when no source sets it.
    pub fn get_or<T: SettingValue>(
        &self,
        setting: &Setting<T>,
        given: Option<T>,
        from_file: Option<T>,
        default: T,
    ) -> Result<T, ConfigError> {
        Ok(self.get(setting, given, from_file)?.unwrap_or(default))
    }
}

fn checked<T: SettingValue>(
    setting: &Setting<T>,
    value: T,
    key: &'static str,
    source_name: String,
) -> Result<T, ConfigError> {
    if (setting.valid)(&value) {
        return Ok(value);
    }
    Err(ConfigError::Invalid {
        key,
        source_name,
        value: value.show(),
        expected: setting.expected,
    })
}

fn any<T>(_: &T) -> bool {
    true
}

fn positive(n: &usize) -> bool {
    *n > 0
}

fn parse_from<T: std::str::FromStr>(text: &str) -> Option<T> {
    text.parse().ok()
}

fn parse_string(text: &str) -> Option<String> {
    Some(text.to_string())
}

fn positive_duration(d: &Duration) -> bool {
    !d.is_zero()
}

/// Smallest shared-memory slot or ring segment accepted: a reduce-scatter slot holds a
/// sub-block of every rank's part.
pub const MIN_CHUNK_BYTES: usize = 4096;
/// Largest accepted: 1 GiB, far past where larger chunks stop helping, and small enough that
/// no segment size arithmetic can overflow.
pub const MAX_CHUNK_BYTES: usize = 1 << 30;

fn chunk_bytes(b: &usize) -> bool {
    (MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES).contains(b)
}

/// A bucket size in MiB (the variable's unit), as bytes.
fn parse_mib(text: &str) -> Option<usize> {
    text.parse::<f64>()
        .ok()
        .filter(|mb| mb.is_finite() && *mb > 0.0)
        .map(|mb| ((mb * 1048576.0) as usize).max(1))
}

// --- The launcher's settings (`accelerate-rs launch`) ---

/// Worker processes per machine.
pub const NUM_PROCESSES: Setting<usize> = Setting {
    key: "num_processes",
    flag: Some("--num-processes"),
    env: env_vars::NUM_PROCESSES,
    expected: "a positive integer",
    parse: parse_from,
    valid: positive,
};

/// Machines in the job.
pub const NUM_MACHINES: Setting<usize> = Setting {
    key: "num_machines",
    flag: Some("--num-machines"),
    env: env_vars::NUM_MACHINES,
    expected: "a positive integer",
    parse: parse_from,
    valid: positive,
};

/// This machine's index.
pub const MACHINE_RANK: Setting<usize> = Setting {
    key: "machine_rank",
    flag: Some("--machine-rank"),
    env: env_vars::MACHINE_RANK,
    expected: "a non-negative integer",
    parse: parse_from,
    valid: any,
};

/// Address of rank 0's machine.
pub const MAIN_PROCESS_IP: Setting<String> = Setting {
    key: "main_process_ip",
    flag: Some("--main-process-ip"),
    env: env_vars::MAIN_PROCESS_IP,
    expected: "an address",
    parse: parse_string,
    valid: any,
};

/// Rank 0's rendezvous port.
pub const MAIN_PROCESS_PORT: Setting<u16> = Setting {
    key: "main_process_port",
    flag: Some("--main-process-port"),
    env: env_vars::MAIN_PROCESS_PORT,
    expected: "a port (0 to 65535)",
    parse: parse_from,
    valid: any,
};

/// GPUs the workers may use.
pub const GPU_IDS: Setting<String> = Setting {
    key: "gpu_ids",
    flag: Some("--gpu-ids"),
    env: env_vars::GPU_IDS,
    expected: "a list of GPU indices",
    parse: parse_string,
    valid: any,
};

/// Train on the CPU even where a GPU is present.
pub const USE_CPU: Setting<bool> = Setting {
    key: "use_cpu",
    flag: Some("--cpu"),
    env: env_vars::USE_CPU,
    expected: "true, false, 1, 0, yes or no",
    parse: env_vars::parse_bool,
    valid: any,
};

/// Restarts of the workers after a failure.
pub const MAX_RESTARTS: Setting<usize> = Setting {
    key: "max_restarts",
    flag: Some("--max-restarts"),
    env: env_vars::MAX_RESTARTS,
    expected: "a non-negative integer",
    parse: parse_from,
    valid: any,
};

// --- The training loop's settings (`AcceleratorConfig`) ---

/// Micro-batches per optimizer update.
pub const GRADIENT_ACCUMULATION_STEPS: Setting<usize> = Setting {
    key: "gradient_accumulation_steps",
    flag: None,
    env: env_vars::GRADIENT_ACCUMULATION_STEPS,
    expected: "a positive integer",
    parse: parse_from,
    valid: positive,
};

/// Seed of the device's random streams and of data order.
pub const SEED: Setting<u64> = Setting {
    key: "seed",
    flag: None,
    env: env_vars::SEED,
    expected: "an unsigned 64-bit integer",
    parse: parse_from,
    valid: any,
};

/// Gradient bucket size, in bytes (the variable gives MiB).
pub const GRADIENT_BUCKET_BYTES: Setting<usize> = Setting {
    key: "gradient_bucket_bytes",
    flag: None,
    env: env_vars::GRADIENT_BUCKET_MB,
    expected: "a positive number of MiB",
    parse: parse_mib,
    valid: positive,
};

/// Compute precision.
pub const MIXED_PRECISION: Setting<MixedPrecision> = Setting {
    key: "mixed_precision",
    flag: Some("--mixed-precision"),
    env: env_vars::MIXED_PRECISION,
    expected: MixedPrecision::EXPECTED,
    parse: parse_from,
    valid: any,
};

/// Precision gradients travel in between processes.
pub const GRADIENT_COMMUNICATION: Setting<MixedPrecision> = Setting {
    key: "gradient_communication",
    flag: None,
    env: env_vars::GRADIENT_COMMUNICATION,
    expected: MixedPrecision::EXPECTED,
    parse: parse_from,
    valid: any,
};

/// ZeRO stage of a fused optimizer.
pub const ZERO_STAGE: Setting<u8> = Setting {
    key: "zero_stage",
    flag: Some("--zero-stage"),
    env: env_vars::ZERO_STAGE,
    expected: "0, 1, 2 or 3",
    parse: parse_from,
    valid: |stage| *stage <= 3,
};

/// Processes each ZeRO shard is split across (hybrid sharding below the job).
pub const SHARD_GROUP_SIZE: Setting<ShardGroupSize> = Setting {
    key: "shard_group_size",
    flag: Some("--shard-group-size"),
    env: env_vars::SHARD_GROUP_SIZE,
    expected: ShardGroupSize::EXPECTED,
    parse: parse_from,
    valid: any,
};

/// Activation (gradient) checkpointing.
pub const GRADIENT_CHECKPOINTING: Setting<bool> = Setting {
    key: "gradient_checkpointing",
    flag: None,
    env: env_vars::GRADIENT_CHECKPOINTING,
    expected: "true or false",
    parse: env_vars::parse_bool,
    valid: any,
};

/// Checkpoints written and committed in the background.
pub const ASYNC_CHECKPOINTS: Setting<bool> = Setting {
    key: "async_checkpoints",
    flag: None,
    env: env_vars::ASYNC_CHECKPOINTS,
    expected: "true or false",
    parse: env_vars::parse_bool,
    valid: any,
};

/// Gradients averaged while backward goes on (models with units).
pub const OVERLAP_COMMUNICATION: Setting<bool> = Setting {
    key: "overlap_communication",
    flag: None,
    env: env_vars::OVERLAP_COMMUNICATION,
    expected: "true or false",
    parse: env_vars::parse_bool,
    valid: any,
};

/// Burn's kernel fusion on a GPU backend built with it.
pub const FUSION: Setting<bool> = Setting {
    key: "fusion",
    flag: None,
    env: env_vars::FUSION,
    expected: "true or false",
    parse: env_vars::parse_bool,
    valid: any,
};

/// Whether the cuda backend averages gradients with NCCL.
pub const NCCL: Setting<NcclMode> = Setting {
    key: "nccl",
    flag: None,
    env: env_vars::NCCL,
    expected: NcclMode::EXPECTED,
    parse: parse_from,
    valid: any,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_beats_env_beats_file_and_each_source_is_named() {
        let env = [(env_vars::NUM_PROCESSES, "3")];
        let flags = Resolver::new(&env[..], GivenBy::Flag, Some(Path::new("/c.toml")));
        assert_eq!(
            flags.get(&NUM_PROCESSES, Some(2), Some(5)).unwrap(),
            Some(2)
        );
        assert_eq!(flags.get(&NUM_PROCESSES, None, Some(5)).unwrap(), Some(3));
        assert_eq!(flags.get(&NUM_MACHINES, None, Some(5)).unwrap(), Some(5));
        assert_eq!(flags.get_or(&NUM_MACHINES, None, None, 1).unwrap(), 1);

        let error = |r: Result<Option<usize>, ConfigError>| r.unwrap_err().to_string();
        assert_eq!(
            error(flags.get(&NUM_PROCESSES, Some(0), None)),
            "--num-processes (flag) = 0: expected a positive integer"
        );
        assert_eq!(
            error(flags.get(&NUM_MACHINES, None, Some(0))),
            "num_machines (/c.toml) = 0: expected a positive integer"
        );
        let code = Resolver::new(&env[..], GivenBy::Code, None);
        assert_eq!(
            error(code.get(&GRADIENT_ACCUMULATION_STEPS, Some(0), None)),
            "gradient_accumulation_steps (code) = 0: expected a positive integer"
        );
        assert_eq!(
            error(code.get(&NUM_MACHINES, None, Some(0))),
            "num_machines (config file) = 0: expected a positive integer"
        );
        let bad_env = [(env_vars::SHM_SLOT_BYTES, "12")];
        let bad = Resolver::new(&bad_env[..], GivenBy::Code, None);
        assert_eq!(
            error(bad.get(&SHM_SLOT_BYTES, None, None)),
            "ACCELERATE_SHM_SLOT_BYTES (env) = 12: expected a number of bytes from 4096 to \
             1073741824 (1 GiB)"
        );
    }

    #[test]
    fn values_are_shown_as_written() {
        assert_eq!(Duration::from_millis(2500).show(), "2.5");
        assert_eq!(MixedPrecision::Bf16.show(), "bf16");
        assert_eq!(TransportChoice::Shm.show(), "shm");
        assert_eq!(NcclMode::Require.show(), "require");
    }
}
