//! [`Accelerator`]: the facade a training loop talks to.

use std::fmt::Display;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use accelerate_core::comm::{GroupOptions, ProcessGroup};
use accelerate_core::{
    AcceleratorConfig, ConfigOverrides, DynamicLossScaler, MetricsLogger, MixedPrecision,
    ProcessState, ScaledStep, ScalerConfig, Tracker,
};
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{DType, Device, Tensor};

use crate::backend::AcceleratorBackend;
use crate::data::{DataLoader, LoaderRole, PreparedDataLoader};
use crate::error::AccelerateError;
use crate::fused::{FlatEngine, FusedOptimizer};
use crate::grads;
use crate::loop_state::SharedLoop;
use crate::optim::{PreparedOptimizer, PreparedScheduler};
use crate::precision::{Autocast, Caster, low_precision_view};
use crate::prepare::Prepare;

/// File name of the weights written by [`Accelerator::save_model`].
pub const MODEL_FILE: &str = "model.safetensors";

/// Runs one plain Burn training loop on the backend kind `B`, in this process's place in the
/// job: device placement, gradient accumulation and global gradient clipping.
///
/// ```
/// use accelerate_burn::{Accelerator, DefaultBackend};
///
/// let acc = Accelerator::<DefaultBackend>::from_env()?;
/// assert!(acc.is_main_process());
/// assert_eq!(acc.num_processes(), 1);
/// # Ok::<(), accelerate_burn::AccelerateError>(())
/// ```
pub struct Accelerator<B: AcceleratorBackend> {
    pub(crate) state: ProcessState,
    pub(crate) config: AcceleratorConfig,
    pub(crate) device: Device,
    pub(crate) shared: SharedLoop,
    compute_dtype: DType,
    /// Shared with prepared fused optimizers, whose ZeRO step gathers parameters.
    pub(crate) group: Arc<Mutex<ProcessGroup>>,
    pub(crate) trigger: AtomicBool,
    /// Nanoseconds spent averaging gradients across processes.
    communication_ns: AtomicU64,
    /// Where automatically named checkpoints go.
    pub(crate) project_dir: Option<PathBuf>,
    /// Automatically named checkpoints kept.
    pub(crate) checkpoint_total_limit: Option<usize>,
    /// Whether a checkpoint of another world size may be loaded.
    pub(crate) resume_any_world_size: bool,
    /// Trackers of [`log`](Accelerator::log), opened at the first call (main process).
    trackers: Vec<Tracker>,
    metrics: Mutex<Option<MetricsLogger>>,
    _backend: PhantomData<B>,
}

/// Builds an [`Accelerator`]; values set here win over `ACCELERATE_*` variables and the
/// config file.
pub struct AcceleratorBuilder<B: AcceleratorBackend> {
    overrides: ConfigOverrides,
    state: Option<ProcessState>,
    group_options: Option<GroupOptions>,
    strict_precision: bool,
    scaler: ScalerConfig,
    project_dir: Option<PathBuf>,
    checkpoint_total_limit: Option<usize>,
    resume_any_world_size: bool,
    trackers: Vec<Tracker>,
    _backend: PhantomData<B>,
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
    /// accumulate in f32); wins over `ACCELERATE_GRADIENT_COMMUNICATION`. Off by default.
    pub fn gradient_communication(mut self, precision: MixedPrecision) -> Self {
        self.overrides.gradient_communication = Some(precision);
        self
    }

    /// ZeRO stage of a fused optimizer: 1 shards the optimizer state across the processes
    /// (each updates its 1/N of the parameters); 0 (default) keeps all of it everywhere. Wins
    /// over `ACCELERATE_ZERO_STAGE`.
    pub fn zero_stage(mut self, stage: u8) -> Self {
        self.overrides.zero_stage = Some(stage);
        self
    }

    /// Fails to build when the device cannot compute in the requested precision, instead of
    /// warning once and training in f32.
    pub fn strict_mixed_precision(mut self, strict: bool) -> Self {
        self.strict_precision = strict;
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
        self.project_dir = Some(dir.into());
        self
    }

    /// Keeps at most `limit` automatically named checkpoints, removing the oldest.
    pub fn checkpoint_total_limit(mut self, limit: usize) -> Self {
        self.checkpoint_total_limit = Some(limit.max(1));
        self
    }

    /// Allows loading a checkpoint saved by another number of processes: the training loader
    /// then continues the saved epoch's order from the global position the saved run reached
    /// (batch composition differs from an uninterrupted run, the samples do not).
    pub fn resume_with_different_world_size(mut self, allow: bool) -> Self {
        self.resume_any_world_size = allow;
        self
    }

    /// Where [`log`](Accelerator::log) writes metrics: a CSV file and/or TensorBoard event
    /// files in `<project_dir>/logs` (needs [`project_dir`](Self::project_dir)).
    pub fn log_with(mut self, trackers: &[Tracker]) -> Self {
        self.trackers = trackers.to_vec();
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
        if !self.trackers.is_empty() && self.project_dir.is_none() {
            return Err(AccelerateError::Tracking {
                rank: state.rank,
                reason: "log_with needs a directory for the logs. hint: also call \
                         .project_dir(path); metrics go to <path>/logs"
                    .into(),
            });
        }
        let config = self.overrides.resolve()?;
        let group = if state.is_distributed() {
            let options = match self.group_options {
                Some(options) => options,
                None => GroupOptions::from_env()?,
            };
            ProcessGroup::new(&state, &options)?
        } else {
            ProcessGroup::single()
        };
        let device = B::device(state.local_rank)?.autodiff();
        if let Some(seed) = config.seed {
            device.seed(seed);
        }
        let compute_dtype = match config.mixed_precision {
            MixedPrecision::No => DType::F32,
            MixedPrecision::Bf16 => DType::BF16,
            MixedPrecision::Fp16 => DType::F16,
        };
        let compute_dtype = if B::float_dtypes(&device).contains(&compute_dtype) {
            compute_dtype
        } else if self.strict_precision {
            return Err(AccelerateError::PrecisionUnsupported {
                backend: B::NAME,
                dtype: format!("{compute_dtype:?}"),
            });
        } else {
            if state.is_main_process() {
                eprintln!(
                    "warning: the {} backend cannot compute in {compute_dtype:?} on this device; \
                     training in f32 (ask for strict mixed precision to make this an error)",
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
        let shared = SharedLoop::new(config.gradient_accumulation_steps, state.rank);
        shared.lock().scaler = scaler;
        Ok(Accelerator {
            shared,
            compute_dtype,
            group: Arc::new(Mutex::new(group)),
            trigger: AtomicBool::new(false),
            communication_ns: AtomicU64::new(0),
            project_dir: self.project_dir,
            checkpoint_total_limit: self.checkpoint_total_limit,
            resume_any_world_size: self.resume_any_world_size,
            trackers: self.trackers,
            metrics: Mutex::new(None),
            state,
            config,
            device,
            _backend: PhantomData,
        })
    }
}

impl<B: AcceleratorBackend> Accelerator<B> {
    /// An accelerator configured from the launcher environment, `ACCELERATE_*` variables and
    /// the config file (`accelerate config`), in that order; with none of them, rank 0 of 1
    /// with default settings.
    pub fn from_env() -> Result<Self, AccelerateError> {
        Self::builder().build()
    }

    /// A builder, for settings made in code.
    pub fn builder() -> AcceleratorBuilder<B> {
        AcceleratorBuilder {
            overrides: ConfigOverrides::default(),
            state: None,
            group_options: None,
            strict_precision: false,
            scaler: ScalerConfig::default(),
            project_dir: None,
            checkpoint_total_limit: None,
            resume_any_world_size: false,
            trackers: Vec::new(),
            _backend: PhantomData,
        }
    }

    /// The autodiff device this process trains on: build the model and batches here.
    pub fn device(&self) -> Device {
        self.device.clone()
    }

    /// Name of the backend kind (`"flex"`, `"cuda"`, ...).
    pub fn backend_name(&self) -> &'static str {
        B::NAME
    }

    /// The floating-point dtypes this process's device computes in.
    pub fn float_dtypes(&self) -> Vec<DType> {
        B::float_dtypes(&self.device)
    }

    /// This process's place in the job.
    pub fn state(&self) -> &ProcessState {
        &self.state
    }

    /// The resolved configuration.
    pub fn config(&self) -> &AcceleratorConfig {
        &self.config
    }

    /// Global rank of this process.
    pub fn process_index(&self) -> usize {
        self.state.rank
    }

    /// Rank of this process on its node.
    pub fn local_process_index(&self) -> usize {
        self.state.local_rank
    }

    /// Number of processes in the job.
    pub fn num_processes(&self) -> usize {
        self.state.world_size
    }

    /// True on global rank 0: the process that logs, prints and saves.
    pub fn is_main_process(&self) -> bool {
        self.state.is_main_process()
    }

    /// True on the first process of each node.
    pub fn is_local_main_process(&self) -> bool {
        self.state.is_local_main_process()
    }

    /// Prints `message` on the main process only.
    pub fn print(&self, message: impl Display) {
        if self.is_main_process() {
            println!("{message}");
        }
    }

    /// Seeds the device's random generator (parameter initialisation, dropout). Data order has
    /// its own seed, given to [`DataLoader`]'s builder.
    pub fn set_seed(&self, seed: u64) {
        self.device.seed(seed);
    }

    /// Prepares a model, optimizer, data loader, or a tuple of them, in one call:
    /// `(model, optim)`, `(model, optim, train)` or `(model, optim, train, eval)`.
    pub fn prepare<T: Prepare<B>>(&self, items: T) -> Result<T::Prepared, AccelerateError> {
        items.prepare(self)
    }

    /// Places `model` on this process's device with its own autodiff graph. With several
    /// processes, first checks that every process built the same model (float parameter
    /// shapes, in visit order; a mismatch is an error on every rank), then gives every process
    /// rank 0's parameter values and ids, so all start identical.
    pub fn prepare_model<M: Module>(&self, model: M) -> Result<M, AccelerateError> {
        let model = model.fork(&self.device);
        if !self.state.is_distributed() {
            return Ok(model);
        }
        crate::sync::broadcast_parameters(model, &mut self.group())
    }

    /// The process group, locked (a panic elsewhere cannot leave it half-updated: a failed
    /// collective poisons the group itself).
    pub(crate) fn group(&self) -> MutexGuard<'_, ProcessGroup> {
        self.group.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wraps Burn's optimizer so that it steps once per accumulation window. (ZeRO needs a
    /// fused optimizer; with Burn's, `zero_stage` is ignored with a warning.)
    pub fn prepare_optimizer(&self, optim: ModuleOptimizer) -> PreparedOptimizer {
        if self.config.zero_stage > 0 && self.is_main_process() {
            eprintln!(
                "warning: zero_stage {} needs a fused optimizer (FusedOptimizer::adamw(...)); \
                 Burn's optimizer keeps all of its state on every process",
                self.config.zero_stage
            );
        }
        PreparedOptimizer::new(optim, self.shared.clone())
    }

    /// Prepares a fused optimizer: the model's trainable parameters, their gradients and the
    /// optimizer state become flat f32 buffers, updated by one fused pass per step (see
    /// [`crate::fused`]); with `zero_stage(1)` and several processes the state is sharded.
    pub fn prepare_fused_optimizer(
        &self,
        optimizer: FusedOptimizer,
    ) -> Result<PreparedOptimizer, AccelerateError> {
        if self.config.gradient_communication != MixedPrecision::No {
            return Err(AccelerateError::FusedOptimizer {
                reason: "compressed gradient communication is not fused yet. hint: leave \
                         gradient_communication at `no` with a fused optimizer"
                    .into(),
            });
        }
        self.shared.lock().flat = Some(FlatEngine::new(optimizer, self.config.zero_stage));
        Ok(PreparedOptimizer::fused(
            self.shared.clone(),
            Arc::clone(&self.group),
        ))
    }

    /// Wraps a Burn learning-rate scheduler so that it advances once per optimizer update, not
    /// once per micro-batch.
    pub fn prepare_scheduler(&self, scheduler: impl Into<ModuleLrScheduler>) -> PreparedScheduler {
        PreparedScheduler::new(scheduler.into(), self.shared.clone())
    }

    /// Prepares a training loader: batches arrive on [`device`](Self::device), this process
    /// gets its share of every round, and batch positions drive the accumulation windows.
    pub fn prepare_data_loader<I, O>(
        &self,
        loader: DataLoader<I, O>,
    ) -> Result<PreparedDataLoader<I, O>, AccelerateError> {
        self.prepare_loader(loader, LoaderRole::Train)
    }

    /// Prepares an evaluation loader: batches arrive on the device and leave accumulation
    /// windows alone.
    pub fn prepare_eval_data_loader<I, O>(
        &self,
        loader: DataLoader<I, O>,
    ) -> Result<PreparedDataLoader<I, O>, AccelerateError> {
        self.prepare_loader(loader, LoaderRole::Eval)
    }

    fn prepare_loader<I, O>(
        &self,
        loader: DataLoader<I, O>,
        role: LoaderRole,
    ) -> Result<PreparedDataLoader<I, O>, AccelerateError> {
        let rank_and_world = (self.state.rank, self.state.world_size);
        PreparedDataLoader::new(
            loader,
            self.device(),
            role,
            self.shared.clone(),
            rank_and_world,
        )
    }

    /// Runs the backward pass of `loss` and returns the gradients to step with.
    ///
    /// With gradient accumulation the loss is divided by the real length of its window (a
    /// short last window of an epoch is weighted by its size), gradients are summed on the
    /// device, and only the micro-batch that completes the window returns them; the others
    /// return an empty set, with which the prepared optimizer does not step. With several
    /// processes the returned gradients are averaged over them (in buckets of
    /// `gradient_bucket_bytes`, in module visit order); micro-batches that complete no window
    /// communicate nothing.
    pub fn backward<M: Module>(
        &self,
        loss: Tensor<1>,
        model: &M,
    ) -> Result<GradientsParams, AccelerateError> {
        let mut shared = self.shared.lock();
        let step = shared.accumulation.micro_step();
        let mut loss = loss;
        if loss.dtype() != DType::F32 {
            loss = loss.cast(DType::F32);
        }
        if step.window_len > 1 {
            loss = loss.div_scalar(step.window_len as f64);
        }
        if let Some(scaler) = &shared.scaler {
            loss = loss.mul_scalar(scaler.scale());
        }
        let grads = GradientsParams::from_grads(loss.backward(), model);
        let mut summed = match shared.accumulated.take() {
            Some(mut sum) if !step.first => {
                grads::add_into(&mut sum, grads, model);
                sum
            }
            _ => grads,
        };
        if !step.sync {
            shared.accumulated = Some(summed);
            return Ok(GradientsParams::new());
        }
        // The window is complete: the next one draws from a stream fixed by the window count,
        // so that a resumed run draws what an uninterrupted one would.
        shared.windows += 1;
        if let Some(seed) = self.config.seed {
            self.device.seed(crate::checkpoint::window_seed(
                seed,
                self.state.rank,
                shared.windows,
            ));
        }
        if shared.flat.is_some() {
            return self.backward_flat(&mut shared, summed, model);
        }
        let inv_scale = shared.scaler.as_ref().map(DynamicLossScaler::inv_scale);
        let host_overflow = self.average_if_distributed(&mut summed, model, inv_scale)?;
        shared.step_skipped = false;
        if let (Some(scaler), Some(inv_scale)) = (shared.scaler.as_mut(), inv_scale) {
            // Several processes: the gradients were unscaled and checked in the averaging pass
            // (one fused kernel over each bucket). One process: on the device, with our cubecl
            // kernel where the backend has one, else with Burn's operations.
            let overflow = match host_overflow {
                Some(overflow) => overflow,
                #[cfg(feature = "device-kernels")]
                None if B::DEVICE_KERNELS => {
                    grads::unscale_and_check_on_device(&mut summed, inv_scale, model)
                }
                None => {
                    grads::scale(&mut summed, inv_scale, model);
                    grads::global_norm(&summed, model).is_some_and(|n| !n.is_finite())
                }
            };
            // Averaged gradients hold an overflow of any rank (sums keep inf and NaN), so
            // every rank makes the same decision here without another collective.
            if scaler.update(overflow) == ScaledStep::Skip {
                shared.accumulation.skip_update();
                shared.step_skipped = true;
                return Ok(GradientsParams::new());
            }
        }
        Ok(summed)
    }

    /// The end of a completed window with a fused optimizer: the gradients go into the flat
    /// buffer, are averaged (or reduce-scattered) and unscaled there, and the step reads them
    /// from there; the returned set is empty.
    fn backward_flat<M: Module>(
        &self,
        shared: &mut crate::loop_state::LoopState,
        mut summed: GradientsParams,
        model: &M,
    ) -> Result<GradientsParams, AccelerateError> {
        let (rank, world) = (self.state.rank, self.state.world_size);
        let inv_scale = shared.scaler.as_ref().map(DynamicLossScaler::inv_scale);
        let Some(engine) = shared.flat.as_mut() else {
            return Ok(summed);
        };
        let sharded = engine.zero_stage >= 1 && world > 1;
        let device_kernels = B::DEVICE_KERNELS && cfg!(feature = "device-kernels");
        let layout = engine.ensure_layout(model, rank, world, device_kernels)?;
        layout.gather_grads(&mut summed, model, rank)?;
        drop(summed);
        let overflow = if self.state.is_distributed() {
            self.timed_communication(|| {
                layout.average(Some(&mut self.group()), sharded, inv_scale)
            })?
        } else {
            layout.average(None, false, inv_scale)?
        };
        layout.clip_factor = 1.0;
        layout.grads_ready = true;
        shared.step_skipped = false;
        if let Some(scaler) = shared.scaler.as_mut()
            && scaler.update(overflow) == ScaledStep::Skip
        {
            if let Some(layout) = shared.flat.as_mut().and_then(|e| e.layout.as_mut()) {
                layout.grads_ready = false;
            }
            shared.accumulation.skip_update();
            shared.step_skipped = true;
        }
        Ok(GradientsParams::new())
    }

    /// With several processes, averages `grads` over them (bucketed all-reduce) and, given
    /// `inv_scale`, unscales them in the same pass and says whether any is not finite.
    fn average_if_distributed<M: Module>(
        &self,
        grads: &mut GradientsParams,
        model: &M,
        inv_scale: Option<f32>,
    ) -> Result<Option<bool>, AccelerateError> {
        if !self.state.is_distributed() {
            return Ok(None);
        }
        let result = self.timed_communication(|| {
            crate::sync::average_gradients(
                grads,
                model,
                &mut self.group(),
                self.config.gradient_bucket_bytes,
                self.config.gradient_communication,
                inv_scale,
                B::DEVICE_KERNELS,
            )
        });
        result.map(|overflow| inv_scale.map(|_| overflow))
    }

    /// Runs `communicate` and adds its duration to [`communication_time`](Self::communication_time).
    fn timed_communication<R>(&self, communicate: impl FnOnce() -> R) -> R {
        let started = std::time::Instant::now();
        let result = communicate();
        let spent = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.communication_ns.fetch_add(spent, Ordering::Relaxed);
        result
    }

    /// Runs `forward` in the compute precision: on a view of `model` whose float parameters
    /// are cast (tracked by autodiff, so gradients reach the f32 master parameters as f32),
    /// with a [`Caster`] for the inputs; float tensors in the result come back as f32.
    /// Without mixed precision this is `forward(model, caster)` with an identity caster.
    ///
    /// ```text
    /// let loss = acc.autocast(&model, |m, c| m.forward_loss(c.input(batch.images), batch.targets));
    /// ```
    pub fn autocast<M: Module, R: Autocast>(
        &self,
        model: &M,
        forward: impl FnOnce(&M, &Caster) -> R,
    ) -> R {
        let caster = Caster::new(self.compute_dtype);
        if self.compute_dtype == DType::F32 {
            return forward(model, &caster);
        }
        let view = low_precision_view(model, self.compute_dtype);
        forward(&view, &caster).autocast(DType::F32)
    }

    /// The dtype forward passes compute in under [`autocast`](Self::autocast).
    pub fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }

    /// True when the latest completed window's optimizer step was skipped because a gradient
    /// overflowed (fp16 only); the optimizer and scheduler did not move.
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.shared.lock().step_skipped
    }

    /// The current fp16 loss scale (`None` without fp16).
    pub fn loss_scale(&self) -> Option<f32> {
        self.shared
            .lock()
            .scaler
            .as_ref()
            .map(DynamicLossScaler::scale)
    }

    /// Time spent so far averaging gradients across processes (zero with one process), to
    /// tell how much of a step is communication.
    pub fn communication_time(&self) -> std::time::Duration {
        std::time::Duration::from_nanos(self.communication_ns.load(Ordering::Relaxed))
    }

    /// True when the latest backward pass completed an accumulation window, so the optimizer
    /// steps now (always true without accumulation).
    pub fn sync_gradients(&self) -> bool {
        self.shared.lock().accumulation.sync_gradients()
    }

    /// Optimizer updates applied so far.
    pub fn updates(&self) -> u64 {
        self.shared.lock().accumulation.updates()
    }

    /// Clips `grads` so that their global L2 norm, over every parameter of `model` together,
    /// is at most `max_norm`, and returns the norm before clipping. (Burn's own clipping acts
    /// on each tensor separately.) Returns `None` on micro-batches that complete no window,
    /// whose gradient set is empty.
    pub fn clip_grad_norm<M: Module>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
        max_norm: f32,
    ) -> Result<Option<f32>, AccelerateError> {
        if let Some(engine) = self.shared.lock().flat.as_mut() {
            // Fused: the norm of the flat gradients; the step applies the factor.
            let Some(layout) = engine.layout.as_mut().filter(|l| l.grads_ready) else {
                return Ok(None);
            };
            // Measured over every rank's gradients when they were averaged.
            let norm = layout.norm();
            let factor = accelerate_kernels::clip_coefficient(norm, max_norm);
            if factor < 1.0 || factor.is_nan() {
                layout.clip_factor = factor;
            }
            return Ok(Some(norm));
        }
        let Some(norm) = grads::global_norm(grads, model) else {
            return Ok(None);
        };
        let factor = accelerate_kernels::clip_coefficient(norm, max_norm);
        // A NaN factor is applied too, so a poisoned step stays visible.
        if factor < 1.0 || factor.is_nan() {
            grads::scale(grads, factor, model);
        }
        Ok(Some(norm))
    }

    /// Records `metrics` (name, value) at `step` in the trackers chosen with
    /// [`log_with`](AcceleratorBuilder::log_with), on the main process only (others return at
    /// once). Files are flushed at every call, so `tensorboard --logdir <project>/logs` shows
    /// the run as it trains.
    pub fn log(&self, metrics: &[(&str, f64)], step: u64) -> Result<(), AccelerateError> {
        if !self.is_main_process() || self.trackers.is_empty() {
            return Ok(());
        }
        let mut logger = self.metrics.lock().unwrap_or_else(PoisonError::into_inner);
        let failed = |reason: String| AccelerateError::Tracking {
            rank: self.state.rank,
            reason,
        };
        if logger.is_none() {
            let dir = self.project_dir.clone().unwrap_or_default().join("logs");
            *logger = Some(
                MetricsLogger::create(dir, &self.trackers).map_err(|e| failed(e.to_string()))?,
            );
        }
        match logger.as_mut() {
            Some(logger) => logger.log(metrics, step).map_err(|e| failed(e.to_string())),
            None => Ok(()),
        }
    }

    /// The user's model as prepared. Prepared models are the user's own module type with no
    /// wrapper, so this returns `model` itself; it exists so that Accelerate code ports line
    /// by line, and so that a future wrapper cannot break callers.
    pub fn unwrap_model<M: Module>(&self, model: M) -> M {
        model
    }

    /// Writes `model`'s parameters to `dir/model.safetensors` on the main process (other
    /// processes write nothing) and returns the file's path. The file is written to a
    /// temporary name and renamed, so a crash never leaves a truncated one; a plain Burn
    /// program loads it with `burn::store::SafetensorsStore` and `load_from`.
    pub fn save_model<M: Module>(
        &self,
        model: &M,
        dir: impl AsRef<Path>,
    ) -> Result<PathBuf, AccelerateError> {
        let dir = dir.as_ref();
        let path = dir.join(MODEL_FILE);
        if !self.is_main_process() {
            return Ok(path);
        }
        let failed = |reason: String| AccelerateError::Save {
            rank: self.state.rank,
            path: path.clone(),
            reason,
        };
        std::fs::create_dir_all(dir).map_err(|e| failed(format!("creating the directory: {e}")))?;
        let mut store = SafetensorsStore::from_file(&path).overwrite(true);
        model
            .save_into(&mut store)
            .map_err(|e| failed(e.to_string()))?;
        Ok(path)
    }
}
