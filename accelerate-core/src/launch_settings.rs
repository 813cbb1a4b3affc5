//! What `accelerate-rs launch` runs with: each setting from its command-line flag, else its
//! `ACCELERATE_*` variable, else the config file, else the default (the rows of
//! [`crate::setting_table`] and its resolver), every value validated whatever its source, with
//! errors naming the key, its source and what is accepted.

use std::path::Path;

use crate::config_file::ConfigFile;
use crate::env_vars::{self, EnvSource};
use crate::error::ConfigError;
use crate::setting_table::{self as table, GivenBy, Resolver};
use crate::settings::{MixedPrecision, ShardGroupSize};

/// The launcher's command-line flags (`None`/`false`: not given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaunchFlags {
    /// `-n/--num-processes`.
    pub num_processes: Option<usize>,
    /// `--num-machines`.
    pub num_machines: Option<usize>,
    /// `--machine-rank`.
    pub machine_rank: Option<usize>,
    /// `--main-process-ip`.
    pub main_process_ip: Option<String>,
    /// `--main-process-port`.
    pub main_process_port: Option<u16>,
    /// `--mixed-precision`.
    pub mixed_precision: Option<MixedPrecision>,
    /// `--zero-stage`.
    pub zero_stage: Option<u8>,
    /// `--shard-group-size`.
    pub shard_group_size: Option<ShardGroupSize>,
    /// `--cpu`.
    pub cpu: bool,
    /// `--gpu-ids`.
    pub gpu_ids: Option<String>,
    /// `--max-restarts`.
    pub max_restarts: Option<usize>,
}

/// Which devices the workers see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSelection {
    /// Whatever the machine has.
    Default,
    /// No GPU (`CUDA_VISIBLE_DEVICES=""`).
    Cpu,
    /// These GPUs (`CUDA_VISIBLE_DEVICES`).
    Gpus(String),
}

/// The resolved launch settings: what [`LaunchConfig`](crate::launch::LaunchConfig) runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchSettings {
    /// Worker processes on this machine (default 1).
    pub num_processes: usize,
    /// Machines in the job (default 1).
    pub num_machines: usize,
    /// This machine's index (default 0).
    pub machine_rank: usize,
    /// Rank 0's machine (default 127.0.0.1).
    pub main_process_ip: String,
    /// Rank 0's rendezvous port (default 0, a free one, on one machine; 29500 on several).
    pub main_process_port: u16,
    /// Restarts after a failure (default 0).
    pub max_restarts: usize,
    /// A precision given on the command line, passed to the workers (they read env and file
    /// themselves otherwise).
    pub mixed_precision: Option<MixedPrecision>,
    /// A ZeRO stage given on the command line, passed to the workers.
    pub zero_stage: Option<u8>,
    /// Shard groups given on the command line (hybrid sharding), passed to the workers.
    pub shard_group_size: Option<ShardGroupSize>,
    /// Which devices the workers see.
    pub devices: DeviceSelection,
}

impl LaunchFlags {
    /// Resolves the flags against `env`, then `file`, then the defaults.
    pub fn resolve(
        &self,
        env: &(impl EnvSource + ?Sized),
        file: Option<&ConfigFile>,
    ) -> Result<LaunchSettings, ConfigError> {
        self.resolve_from(env, file, None)
    }

    /// [`resolve`](Self::resolve) with the config file read from `path`, which errors about
    /// its values name.
    pub fn resolve_from(
        &self,
        env: &(impl EnvSource + ?Sized),
        file: Option<&ConfigFile>,
        path: Option<&Path>,
    ) -> Result<LaunchSettings, ConfigError> {
        let settings = Resolver::new(env, GivenBy::Flag, path);
        let file = file.cloned().unwrap_or_default();
        let num_machines = settings.get_or(
            &table::NUM_MACHINES,
            self.num_machines,
            file.num_machines,
            1,
        )?;
        let main_process_port = settings.get_or(
            &table::MAIN_PROCESS_PORT,
            self.main_process_port,
            file.main_process_port,
            if num_machines == 1 { 0 } else { 29500 },
        )?;
        let gpu_ids = settings.get(&table::GPU_IDS, self.gpu_ids.clone(), file.gpu_ids)?;
        // `--cpu` only ever says yes; without it the variable, then the file, decide.
        let use_cpu = settings.get_or(
            &table::USE_CPU,
            self.cpu.then_some(true),
            file.use_cpu,
            false,
        )?;
        let devices = match (self.cpu, gpu_ids) {
            (true, _) => DeviceSelection::Cpu,
            (false, Some(ids)) => DeviceSelection::Gpus(ids),
            (false, None) if use_cpu => DeviceSelection::Cpu,
            (false, None) => DeviceSelection::Default,
        };
        Ok(LaunchSettings {
            num_processes: settings.get_or(
                &table::NUM_PROCESSES,
                self.num_processes,
                file.num_processes,
                1,
            )?,
            num_machines,
            machine_rank: settings.get_or(
                &table::MACHINE_RANK,
                self.machine_rank,
                file.machine_rank,
                0,
            )?,
            main_process_ip: settings.get_or(
                &table::MAIN_PROCESS_IP,
                self.main_process_ip.clone(),
                file.main_process_ip,
                "127.0.0.1".into(),
            )?,
            main_process_port,
            max_restarts: settings.get_or(
                &table::MAX_RESTARTS,
                self.max_restarts,
                file.max_restarts,
                0,
            )?,
            // Only a precision given on the command line is passed on: the workers read the
            // environment and the file themselves.
            mixed_precision: self.mixed_precision,
            // Checked here, so that a bad value stops the launch rather than every worker.
            zero_stage: settings.get(&table::ZERO_STAGE, self.zero_stage, None)?,
            shard_group_size: self.shard_group_size,
            devices,
        })
    }
}

impl Default for LaunchSettings {
    /// What a launch with no flag, variable or file runs: one process on this machine, rank 0
    /// at 127.0.0.1 on a free port.
    fn default() -> Self {
        Self {
            num_processes: 1,
            num_machines: 1,
            machine_rank: 0,
            main_process_ip: "127.0.0.1".into(),
            main_process_port: 0,
            max_restarts: 0,
            mixed_precision: None,
            zero_stage: None,
            shard_group_size: None,
            devices: DeviceSelection::Default,
        }
    }
}

impl LaunchSettings {
    /// The variables the workers get for these settings (besides the process contract).
    pub fn worker_env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        if let Some(precision) = self.mixed_precision {
            env.push((
                env_vars::MIXED_PRECISION.to_string(),
                precision.as_str().to_string(),
            ));
        }
        if let Some(stage) = self.zero_stage {
            env.push((env_vars::ZERO_STAGE.to_string(), stage.to_string()));
        }
        if let Some(size) = self.shard_group_size {
            env.push((env_vars::SHARD_GROUP_SIZE.to_string(), size.to_string()));
        }
        match &self.devices {
            DeviceSelection::Default => {}
            DeviceSelection::Cpu => {
                env.push(("CUDA_VISIBLE_DEVICES".to_string(), String::new()));
                env.push((env_vars::USE_CPU.to_string(), "1".to_string()));
            }
            DeviceSelection::Gpus(ids) => {
                env.push(("CUDA_VISIBLE_DEVICES".to_string(), ids.clone()));
            }
        }
        env
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_beats_env_beats_file_beats_default() {
        let file = ConfigFile {
            num_processes: Some(3),
            max_restarts: Some(2),
            main_process_ip: Some("10.0.0.1".into()),
            ..ConfigFile::default()
        };
        let none: [(&str, &str); 0] = [];
        let defaults = LaunchFlags::default().resolve(&none[..], None).unwrap();
        assert_eq!(
            (
                defaults.num_processes,
                defaults.main_process_port,
                defaults.max_restarts
            ),
            (1, 0, 0)
        );
        assert_eq!(defaults.devices, DeviceSelection::Default);
        let from_file = LaunchFlags::default()
            .resolve(&none[..], Some(&file))
            .unwrap();
        assert_eq!((from_file.num_processes, from_file.max_restarts), (3, 2));
        assert_eq!(from_file.main_process_ip, "10.0.0.1");
        let env = [
            (env_vars::NUM_PROCESSES, "4"),
            (env_vars::NUM_MACHINES, "2"),
        ];
        let from_env = LaunchFlags::default()
            .resolve(&env[..], Some(&file))
            .unwrap();
        assert_eq!(
            (from_env.num_processes, from_env.main_process_port),
            (4, 29500)
        );
        let flags = LaunchFlags {
            num_processes: Some(2),
            ..LaunchFlags::default()
        };
        assert_eq!(
            flags.resolve(&env[..], Some(&file)).unwrap().num_processes,
            2
        );
    }

    #[test]
    fn an_unrecognised_boolean_is_an_error_naming_the_variable() {
        let env = [(env_vars::USE_CPU, "on")];
        let err = LaunchFlags::default()
            .resolve(&env[..], None)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "ACCELERATE_USE_CPU (env) = on: expected true, false, 1, 0, yes or no"
        );
        let env = [(env_vars::USE_CPU, "yes")];
        let settings = LaunchFlags::default().resolve(&env[..], None).unwrap();
        assert_eq!(settings.devices, DeviceSelection::Cpu);
        assert!(
            settings
                .worker_env()
                .contains(&("CUDA_VISIBLE_DEVICES".to_string(), String::new()))
        );
    }

    #[test]
    fn gpu_ids_win_over_use_cpu_from_env_but_not_over_the_cpu_flag() {
        let env = [(env_vars::USE_CPU, "1"), (env_vars::GPU_IDS, "0,1")];
        let settings = LaunchFlags::default().resolve(&env[..], None).unwrap();
        assert_eq!(settings.devices, DeviceSelection::Gpus("0,1".into()));
        let cpu = LaunchFlags {
            cpu: true,
            ..LaunchFlags::default()
        };
        assert_eq!(
            cpu.resolve(&env[..], None).unwrap().devices,
            DeviceSelection::Cpu
        );
    }

    #[test]
    fn a_bad_port_or_count_names_the_variable() {
        let env = [(env_vars::MAIN_PROCESS_PORT, "70000")];
        let err = LaunchFlags::default().resolve(&env[..], None).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("ACCELERATE_MAIN_PROCESS_PORT (env) = 70000")
        );
        let env = [(env_vars::NUM_PROCESSES, "-1")];
        let err = LaunchFlags::default().resolve(&env[..], None).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("ACCELERATE_NUM_PROCESSES (env) = -1")
        );
    }

    #[test]
    fn the_precision_flag_reaches_the_workers_in_the_spelling_they_read() {
        let flags = LaunchFlags {
            mixed_precision: Some(MixedPrecision::Bf16),
            ..LaunchFlags::default()
        };
        let none: [(&str, &str); 0] = [];
        let env = flags.resolve(&none[..], None).unwrap().worker_env();
        assert_eq!(
            env,
            vec![(env_vars::MIXED_PRECISION.to_string(), "bf16".to_string())]
        );
        assert_eq!("bf16".parse::<MixedPrecision>(), Ok(MixedPrecision::Bf16));
    }

    #[test]
    fn the_zero_stage_flag_reaches_the_workers_and_a_stage_not_built_stops_the_launch() {
        let none: [(&str, &str); 0] = [];
        let flags = |stage| LaunchFlags {
            zero_stage: Some(stage),
            ..LaunchFlags::default()
        };
        let env = flags(2).resolve(&none[..], None).unwrap().worker_env();
        assert_eq!(
            env,
            vec![(env_vars::ZERO_STAGE.to_string(), "2".to_string())]
        );
        let env = flags(3).resolve(&none[..], None).unwrap().worker_env();
        assert_eq!(
            env,
            vec![(env_vars::ZERO_STAGE.to_string(), "3".to_string())]
        );
        let err = flags(4).resolve(&none[..], None).unwrap_err().to_string();
        assert_eq!(err, "--zero-stage (flag) = 4: expected 0, 1, 2 or 3");
        let hybrid = LaunchFlags {
            shard_group_size: Some("host".parse().unwrap()),
            ..flags(3)
        };
        let env = hybrid.resolve(&none[..], None).unwrap().worker_env();
        assert!(env.contains(&(env_vars::SHARD_GROUP_SIZE.to_string(), "host".to_string())));
        assert_eq!("2".parse(), Ok(ShardGroupSize::Processes(2)));
        assert!("0".parse::<ShardGroupSize>().is_err());
    }
}
