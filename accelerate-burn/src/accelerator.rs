//! [`Accelerator`]: the facade a training loop talks to.

use std::fmt::Display;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use accelerate_core::comm::{GroupOptions, ProcessGroup};
use accelerate_core::{AcceleratorConfig, ConfigOverrides, ProcessState};
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{DType, Device, Tensor};

use crate::backend::AcceleratorBackend;
use crate::data::{DataLoader, LoaderRole, PreparedDataLoader};
use crate::error::AccelerateError;
use crate::grads;
use crate::loop_state::SharedLoop;
use crate::optim::{PreparedOptimizer, PreparedScheduler};
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
    state: ProcessState,
    config: AcceleratorConfig,
    device: Device,
    pub(crate) shared: SharedLoop,
    pub(crate) group: Mutex<ProcessGroup>,
    pub(crate) trigger: AtomicBool,
    /// Nanoseconds spent averaging gradients across processes.
    communication_ns: AtomicU64,
    _backend: PhantomData<B>,
}

/// Builds an [`Accelerator`]; values set here win over `ACCELERATE_*` variables.
pub struct AcceleratorBuilder<B: AcceleratorBackend> {
    overrides: ConfigOverrides,
    state: Option<ProcessState>,
    group_options: Option<GroupOptions>,
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
        tracing::debug!(backend = B::NAME, %state, ?config, "accelerator ready");
        Ok(Accelerator {
            shared: SharedLoop::new(config.gradient_accumulation_steps, state.rank),
            group: Mutex::new(group),
            trigger: AtomicBool::new(false),
            communication_ns: AtomicU64::new(0),
            state,
            config,
            device,
            _backend: PhantomData,
        })
    }
}

impl<B: AcceleratorBackend> Accelerator<B> {
    /// An accelerator configured from the launcher environment and `ACCELERATE_*` variables;
    /// with neither, rank 0 of 1 with default settings.
    pub fn from_env() -> Result<Self, AccelerateError> {
        Self::builder().build()
    }

    /// A builder, for settings made in code.
    pub fn builder() -> AcceleratorBuilder<B> {
        AcceleratorBuilder {
            overrides: ConfigOverrides::default(),
            state: None,
            group_options: None,
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

    /// Wraps Burn's optimizer so that it steps once per accumulation window.
    pub fn prepare_optimizer(&self, optim: ModuleOptimizer) -> PreparedOptimizer {
        PreparedOptimizer::new(optim, self.shared.clone())
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
        if shared.accumulation.steps() == 1 {
            let mut grads = GradientsParams::from_grads(loss.backward(), model);
            self.average_if_distributed(&mut grads, model)?;
            return Ok(grads);
        }
        let loss = if step.window_len > 1 {
            loss.div_scalar(step.window_len as f64)
        } else {
            loss
        };
        let grads = GradientsParams::from_grads(loss.backward(), model);
        let summed = match shared.accumulated.take() {
            Some(mut sum) if !step.first => {
                grads::add_into(&mut sum, grads, model);
                sum
            }
            _ => grads,
        };
        if step.sync {
            let mut summed = summed;
            self.average_if_distributed(&mut summed, model)?;
            Ok(summed)
        } else {
            shared.accumulated = Some(summed);
            Ok(GradientsParams::new())
        }
    }

    /// With several processes, averages `grads` over them (bucketed all-reduce).
    fn average_if_distributed<M: Module>(
        &self,
        grads: &mut GradientsParams,
        model: &M,
    ) -> Result<(), AccelerateError> {
        if !self.state.is_distributed() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let result = crate::sync::average_gradients(
            grads,
            model,
            &mut self.group(),
            self.config.gradient_bucket_bytes,
        );
        let spent = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.communication_ns.fetch_add(spent, Ordering::Relaxed);
        result
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
