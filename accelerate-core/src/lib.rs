//! The process layer of accelerate-rs: everything about processes and training-loop
//! bookkeeping, nothing about tensors.
//!
//! This crate knows who a process is in a job ([`ProcessState`], read from `accelerate-rs launch`,
//! torchrun, SLURM, Open MPI or PMI variables), how the accelerated loop is configured
//! ([`AcceleratorConfig`]: code over `ACCELERATE_*` env over defaults), when a gradient
//! accumulation window completes ([`GradientAccumulation`]), and in which order an epoch visits
//! the data ([`sampler`]). It has no Burn dependency, so all of it is tested in milliseconds.
//!
//! ```
//! use accelerate_core::{BatchPosition, GradientAccumulation, ProcessState};
//!
//! // No launcher variables: rank 0 of 1.
//! let state = ProcessState::from_source(&[][..]).unwrap();
//! assert_eq!((state.rank, state.world_size), (0, 1));
//!
//! // Accumulating 4 micro-batches over an epoch of 6: the last window has 2.
//! let mut acc = GradientAccumulation::new(4);
//! acc.begin_batch(BatchPosition { index: 4, epoch_len: 6 });
//! let step = acc.micro_step();
//! assert_eq!((step.window_len, step.sync), (2, false));
//! ```
//!
//! - [`state`]: the launcher environment, parsed and validated (one reader per launcher, and
//!   the [`state::contract`] between `accelerate-rs launch` and its workers).
//! - [`settings`]: the settings' value types (precision, NCCL use, transport), a leaf.
//! - [`setting_table`]: every setting's key, flag, variable and accepted values, and the one
//!   resolver of flag or code > environment > config file > default.
//! - [`config`]: [`AcceleratorConfig`] and its sources.
//! - [`config_file`]: the config file (`accelerate-rs config`), and Accelerate's YAML import.
//! - [`env_vars`]: every `ACCELERATE_*` variable, named once, and the environment reader.
//! - [`launch_settings`]: what `accelerate-rs launch` runs with (flag > env > file > default).
//! - [`accumulation`]: gradient accumulation windows.
//! - [`sampler`]: the per-epoch data order.
//! - [`scaler`]: the dynamic loss scaler of fp16 training (state machine, no tensors).
//! - [`distributed_sampler`]: each rank's batches of an epoch, padding and resume cursor.
//! - [`piece_order`]: the epoch order of data read in pieces (Parquet row groups, files).
//! - [`rank_batches`]: one rank's batches of an epoch, made as they are asked for.
//! - [`checkpoint`]: checkpoint directories: manifest, per-rank state, atomic commit, rotation.
//! - [`comm`]: the process group and its collectives (rendezvous, shared memory, TCP).
//! - `nccl` (Unix): finding libnccl, and agreeing whether a job reduces with it (no GPU needed).
//! - [`input_file`]: config files and manifests, read up to a size limit.
//! - [`output_file`]: logs and metrics files, never written through a symbolic link.
//! - [`tracking`]: trackers ([`GeneralTracker`]): CSV, TensorBoard (with hparams), MLflow's
//!   REST API, and users' own, fanned out by [`Trackers`].
//! - [`trace`]: per-rank Chrome/Perfetto timelines from `tracing` spans (`ACCELERATE_TRACE`).
//! - [`throughput`]: tokens/s, model FLOPs/s, MFU and peak memory as tracker metrics.
//! - `launch` (Unix): starting and supervising the workers of one machine, and its progress
//!   line.
//! - [`wait`]: configured waits, bounded, and deadlines that cannot overflow.
//! - [`weights`]: safetensors headers, the Hugging Face sharded layout, merging shards.
//! - [`memory_estimate`]: what each ZeRO stage holds per process.

pub mod accumulation;
pub mod checkpoint;
pub mod comm;
pub mod config;
pub mod config_file;
pub mod distributed_sampler;
pub mod env_vars;
pub mod error;
pub mod input_file;
#[cfg(unix)]
pub mod launch;
pub mod launch_settings;
pub mod malloc_tuning;
pub mod memory_estimate;
pub mod memory_limit;
#[cfg(unix)]
pub mod nccl;
pub mod output_file;
pub mod piece_order;
pub mod process;
pub mod rank_batches;
pub mod sampler;
pub mod scaler;
pub mod setting_table;
pub mod settings;
pub mod state;
pub mod stream_order;
pub mod stream_walk;
pub mod throughput;
pub mod trace;
pub mod tracking;
pub mod wait;
pub mod weights;

pub use accumulation::{BatchPosition, GradientAccumulation, MicroStep};
pub use checkpoint::{CheckpointError, CheckpointRotation, LoaderState, Manifest, RankState};
pub use comm::{GroupOptions, ProcessGroup, Reduction};
pub use config::{AcceleratorConfig, ConfigOverrides, MixedPrecision, NcclMode, ShardGroupSize};
pub use config_file::{ConfigFile, ConfigFileError, LoadedConfig};
pub use distributed_sampler::{
    DistributedSampler, RankBatch, RankBatches, SamplerConfig, SamplerCursor, SamplerError,
};
pub use error::{CommError, ConfigError, RendezvousWait, StateError};
pub use launch_settings::{DeviceSelection, LaunchFlags, LaunchSettings};
pub use piece_order::{ConsumedShares, PieceCursor, PieceLayout, Positions};
pub use sampler::{KeyedOrder, ShuffleOrder};
pub use scaler::{DynamicLossScaler, ScaledStep, ScalerConfig, ScalerState};
pub use state::{EnvSource, Launcher, ProcessEnv, ProcessState};
pub use stream_order::{Ahead, StreamConfig, StreamCursor, StreamState};
pub use stream_walk::{ShardReader, StreamWalk, Walked};
pub use tracking::{GeneralTracker, RunInfo, RunStatus, Tracker, TrackerError, Trackers};

/// The crate's README, whose examples run as doctests so that what crates.io shows compiles.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
