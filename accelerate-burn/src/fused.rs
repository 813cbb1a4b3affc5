//! Fused optimizers over flat parameters, and ZeRO-1.
//!
//! With a [`FusedOptimizer`], the trainable float parameters of the model live, as the f32
//! master copy, in one flat host buffer in module visit order (frozen parameters are left
//! out), beside one flat gradient buffer and flat optimizer state. A completed accumulation
//! window copies the gradients into the flat buffer once (averaging them across processes
//! there); clipping only records a factor; the optimizer step is one fused pass of
//! `accelerate_kernels::optim` (gradient scale = fp16 unscale x clip factor, moments and
//! parameter in place, no allocation), and the model receives its new values in one upload per
//! parameter tensor.
//!
//! On wgpu and cuda (without ZeRO) the flat buffers live on the GPU instead: the gradients are
//! concatenated there, the update is our cubecl kernel, and the model's parameters become views
//! of the flat parameter buffer, so nothing crosses to the host but a 4-byte norm (and, with
//! several processes, the gradients the collectives average).
//!
//! ZeRO-1 (`AcceleratorBuilder::zero_stage(1)`): gradients are reduce-scattered instead of
//! all-reduced, each rank updates its 1/N of the flat parameters with its 1/N of the optimizer
//! state, and the updated parameters are all-gathered.

use std::collections::BTreeMap;

use accelerate_core::comm::{ProcessGroup, Reduction};
use accelerate_kernels::optim::{AdamHyper, SgdHyper, SgdMomentum, adam_step, sgd_step};
use accelerate_kernels::schedule::chunk_range;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{AdamConfig, AdamWConfig, GradientsParams, SgdConfig};
use burn::tensor::{DType, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::AccelerateError;

/// Which fused update, with Burn's hyperparameters. Build it from Burn's own configs with
/// [`adamw`](Self::adamw), [`adam`](Self::adam) or [`sgd`](Self::sgd) and give it to
/// `acc.prepare((model, fused, ...))` in place of `config.init()`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum FusedOptimizer {
    /// Adam (L2 weight decay) or AdamW (decoupled weight decay), with optional AMSGrad.
    Adam {
        /// The hyperparameters.
        hyper: AdamHyper,
        /// Keep the running maximum of the second moment.
        amsgrad: bool,
    },
    /// SGD with optional L2 weight decay and momentum.
    Sgd {
        /// L2 penalty.
        weight_decay: Option<f32>,
        /// `(momentum, dampening, nesterov)`.
        momentum: Option<(f32, f64, bool)>,
    },
}

fn config_error(what: &str, reason: String) -> AccelerateError {
    AccelerateError::FusedOptimizer {
        reason: format!("{what}: {reason}"),
    }
}

/// Reads a Burn config's fields through its serde form (Burn's config fields are private).
fn fields(config: &impl Serialize, what: &str) -> Result<serde_json::Value, AccelerateError> {
    serde_json::to_value(config).map_err(|e| config_error(what, e.to_string()))
}

fn number(v: &serde_json::Value, key: &str, what: &str) -> Result<f64, AccelerateError> {
    v.get(key)
        .and_then(serde_json::Value::as_f64)
        .ok_or_else(|| config_error(what, format!("no numeric field `{key}` in {v}")))
}

fn refuse_clipping(v: &serde_json::Value, key: &str, what: &str) -> Result<(), AccelerateError> {
    if v.get(key).is_some_and(|c| !c.is_null()) {
        return Err(config_error(
            what,
            "per-tensor gradient clipping is not fused. hint: clip over all parameters with \
             acc.clip_grad_norm(&model, &mut grads, max_norm), which the fused step applies"
                .into(),
        ));
    }
    Ok(())
}

impl FusedOptimizer {
    /// Burn's AdamW, fused (same formula and defaults).
    pub fn adamw(config: &AdamWConfig) -> Result<Self, AccelerateError> {
        let what = "AdamWConfig";
        let v = fields(config, what)?;
        refuse_clipping(&v, "grad_clipping", what)?;
        if v.get("cautious_weight_decay")
            .and_then(serde_json::Value::as_bool)
            == Some(true)
        {
            return Err(config_error(
                what,
                "cautious weight decay is not fused".into(),
            ));
        }
        Ok(Self::Adam {
            hyper: AdamHyper {
                beta_1: number(&v, "beta_1", what)? as f32,
                beta_2: number(&v, "beta_2", what)? as f32,
                epsilon: number(&v, "epsilon", what)? as f32,
                weight_decay: number(&v, "weight_decay", what)? as f32,
                decoupled: true,
            },
            amsgrad: v.get("amsgrad").and_then(serde_json::Value::as_bool) == Some(true),
        })
    }

    /// Burn's Adam, fused.
    pub fn adam(config: &AdamConfig) -> Result<Self, AccelerateError> {
        let what = "AdamConfig";
        let v = fields(config, what)?;
        refuse_clipping(&v, "grad_clipping", what)?;
        let weight_decay = match v.get("weight_decay") {
            Some(wd) if !wd.is_null() => number(wd, "penalty", what)? as f32,
            _ => 0.0,
        };
        Ok(Self::Adam {
            hyper: AdamHyper {
                beta_1: number(&v, "beta_1", what)? as f32,
                beta_2: number(&v, "beta_2", what)? as f32,
                epsilon: number(&v, "epsilon", what)? as f32,
                weight_decay,
                decoupled: false,
            },
            amsgrad: v.get("amsgrad").and_then(serde_json::Value::as_bool) == Some(true),
        })
    }

    /// Burn's SGD (with its weight decay and momentum), fused.
    pub fn sgd(config: &SgdConfig) -> Result<Self, AccelerateError> {
        let what = "SgdConfig";
        let v = fields(config, what)?;
        refuse_clipping(&v, "gradient_clipping", what)?;
        let weight_decay = match v.get("weight_decay") {
            Some(wd) if !wd.is_null() => Some(number(wd, "penalty", what)? as f32),
            _ => None,
        };
        let momentum = match v.get("momentum") {
            Some(m) if !m.is_null() => Some((
                number(m, "momentum", what)? as f32,
                number(m, "dampening", what)?,
                m.get("nesterov").and_then(serde_json::Value::as_bool) == Some(true),
            )),
            _ => None,
        };
        Ok(Self::Sgd {
            weight_decay,
            momentum,
        })
    }

    /// The kernels' SGD settings (`None` for Adam).
    pub(crate) fn sgd_hyper(&self) -> Option<SgdHyper> {
        match self {
            Self::Sgd {
                weight_decay,
                momentum,
            } => Some(SgdHyper {
                weight_decay: *weight_decay,
                momentum: momentum.map(|(momentum, dampening, nesterov)| SgdMomentum {
                    momentum,
                    dampening,
                    nesterov,
                }),
            }),
            Self::Adam { .. } => None,
        }
    }

    /// Flat state buffers per parameter element (moments, velocity).
    pub(crate) fn state_buffers(&self) -> usize {
        match self {
            Self::Adam { amsgrad, .. } => 2 + usize::from(*amsgrad),
            Self::Sgd { momentum, .. } => usize::from(momentum.is_some()),
        }
    }
}

/// One trainable float parameter's place in the flat buffers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Segment {
    pub id: u64,
    /// Module path, for per-group learning rates.
    pub path: String,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub len: usize,
}

/// The flat master parameters, gradients and optimizer state of one process.
pub(crate) struct FlatEngine {
    pub optimizer: FusedOptimizer,
    /// 0: every process keeps all of the state; 1: ZeRO-1.
    pub zero_stage: u8,
    pub layout: Option<Layout>,
    /// State loaded from a checkpoint (every saving rank's file), applied when the buffers
    /// are next built.
    pub pending: Option<Vec<FusedStateFile>>,
}

/// Buffers sized for one model.
pub(crate) struct Layout {
    pub segments: Vec<Segment>,
    /// Trainable elements.
    pub len: usize,
    /// `len` rounded up to a multiple of the world size, so every shard is equal.
    pub padded: usize,
    /// This rank's shard of the padded range (everything without ZeRO).
    pub shard: std::ops::Range<usize>,
    /// Master parameters, all of them (padded).
    pub params: Vec<f32>,
    /// Gradients, all of them (padded), as copied from the device.
    pub grads: Vec<f32>,
    /// This rank's averaged gradients (the whole range without ZeRO).
    pub shard_grads: Vec<f32>,
    /// Optimizer state over the shard: `state_buffers()` vectors.
    pub state: Vec<Vec<f32>>,
    /// Updates applied to each segment (Burn counts per parameter).
    pub times: Vec<i32>,
    /// Which segments got a gradient in the window being applied.
    pub has_grad: Vec<bool>,
    /// True between a completed window's backward and its optimizer step.
    pub grads_ready: bool,
    /// Clip factor recorded by `clip_grad_norm` for the pending step.
    pub clip_factor: f32,
    /// The fp16 unscale factor of the pending step (1 otherwise), applied in the update.
    pub unscale: f32,
    /// Global L2 norm of the pending step's unscaled gradients.
    pub norm: f32,
    /// The buffers on the GPU, when the update runs there (wgpu, cuda without ZeRO); the host
    /// vectors above then stay empty, except the state, copied down for checkpoints.
    pub device: Option<DeviceFlat>,
}

/// The flat buffers of a [`Layout`] on a cubecl device, as Burn tensors of shape `[len]`.
pub(crate) struct DeviceFlat {
    /// Master parameters (a new buffer after every update; the model views it).
    pub params: Tensor<1>,
    /// The gathered (and averaged) gradients of the pending step.
    pub grads: Option<Tensor<1>>,
    /// Optimizer state, as `Layout::state`.
    pub state: Vec<Tensor<1>>,
}

/// Copies a tensor's values into `target` as f32 (a plain copy when they already are).
fn copy_f32(data: TensorData, target: &mut [f32]) {
    match data.as_slice::<f32>() {
        Ok(values) => target.copy_from_slice(values),
        Err(_) => {
            let data = data.convert::<f32>();
            for (t, v) in target.iter_mut().zip(data.iter::<f32>()) {
                *t = v;
            }
        }
    }
}

/// Per-parameter view of the model: visit order, trainable float parameters only.
struct Collect {
    path: Vec<String>,
    segments: Vec<Segment>,
    values: Vec<f32>,
    device: Option<burn::tensor::Device>,
}

impl ModuleVisitor for Collect {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let value = param.val();
        if !value.is_require_grad() {
            return;
        }
        let shape = value.dims().to_vec();
        let len: usize = shape.iter().product();
        let offset = self.values.len();
        self.device.get_or_insert_with(|| value.device());
        self.values.resize(offset + len, 0.0);
        copy_f32(value.into_data(), &mut self.values[offset..]);
        self.segments.push(Segment {
            id: param.id.val(),
            path: self.path.join("."),
            shape,
            offset,
            len,
        });
    }
}

impl FlatEngine {
    pub fn new(optimizer: FusedOptimizer, zero_stage: u8) -> Self {
        Self {
            optimizer,
            zero_stage,
            layout: None,
            pending: None,
        }
    }

    /// Builds the flat buffers from `model` (once; again after a checkpoint was loaded), and
    /// applies optimizer state loaded from a checkpoint.
    /// With `device_kernels` (a cubecl backend) and without ZeRO, the buffers live on the
    /// model's device and the update is our cubecl kernel.
    pub fn ensure_layout<M: Module>(
        &mut self,
        model: &M,
        rank: usize,
        world: usize,
        device_kernels: bool,
    ) -> Result<&mut Layout, AccelerateError> {
        if self.layout.is_none() {
            let device = self.build_layout(model, rank, world);
            if let Some(files) = self.pending.take() {
                self.apply_state(files, rank)?;
            }
            let sharded = self.zero_stage >= 1 && world > 1;
            if let (Some(layout), Some(device), true) =
                (self.layout.as_mut(), device, device_kernels && !sharded)
            {
                layout.move_to_device(&device);
            }
        }
        self.layout
            .as_mut()
            .ok_or_else(|| AccelerateError::FusedOptimizer {
                reason: "the flat buffers could not be built".into(),
            })
    }

    /// Builds the host buffers; returns the device of the trainable parameters.
    fn build_layout<M: Module>(
        &mut self,
        model: &M,
        rank: usize,
        world: usize,
    ) -> Option<burn::tensor::Device> {
        let mut collect = Collect {
            path: Vec::new(),
            segments: Vec::new(),
            values: Vec::new(),
            device: None,
        };
        model.visit(&mut collect);
        let len = collect.values.len();
        let sharded = self.zero_stage >= 1 && world > 1;
        let parts = if sharded { world } else { 1 };
        let padded = len.div_ceil(parts) * parts;
        let shard = if sharded {
            chunk_range(padded, world, rank)
        } else {
            0..padded
        };
        let mut params = collect.values;
        params.resize(padded, 0.0);
        let n = collect.segments.len();
        self.layout = Some(Layout {
            segments: collect.segments,
            len,
            padded,
            state: vec![vec![0.0; shard.len()]; self.optimizer.state_buffers()],
            shard_grads: vec![0.0; shard.len()],
            shard,
            params,
            grads: vec![0.0; padded],
            times: vec![0; n],
            has_grad: vec![false; n],
            grads_ready: false,
            clip_factor: 1.0,
            unscale: 1.0,
            norm: 0.0,
            device: None,
        });
        collect.device
    }

    /// Names of the state buffers, in order.
    fn buffer_names(&self) -> &'static [&'static str] {
        match &self.optimizer {
            FusedOptimizer::Adam { amsgrad: false, .. } => &["m", "v"],
            FusedOptimizer::Adam { amsgrad: true, .. } => &["m", "v", "max_v"],
            FusedOptimizer::Sgd { momentum: None, .. } => &[],
            FusedOptimizer::Sgd { .. } => &["velocity"],
        }
    }

    /// This rank's state as a checkpoint stores it (`None` before the first window); state on
    /// the device is copied down first.
    pub fn state_file(&mut self) -> Option<FusedStateFile> {
        let layout = self.layout.as_mut()?;
        layout.state_to_host();
        let layout = self.layout.as_ref()?;
        Some(FusedStateFile {
            optimizer: self.optimizer.clone(),
            segments: layout.segments.clone(),
            len: layout.len,
            shard_start: layout.shard.start,
            times: layout.times.clone(),
            buffers: self
                .buffer_names()
                .iter()
                .zip(&layout.state)
                .map(|(name, values)| (name.to_string(), values.clone()))
                .collect(),
        })
    }

    /// Fills this rank's shard of the state from the saved shards (of any world size).
    fn apply_state(
        &mut self,
        files: Vec<FusedStateFile>,
        rank: usize,
    ) -> Result<(), AccelerateError> {
        let names = self.buffer_names();
        let Some(layout) = self.layout.as_mut() else {
            return Ok(());
        };
        let mismatch = |detail: String| AccelerateError::ModelMismatch {
            rank,
            detail: format!("the checkpoint's fused optimizer state {detail}"),
        };
        for file in &files {
            if file.optimizer != self.optimizer {
                return Err(mismatch(format!(
                    "is for {:?}, this run uses {:?}",
                    file.optimizer, self.optimizer
                )));
            }
            if file.segments != layout.segments {
                return Err(mismatch("was saved for other parameters".into()));
            }
        }
        if let Some(first) = files.first() {
            layout.times.clone_from(&first.times);
        }
        for (name, target) in names.iter().zip(layout.state.iter_mut()) {
            let mut full = vec![0.0f32; layout.padded.max(layout.len)];
            for file in &files {
                let values = file
                    .buffers
                    .get(*name)
                    .ok_or_else(|| mismatch(format!("has no `{name}` buffer")))?;
                let end = (file.shard_start + values.len()).min(full.len());
                if file.shard_start < end {
                    full[file.shard_start..end].copy_from_slice(&values[..end - file.shard_start]);
                }
            }
            *target = full[layout.shard.clone()].to_vec();
        }
        Ok(())
    }
}

impl FusedStateFile {
    /// A JSON header line, then the buffers as little-endian f32.
    pub fn to_bytes(&self) -> Vec<u8> {
        let header = FusedStateHeader {
            optimizer: self.optimizer.clone(),
            segments: self.segments.clone(),
            len: self.len,
            shard_start: self.shard_start,
            times: self.times.clone(),
            buffers: self
                .buffers
                .iter()
                .map(|(k, v)| (k.clone(), v.len()))
                .collect(),
        };
        let mut out = serde_json::to_vec(&header).unwrap_or_default();
        out.push(b'\n');
        for values in self.buffers.values() {
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        out
    }

    /// Reads what [`to_bytes`](Self::to_bytes) wrote.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let split = bytes
            .iter()
            .position(|&b| b == b'\n')
            .ok_or("no header line")?;
        let header: FusedStateHeader =
            serde_json::from_slice(&bytes[..split]).map_err(|e| e.to_string())?;
        let mut data = bytes[split + 1..]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        let mut buffers = BTreeMap::new();
        for (name, len) in header.buffers {
            let values: Vec<f32> = data.by_ref().take(len).collect();
            if values.len() != len {
                return Err(format!("buffer `{name}` is truncated"));
            }
            buffers.insert(name, values);
        }
        Ok(Self {
            optimizer: header.optimizer,
            segments: header.segments,
            len: header.len,
            shard_start: header.shard_start,
            times: header.times,
            buffers,
        })
    }
}

#[derive(Serialize, Deserialize)]
struct FusedStateHeader {
    optimizer: FusedOptimizer,
    segments: Vec<Segment>,
    len: usize,
    shard_start: usize,
    times: Vec<i32>,
    buffers: Vec<(String, usize)>,
}

impl Layout {
    /// Copies `grads` of `model` into the flat gradient buffer, checking that the model still
    /// has the parameters the buffers were built for.
    pub fn gather_grads<M: Module>(
        &mut self,
        grads: &mut GradientsParams,
        model: &M,
        rank: usize,
    ) -> Result<(), AccelerateError> {
        struct Gather<'a> {
            layout: &'a mut Layout,
            grads: &'a mut GradientsParams,
            next: usize,
            mismatch: Option<String>,
            /// On the device: the flat gradient of each segment, concatenated after the visit.
            parts: Option<Vec<Tensor<1>>>,
        }
        impl ModuleVisitor for Gather<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                if self.mismatch.is_some() || !param.val().is_require_grad() {
                    return;
                }
                let Some(segment) = self.layout.segments.get(self.next) else {
                    self.mismatch = Some(format!(
                        "the model has more trainable parameters than the {} it was prepared \
                         with",
                        self.layout.segments.len()
                    ));
                    return;
                };
                if segment.id != param.id.val() {
                    self.mismatch = Some(format!(
                        "trainable parameter #{} ({}) is not the one the model was prepared with",
                        self.next, segment.path
                    ));
                    return;
                }
                let range = segment.offset..segment.offset + segment.len;
                let index = self.next;
                self.next += 1;
                let grad = self.grads.remove::<D>(param.id);
                self.layout.has_grad[index] = grad.is_some();
                if let Some(parts) = self.parts.as_mut() {
                    parts.push(match grad {
                        Some(grad) => {
                            let grad = grad.reshape([segment.len]);
                            if grad.dtype() == DType::F32 {
                                grad
                            } else {
                                grad.cast(DType::F32)
                            }
                        }
                        // Gradients are plain tensors; so must the filler be.
                        None => Tensor::zeros([segment.len], &param.device().without_autodiff()),
                    });
                    return;
                }
                // Removed, not cloned: a uniquely owned tensor hands its data over uncopied.
                match grad {
                    Some(grad) => copy_f32(grad.into_data(), &mut self.layout.grads[range]),
                    None => self.layout.grads[range].fill(0.0),
                }
            }
        }
        let parts = self.device.is_some().then(Vec::new);
        let mut gather = Gather {
            layout: self,
            grads,
            next: 0,
            mismatch: None,
            parts,
        };
        model.visit(&mut gather);
        let (next, mismatch, parts) = (gather.next, gather.mismatch, gather.parts);
        if let (Some(device), Some(parts), None) = (self.device.as_mut(), parts, &mismatch) {
            device.grads = Some(Tensor::cat(parts, 0));
        }
        let mismatch = mismatch.or_else(|| {
            (next != self.segments.len()).then(|| {
                format!(
                    "the model has {next} trainable parameters, it was prepared with {}",
                    self.segments.len()
                )
            })
        });
        match mismatch {
            Some(detail) => Err(AccelerateError::ModelMismatch {
                rank,
                detail: format!(
                    "{detail}; a fused optimizer keeps the parameters it was prepared with \
                     (add parameters before prepare, or use Burn's optimizer)"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Averages the gathered gradients over the processes into `shard_grads` (all-reduce, or
    /// reduce-scatter with ZeRO) and measures them in one read-only pass: the sum of squares
    /// over every rank's values (for clipping) is non-finite exactly when some gradient is,
    /// which is the fp16 overflow test. Unscaling by `inv_scale` is left to the update pass.
    /// Returns whether a gradient is not finite.
    pub fn average(
        &mut self,
        mut group: Option<&mut ProcessGroup>,
        sharded: bool,
        inv_scale: Option<f32>,
    ) -> Result<bool, AccelerateError> {
        if self.device.is_some() {
            return self.average_on_device(group, inv_scale);
        }
        match group.as_deref_mut() {
            Some(g) if sharded => {
                g.reduce_scatter(&self.grads, &mut self.shard_grads, Reduction::Mean)?;
            }
            Some(g) => {
                g.all_reduce(&mut self.grads, Reduction::Mean)?;
                std::mem::swap(&mut self.grads, &mut self.shard_grads);
            }
            None => std::mem::swap(&mut self.grads, &mut self.shard_grads),
        }
        let mut sum_sq = accelerate_kernels::sum_of_squares(&self.shard_grads);
        if let (Some(g), true) = (group, sharded) {
            // Each rank measured its shard; infinities and NaN survive the sum.
            let mut total = [sum_sq as f32];
            g.all_reduce(&mut total, Reduction::Sum)?;
            sum_sq = f64::from(total[0]);
        }
        Ok(self.record_measure(sum_sq, inv_scale))
    }

    /// Records the pending step's unscale factor and the norm of its unscaled gradients from
    /// the sum of squares of the scaled ones; true when that sum is not finite (overflow).
    fn record_measure(&mut self, sum_sq: f64, inv_scale: Option<f32>) -> bool {
        let scale = inv_scale.unwrap_or(1.0);
        self.unscale = scale;
        self.norm = (sum_sq.sqrt() * f64::from(scale)) as f32;
        !sum_sq.is_finite()
    }

    /// [`average`](Self::average) with the buffers on the device (never sharded): one process
    /// measures the gradients there (f32 sum of squares, one 4-byte read); several average
    /// them on the host, where the collectives run, and measure them there.
    fn average_on_device(
        &mut self,
        group: Option<&mut ProcessGroup>,
        inv_scale: Option<f32>,
    ) -> Result<bool, AccelerateError> {
        let Some(device) = self.device.as_mut() else {
            return Ok(false);
        };
        let Some(grads) = device.grads.take() else {
            return Err(AccelerateError::FusedOptimizer {
                reason: "no gradients were gathered for this step".into(),
            });
        };
        let (grads, sum_sq) = match group {
            Some(group) => {
                let place = grads.device();
                let mut values = vec![0.0f32; self.len];
                copy_f32(grads.into_data(), &mut values);
                group.all_reduce(&mut values, Reduction::Mean)?;
                let sum_sq = accelerate_kernels::sum_of_squares(&values);
                let len = values.len();
                let grads = Tensor::<1>::from_data(TensorData::new(values, [len]), &place);
                (grads, sum_sq)
            }
            None => {
                let sum_sq = grads.clone().square().sum().into_scalar::<f32>();
                (grads, f64::from(sum_sq))
            }
        };
        device.grads = Some(grads);
        Ok(self.record_measure(sum_sq, inv_scale))
    }

    /// Puts the master parameters and the state on `device`, where the update then runs
    /// (once, when the buffers are built or rebuilt after a checkpoint was loaded).
    fn move_to_device(&mut self, device: &burn::tensor::Device) {
        // The kernels index with 32 bits; larger buffers stay on the host path.
        if self.len == 0 || self.len != self.padded || u32::try_from(self.len).is_err() {
            return;
        }
        // Plain tensors: the kernels run on the backend itself, never through autodiff.
        let device = device.clone().without_autodiff();
        let upload = |values: &[f32]| {
            Tensor::<1>::from_data(TensorData::new(values.to_vec(), [values.len()]), &device)
        };
        let params = upload(&self.params[..self.len]);
        let state = self.state.iter().map(|s| upload(s)).collect();
        self.params = Vec::new();
        self.grads = Vec::new();
        self.shard_grads = Vec::new();
        self.state.iter_mut().for_each(|s| *s = Vec::new());
        self.device = Some(DeviceFlat {
            params,
            grads: None,
            state,
        });
    }

    /// Copies the optimizer state down from the device (for a checkpoint).
    fn state_to_host(&mut self) {
        if let Some(device) = &self.device {
            for (host, values) in self.state.iter_mut().zip(&device.state) {
                host.resize(self.len, 0.0);
                copy_f32(values.clone().into_data(), host);
            }
        }
    }

    /// The global L2 norm of the averaged, unscaled gradients.
    pub fn norm(&self) -> f32 {
        self.norm
    }

    /// Applies the fused update to this rank's shard with the learning rates of `lr`.
    pub fn step(&mut self, optimizer: &FusedOptimizer, lr: &ModuleLearningRate, grad_scale: f32) {
        if self.device.is_some() {
            self.step_on_device(optimizer, lr, grad_scale);
            return;
        }
        let shard = self.shard.clone();
        for (index, segment) in self.segments.iter().enumerate() {
            if !self.has_grad[index] {
                continue;
            }
            let start = segment.offset.max(shard.start);
            let end = (segment.offset + segment.len).min(shard.end);
            // Burn counts updates per parameter; every rank advances every segment's count so
            // that a shard boundary inside a segment sees one count.
            self.times[index] += 1;
            if start >= end {
                continue;
            }
            let rate = lr.lr_from_param(ParamId::from(segment.id), Some(&segment.path));
            let params = &mut self.params[start..end];
            let local = start - shard.start..end - shard.start;
            let grads = &self.shard_grads[local.clone()];
            match optimizer {
                FusedOptimizer::Adam { hyper, amsgrad } => {
                    let (m, rest) = self.state.split_at_mut(1);
                    let (v, rest) = rest.split_at_mut(1);
                    let max_v = if *amsgrad {
                        Some(&mut rest[0][local.clone()])
                    } else {
                        None
                    };
                    adam_step(
                        params,
                        grads,
                        &mut m[0][local.clone()],
                        &mut v[0][local.clone()],
                        max_v,
                        self.times[index],
                        rate,
                        grad_scale,
                        hyper,
                    );
                }
                FusedOptimizer::Sgd { .. } => {
                    let Some(hyper) = optimizer.sgd_hyper() else {
                        continue;
                    };
                    let velocity = self.state.first_mut().map(|v| &mut v[local.clone()]);
                    sgd_step(
                        params,
                        grads,
                        velocity,
                        self.times[index] == 1,
                        rate,
                        grad_scale,
                        &hyper,
                    );
                }
            }
        }
    }

    /// [`step`](Self::step) with the buffers on the device: one cubecl kernel per segment (a
    /// copy for segments without a gradient), writing the parameters to a new buffer.
    #[cfg(feature = "device-kernels")]
    fn step_on_device(
        &mut self,
        optimizer: &FusedOptimizer,
        lr: &ModuleLearningRate,
        grad_scale: f32,
    ) {
        let segments = self
            .segments
            .iter()
            .enumerate()
            .map(|(index, segment)| {
                let update = self.has_grad[index].then(|| {
                    self.times[index] += 1;
                    let rate = lr.lr_from_param(ParamId::from(segment.id), Some(&segment.path));
                    (self.times[index], rate)
                });
                crate::device_kernels::PlannedSegment {
                    offset: segment.offset,
                    len: segment.len,
                    update,
                }
            })
            .collect();
        let Some(device) = self.device.as_mut() else {
            return;
        };
        let Some(grads) = device.grads.take() else {
            return;
        };
        let plan = crate::device_kernels::FusedPlan {
            optimizer: optimizer.clone(),
            grad_scale,
            segments,
        };
        let state = std::mem::take(&mut device.state);
        let (params, state) =
            crate::device_kernels::fused_update(device.params.clone(), grads, state, plan);
        device.params = params;
        device.state = state;
    }

    /// Without a cubecl backend in the build the buffers never move to a device.
    #[cfg(not(feature = "device-kernels"))]
    fn step_on_device(&mut self, _: &FusedOptimizer, _: &ModuleLearningRate, _: f32) {}

    /// Gives every rank every shard of the updated parameters (ZeRO).
    pub fn gather_params(&mut self, group: &mut ProcessGroup) -> Result<(), AccelerateError> {
        let mine = self.params[self.shard.clone()].to_vec();
        group.all_gather(&mine, &mut self.params)?;
        Ok(())
    }

    /// Writes the master parameters into `model` (one upload per parameter tensor).
    pub fn upload<M: Module>(&self, model: M) -> M {
        struct Upload<'a> {
            layout: &'a Layout,
            next: usize,
        }
        impl ModuleMapper for Upload<'_> {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let (id, tensor, mapper) = param.consume();
                let segment = match self.layout.segments.get(self.next) {
                    Some(s) if s.id == id.val() && tensor.is_require_grad() => s,
                    _ => return Param::from_mapped_value(id, tensor, mapper),
                };
                self.next += 1;
                let mut value = match &self.layout.device {
                    // A view of the flat buffer (no copy), in the model's autodiff context.
                    Some(device) => {
                        let view = device
                            .params
                            .clone()
                            .narrow(0, segment.offset, segment.len)
                            .reshape(tensor.shape());
                        match tensor.gradient_checkpointing_strategy() {
                            Some(strategy) => view
                                .autodiff()
                                .with_gradient_checkpointing_strategy(strategy),
                            None => view,
                        }
                    }
                    None => {
                        let values = self.layout.params
                            [segment.offset..segment.offset + segment.len]
                            .to_vec();
                        Tensor::<D>::from_data(
                            TensorData::new(values, segment.shape.clone()),
                            &tensor.device(),
                        )
                    }
                };
                if tensor.dtype() != DType::F32 {
                    value = value.cast(tensor.dtype());
                }
                Param::from_mapped_value(id, value.require_grad(), mapper)
            }
        }
        model.map(&mut Upload {
            layout: self,
            next: 0,
        })
    }

    /// Bytes of optimizer state this process holds.
    pub fn state_bytes(&self) -> usize {
        if let Some(device) = &self.device {
            return device
                .state
                .iter()
                .map(|s| s.shape().num_elements() * 4)
                .sum();
        }
        self.state.iter().map(|s| s.capacity() * 4).sum()
    }
}

/// The optimizer state of one rank, as a checkpoint stores it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct FusedStateFile {
    pub optimizer: FusedOptimizer,
    pub segments: Vec<Segment>,
    pub len: usize,
    pub shard_start: usize,
    pub times: Vec<i32>,
    /// Named state buffers over this rank's shard.
    pub buffers: BTreeMap<String, Vec<f32>>,
}
