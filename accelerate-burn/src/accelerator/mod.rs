//! [`Accelerator`]: the facade a training loop talks to. Its methods are grouped by concern in
//! the files beside this one: [`builder`] (settings), `step` (backward, clipping, the loop's
//! counters), `collectives` (what a script calls across processes), `checkpoints` (save and
//! resume), `model_files` (the model's weights alone, whole or sharded), `prepare` (what
//! `prepare` accepts); preparing is here.

mod builder;
mod checkpoints;
mod collectives;
mod memory_check;
mod model_files;
mod overlap;
mod prepare;
mod sharded_weights;
mod sharding;
mod step;
mod tracking;

use std::fmt::Display;
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use accelerate_core::{AcceleratorConfig, ProcessState};
use burn::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::tensor::{DType, Device};

pub use builder::AcceleratorBuilder;
pub use prepare::{OptimizerSource, Prepare};

use crate::backend::AcceleratorBackend;
use crate::buffers::BufferSync;
use crate::data::{DataLoader, LoaderRole, PreparedDataLoader};
use crate::error::AccelerateError;
use crate::fused::FusedOptimizer;
use crate::group::Comm;
use crate::loader_link::LoaderLinks;
use crate::model_slot::{ModelSlots, Registered};
use crate::optim::Follows;
use crate::optim::{PreparedOptimizer, PreparedScheduler};
use crate::params::{self, ParamLayout};
use crate::reducer::{self, GradientReducer, OptimizerChoice, ReducerSpec};
use crate::sharded::ShardGroup;
use crate::stream::{PreparedStreamLoader, StreamLoader};
use crate::training_loop::LoopClock;

/// File name of the weights written by [`Accelerator::save_model`].
pub const MODEL_FILE: &str = crate::checkpoint::MODEL_FILE;

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
    compute_dtype: DType,
    /// The latest training batch and the random stream: ticked by the training loaders.
    clock: LoopClock,
    /// Each prepared model's windows and reducer, found by `backward` from the model.
    slots: ModelSlots,
    /// The prepared loaders' positions, for checkpoints and `gather_for_metrics`.
    pub(crate) links: LoaderLinks,
    /// The process group, shared with the reducer and prepared optimizer.
    comm: Comm,
    /// What the units sharded by [`shard`](Self::shard) share (ZeRO-3).
    shards: Arc<ShardGroup>,
    /// Hybrid sharding's groups (`shard_group_size` below the job, at ZeRO 1 to 3).
    hybrid: Option<crate::group::Hybrid>,
    /// What the units marked by [`unit`](Self::unit) share with `backward` (overlap).
    taps: Arc<crate::overlap::TapHub>,
    /// A group of one, for reducers given gradients the pipe already averaged.
    local_comm: Comm,
    trigger: AtomicBool,
    checkpoints: CheckpointSettings,
    /// The save being written in the background, if any (at most one).
    background_save: Mutex<Option<crate::checkpoint::BackgroundSave>>,
    /// The run's trackers.
    metrics: tracking::Metrics,
    /// Whether running states (BatchNorm statistics) are averaged at every update.
    sync_buffers: bool,
    _backend: PhantomData<B>,
}

/// Where automatically named checkpoints go, what may be resumed, and how models are written.
#[derive(Default, Clone)]
struct CheckpointSettings {
    project_dir: Option<PathBuf>,
    /// Automatically named checkpoints kept.
    total_limit: Option<usize>,
    /// Whether a checkpoint of another world size may be loaded.
    resume_any_world_size: bool,
    /// Where a background save keeps its snapshot.
    snapshot: crate::CheckpointSnapshot,
    /// The dtype `save_model` writes float parameters in (`None`: as the model holds them).
    export_dtype: Option<DType>,
}

impl<B: AcceleratorBackend> Accelerator<B> {
    /// An accelerator configured from the launcher environment, `ACCELERATE_*` variables and
    /// the config file (`accelerate-rs config`), in that order; with none of them, rank 0 of 1
    /// with default settings.
    pub fn from_env() -> Result<Self, AccelerateError> {
        Self::builder().build()
    }

    /// A builder, for settings made in code.
    pub fn builder() -> AcceleratorBuilder<B> {
        AcceleratorBuilder::default()
    }

    /// The autodiff device this process trains on: build the model and batches here.
    pub fn device(&self) -> Device {
        self.device.clone()
    }

    /// Name of the backend kind (`"flex"`, `"cuda"`, ...).
    pub fn backend_name(&self) -> &'static str {
        B::NAME
    }

    /// Whether gradients are averaged on the GPUs with NCCL (decided at build, the same on
    /// every process; see [`AcceleratorBuilder::nccl`](crate::AcceleratorBuilder::nccl)).
    pub fn uses_nccl(&self) -> bool {
        self.comm.device_collectives().is_some()
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

    /// How this process reaches the others: `single` (alone), `shm` (shared memory, one
    /// host), `tcp`, or `tcp+shm` (hosts with several processes each: shared memory inside a
    /// host, TCP between hosts).
    pub fn transport(&self) -> &'static str {
        self.comm.lock().transport()
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

    /// Prepares a model with its optimizer, and data loaders, in one call: `(model, optim)`,
    /// `(model, optim, train)` or `(model, optim, train, eval)`; or a data loader alone.
    pub fn prepare<T: Prepare<B>>(&self, items: T) -> Result<T::Prepared, AccelerateError> {
        items.prepare(self)
    }

    /// Places `model` on this process's device with its own autodiff graph, in the device's
    /// gradient-checkpointing strategy whatever device it was built on. With several
    /// processes, first checks that every process built the same model (float parameter
    /// shapes, in visit order; a mismatch is an error on every rank), then gives every process
    /// rank 0's parameter values and ids, so all start identical.
    pub fn prepare_model<M: Module>(&self, model: M) -> Result<M, AccelerateError> {
        let model = params::adopt_device(model, &self.device);
        if !self.state.is_distributed() {
            return Ok(model);
        }
        crate::replicate::from_rank0(model, &self.comm, |id| self.shards.is_shard(id))
    }

    /// Wraps Burn's optimizer for the prepared `model`: gradients are averaged in buckets and
    /// the optimizer steps once per accumulation window. (ZeRO needs a fused optimizer; with
    /// Burn's, `zero_stage(1)` is ignored with a warning, and `zero_stage(2)` is an error:
    /// Burn's optimizer updates whole parameters from whole gradients, and ZeRO-2 leaves each
    /// process only its shard of them.)
    pub fn prepare_optimizer<M: Module>(
        &self,
        model: &M,
        optim: ModuleOptimizer,
    ) -> Result<PreparedOptimizer, AccelerateError> {
        if self.config.zero_stage == 2 {
            return Err(AccelerateError::Misuse {
                rank: self.state.rank,
                what: format!(
                    "zero_stage {} with Burn's optimizer, which updates whole parameters from \
                     whole gradients",
                    self.config.zero_stage
                ),
                hint: "prepare a fused optimizer (FusedOptimizer::adamw(&config), not \
                       config.init()), or set zero_stage 1 or 0",
            });
        }
        if matches!(self.config.zero_stage, 1 | 2) && self.is_main_process() {
            tracing::warn!(
                zero_stage = self.config.zero_stage,
                "zero_stage needs the fused update (prepare Burn's config, not config.init()); Burn's \
                 optimizer keeps all of its state on every process"
            );
        }
        let spec = self.reducer_spec(model)?;
        self.check_memory(&spec, None)?;
        let reducer = reducer::build(spec, OptimizerChoice::Burn(optim), &self.comm)?;
        self.install(reducer, self.buffer_sync(model))
    }

    /// Prepares a fused optimizer for the prepared `model`: its trainable parameters, their
    /// gradients and the optimizer state become flat f32 buffers, updated by one fused pass per
    /// step (see [`crate::fused`]); with `zero_stage(1)` and several processes the state is
    /// sharded, with `zero_stage(2)` the gradients and master parameters too.
    pub fn prepare_fused_optimizer<M: Module>(
        &self,
        model: &M,
        optimizer: FusedOptimizer,
    ) -> Result<PreparedOptimizer, AccelerateError> {
        let spec = self.reducer_spec(model)?;
        self.check_memory(&spec, Some(optimizer.buffer_names().len() as u64))?;
        let reducer = reducer::build(spec, OptimizerChoice::Fused(optimizer), &self.comm)?;
        self.install(reducer, self.buffer_sync(model))
    }

    /// The process group (for the self-test's checks).
    pub(crate) fn comm(&self) -> &Comm {
        &self.comm
    }

    /// What a reducer for `model` is built from: its parameters, and this process's settings.
    fn reducer_spec<M: Module>(&self, model: &M) -> Result<ReducerSpec, AccelerateError> {
        let layout = ParamLayout::of(model);
        if let Some(entry) = layout.unsupported_rank() {
            return Err(AccelerateError::Misuse {
                rank: self.state.rank,
                what: format!(
                    "parameter {} has {} dimensions; gradients of 1 to {} dimensions are \
                     supported",
                    entry.path,
                    entry.shape.len(),
                    params::MAX_RANK
                ),
                hint: "reshape the parameter inside the module's forward",
            });
        }
        let shards = self.shard_mask(&layout);
        self.check_sharding(&shards)?;
        Ok(ReducerSpec {
            shards,
            layout: std::sync::Arc::new(layout),
            values: params::values(model),
            config: self.config.clone(),
            rank: self.state.rank,
            world: self.state.world_size,
            device_kernels: B::DEVICE_KERNELS && cfg!(feature = "device-kernels"),
            hybrid: self.hybrid.clone(),
        })
    }

    /// Averages `model`'s running states (BatchNorm statistics) over the processes now and
    /// returns the model with them. Prepared optimizers do this at every update; call it for a
    /// model whose optimizer is your own (its gradients through
    /// [`Gradients::to_params`](crate::Gradients::to_params)), or to evaluate or save in the
    /// middle of an accumulation window. Every process must call it at the same point. The
    /// model as it is on one process, with [`sync_buffers(false)`](crate::AcceleratorBuilder::sync_buffers),
    /// or when it has no running states.
    pub fn sync_buffers<M: Module>(&self, model: M) -> Result<M, AccelerateError> {
        match self.buffer_sync(&model) {
            Some(buffers) => buffers.average(model, &self.comm),
            None => Ok(model),
        }
    }

    /// The running states of `model` (BatchNorm statistics) to average at every update; none
    /// on one process, with [`sync_buffers(false)`](crate::AcceleratorBuilder::sync_buffers),
    /// or off an autodiff device (where running states cannot be told from frozen
    /// parameters).
    fn buffer_sync<M: Module>(&self, model: &M) -> Option<BufferSync> {
        if !self.state.is_distributed() || !self.sync_buffers || !self.device.is_autodiff() {
            return None;
        }
        BufferSync::of(model)
    }

    /// Makes `reducer` the one `backward` feeds for its model: in place of a reducer that
    /// `backward` made for the model without an optimizer (its windows go on), else in a new
    /// slot.
    fn install(
        &self,
        reducer: Box<dyn GradientReducer>,
        buffers: Option<BufferSync>,
    ) -> Result<PreparedOptimizer, AccelerateError> {
        let slot = match self.slots.register(reducer, true) {
            Ok(slot) => slot,
            Err(Registered { slot, reducer }) => {
                let mut state = slot.lock();
                if state.prepared {
                    return Err(AccelerateError::Misuse {
                        rank: self.state.rank,
                        what: "an optimizer was already prepared for this model".into(),
                        hint: "prepare each model with one optimizer (other models may have \
                               their own)",
                    });
                }
                state.install(reducer);
                drop(state);
                slot
            }
        };
        Ok(PreparedOptimizer::new(slot, self.comm.clone(), buffers))
    }

    /// Wraps a Burn learning-rate scheduler so that it advances once per optimizer update, not
    /// once per micro-batch (the updates of the first prepared optimizer; with several, see
    /// [`prepare_scheduler_for`](Self::prepare_scheduler_for)).
    pub fn prepare_scheduler(&self, scheduler: impl Into<ModuleLrScheduler>) -> PreparedScheduler {
        PreparedScheduler::new(scheduler.into(), Follows::First(self.slots.clone()))
    }

    /// Wraps a Burn learning-rate scheduler that advances once per update of `optimizer`.
    pub fn prepare_scheduler_for(
        &self,
        optimizer: &PreparedOptimizer,
        scheduler: impl Into<ModuleLrScheduler>,
    ) -> PreparedScheduler {
        PreparedScheduler::new(scheduler.into(), Follows::Model(optimizer.slot().clone()))
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
        PreparedDataLoader::new(
            loader,
            self.device(),
            role,
            (self.clock.clone(), self.links.clone()),
            (self.state.rank, self.state.world_size),
        )
    }

    /// Prepares a training stream loader: this process reads its shards on a background
    /// thread, batches arrive on [`device`](Self::device), and their positions drive the
    /// accumulation windows (see [`crate::stream`]).
    pub fn prepare_stream_loader<I, O>(
        &self,
        loader: StreamLoader<I, O>,
    ) -> Result<PreparedStreamLoader<I, O>, AccelerateError> {
        self.prepare_stream(loader, LoaderRole::Train)
    }

    /// Prepares an evaluation stream loader: batches arrive on the device and leave
    /// accumulation windows alone.
    pub fn prepare_eval_stream_loader<I, O>(
        &self,
        loader: StreamLoader<I, O>,
    ) -> Result<PreparedStreamLoader<I, O>, AccelerateError> {
        self.prepare_stream(loader, LoaderRole::Eval)
    }

    fn prepare_stream<I, O>(
        &self,
        loader: StreamLoader<I, O>,
        role: LoaderRole,
    ) -> Result<PreparedStreamLoader<I, O>, AccelerateError> {
        PreparedStreamLoader::new(
            loader,
            (self.device(), role),
            (self.clock.clone(), self.links.clone(), self.comm.clone()),
            self.slots.accumulation_steps(),
        )
    }

    /// The user's model as prepared. Prepared models are the user's own module type with no
    /// wrapper, so this returns `model` itself; it exists so that Accelerate code ports line
    /// by line, and so that a future wrapper cannot break callers.
    pub fn unwrap_model<M: Module>(&self, model: M) -> M {
        model
    }
}
