//! [`AcceleratorBuilder`]: settings made in code, resolved against `ACCELERATE_*` variables and
//! the config file, then the process group, the device and the precision.

use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use accelerate_core::comm::{GroupOptions, ProcessGroup};
use accelerate_core::trace::StepWindow;
use accelerate_core::tracking::GeneralTracker;
use accelerate_core::{
    ConfigOverrides, DynamicLossScaler, MixedPrecision, NcclMode, ProcessState, ScalerConfig,
    Tracker,
};
use burn::tensor::DType;

use super::tracking::Metrics;
use super::{Accelerator, CheckpointSettings};
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::group::{Comm, Hybrid};
use crate::loader_link::LoaderLinks;
use crate::model_slot::ModelSlots;
use crate::overlap::TapHub;
use crate::sharded::ShardGroup;
use crate::training_loop::LoopClock;

/// Builds an [`Accelerator`]; values set here win over `ACCELERATE_*` variables and the
/// config file.
pub struct AcceleratorBuilder<B: AcceleratorBackend> {
    overrides: ConfigOverrides,
    state: Option<ProcessState>,
    group_options: Option<GroupOptions>,
    strict_precision: bool,
    scaler: ScalerConfig,
    checkpoints: CheckpointSettings,
    checkpoint_limit_zero: bool,
    trackers: Vec<Tracker>,
    custom_trackers: Vec<Box<dyn GeneralTracker>>,
    tracker_errors_fatal: bool,
    trace: Option<(PathBuf, StepWindow)>,
    keep_freed_memory: bool,
    sync_buffers: bool,
    _backend: PhantomData<B>,
}

impl<B: AcceleratorBackend> Default for AcceleratorBuilder<B> {
    fn default() -> Self {
        Self {
            overrides: ConfigOverrides::default(),
            state: None,
            group_options: None,
            strict_precision: false,
            scaler: ScalerConfig::default(),
            checkpoints: CheckpointSettings::default(),
            checkpoint_limit_zero: false,
            trackers: Vec::new(),
            custom_trackers: Vec::new(),
            tracker_errors_fatal: false,
            trace: None,
            keep_freed_memory: true,
            sync_buffers: true,
            _backend: PhantomData,
        }
    }
}

impl<B: AcceleratorBackend> AcceleratorBuilder<B> {
    /// Sums the gradients of `steps` micro-batches before each optimizer update.
    pub fn gradient_accumulation_steps(mut self, steps: usize) -> Self {
        self.overrides.gradient_accumulation_steps = Some(steps);
        self
    }

    /// Seeds the device's random generator (parameter initialisation, dropout) at build time.
    pub fn seed(mut self, seed: u64) -> Self {
        self.overrides.seed = Some(seed);
        self
    }

    /// Computes in bf16 or fp16 (master weights, gradients and optimizer state stay f32);
    /// wins over `ACCELERATE_MIXED_PRECISION`.
    pub fn mixed_precision(mut self, precision: MixedPrecision) -> Self {
        self.overrides.mixed_precision = Some(precision);
        self
    }

    /// Sends gradients between processes in bf16 or fp16 (half the bytes; sums still
    /// accumulate in f32), with Burn's optimizers and fused ones alike; wins over
    /// `ACCELERATE_GRADIENT_COMMUNICATION`. Off by default.
    pub fn gradient_communication(mut self, precision: MixedPrecision) -> Self {
        self.overrides.gradient_communication = Some(precision);
        self
    }

    /// ZeRO stage of a fused optimizer: 1 shards the optimizer state across the processes
    /// (each updates its 1/N of the parameters), 2 the gradients and master parameters too;
    /// 0 (default) keeps all of it everywhere. Wins over `ACCELERATE_ZERO_STAGE`.
    pub fn zero_stage(mut self, stage: u8) -> Self {
        self.overrides.zero_stage = Some(stage);
        self
    }

    /// Which processes ZeRO's shards are cut across (stages 1 to 3): the whole job (default),
    /// or groups of it, every shard group holding a whole copy and each shard's gradients
    /// averaged across the groups (hybrid sharding, FSDP's `HYBRID_SHARD`):
    /// [`ShardGroupSize::Host`](accelerate_core::ShardGroupSize::Host) keeps the shards'
    /// gathers on each host's shared memory and sends only averaged shard gradients between
    /// hosts. Wins over `ACCELERATE_SHARD_GROUP_SIZE`.
    pub fn shard_group_size(mut self, size: accelerate_core::ShardGroupSize) -> Self {
        self.overrides.shard_group_size = Some(size);
        self
    }

    /// Activation (gradient) checkpointing: the prepared device carries Burn's balanced
    /// strategy, so the backward pass recomputes memory-bound activations (element-wise ops,
    /// norms) instead of keeping them, while matrix products keep theirs: lower peak memory
    /// for some extra compute. Build the model and batches on [`Accelerator::device`] (tensors
    /// of devices with different strategies cannot be combined). Wins over
    /// `ACCELERATE_GRADIENT_CHECKPOINTING`; off by default.
    pub fn gradient_checkpointing(mut self, on: bool) -> Self {
        self.overrides.gradient_checkpointing = Some(on);
        self
    }

    /// Burn's kernel fusion on a GPU backend built with it (`wgpu`, `cuda`): on by default,
    /// as a plain Burn user has it. Off takes Burn's fusers out for the whole process, so
    /// every operation runs as its own kernel (for debugging, or to compare); it must be
    /// chosen before the first tensor operation on the GPU, so build the accelerator first.
    /// Wins over `ACCELERATE_FUSION`; no effect on the CPU backends.
    pub fn fusion(mut self, on: bool) -> Self {
        self.overrides.fusion = Some(on);
        self
    }

    /// Fails to build when the device cannot compute in the requested precision, instead of
    /// warning once and training in f32.
    pub fn strict_mixed_precision(mut self, strict: bool) -> Self {
        self.strict_precision = strict;
        self
    }

    /// Whether the cuda backend averages gradients on the GPUs with NCCL: `Auto` (default)
    /// does when every process can load libnccl and there are several, else it warns once and
    /// averages on the host; `Off` never; `Require` fails to build instead of falling back
    /// (and uses NCCL even for one process). Wins over `ACCELERATE_NCCL`. Needs the `nccl`
    /// feature.
    pub fn nccl(mut self, mode: NcclMode) -> Self {
        self.overrides.nccl = Some(mode);
        self
    }

    /// Fails to build when gradients cannot be averaged with NCCL (`nccl(NcclMode::Require)`),
    /// like [`strict_mixed_precision`](Self::strict_mixed_precision) for precisions.
    pub fn strict_nccl(self) -> Self {
        self.nccl(NcclMode::Require)
    }

    /// Whether building the accelerator sets glibc's malloc thresholds so that buffers freed
    /// by one step are reused by the next instead of being faulted in again (default true;
    /// `ACCELERATE_MALLOC_TUNING=false` also turns it off; see
    /// [`accelerate_core::malloc_tuning`]).
    pub fn keep_freed_memory(mut self, keep: bool) -> Self {
        self.keep_freed_memory = keep;
        self
    }

    /// Whether the running states of prepared models (BatchNorm's running mean and variance,
    /// any `RunningState`) are averaged over the processes at every optimizer update, so
    /// that every rank evaluates and saves the same statistics (default true). The average
    /// of the running means is what one process keeps on the global batch; the running
    /// variance averages the per-process batch variances (as DDP without SyncBatchNorm).
    /// `false` leaves each process's statistics to its own batches.
    pub fn sync_buffers(mut self, sync: bool) -> Self {
        self.sync_buffers = sync;
        self
    }

    /// Settings of the fp16 dynamic loss scaler (PyTorch's defaults otherwise).
    pub fn loss_scaler(mut self, config: ScalerConfig) -> Self {
        self.scaler = config;
        self
    }

    /// The project directory: automatically named checkpoints go to its `checkpoints/`
    /// ([`save_checkpoint`](Accelerator::save_checkpoint),
    /// [`load_latest_checkpoint`](Accelerator::load_latest_checkpoint)).
    pub fn project_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.checkpoints.project_dir = Some(dir.into());
        self
    }

    /// Keeps at most `limit` automatically named checkpoints, removing the oldest (at least 1:
    /// `build` refuses 0).
    pub fn checkpoint_total_limit(mut self, limit: usize) -> Self {
        self.checkpoint_limit_zero = limit == 0;
        self.checkpoints.total_limit = Some(limit);
        self
    }

    /// Saves checkpoints in the background (also `ACCELERATE_ASYNC_CHECKPOINTS`, or
    /// `async_checkpoints` in the config file; off by default): `save_state` and
    /// `save_checkpoint` take a snapshot of what they save and return; a thread writes it,
    /// and the main process commits it once every rank's part is on disk. At most one save is
    /// in flight: the next save, a load, [`wait_for_checkpoint`](Accelerator::wait_for_checkpoint)
    /// or the end of the accelerator waits for it; its errors are reported by the next of
    /// those calls. The crash-safe commit, rotation and bit-identical resume are those of a
    /// synchronous save.
    pub fn async_checkpoints(mut self, on: bool) -> Self {
        self.overrides.async_checkpoints = Some(on);
        self
    }

    /// Averages the gradients of a model's units on a communication thread while the backward
    /// pass goes on (on by default; also `ACCELERATE_OVERLAP_COMMUNICATION`). A unit is a part
    /// of the model made by [`Accelerator::unit`]; a model that marks none averages after
    /// backward as before. The results are the same bits either way: `false` is for
    /// comparisons and as an escape hatch.
    pub fn overlap_communication(mut self, on: bool) -> Self {
        self.overrides.overlap_communication = Some(on);
        self
    }

    /// Where a background save keeps its snapshot (default: memory; see
    /// [`CheckpointSnapshot`](crate::CheckpointSnapshot)).
    pub fn checkpoint_snapshot(mut self, snapshot: crate::CheckpointSnapshot) -> Self {
        self.checkpoints.snapshot = snapshot;
        self
    }

    /// The dtype [`save_model`](Accelerator::save_model), [`save_model_sharded`](Accelerator::save_model_sharded)
    /// and the whole saves of a model with sharded units write float parameters in: `F32`,
    /// `BF16` or `F16` (half the bytes, for inference; each value rounded to nearest even
    /// once). Unset, each is written as the model holds it (a model with sharded units, in
    /// f32). Checkpoints (`save_state`) always keep the training's own dtypes.
    pub fn export_dtype(mut self, dtype: DType) -> Self {
        self.checkpoints.export_dtype = Some(dtype);
        self
    }

    /// Allows loading a checkpoint saved by another number of processes: the training loader
    /// then continues the saved epoch's order from the global position the saved run reached
    /// (batch composition differs from an uninterrupted run, the samples do not).
    pub fn resume_with_different_world_size(mut self, allow: bool) -> Self {
        self.checkpoints.resume_any_world_size = allow;
        self
    }

    /// Where [`log`](Accelerator::log) writes metrics: a CSV file and/or TensorBoard event
    /// files in `<project_dir>/logs` (these need [`project_dir`](Self::project_dir)), an
    /// MLflow server (at `MLFLOW_TRACKING_URI`). On the main process only.
    pub fn log_with(mut self, trackers: &[Tracker]) -> Self {
        self.trackers = trackers.to_vec();
        self
    }

    /// Adds a tracker of the user's own (a [`GeneralTracker`] impl), beside those of
    /// [`log_with`](Self::log_with); it runs on the main process unless its
    /// `main_process_only` says `false`.
    pub fn add_tracker(mut self, tracker: impl GeneralTracker + 'static) -> Self {
        self.custom_trackers.push(Box::new(tracker));
        self
    }

    /// Makes a tracker's failure (a full disk, an MLflow server that refuses a value) an
    /// error of the call that meets it; by default it is a warning and training goes on.
    pub fn tracker_errors_fatal(mut self, fatal: bool) -> Self {
        self.tracker_errors_fatal = fatal;
        self
    }

    /// Writes this rank's timeline (`trace_rank_<r>.json`: every step's phases and
    /// collectives, see `accelerate_core::trace`) into `dir` when the accelerator ends,
    /// keeping `window` (`StepWindow::Last(20)`, or `Range(k, m)`); wins over
    /// `ACCELERATE_TRACE`.
    pub fn trace(mut self, dir: impl Into<PathBuf>, window: StepWindow) -> Self {
        self.trace = Some((dir.into(), window));
        self
    }

    /// Uses `state` instead of reading the launcher environment.
    pub fn process_state(mut self, state: ProcessState) -> Self {
        self.state = Some(state);
        self
    }

    /// Uses `options` for the process group (timeouts, transport) instead of reading
    /// `ACCELERATE_*` variables.
    pub fn process_group_options(mut self, options: GroupOptions) -> Self {
        self.group_options = Some(options);
        self
    }

    /// Reads what was not set in code from the environment, validates it, and selects the
    /// device of this process's local rank.
    pub fn build(self) -> Result<Accelerator<B>, AccelerateError> {
        let state = match self.state {
            Some(state) => state,
            None => ProcessState::from_env()?,
        };
        let rank = state.rank;
        if let Some(kind) = self.trackers.iter().find(|t| t.needs_log_dir())
            && self.checkpoints.project_dir.is_none()
        {
            return Err(AccelerateError::Misuse {
                rank,
                what: format!("log_with: the {kind} tracker needs a directory for the logs"),
                hint: "also call .project_dir(path); metrics go to <path>/logs",
            });
        }
        if let Some(dtype) = self.checkpoints.export_dtype
            && !matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
        {
            return Err(AccelerateError::Misuse {
                rank,
                what: format!("export_dtype({dtype:?}): models are exported in F32, BF16 or F16"),
                hint: "pass DType::BF16 or DType::F16 for half the bytes, or leave it unset",
            });
        }
        if self.checkpoint_limit_zero {
            return Err(AccelerateError::Misuse {
                rank,
                what: "checkpoint_total_limit(0) would keep no checkpoint".into(),
                hint: "keep at least 1, or leave the limit unset to keep them all",
            });
        }
        let config = self.overrides.resolve()?;
        // After every check of the settings: a refused build leaves no log file behind.
        let metrics = Metrics::open(
            &self.trackers,
            self.custom_trackers,
            self.tracker_errors_fatal,
            self.checkpoints.project_dir.as_deref(),
            state.is_main_process(),
        )
        .map_err(|source| AccelerateError::Tracker { rank, source })?;
        match &self.trace {
            Some((dir, window)) => accelerate_core::trace::install(dir, *window, rank),
            None => accelerate_core::trace::install_from_env(rank)?,
        }
        accelerate_core::malloc_tuning::keep_freed_memory(
            self.keep_freed_memory,
            &accelerate_core::state::ProcessEnv,
        );
        let (mut group, timeout) = if state.is_distributed() {
            let options = match self.group_options {
                Some(options) => options,
                None => GroupOptions::from_env()?,
            };
            (ProcessGroup::new(&state, &options)?, options.timeout)
        } else {
            let options = self.group_options.unwrap_or_default();
            (ProcessGroup::single(), options.timeout)
        };
        crate::backend::fusion::choose(config.fusion, rank)?;
        let mut device = B::device(state.local_rank)?.autodiff();
        // After the device probe, so that a machine without the backend's driver gets that
        // error, not one about NCCL.
        let device_collectives =
            crate::nccl::connect(&mut group, B::NAME, config.nccl, state.local_rank, timeout)?;
        if config.gradient_checkpointing {
            device = device.gradient_checkpointing();
        }
        if let Some(seed) = config.seed {
            device.seed(seed);
        }
        let wanted = match config.mixed_precision {
            MixedPrecision::No => DType::F32,
            MixedPrecision::Bf16 => DType::BF16,
            MixedPrecision::Fp16 => DType::F16,
        };
        let compute_dtype = if B::float_dtypes(&device).contains(&wanted) {
            wanted
        } else if self.strict_precision {
            return Err(AccelerateError::PrecisionUnsupported {
                backend: B::NAME,
                dtype: format!("{wanted:?}"),
            });
        } else {
            if state.is_main_process() {
                tracing::warn!(
                    backend = B::NAME,
                    "the {} backend cannot compute in {wanted:?} on this device; training in \
                     f32 (ask for strict mixed precision to make this an error)",
                    B::NAME
                );
            }
            DType::F32
        };
        let scaler = if compute_dtype == DType::F16 {
            Some(DynamicLossScaler::new(self.scaler)?)
        } else {
            None
        };
        tracing::debug!(backend = B::NAME, %state, ?config, "accelerator ready");
        let clock = LoopClock::new(config.seed, rank);
        let comm = Comm::new(group).with_device_collectives(device_collectives);
        // Shards cut within groups of the job: only where something is sharded.
        let hybrid = if config.zero_stage >= 1 {
            Hybrid::form(&comm, config.shard_group_size)?
        } else {
            None
        };
        Ok(Accelerator {
            slots: ModelSlots::new(clock.clone(), config.gradient_accumulation_steps, scaler),
            clock,
            links: LoaderLinks::default(),
            compute_dtype,
            shards: Arc::new(ShardGroup::new(
                comm.clone(),
                hybrid.as_ref(),
                config.overlap_communication,
            )),
            hybrid,
            local_comm: crate::reducer::sharded::ShardedReducer::local_comm(),
            // Not under Burn's fusion on a GPU: a tap reads its gradient in the middle of
            // backward, which ends fused kernels elsewhere than after backward, and the
            // results would move with overlap (3.7e-4 after 8 fp16 updates on lavapipe).
            taps: Arc::new(TapHub::new(
                config.overlap_communication
                    && comm.is_distributed()
                    && B::SHARDED_UNITS
                    && !(B::DEVICE_KERNELS && config.fusion),
            )),
            comm,
            trigger: AtomicBool::new(false),
            background_save: Mutex::new(None),
            checkpoints: self.checkpoints,
            sync_buffers: self.sync_buffers,
            metrics,
            state,
            config,
            device,
            _backend: PhantomData,
        })
    }
}
