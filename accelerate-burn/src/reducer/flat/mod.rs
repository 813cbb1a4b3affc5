//! [`FlatReducer`]: the reducer of fused optimizers. It builds the flat buffers at prepare,
//! gathers each completed window's gradients into them, averages and measures them (norm and
//! overflow in one read-only pass), and runs the fused update on the host (`host`) or the
//! device (`device`); `state_file` is its part of a checkpoint. (What the buffers are is
//! described in [`crate::fused`].)

use std::sync::Arc;

use accelerate_core::MixedPrecision;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::Tensor;

mod checkpointing;
mod columns;
mod cut;
#[cfg(feature = "device-kernels")]
mod device;
mod grads;
mod host;
mod in_place;
mod plan;
mod shard_sink;
mod state_file;

use columns::SegmentGrads;
use cut::Cut;
#[cfg(feature = "device-kernels")]
use device::DeviceFlat;
use grads::GradBuffer;
use host::HostFlat;
use in_place::StepRates;
pub(crate) use plan::FlatPlan;
use plan::Sharding;
use shard_sink::ShardSinkParts;
pub(crate) use shard_sink::{BucketGrad, ShardSink};
pub(crate) use state_file::FusedStateError;
pub(crate) use state_file::{FusedStateFile, Segment};

use crate::error::AccelerateError;
use crate::fused::{FusedOptimizer, HeldBytes};
use crate::group::{Comm, Hybrid};
use crate::params::{ParamLayout, ParamList};
use crate::reducer::api::{
    GradientReducer, HeldNorm, LoadSource, ModelUpdate, Outcome, Reduced, ReducerKind, SaveRole,
    SavedFile, SumOfSquares, unscaled_norm,
};
use crate::reducer::wire::Wire;
use crate::stage_error::StageError;

/// Prefix of the fused optimizer state files (`fused_optimizer_<rank>.bin`).
const FUSED_PREFIX: &str = "fused_optimizer_";

/// Where the flat buffers live, chosen once at prepare. The device variant exists only in
/// builds with our cubecl kernels, the only ones that can update buffers there.
pub(crate) enum Buffers {
    Host(Box<HostFlat>),
    #[cfg(feature = "device-kernels")]
    Device(Box<DeviceFlat>),
}

impl Buffers {
    /// The host buffers, if that is where they are.
    fn host_mut(&mut self) -> Option<&mut HostFlat> {
        match self {
            Self::Host(host) => Some(host),
            #[cfg(feature = "device-kernels")]
            Self::Device(_) => None,
        }
    }
}

/// The pending step's measure: set by `reduce`, consumed by `step`.
#[derive(Clone, Copy)]
struct Pending {
    /// The fp16 unscale factor (1 otherwise), applied in the update pass.
    unscale: f32,
}

/// Fused optimizer state over flat buffers, split across the processes as `sharding` says.
pub(crate) struct FlatReducer {
    layout: Arc<ParamLayout>,
    optimizer: FusedOptimizer,
    sharding: Sharding,
    plan: FlatPlan,
    buffers: Buffers,
    wire: Wire,
    pending: Option<Pending>,
    /// Build options, kept to rebuild the buffers after a checkpoint is loaded.
    options: FlatOptions,
}

/// How a [`FlatReducer`] is built.
#[derive(Clone)]
pub(crate) struct FlatOptions {
    pub zero_stage: u8,
    pub rank: usize,
    pub world: usize,
    /// A cubecl backend: without ZeRO the buffers live on the device (always false, and
    /// unread, in builds without our cubecl kernels).
    #[cfg_attr(not(feature = "device-kernels"), allow(dead_code))]
    pub device_kernels: bool,
    /// The precision gradients travel in.
    pub wire: MixedPrecision,
    /// The job averages gradients with NCCL on the GPUs: ZeRO-1 can stay on the device.
    pub device_collectives: bool,
    /// Hybrid sharding's groups: the buffers are cut across the shard group, and each shard's
    /// gradients averaged across the replicas too (on the host).
    pub hybrid: Option<Hybrid>,
}

impl FlatOptions {
    /// This process's rank among the processes the shards are cut across, and how many they
    /// are: the job's, or under hybrid sharding the shard group's.
    fn shard_job(&self) -> (usize, usize) {
        self.hybrid.as_ref().map_or((self.rank, self.world), |h| {
            (h.shard.rank(), h.shard.world_size())
        })
    }
}

impl FlatReducer {
    /// Flat buffers for the trainable parameters of `layout`, starting from `values` (the
    /// model's parameters, visit order).
    pub fn new(
        layout: Arc<ParamLayout>,
        values: Vec<Tensor<1>>,
        optimizer: FusedOptimizer,
        options: FlatOptions,
        comm: &Comm,
    ) -> Result<Self, AccelerateError> {
        // One process has nothing to shard, except where NCCL was required: the device ZeRO
        // path then runs as it would over N GPUs (that is how one GPU tests it).
        let sharding = Sharding::of(
            options.zero_stage,
            options.world,
            options.device_collectives,
        );
        let (shard_rank, shard_world) = options.shard_job();
        let plan = FlatPlan::new(&layout, sharding.splits(), shard_rank, shard_world);
        // All-reduced whole, the gradients go in the group's shared buffer (every rank
        // allocates it here, at prepare, in the same order). On transports without shared
        // memory that is an ordinary vector and the all-reduce the usual one.
        let padded = plan.padded;
        let grads = || {
            Ok(if comm.is_distributed() && sharding == Sharding::Whole {
                GradBuffer::Group(comm.lock().shared_buffer(padded)?)
            } else {
                Self::local_grads(sharding, padded, options.world)
            })
        };
        let buffers = Self::buffers(&plan, values, &optimizer, sharding, &options, grads)?;
        Ok(Self {
            layout,
            optimizer,
            sharding,
            plan,
            buffers,
            wire: Wire::new(options.wire),
            pending: None,
            options,
        })
    }

    /// A gradient buffer of this process's own: a flat vector where the gradients are
    /// all-reduced whole over several processes, else none (one process keeps its gradients
    /// as backward returned them, ZeRO reduce-scatters them from there).
    fn local_grads(sharding: Sharding, padded: usize, world: usize) -> GradBuffer {
        if world > 1 && sharding == Sharding::Whole {
            GradBuffer::Flat(vec![0.0; padded])
        } else {
            GradBuffer::Segments(SegmentGrads::none())
        }
    }

    fn buffers(
        plan: &FlatPlan,
        values: Vec<Tensor<1>>,
        optimizer: &FusedOptimizer,
        sharding: Sharding,
        options: &FlatOptions,
        grads: impl FnOnce() -> Result<GradBuffer, AccelerateError>,
    ) -> Result<Buffers, AccelerateError> {
        let trainable: Vec<Tensor<1>> = plan
            .entries
            .iter()
            .filter_map(|&i| values.get(i).cloned())
            .collect();
        if trainable.len() != plan.entries.len() {
            return Err(AccelerateError::ModelMismatch {
                rank: options.rank,
                detail: format!(
                    "the model has {} float parameters, its layout {}",
                    values.len(),
                    plan.entries.len()
                ),
            });
        }
        #[cfg(feature = "device-kernels")]
        {
            // The kernels index with 32 bits; larger buffers (ZeRO's padding included) stay
            // on the host path. ZeRO-1 shards stay on the device only where NCCL can scatter
            // and gather them there; ZeRO-2 runs on the host.
            let fits = plan.len > 0 && u32::try_from(plan.padded.max(plan.len)).is_ok();
            let placeable = match sharding {
                Sharding::Whole => true,
                Sharding::State => options.device_collectives,
                Sharding::Gradients => false,
            };
            if options.device_kernels && fits && placeable {
                return Ok(Buffers::Device(Box::new(DeviceFlat::new(
                    trainable,
                    optimizer.state_buffers(),
                    sharding.splits().then(|| (plan.shard.clone(), plan.padded)),
                ))));
            }
        }
        Ok(Buffers::Host(Box::new(HostFlat::new(
            plan,
            trainable,
            optimizer.state_buffers(),
            grads()?,
            sharding,
            !options.device_kernels,
        ))))
    }
}

impl GradientReducer for FlatReducer {
    fn kind(&self) -> ReducerKind {
        ReducerKind::Fused
    }

    fn layout(&self) -> &Arc<ParamLayout> {
        &self.layout
    }

    fn reduce(
        &mut self,
        mut grads: ParamList,
        comm: &Comm,
        inv_scale: Option<f32>,
    ) -> Result<Reduced, AccelerateError> {
        let sum_sq = match &mut self.buffers {
            // ZeRO-2: `accumulate` already averaged the window into the shard.
            Buffers::Host(host) if self.sharding == Sharding::Gradients => {
                let cut = Cut::new(comm, self.options.hybrid.as_ref());
                SumOfSquares::Measured(host.measure(&mut self.plan, cut)?)
            }
            Buffers::Host(host) => {
                self.plan.note_grads(&grads, true);
                // Taken first: the average also agrees on the plan's gradient mask.
                let taken: Vec<_> = self.plan.entries.iter().map(|&e| grads[e].take()).collect();
                let cut = Cut::new(comm, self.options.hybrid.as_ref());
                let sum_sq =
                    host.average(&mut self.plan, taken.into_iter(), &mut self.wire, cut)?;
                SumOfSquares::Measured(sum_sq)
            }
            #[cfg(feature = "device-kernels")]
            Buffers::Device(device) => {
                self.plan.note_grads(&grads, true);
                self.plan.agree_grads(Cut::new(comm, None), None)?;
                let taken = self.plan.entries.iter().map(|&e| grads[e].take());
                device.gather(&self.plan, taken, !comm.is_distributed());
                // fp16's overflow test needs the value now; otherwise it waits for clipping.
                device.average(&mut self.wire, comm, inv_scale.is_none())?
            }
        };
        let unscale = inv_scale.unwrap_or(1.0);
        self.pending = Some(Pending { unscale });
        let (norm, overflow) = match sum_sq {
            // The sum of squares over every rank's values is non-finite exactly when some
            // gradient is: the fp16 overflow test.
            SumOfSquares::Measured(sum_sq) => (
                HeldNorm::Known(unscaled_norm(sum_sq, unscale)),
                !sum_sq.is_finite(),
            ),
            // Deferred only without fp16's loss scaler, which alone reads the overflow test.
            SumOfSquares::Deferred(grads) => (HeldNorm::OnDevice { grads, unscale }, false),
        };
        Ok(Reduced {
            outcome: Outcome::Held {
                norm,
                clip_factor: 1.0,
            },
            overflow,
        })
    }

    fn takes_averaged(&self) -> bool {
        self.sharding == Sharding::Whole && matches!(self.buffers, Buffers::Host(_))
    }

    fn holds_window_sum(&self) -> bool {
        self.sharding == Sharding::Gradients && matches!(self.buffers, Buffers::Host(_))
    }

    fn accumulate(
        &mut self,
        mut grads: ParamList,
        first: bool,
        comm: &Comm,
    ) -> Result<(), AccelerateError> {
        // ZeRO-2's buffers are always on the host (`buffers`).
        let Some(host) = self.buffers.host_mut() else {
            return Err(AccelerateError::UnexpectedGradients { rank: comm.rank() });
        };
        self.plan.note_grads(&grads, first);
        let taken = self.plan.entries.iter().map(|&e| grads[e].take());
        let cut = Cut::new(comm, self.options.hybrid.as_ref());
        host.accumulate(&self.plan, taken, first, &mut self.wire, cut)
    }

    fn lend_shard(&mut self, first: bool, comm: &Comm) -> Option<ShardSink> {
        if !self.holds_window_sum() {
            return None;
        }
        let host = self.buffers.host_mut()?;
        let mut flat = vec![None; self.layout.entries.len()];
        for (segment, &entry) in self.plan.segments.iter().zip(&self.plan.entries) {
            if let Some(slot) = flat.get_mut(entry) {
                *slot = Some(segment.offset..segment.offset + segment.len);
            }
        }
        let cut = Cut::new(comm, self.options.hybrid.as_ref());
        Some(ShardSink::new(ShardSinkParts {
            flat,
            shard_len: self.plan.shard.len(),
            sum: host.take_shard_sum(&self.plan, first),
            first,
            shard: cut.shard.clone(),
            replicas: cut.replicas.cloned(),
            wire: std::mem::replace(&mut self.wire, Wire::new(self.options.wire)),
        }))
    }

    fn return_shard(&mut self, sink: ShardSink) {
        let (sum, had, wire, first) = sink.into_parts();
        self.wire = wire;
        for (index, &entry) in self.plan.entries.iter().enumerate() {
            let has = had.get(entry).copied().unwrap_or(false);
            self.plan.has_grad[index] = has || !first && self.plan.has_grad[index];
        }
        if let Some(host) = self.buffers.host_mut() {
            host.keep_shard_sum(sum);
        }
    }

    fn scale_held(&mut self, factor: f64) {
        if let (Sharding::Gradients, Some(host)) = (self.sharding, self.buffers.host_mut()) {
            host.scale_held(&self.plan, factor as f32);
        }
    }

    fn discard(&mut self) {
        self.pending = None;
        if let Some(host) = self.buffers.host_mut() {
            host.release_grads();
        }
    }

    fn step(
        &mut self,
        lr: ModuleLearningRate,
        outcome: Outcome,
        model: &mut dyn ModelUpdate,
        comm: &Comm,
    ) -> Result<(), AccelerateError> {
        let (Outcome::Held { clip_factor, .. }, Some(pending)) = (outcome, self.pending.take())
        else {
            return Err(AccelerateError::UnexpectedGradients { rank: comm.rank() });
        };
        // fp16 unscale and clipping in one factor, applied in the update pass.
        let grad_scale = pending.unscale * clip_factor;
        let values = match &mut self.buffers {
            Buffers::Host(host) => {
                let step = StepRates {
                    optimizer: &self.optimizer,
                    lr: &lr,
                    grad_scale,
                };
                let cut = Cut::new(comm, self.options.hybrid.as_ref());
                if host.in_place() {
                    return host.step_in_place(&mut self.plan, step, model, cut);
                }
                host.step(&mut self.plan, step);
                host.publish(&self.plan, cut)?
            }
            #[cfg(feature = "device-kernels")]
            Buffers::Device(device) => {
                device.step(&mut self.plan, &self.optimizer, &lr, grad_scale, comm)?;
                device.values(&self.plan)
            }
        };
        let mut list: ParamList = vec![None; self.layout.entries.len()];
        for (&entry, value) in self.plan.entries.iter().zip(values) {
            list[entry] = Some(value);
        }
        model.replace(list);
        Ok(())
    }

    fn save(&mut self, role: SaveRole) -> Result<Vec<SavedFile>, StageError> {
        // Every rank's shard with ZeRO (under hybrid sharding the first shard group's, named
        // by the rank in it), else the main process's (all hold the same state).
        let hybrid = self.options.hybrid.as_ref();
        let shards = self.sharding.splits() && role.distributed;
        if !(role.main || shards) || shards && hybrid.is_some_and(|h| !h.writes_shards()) {
            return Ok(Vec::new());
        }
        let rank = if shards {
            self.options.shard_job().0
        } else {
            role.rank
        };
        Ok(vec![SavedFile {
            name: format!("{FUSED_PREFIX}{rank}.bin"),
            contents: "fused optimizer state of one shard (JSON header, f32 data)",
            rank: Some(rank),
            data: self.state_file().to_bytes(),
        }])
    }

    fn load(&mut self, source: LoadSource<'_>) -> Result<(), StageError> {
        let mut files = Vec::new();
        for file in source.files {
            if !file.name.starts_with(FUSED_PREFIX) {
                continue;
            }
            let path = source.dir.join(&file.name);
            let bytes = std::fs::read(&path).map_err(|source| StageError::Io { path, source })?;
            files.push(FusedStateFile::from_bytes(&bytes).map_err(|source| {
                StageError::FusedStateFile {
                    file: file.name.clone(),
                    source,
                }
            })?);
        }
        self.rebuild(source)?;
        if files.is_empty() {
            return Ok(());
        }
        Ok(self.apply_state(files)?)
    }

    fn load_resharded(
        &mut self,
        source: LoadSource<'_>,
        state: &mut dyn FnMut(&[Segment]) -> Result<FusedStateFile, StageError>,
    ) -> Result<(), StageError> {
        self.rebuild(source)?;
        let file = state(&self.plan.segments)?;
        Ok(self.apply_state(vec![file])?)
    }

    fn state_on_device(&self) -> Option<bool> {
        match self.buffers {
            Buffers::Host(_) => Some(false),
            #[cfg(feature = "device-kernels")]
            Buffers::Device(_) => Some(true),
        }
    }

    fn held_bytes(&self) -> Option<HeldBytes> {
        Some(match &self.buffers {
            Buffers::Host(host) => host.held_bytes(),
            #[cfg(feature = "device-kernels")]
            Buffers::Device(device) => device.held_bytes(),
        })
    }
}
