//! The config file: what `accelerate-rs config` writes, and what `accelerate-rs launch` and
//! `Accelerator::from_env` read below the command line and the environment.
//!
//! Which file, first match wins:
//! 1. `ACCELERATE_CONFIG_FILE` (`launch --config-file` sets it for its workers; `none` means
//!    no file at all);
//! 2. ours, `$XDG_CONFIG_HOME/accelerate-rs/config.toml` (`~/.config/...` without the variable);
//! 3. Hugging Face Accelerate's `default_config.yaml` (`$HF_HOME/accelerate/`, else
//!    `$XDG_CACHE_HOME/huggingface/accelerate/`, else `~/.cache/huggingface/accelerate/`), of
//!    which the keys that mean the same here are read and the others reported as ignored.
//!
//! A file ending in `.yaml` or `.yml` is read as Accelerate's format, anything else as ours
//! (TOML, unknown keys refused). Errors are one line naming the file and the line.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::env_vars::EnvSource;
pub use crate::error::ConfigFileError;
use crate::settings::{MixedPrecision, ShardGroupSize};

/// Variable naming the config file to read (`none`: read no file).
pub const ENV_CONFIG_FILE: &str = crate::env_vars::CONFIG_FILE;

/// The settings a config file can hold; every key is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Worker processes per machine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_processes: Option<usize>,
    /// Machines in the job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_machines: Option<usize>,
    /// This machine's index.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine_rank: Option<usize>,
    /// Address of rank 0's machine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub main_process_ip: Option<String>,
    /// Rank 0's rendezvous port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub main_process_port: Option<u16>,
    /// Compute precision: `no`, `fp16` or `bf16`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mixed_precision: Option<MixedPrecision>,
    /// GPUs the workers may use (`"0,1"`; `"all"` for every one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_ids: Option<String>,
    /// Train on the CPU even where a GPU is present.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub use_cpu: Option<bool>,
    /// Restarts of the workers after a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_restarts: Option<usize>,
    /// Micro-batches per optimizer update.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<usize>,
    /// Seed of the device's random streams.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// ZeRO stage of a fused optimizer (from Accelerate's YAML: `deepspeed_config.zero_stage`,
    /// or `fsdp_config`'s sharding strategy).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub zero_stage: Option<u8>,
    /// Processes each ZeRO shard is split across (from Accelerate's YAML: `host` for FSDP's
    /// `HYBRID_SHARD` and `HYBRID_SHARD_ZERO2`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shard_group_size: Option<ShardGroupSize>,
    /// Checkpoints saved in the background (`async_checkpoints = true`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub async_checkpoints: Option<bool>,
}

/// Which format a config file was read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigFormat {
    /// Ours (TOML).
    Toml,
    /// Hugging Face Accelerate's YAML.
    AccelerateYaml,
}

/// A config file as read: where from, what it set, and what it ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedConfig {
    /// The file.
    pub path: PathBuf,
    /// Its format.
    pub format: ConfigFormat,
    /// The settings.
    pub file: ConfigFile,
    /// Keys of an Accelerate YAML file that mean nothing here.
    pub ignored: Vec<String>,
}

impl LoadedConfig {
    /// A one-line note on the ignored keys, if any.
    pub fn ignored_note(&self) -> Option<String> {
        (!self.ignored.is_empty()).then(|| {
            format!(
                "{}: ignored keys that have no meaning in accelerate-rs: {}",
                self.path.display(),
                self.ignored.join(", ")
            )
        })
    }
}

/// Our config file's location: `$XDG_CONFIG_HOME/accelerate-rs/config.toml`, or
/// `$HOME/.config/accelerate-rs/config.toml`.
pub fn default_path(env: &(impl EnvSource + ?Sized)) -> Option<PathBuf> {
    let base = match env.var("XDG_CONFIG_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env.var("HOME").filter(|v| !v.is_empty())?).join(".config"),
    };
    Some(base.join("accelerate-rs").join("config.toml"))
}

/// Hugging Face Accelerate's default config file location.
pub fn accelerate_default_path(env: &(impl EnvSource + ?Sized)) -> Option<PathBuf> {
    let home = || env.var("HOME").filter(|v| !v.is_empty()).map(PathBuf::from);
    let hf_home = match env.var("HF_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => match env.var("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
            Some(cache) => PathBuf::from(cache).join("huggingface"),
            None => home()?.join(".cache").join("huggingface"),
        },
    };
    Some(hf_home.join("accelerate").join("default_config.yaml"))
}

/// Finds and reads the config file that applies (see the module docs); `None` when there is
/// none. A file named by `ACCELERATE_CONFIG_FILE` must exist.
pub fn discover(env: &(impl EnvSource + ?Sized)) -> Result<Option<LoadedConfig>, ConfigFileError> {
    if let Some(named) = env.var(ENV_CONFIG_FILE) {
        if named == "none" {
            return Ok(None);
        }
        return read(Path::new(&named)).map(Some);
    }
    for path in [default_path(env), accelerate_default_path(env)]
        .into_iter()
        .flatten()
    {
        if path.is_file() {
            return read(&path).map(Some);
        }
    }
    Ok(None)
}

/// Longest config file read (ours are a few hundred bytes).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Reads `path`, as Accelerate's YAML when it ends in `.yaml`/`.yml`, else as our TOML.
pub fn read(path: &Path) -> Result<LoadedConfig, ConfigFileError> {
    let text = crate::input_file::read_text_at_most(path, MAX_CONFIG_BYTES).map_err(|e| {
        ConfigFileError {
            path: path.to_path_buf(),
            line: None,
            message: e.to_string(),
        }
    })?;
    let yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
    if yaml {
        parse_accelerate_yaml(path, &text)
    } else {
        parse_toml(path, &text)
    }
}

/// Parses our TOML format.
pub fn parse_toml(path: &Path, text: &str) -> Result<LoadedConfig, ConfigFileError> {
    let file: ConfigFile = toml::from_str(text).map_err(|e| ConfigFileError {
        path: path.to_path_buf(),
        line: e.span().map(|span| line_of(text, span.start)),
        message: e.message().trim().replace('\n', " "),
    })?;
    let loaded = LoadedConfig {
        path: path.to_path_buf(),
        format: ConfigFormat::Toml,
        file,
        ignored: Vec::new(),
    };
    validate(&loaded, text)?;
    Ok(loaded)
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// The line where `key` is set in `text`, for errors about its value.
fn line_of_key(text: &str, key: &str) -> Option<usize> {
    text.lines()
        .position(|l| {
            let l = l.trim_start();
            l.strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with(['=', ':']))
        })
        .map(|i| i + 1)
}

fn validate(loaded: &LoadedConfig, text: &str) -> Result<(), ConfigFileError> {
    let fail = |key: &str, message: String| ConfigFileError {
        path: loaded.path.clone(),
        line: line_of_key(text, key),
        message,
    };
    let file = &loaded.file;
    for (key, value) in [
        ("num_processes", file.num_processes),
        ("num_machines", file.num_machines),
        (
            "gradient_accumulation_steps",
            file.gradient_accumulation_steps,
        ),
    ] {
        if value == Some(0) {
            return Err(fail(key, format!("{key} = 0: expected a positive integer")));
        }
    }
    if let (Some(machines), Some(rank)) = (file.num_machines, file.machine_rank)
        && rank >= machines
    {
        return Err(fail(
            "machine_rank",
            format!("machine_rank = {rank} is not below num_machines = {machines}"),
        ));
    }
    Ok(())
}

/// Keys of Accelerate's `default_config.yaml` that mean the same here.
const ACCELERATE_KEYS: [&str; 8] = [
    "num_processes",
    "num_machines",
    "machine_rank",
    "main_process_ip",
    "main_process_port",
    "mixed_precision",
    "gpu_ids",
    "use_cpu",
];

/// Parses Hugging Face Accelerate's YAML: the keys of `ACCELERATE_KEYS` are read (nulls are
/// absent), the others are listed as ignored.
pub fn parse_accelerate_yaml(path: &Path, text: &str) -> Result<LoadedConfig, ConfigFileError> {
    let fail = |line: Option<usize>, message: String| ConfigFileError {
        path: path.to_path_buf(),
        line,
        message,
    };
    let value: serde_yaml::Value = serde_yaml::from_str(text).map_err(|e| {
        let message = e.to_string();
        // serde_yaml appends " at line L column C"; the line goes in front instead.
        let message = message
            .split(" at line ")
            .next()
            .unwrap_or(&message)
            .to_string();
        fail(e.location().map(|l| l.line()), message)
    })?;
    let mapping = match value {
        serde_yaml::Value::Mapping(m) => m,
        serde_yaml::Value::Null => serde_yaml::Mapping::new(),
        _ => return Err(fail(Some(1), "expected a mapping of keys to values".into())),
    };
    let mut kept = serde_yaml::Mapping::new();
    let mut ignored = Vec::new();
    for (key, value) in mapping {
        let name = match &key {
            serde_yaml::Value::String(s) => s.clone(),
            other => format!("{other:?}"),
        };
        if matches!(name.as_str(), "deepspeed_config" | "fsdp_config") {
            match zero_stage_of(&name, &value) {
                Ok(Some(stage)) => {
                    kept.insert("zero_stage".into(), stage.into());
                    if hybrid_strategy(&value) {
                        // FSDP's hybrid strategies shard within a machine, replicate across.
                        let host = ShardGroupSize::Host.to_string();
                        kept.insert("shard_group_size".into(), host.into());
                    }
                }
                Ok(None) => ignored.push(name),
                Err(e) => return Err(fail(line_of_key(text, &name), e.to_string())),
            }
            continue;
        }
        if !ACCELERATE_KEYS.contains(&name.as_str()) {
            ignored.push(name);
            continue;
        }
        let value = match (name.as_str(), value) {
            (_, serde_yaml::Value::Null) => continue,
            // Accelerate writes "all" for every GPU, and sometimes a bare number.
            ("gpu_ids", serde_yaml::Value::String(s)) if s == "all" => continue,
            ("gpu_ids", serde_yaml::Value::Number(n)) => serde_yaml::Value::String(n.to_string()),
            (_, value) => value,
        };
        // One key at a time, so that an error names the key and its line.
        let mut single = serde_yaml::Mapping::new();
        single.insert(key.clone(), value.clone());
        if let Err(e) = serde_yaml::from_value::<ConfigFile>(serde_yaml::Value::Mapping(single)) {
            return Err(fail(line_of_key(text, &name), format!("{name}: {e}")));
        }
        kept.insert(key, value);
    }
    ignored.sort();
    let mut file: ConfigFile =
        serde_yaml::from_value(serde_yaml::Value::Mapping(kept)).map_err(|e| {
            let message = e.to_string();
            let line = ACCELERATE_KEYS
                .iter()
                .find(|k| message.contains(*k))
                .and_then(|k| line_of_key(text, k));
            fail(line, message)
        })?;
    // Accelerate's `num_processes` counts every machine's processes; ours is per machine.
    if let (Some(total), Some(machines)) = (file.num_processes, file.num_machines)
        && machines > 1
        && total > 0
    {
        if total % machines != 0 {
            return Err(fail(
                line_of_key(text, "num_processes"),
                format!(
                    "num_processes = {total} is Accelerate's total over num_machines = \
                     {machines} machines and does not divide evenly among them"
                ),
            ));
        }
        file.num_processes = Some(total / machines);
    }
    let loaded = LoadedConfig {
        path: path.to_path_buf(),
        format: ConfigFormat::AccelerateYaml,
        file,
        ignored,
    };
    validate(&loaded, text)?;
    Ok(loaded)
}

/// A value of Accelerate's `deepspeed_config` or `fsdp_config` that names no ZeRO stage.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum ShardingValueError {
    /// A key holds a value of the wrong kind.
    #[error("{key}: expected {expected}, found {found}")]
    Kind {
        /// Where the value is (`section.key`).
        key: &'static str,
        /// What the key takes.
        expected: &'static str,
        /// The value found, as YAML reads it.
        found: String,
    },
    /// A sharding strategy FSDP does not have.
    #[error(
        "fsdp_config: unknown sharding strategy {0:?} (expected FULL_SHARD, SHARD_GRAD_OP, \
         NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_ZERO2)"
    )]
    Strategy(String),
}

/// The ZeRO stage that Accelerate's `deepspeed_config` (its `zero_stage`) or `fsdp_config`
/// (its sharding strategy: FSDP's `FULL_SHARD` shards parameters, gradients and state like
/// ZeRO-3, `SHARD_GRAD_OP` gradients and state like ZeRO-2; the hybrid strategies shard the
/// same within a machine) asks for; `None` when the section names none.
fn zero_stage_of(
    section: &str,
    value: &serde_yaml::Value,
) -> Result<Option<u64>, ShardingValueError> {
    use serde_yaml::Value;
    let get = |key: &str| value.get(key).filter(|v| !v.is_null());
    let kind = |key, expected, found: &dyn std::fmt::Debug| ShardingValueError::Kind {
        key,
        expected,
        found: format!("{found:?}"),
    };
    if section == "deepspeed_config" {
        return match get("zero_stage") {
            None => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
            Some(other) => Err(kind("deepspeed_config.zero_stage", "a number", other)),
        };
    }
    // FSDP2 (`fsdp_version: 2`) says whether parameters are resharded after the forward pass.
    if let Some(reshard) = get("fsdp_reshard_after_forward") {
        return match reshard {
            Value::Bool(true) => Ok(Some(3)),
            Value::Bool(false) => Ok(Some(2)),
            Value::String(s) => fsdp_strategy(s).map(Some),
            other => Err(kind(
                "fsdp_config.fsdp_reshard_after_forward",
                "true or false",
                other,
            )),
        };
    }
    const STRATEGY: &str = "fsdp_config.fsdp_sharding_strategy";
    match get("fsdp_sharding_strategy") {
        None => Ok(None),
        Some(Value::String(s)) => fsdp_strategy(s).map(Some),
        // Older Accelerate versions write the enum's number (1 = FULL_SHARD).
        Some(Value::Number(n)) => match n.as_u64() {
            Some(1 | 4) => Ok(Some(3)),
            Some(2 | 5) => Ok(Some(2)),
            Some(3) => Ok(Some(0)),
            _ => Err(kind(STRATEGY, "1 to 5 or a strategy's name", n)),
        },
        Some(other) => Err(kind(STRATEGY, "a strategy's name", other)),
    }
}

/// Whether an `fsdp_config` section names one of FSDP's hybrid strategies (by name, or by the
/// enum's number that older Accelerate versions write: 4 and 5).
fn hybrid_strategy(section: &serde_yaml::Value) -> bool {
    match section.get("fsdp_sharding_strategy") {
        Some(serde_yaml::Value::String(s)) => s.trim().to_ascii_uppercase().starts_with("HYBRID"),
        Some(serde_yaml::Value::Number(n)) => matches!(n.as_u64(), Some(4 | 5)),
        _ => false,
    }
}

/// The ZeRO stage of FSDP's sharding strategy `name`.
fn fsdp_strategy(name: &str) -> Result<u64, ShardingValueError> {
    match name.trim().to_ascii_uppercase().as_str() {
        "FULL_SHARD" | "HYBRID_SHARD" => Ok(3),
        "SHARD_GRAD_OP" | "HYBRID_SHARD_ZERO2" => Ok(2),
        "NO_SHARD" => Ok(0),
        _ => Err(ShardingValueError::Strategy(name.to_string())),
    }
}

/// Writes `file` to `path` as our TOML (creating the directory; written to a temporary name
/// and renamed, so a reader never sees half a file).
pub fn write(path: &Path, file: &ConfigFile) -> Result<(), ConfigFileError> {
    let fail = |message: String| ConfigFileError {
        path: path.to_path_buf(),
        line: None,
        message,
    };
    let body = toml::to_string(file).map_err(|e| fail(e.to_string()))?;
    let text = format!(
        "# accelerate-rs configuration, written by `accelerate-rs config`.\n\
         # Read by `accelerate-rs launch` and Accelerator::from_env; command-line flags and\n\
         # ACCELERATE_* variables win over it.\n{body}"
    );
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| fail(format!("creating the directory: {e}")))?;
    }
    let tmp = path.with_extension("toml.tmp");
    std::fs::write(&tmp, text).map_err(|e| fail(e.to_string()))?;
    std::fs::rename(&tmp, path).map_err(|e| fail(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config path that is not a config (a huge file, a device) is an error naming it,
    /// not a read without end.
    #[test]
    fn an_oversized_config_file_is_refused_naming_it() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("huge.toml");
        std::fs::write(&path, vec![b'#'; (MAX_CONFIG_BYTES + 1) as usize]).unwrap();
        let err = read(&path).unwrap_err().to_string();
        assert!(
            err.contains("huge.toml") && err.contains("1048576 bytes"),
            "{err}"
        );
        let err = read(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(err.contains("/dev/zero"), "{err}");
    }

    const HF_YAML: &str = "\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
";

    #[test]
    fn accelerate_yaml_deepspeed_and_fsdp_sections_give_the_zero_stage() {
        let parse = |section: &str| {
            parse_accelerate_yaml(Path::new("c.yaml"), &format!("{HF_YAML}{section}"))
        };
        let stage = |section: &str| parse(section).map(|loaded| loaded.file.zero_stage);
        assert_eq!(stage("").unwrap(), None);
        let deepspeed = "deepspeed_config:\n  zero_stage: 2\n  offload_optimizer_device: none\n";
        assert_eq!(stage(deepspeed).unwrap(), Some(2));
        for (strategy, zero) in [
            ("FULL_SHARD", 3),
            ("SHARD_GRAD_OP", 2),
            ("NO_SHARD", 0),
            ("HYBRID_SHARD_ZERO2", 2),
            ("1", 3),
            ("2", 2),
        ] {
            let fsdp = format!("fsdp_config:\n  fsdp_sharding_strategy: {strategy}\n");
            assert_eq!(stage(&fsdp).unwrap(), Some(zero), "{strategy}");
        }
        // The hybrid strategies shard within each machine.
        for (strategy, zero, groups) in [
            ("HYBRID_SHARD", 3, Some(ShardGroupSize::Host)),
            ("HYBRID_SHARD_ZERO2", 2, Some(ShardGroupSize::Host)),
            ("4", 3, Some(ShardGroupSize::Host)),
            ("FULL_SHARD", 3, None),
        ] {
            let fsdp = format!("fsdp_config:\n  fsdp_sharding_strategy: {strategy}\n");
            let file = parse(&fsdp).unwrap().file;
            assert_eq!(
                (file.zero_stage, file.shard_group_size),
                (Some(zero), groups),
                "{strategy}"
            );
        }
        let fsdp2 = "fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n";
        assert_eq!(stage(fsdp2).unwrap(), Some(2));
        let err = stage("fsdp_config:\n  fsdp_sharding_strategy: HALF_SHARD\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("config file c.yaml:18: fsdp_config: unknown sharding strategy"),
            "{err}"
        );
        // A section without a stage is ignored, and said to be.
        let other = parse_accelerate_yaml(
            Path::new("c.yaml"),
            &format!("{HF_YAML}fsdp_config:\n  fsdp_offload_params: false\n"),
        )
        .unwrap();
        assert!(other.ignored.contains(&"fsdp_config".to_string()));
    }

    #[test]
    fn shard_groups_are_written_as_a_word_or_a_number() {
        let groups = |text: &str| {
            parse_toml(Path::new("c.toml"), text).map(|loaded| loaded.file.shard_group_size)
        };
        assert_eq!(
            groups("shard_group_size = \"host\"\n").unwrap(),
            Some(ShardGroupSize::Host)
        );
        assert_eq!(
            groups("shard_group_size = 2\n").unwrap(),
            Some(ShardGroupSize::Processes(2))
        );
        let err = groups("shard_group_size = 0\n").unwrap_err().to_string();
        assert!(err.contains("job, host or a number of processes"), "{err}");
    }

    #[test]
    fn accelerate_yaml_num_processes_is_the_total_over_machines() {
        let two_machines = HF_YAML
            .replace("num_machines: 1", "num_machines: 2")
            .replace("num_processes: 2", "num_processes: 8");
        let loaded = parse_accelerate_yaml(Path::new("c.yaml"), &two_machines).unwrap();
        assert_eq!(loaded.file.num_processes, Some(4), "8 in all on 2 machines");
        let uneven = two_machines.replace("num_processes: 8", "num_processes: 7");
        let err = parse_accelerate_yaml(Path::new("c.yaml"), &uneven)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("config file c.yaml:11: num_processes = 7 is Accelerate's total"),
            "{err}"
        );
        let one = parse_accelerate_yaml(Path::new("c.yaml"), HF_YAML).unwrap();
        assert_eq!(one.file.num_processes, Some(2));
    }

    #[test]
    fn accelerate_yaml_keeps_the_keys_that_mean_the_same_and_names_the_rest() {
        let loaded = parse_accelerate_yaml(Path::new("default_config.yaml"), HF_YAML).unwrap();
        assert_eq!(loaded.format, ConfigFormat::AccelerateYaml);
        assert_eq!(
            loaded.file,
            ConfigFile {
                num_processes: Some(2),
                num_machines: Some(1),
                machine_rank: Some(0),
                mixed_precision: Some(MixedPrecision::Bf16),
                use_cpu: Some(false),
                ..ConfigFile::default()
            }
        );
        assert_eq!(
            loaded.ignored,
            [
                "compute_environment",
                "debug",
                "distributed_type",
                "downcast_bf16",
                "enable_cpu_affinity",
                "main_training_function",
                "rdzv_backend",
                "same_network",
                "tpu_env",
                "tpu_use_cluster",
                "tpu_use_sudo"
            ]
        );
        assert!(loaded.ignored_note().unwrap().contains("distributed_type"));
        let ids =
            parse_accelerate_yaml(Path::new("c.yaml"), "gpu_ids: 0,1\nmain_process_ip: null\n")
                .unwrap();
        assert_eq!(ids.file.gpu_ids.as_deref(), Some("0,1"));
        assert_eq!(ids.file.main_process_ip, None);
    }

    #[test]
    fn malformed_files_are_one_line_errors_naming_file_and_line() {
        let err = parse_accelerate_yaml(
            Path::new("/x/c.yaml"),
            "num_processes: 2\nmixed_precision: [\n",
        )
        .unwrap_err();
        assert_eq!(err.line, Some(3), "{err}");
        assert!(
            err.to_string().starts_with("config file /x/c.yaml:3: "),
            "{err}"
        );
        assert!(!err.to_string().contains('\n'), "{err}");

        let err = parse_accelerate_yaml(
            Path::new("c.yaml"),
            "num_processes: 2\nmixed_precision: fp8\n",
        )
        .unwrap_err();
        assert_eq!(err.line, Some(2), "{err}");
        assert!(err.to_string().contains("fp8"), "{err}");

        let err =
            parse_toml(Path::new("c.toml"), "num_processes = 2\nnum_procs = 3\n").unwrap_err();
        assert_eq!(err.line, Some(2), "{err}");
        assert!(err.to_string().contains("num_procs"), "{err}");
        assert!(!err.to_string().contains('\n'), "{err}");

        let err = parse_toml(Path::new("c.toml"), "seed = 1\nnum_processes = 0\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "config file c.toml:2: num_processes = 0: expected a positive integer"
        );

        let err =
            parse_toml(Path::new("c.toml"), "num_machines = 2\nmachine_rank = 2\n").unwrap_err();
        assert_eq!(err.line, Some(2));
    }

    #[test]
    fn our_file_round_trips_and_is_found_where_documented() {
        let tmp = tempfile::tempdir().unwrap();
        let home = tmp.path().display().to_string();
        let env = [("HOME", home.as_str())];
        let ours = default_path(&env[..]).unwrap();
        assert_eq!(ours, tmp.path().join(".config/accelerate-rs/config.toml"));
        assert_eq!(discover(&env[..]).unwrap(), None);

        // Accelerate's file is read when ours is absent.
        let hf = accelerate_default_path(&env[..]).unwrap();
        assert_eq!(
            hf,
            tmp.path()
                .join(".cache/huggingface/accelerate/default_config.yaml")
        );
        std::fs::create_dir_all(hf.parent().unwrap()).unwrap();
        std::fs::write(&hf, HF_YAML).unwrap();
        assert_eq!(discover(&env[..]).unwrap().unwrap().path, hf);

        // Ours wins over Accelerate's.
        let file = ConfigFile {
            num_processes: Some(4),
            mixed_precision: Some(MixedPrecision::Fp16),
            seed: Some(3),
            ..ConfigFile::default()
        };
        write(&ours, &file).unwrap();
        let found = discover(&env[..]).unwrap().unwrap();
        assert_eq!((found.path.clone(), found.file), (ours.clone(), file));

        // The variable wins over both; `none` means no file.
        let other = tmp.path().join("other.toml");
        std::fs::write(&other, "num_processes = 3\n").unwrap();
        let other_s = other.display().to_string();
        let env2 = [("HOME", home.as_str()), (ENV_CONFIG_FILE, other_s.as_str())];
        assert_eq!(
            discover(&env2[..]).unwrap().unwrap().file.num_processes,
            Some(3)
        );
        let env3 = [("HOME", home.as_str()), (ENV_CONFIG_FILE, "none")];
        assert_eq!(discover(&env3[..]).unwrap(), None);
        let missing = [(ENV_CONFIG_FILE, "/nonexistent/c.toml")];
        assert!(discover(&missing[..]).is_err());
        // XDG_CONFIG_HOME moves ours.
        let xdg = [("HOME", home.as_str()), ("XDG_CONFIG_HOME", "/etc/xdg")];
        assert_eq!(
            default_path(&xdg[..]).unwrap(),
            PathBuf::from("/etc/xdg/accelerate-rs/config.toml")
        );
    }
}
