//! `AcceleratorConfig`: the knobs of an accelerated loop and where each value comes from.
//!
//! Precedence, highest first: a value set in code (on [`ConfigOverrides`]), then the
//! `ACCELERATE_*` environment variable (which `accelerate-rs launch` flags set), then the config
//! file ([`crate::config_file`]), then the default: the rows of [`crate::setting_table`] and
//! its resolver, which validates every value whatever its source; an error names the key, the
//! source and what would have been accepted.

use serde::{Deserialize, Serialize};

use crate::config_file::{self, ConfigFile};
use crate::env_vars::{self, EnvSource, ProcessEnv};
use crate::error::ConfigError;
use crate::setting_table::{self as table, GivenBy, Resolver};
pub use crate::settings::{MixedPrecision, NcclMode, ShardGroupSize};

/// Environment variable for [`AcceleratorConfig::gradient_accumulation_steps`].
pub const ENV_GRADIENT_ACCUMULATION_STEPS: &str = env_vars::GRADIENT_ACCUMULATION_STEPS;
/// Environment variable for [`AcceleratorConfig::seed`].
pub const ENV_SEED: &str = env_vars::SEED;
/// Environment variable for [`AcceleratorConfig::mixed_precision`].
pub const ENV_MIXED_PRECISION: &str = env_vars::MIXED_PRECISION;
/// Environment variable for [`AcceleratorConfig::gradient_communication`].
pub const ENV_GRADIENT_COMMUNICATION: &str = env_vars::GRADIENT_COMMUNICATION;
/// Environment variable for [`AcceleratorConfig::zero_stage`].
pub const ENV_ZERO_STAGE: &str = env_vars::ZERO_STAGE;
/// Environment variable for [`AcceleratorConfig::shard_group_size`].
pub const ENV_SHARD_GROUP_SIZE: &str = env_vars::SHARD_GROUP_SIZE;
/// Environment variable for [`AcceleratorConfig::gradient_checkpointing`].
pub const ENV_GRADIENT_CHECKPOINTING: &str = env_vars::GRADIENT_CHECKPOINTING;
/// Environment variable for [`AcceleratorConfig::async_checkpoints`].
pub const ENV_ASYNC_CHECKPOINTS: &str = env_vars::ASYNC_CHECKPOINTS;
/// Environment variable for [`AcceleratorConfig::overlap_communication`].
pub const ENV_OVERLAP_COMMUNICATION: &str = env_vars::OVERLAP_COMMUNICATION;
/// Environment variable for [`AcceleratorConfig::fusion`].
pub const ENV_FUSION: &str = env_vars::FUSION;
/// Environment variable for [`AcceleratorConfig::nccl`].
pub const ENV_NCCL: &str = env_vars::NCCL;
/// Environment variable for [`AcceleratorConfig::gradient_bucket_bytes`], in MiB.
pub const ENV_GRADIENT_BUCKET_MB: &str = env_vars::GRADIENT_BUCKET_MB;

/// The resolved configuration of an accelerated training loop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcceleratorConfig {
    /// Micro-batches whose gradients are summed before one optimizer update (default 1).
    pub gradient_accumulation_steps: usize,
    /// Seed for parameter initialisation and data order, when set (default: none).
    pub seed: Option<u64>,
    /// Gradients are all-reduced in buckets of at most this many bytes, in module visit order
    /// (default 25 MiB, like PyTorch DDP).
    pub gradient_bucket_bytes: usize,
    /// Compute precision (default: no mixed precision).
    pub mixed_precision: MixedPrecision,
    /// Precision gradients travel in between processes: `No` sends f32 (default); `Bf16` and
    /// `Fp16` halve the bytes, like DDP's compression hooks (sums still accumulate in f32).
    pub gradient_communication: MixedPrecision,
    /// ZeRO stage of a fused optimizer: 0 keeps all optimizer state on every process
    /// (default), 1 shards it across the processes (ZeRO-1), 2 shards the gradients and the
    /// master parameters too (ZeRO-2), 3 shards the parameters at rest: the units a model
    /// marks as sharded hold 1/N of their parameters and gather them for each use (ZeRO-3).
    pub zero_stage: u8,
    /// Which processes ZeRO-1/2/3 shards are split across: the whole job (default), or
    /// groups of it, each shard replicated across the groups (hybrid sharding: `host` shards
    /// within each host and averages only the shards' gradients between hosts).
    #[serde(default)]
    pub shard_group_size: ShardGroupSize,
    /// Activation (gradient) checkpointing: the backward pass recomputes memory-bound
    /// activations instead of keeping them from the forward pass (Burn's balanced strategy on
    /// the prepared device; default off).
    pub gradient_checkpointing: bool,
    /// Checkpoints saved in the background: `save_state` takes a snapshot of what it saves
    /// and returns; a thread writes and commits it while training goes on (default off).
    #[serde(default)]
    pub async_checkpoints: bool,
    /// Gradients averaged on a communication thread while the backward pass goes on, for a
    /// model whose units are marked (accelerate-burn's `Accelerator::unit`; default on).
    /// The results are the same bits either way; off is for comparisons and as an escape
    /// hatch.
    #[serde(default = "overlap_default")]
    pub overlap_communication: bool,
    /// Burn's kernel fusion, in a build whose GPU backend has it (`wgpu`, `cuda`; default on,
    /// as a plain Burn user has it). Off, Burn's fused stream stays but runs each operation
    /// as its own kernel: for debugging, and for comparing against fusion. Nothing changes
    /// on the CPU backends or in a build without fusion.
    #[serde(default = "fusion_default")]
    pub fusion: bool,
    /// Whether the cuda backend averages gradients with NCCL (default `auto`: when every
    /// process can load libnccl; see [`crate::nccl`]).
    #[serde(default)]
    pub nccl: NcclMode,
}

impl Default for AcceleratorConfig {
    fn default() -> Self {
        Self {
            gradient_accumulation_steps: 1,
            seed: None,
            gradient_bucket_bytes: 25 << 20,
            mixed_precision: MixedPrecision::No,
            gradient_communication: MixedPrecision::No,
            zero_stage: 0,
            shard_group_size: ShardGroupSize::Job,
            gradient_checkpointing: false,
            async_checkpoints: false,
            overlap_communication: true,
            fusion: true,
            nccl: NcclMode::Auto,
        }
    }
}

fn fusion_default() -> bool {
    true
}

fn overlap_default() -> bool {
    true
}

/// Values set in code; each one that is `Some` wins over the environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigOverrides {
    /// See [`AcceleratorConfig::gradient_accumulation_steps`].
    pub gradient_accumulation_steps: Option<usize>,
    /// See [`AcceleratorConfig::seed`].
    pub seed: Option<u64>,
    /// See [`AcceleratorConfig::gradient_bucket_bytes`].
    pub gradient_bucket_bytes: Option<usize>,
    /// See [`AcceleratorConfig::mixed_precision`].
    pub mixed_precision: Option<MixedPrecision>,
    /// See [`AcceleratorConfig::gradient_communication`].
    pub gradient_communication: Option<MixedPrecision>,
    /// See [`AcceleratorConfig::zero_stage`].
    pub zero_stage: Option<u8>,
    /// See [`AcceleratorConfig::shard_group_size`].
    pub shard_group_size: Option<ShardGroupSize>,
    /// See [`AcceleratorConfig::gradient_checkpointing`].
    pub gradient_checkpointing: Option<bool>,
    /// See [`AcceleratorConfig::async_checkpoints`].
    pub async_checkpoints: Option<bool>,
    /// See [`AcceleratorConfig::overlap_communication`].
    pub overlap_communication: Option<bool>,
    /// See [`AcceleratorConfig::fusion`].
    pub fusion: Option<bool>,
    /// See [`AcceleratorConfig::nccl`].
    pub nccl: Option<NcclMode>,
}

impl ConfigOverrides {
    /// Resolves against the process environment, the config file it leads to, and the
    /// defaults.
    pub fn resolve(&self) -> Result<AcceleratorConfig, ConfigError> {
        let loaded = config_file::discover(&ProcessEnv)?;
        if let Some(note) = loaded.as_ref().and_then(|l| l.ignored_note()) {
            tracing::debug!("{note}");
        }
        let path = loaded.as_ref().map(|l| l.path.as_path());
        let settings = Resolver::new(&ProcessEnv, GivenBy::Code, path);
        self.resolve_from(settings, loaded.as_ref().map(|l| &l.file))
    }

    /// Resolves against `env` and the defaults (no config file).
    pub fn resolve_with(
        &self,
        env: &(impl EnvSource + ?Sized),
    ) -> Result<AcceleratorConfig, ConfigError> {
        self.resolve_with_file(env, None)
    }

    /// Resolves against `env`, then `file`, then the defaults.
    pub fn resolve_with_file(
        &self,
        env: &(impl EnvSource + ?Sized),
        file: Option<&ConfigFile>,
    ) -> Result<AcceleratorConfig, ConfigError> {
        self.resolve_from(Resolver::new(env, GivenBy::Code, None), file)
    }

    /// Every setting through the table's resolver: code, then the environment, then the
    /// file, then the default.
    fn resolve_from<E: EnvSource + ?Sized>(
        &self,
        settings: Resolver<'_, E>,
        file: Option<&ConfigFile>,
    ) -> Result<AcceleratorConfig, ConfigError> {
        let file = file.cloned().unwrap_or_default();
        let default = AcceleratorConfig::default();
        Ok(AcceleratorConfig {
            gradient_accumulation_steps: settings.get_or(
                &table::GRADIENT_ACCUMULATION_STEPS,
                self.gradient_accumulation_steps,
                file.gradient_accumulation_steps,
                default.gradient_accumulation_steps,
            )?,
            seed: settings.get(&table::SEED, self.seed, file.seed)?,
            // A bucket of 0 bytes set in code means the smallest, as it always has.
            gradient_bucket_bytes: settings.get_or(
                &table::GRADIENT_BUCKET_BYTES,
                self.gradient_bucket_bytes.map(|bytes| bytes.max(1)),
                None,
                default.gradient_bucket_bytes,
            )?,
            mixed_precision: settings.get_or(
                &table::MIXED_PRECISION,
                self.mixed_precision,
                file.mixed_precision,
                default.mixed_precision,
            )?,
            gradient_communication: settings.get_or(
                &table::GRADIENT_COMMUNICATION,
                self.gradient_communication,
                None,
                default.gradient_communication,
            )?,
            zero_stage: settings.get_or(
                &table::ZERO_STAGE,
                self.zero_stage,
                file.zero_stage,
                default.zero_stage,
            )?,
            shard_group_size: settings.get_or(
                &table::SHARD_GROUP_SIZE,
                self.shard_group_size,
                file.shard_group_size,
                default.shard_group_size,
            )?,
            gradient_checkpointing: settings.get_or(
                &table::GRADIENT_CHECKPOINTING,
                self.gradient_checkpointing,
                None,
                default.gradient_checkpointing,
            )?,
            async_checkpoints: settings.get_or(
                &table::ASYNC_CHECKPOINTS,
                self.async_checkpoints,
                file.async_checkpoints,
                default.async_checkpoints,
            )?,
            overlap_communication: settings.get_or(
                &table::OVERLAP_COMMUNICATION,
                self.overlap_communication,
                None,
                default.overlap_communication,
            )?,
            fusion: settings.get_or(&table::FUSION, self.fusion, None, default.fusion)?,
            nccl: settings.get_or(&table::NCCL, self.nccl, None, default.nccl)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_without_env() {
        let c = ConfigOverrides::default().resolve_with(&[][..]).unwrap();
        assert_eq!(c, AcceleratorConfig::default());
    }

    #[test]
    fn fusion_is_on_unless_the_environment_or_code_turns_it_off() {
        assert!(
            ConfigOverrides::default()
                .resolve_with(&[][..])
                .unwrap()
                .fusion
        );
        let env = [(ENV_FUSION, "false")];
        assert!(
            !ConfigOverrides::default()
                .resolve_with(&env[..])
                .unwrap()
                .fusion
        );
        let code = ConfigOverrides {
            fusion: Some(true),
            ..Default::default()
        };
        assert!(code.resolve_with(&env[..]).unwrap().fusion);
        let err = ConfigOverrides::default()
            .resolve_with(&[(ENV_FUSION, "fused")][..])
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "ACCELERATE_FUSION (env) = fused: expected true or false"
        );
    }

    #[test]
    fn code_beats_env_beats_default() {
        let env = [(ENV_GRADIENT_ACCUMULATION_STEPS, "4"), (ENV_SEED, "7")];
        let from_env = ConfigOverrides::default().resolve_with(&env[..]).unwrap();
        assert_eq!(from_env.gradient_accumulation_steps, 4);
        assert_eq!(from_env.seed, Some(7));
        let code = ConfigOverrides {
            gradient_accumulation_steps: Some(2),
            seed: Some(1),
            ..Default::default()
        };
        let from_code = code.resolve_with(&env[..]).unwrap();
        assert_eq!(from_code.gradient_accumulation_steps, 2);
        assert_eq!(from_code.seed, Some(1));
    }

    #[test]
    fn code_beats_env_beats_file_beats_default() {
        let file = ConfigFile {
            gradient_accumulation_steps: Some(8),
            seed: Some(5),
            mixed_precision: Some(MixedPrecision::Bf16),
            ..ConfigFile::default()
        };
        let from_file = ConfigOverrides::default()
            .resolve_with_file(&[][..], Some(&file))
            .unwrap();
        assert_eq!(from_file.gradient_accumulation_steps, 8);
        assert_eq!(from_file.seed, Some(5));
        assert_eq!(from_file.mixed_precision, MixedPrecision::Bf16);
        let env = [(ENV_MIXED_PRECISION, "fp16"), (ENV_SEED, "6")];
        let from_env = ConfigOverrides::default()
            .resolve_with_file(&env[..], Some(&file))
            .unwrap();
        assert_eq!(from_env.mixed_precision, MixedPrecision::Fp16);
        assert_eq!(from_env.seed, Some(6));
        assert_eq!(from_env.gradient_accumulation_steps, 8);
        let code = ConfigOverrides {
            mixed_precision: Some(MixedPrecision::No),
            ..Default::default()
        };
        let from_code = code.resolve_with_file(&env[..], Some(&file)).unwrap();
        assert_eq!(from_code.mixed_precision, MixedPrecision::No);
    }

    #[test]
    fn mixed_precision_comes_from_code_or_env() {
        let env = [(ENV_MIXED_PRECISION, "BF16")];
        let c = ConfigOverrides::default().resolve_with(&env[..]).unwrap();
        assert_eq!(c.mixed_precision, MixedPrecision::Bf16);
        let code = ConfigOverrides {
            mixed_precision: Some(MixedPrecision::Fp16),
            ..Default::default()
        };
        assert_eq!(
            code.resolve_with(&env[..]).unwrap().mixed_precision,
            MixedPrecision::Fp16
        );
        let err = ConfigOverrides::default()
            .resolve_with(&[(ENV_MIXED_PRECISION, "fp8")][..])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "ACCELERATE_MIXED_PRECISION (env) = fp8: expected no, fp16 or bf16"
        );
    }

    #[test]
    fn bucket_size_comes_in_mib_from_the_environment() {
        let env = [(ENV_GRADIENT_BUCKET_MB, "0.5")];
        let c = ConfigOverrides::default().resolve_with(&env[..]).unwrap();
        assert_eq!(c.gradient_bucket_bytes, 512 << 10);
        assert_eq!(AcceleratorConfig::default().gradient_bucket_bytes, 25 << 20);
        let env = [(ENV_GRADIENT_BUCKET_MB, "-1")];
        assert!(ConfigOverrides::default().resolve_with(&env[..]).is_err());
    }

    #[test]
    fn errors_name_key_source_and_expectation() {
        let env = [(ENV_GRADIENT_ACCUMULATION_STEPS, "0")];
        let err = ConfigOverrides::default()
            .resolve_with(&env[..])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "ACCELERATE_GRADIENT_ACCUMULATION_STEPS (env) = 0: expected a positive integer"
        );
        let code = ConfigOverrides {
            gradient_accumulation_steps: Some(0),
            ..Default::default()
        };
        let err = code.resolve_with(&[][..]).unwrap_err().to_string();
        assert!(
            err.starts_with("gradient_accumulation_steps (code) = 0"),
            "{err}"
        );
        let env = [(ENV_SEED, "-3")];
        let err = ConfigOverrides::default()
            .resolve_with(&env[..])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("ACCELERATE_SEED (env) = -3"), "{err}");
    }

    #[test]
    fn gradient_checkpointing_from_code_or_env() {
        let on = [(ENV_GRADIENT_CHECKPOINTING, "true")];
        assert!(
            ConfigOverrides::default()
                .resolve_with(&on[..])
                .unwrap()
                .gradient_checkpointing
        );
        let code_off = ConfigOverrides {
            gradient_checkpointing: Some(false),
            ..Default::default()
        };
        assert!(
            !code_off
                .resolve_with(&on[..])
                .unwrap()
                .gradient_checkpointing
        );
        let bad = [(ENV_GRADIENT_CHECKPOINTING, "on")];
        let err = ConfigOverrides::default()
            .resolve_with(&bad[..])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "ACCELERATE_GRADIENT_CHECKPOINTING (env) = on: expected true or false"
        );
    }
}
