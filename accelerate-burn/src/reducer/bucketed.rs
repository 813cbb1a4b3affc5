//! The reducer of Burn's optimizers: gradients stay Burn tensors. On the host they arrive
//! averaged by the accelerator's gradient pipe (`crate::overlap`); on a cubecl backend with a
//! half-precision wire they are averaged here in buckets of at least `bucket_bytes`, in module
//! visit order, narrowed and widened on the device so that only half precision crosses to the
//! host; where the job uses NCCL a bucket is averaged in place on the GPUs instead. The update
//! is Burn's optimizer's own `step`; its record is the checkpoint state.

use std::ops::Range;
use std::sync::Arc;

use accelerate_core::MixedPrecision;
use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{ModuleOptimizer, OptimizerRecord};
use burn::tensor::{DType, Tensor};

use super::api::{
    GradientReducer, LoadSource, ModelUpdate, Outcome, Reduced, ReducerKind, SaveRole, SavedFile,
    global_norm,
};
use super::wire::Wire;
use crate::error::AccelerateError;
use crate::group::Comm;
use crate::nccl::DeviceCollectives;
use crate::params::{self, ParamLayout, ParamList};
use crate::stage_error::StageError;

/// The optimizer's record in a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.bpk";

/// Burn's optimizer behind the reducer seam.
pub(crate) struct BucketedReducer {
    layout: Arc<ParamLayout>,
    /// `None` for gradients averaged for the user's own optimizer (no prepared one).
    optimizer: Option<ModuleOptimizer>,
    /// Ranges of layout entries reduced together.
    buckets: Vec<Range<usize>>,
    wire: Wire,
    /// Where buckets are averaged.
    path: BucketPath,
    /// Unscale with our cubecl kernel (cubecl backends).
    device_kernels: bool,
}

/// Where a bucket is averaged, chosen once when the model is prepared.
enum BucketPath {
    /// In place on the GPUs with NCCL, in the wire's precision.
    Nccl(DeviceCollectives),
    /// Narrowed and widened on the device by our kernels: only the half-precision wire
    /// crosses to the host (cubecl backends with a half-precision wire).
    #[cfg(feature = "device-kernels")]
    HalfOnDevice,
    /// On the host, by the accelerator's gradient pipe (`crate::overlap`): the reducer gets
    /// the gradients averaged.
    Host,
}

impl BucketPath {
    fn choose(nccl: Option<DeviceCollectives>, wire: MixedPrecision, device_kernels: bool) -> Self {
        if let Some(nccl) = nccl {
            return Self::Nccl(nccl);
        }
        #[cfg(feature = "device-kernels")]
        if device_kernels && wire != MixedPrecision::No {
            return Self::HalfOnDevice;
        }
        let _ = (wire, device_kernels);
        Self::Host
    }
}

impl BucketedReducer {
    pub fn new(
        layout: Arc<ParamLayout>,
        optimizer: Option<ModuleOptimizer>,
        bucket_bytes: usize,
        wire: MixedPrecision,
        device_kernels: bool,
        nccl: Option<DeviceCollectives>,
    ) -> Self {
        let buckets = layout.buckets(bucket_bytes, |_| None);
        Self {
            layout,
            optimizer,
            buckets,
            wire: Wire::new(wire),
            path: BucketPath::choose(nccl, wire, device_kernels),
            device_kernels,
        }
    }

    /// Averages the gradients of `range` (one bucket) over the ranks; with `inv_scale`, also
    /// unscales them and says whether any is not finite.
    fn reduce_bucket(
        &mut self,
        grads: &mut ParamList,
        range: Range<usize>,
        comm: &Comm,
        inv_scale: Option<f32>,
    ) -> Result<bool, AccelerateError> {
        let present: Vec<usize> = range.filter(|&i| grads[i].is_some()).collect();
        if present.is_empty() {
            return Ok(false);
        }
        let mut dtypes = Vec::with_capacity(present.len());
        let mut parts = Vec::with_capacity(present.len());
        for &i in &present {
            if let Some(grad) = grads[i].take() {
                dtypes.push(grad.dtype());
                parts.push(params::as_f32(grad));
            }
        }
        let joined = Tensor::cat(parts, 0);
        let precision = self.wire.precision;
        let (joined, overflow) = match &self.path {
            BucketPath::Nccl(nccl) => {
                // In place on the GPUs, in the wire's precision (NCCL's own half types).
                let joined = comm.timed_device(|| nccl.all_reduce_mean(joined, precision))?;
                match inv_scale {
                    Some(inv) => {
                        let mut list = vec![Some(joined)];
                        let overflow = unscale_on_device(&mut list, inv, self.device_kernels);
                        let joined = list
                            .pop()
                            .flatten()
                            .ok_or(AccelerateError::UnexpectedGradients { rank: comm.rank() })?;
                        (joined, overflow)
                    }
                    None => (joined, false),
                }
            }
            #[cfg(feature = "device-kernels")]
            BucketPath::HalfOnDevice => comm.timed(|group| {
                super::wire::average_on_device(joined, group, precision, inv_scale)
            })?,
            // Host averaging is the accelerator's gradient pipe (`takes_averaged`).
            BucketPath::Host => {
                return Err(AccelerateError::UnexpectedGradients { rank: comm.rank() });
            }
        };
        let mut offset = 0;
        for (&i, dtype) in present.iter().zip(dtypes) {
            let n = self.layout.entries[i].numel;
            let mut part = joined.clone().narrow(0, offset, n);
            if dtype != DType::F32 {
                part = part.cast(dtype);
            }
            grads[i] = Some(part);
            offset += n;
        }
        Ok(overflow)
    }
}

/// Unscales `grads` on the device and says whether any value is not finite: our cubecl kernel
/// where the backend has one (one pass per tensor, one 4-byte read), else Burn's operations.
fn unscale_on_device(grads: &mut ParamList, inv_scale: f32, device_kernels: bool) -> bool {
    #[cfg(feature = "device-kernels")]
    if device_kernels {
        let mut flag: Option<crate::device_kernels::OverflowFlag> = None;
        for grad in grads.iter_mut() {
            if let Some(g) = grad.take() {
                let f = flag
                    .get_or_insert_with(|| crate::device_kernels::OverflowFlag::new(&g.device()));
                *grad = Some(f.unscale(g, inv_scale));
            }
        }
        return flag.is_some_and(crate::device_kernels::OverflowFlag::found);
    }
    let _ = device_kernels;
    for grad in grads.iter_mut().flatten() {
        *grad = grad.clone().mul_scalar(inv_scale);
    }
    global_norm(grads).is_some_and(|n| !n.is_finite())
}

impl GradientReducer for BucketedReducer {
    fn kind(&self) -> ReducerKind {
        ReducerKind::Burn
    }

    fn layout(&self) -> &Arc<ParamLayout> {
        &self.layout
    }

    fn takes_averaged(&self) -> bool {
        matches!(self.path, BucketPath::Host)
    }

    fn reduce(
        &mut self,
        mut grads: ParamList,
        comm: &Comm,
        inv_scale: Option<f32>,
    ) -> Result<Reduced, AccelerateError> {
        // NCCL runs even for one process when it was required (that is how one GPU tests it).
        let overflow = if comm.is_distributed() || comm.device_collectives().is_some() {
            let mut overflow = false;
            for range in self.buckets.clone() {
                overflow |= self.reduce_bucket(&mut grads, range, comm, inv_scale)?;
            }
            overflow
        } else {
            inv_scale.is_some_and(|inv| unscale_on_device(&mut grads, inv, self.device_kernels))
        };
        Ok(Reduced {
            outcome: Outcome::Ready {
                grads,
                layout: Arc::clone(&self.layout),
                norm: None,
            },
            overflow,
        })
    }

    fn step(
        &mut self,
        lr: ModuleLearningRate,
        outcome: Outcome,
        model: &mut dyn ModelUpdate,
        comm: &Comm,
    ) -> Result<(), AccelerateError> {
        let (Outcome::Ready { grads, layout, .. }, Some(optimizer)) =
            (outcome, self.optimizer.as_mut())
        else {
            return Err(AccelerateError::UnexpectedGradients { rank: comm.rank() });
        };
        model.burn_step(optimizer, lr, layout.to_grads(grads));
        Ok(())
    }

    fn save(&mut self, role: SaveRole) -> Result<Vec<SavedFile>, StageError> {
        let Some(optimizer) = self.optimizer.as_ref().filter(|_| role.main) else {
            return Ok(Vec::new());
        };
        let data = optimizer
            .to_record()
            .into_bytes()
            .map_err(|e| StageError::Burn {
                what: "optimizer record".into(),
                detail: e.to_string(),
            })?;
        Ok(vec![SavedFile {
            name: OPTIMIZER_FILE.into(),
            contents: "optimizer record (burnpack)",
            rank: None,
            data: data.to_vec(),
        }])
    }

    fn load(&mut self, source: LoadSource<'_>) -> Result<(), StageError> {
        self.layout = Arc::new(source.layout);
        if let Some(optimizer) = self.optimizer.as_mut() {
            let record = OptimizerRecord::load(source.dir.join(OPTIMIZER_FILE)).map_err(|e| {
                StageError::Burn {
                    what: OPTIMIZER_FILE.into(),
                    detail: e.to_string(),
                }
            })?;
            *optimizer = optimizer.clone().load_record(record);
        }
        Ok(())
    }

    fn burn_optimizer(&self) -> Option<&ModuleOptimizer> {
        self.optimizer.as_ref()
    }

    fn burn_optimizer_mut(&mut self) -> Option<&mut ModuleOptimizer> {
        self.optimizer.as_mut()
    }
}
