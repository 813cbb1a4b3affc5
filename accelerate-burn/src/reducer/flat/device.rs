//! The flat buffers on a cubecl device (wgpu, cuda; never sharded): the gradients are
//! concatenated there, the update is our cubecl kernel, and the model's parameters become
//! views of the flat parameter buffer, so a step moves nothing to the host but a 4-byte norm
//! (with several processes, also the gradients the collectives average).

use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::tensor::Tensor;

use super::FlatPlan;
use crate::error::AccelerateError;
use crate::fused::FusedOptimizer;
use crate::group::Comm;
use crate::params;
use crate::reducer::wire::Wire;

/// Flat buffers as Burn tensors of shape `[len]` on the model's device (plain tensors: the
/// kernels run on the backend itself, never through autodiff).
pub(crate) struct DeviceFlat {
    /// Master parameters (a new buffer after every update; the model views it).
    params: Tensor<1>,
    /// The gathered (and averaged) gradients of the pending step.
    grads: Option<Tensor<1>>,
    /// Optimizer state.
    state: Vec<Tensor<1>>,
}

impl DeviceFlat {
    /// Buffers starting from `trainable` (one tensor per segment, on the device).
    pub fn new(trainable: Vec<Tensor<1>>, state_buffers: usize) -> Self {
        let params = Tensor::cat(trainable.into_iter().map(params::as_f32).collect(), 0);
        let len = params.shape().num_elements();
        let device = params.device();
        let state = (0..state_buffers)
            .map(|_| Tensor::<1>::zeros([len], &device))
            .collect();
        Self {
            params,
            grads: None,
            state,
        }
    }

    /// Concatenates each segment's gradient into the flat gradient buffer (zeros where a
    /// parameter got none).
    pub fn gather(&mut self, plan: &FlatPlan, grads: impl Iterator<Item = Option<Tensor<1>>>) {
        let device = self.params.device();
        let parts = plan
            .segments
            .iter()
            .zip(grads)
            .map(|(segment, grad)| match grad {
                Some(grad) => params::as_f32(grad),
                // Gradients are plain tensors; so must the filler be.
                None => Tensor::zeros([segment.len], &device),
            })
            .collect();
        self.grads = Some(Tensor::cat(parts, 0));
    }

    /// Averages the gathered gradients over the processes (on the host, where the collectives
    /// run) and returns the sum of their squares (on the device with one process: one 4-byte
    /// read).
    pub fn average(&mut self, wire: &mut Wire, comm: &Comm) -> Result<f64, AccelerateError> {
        let Some(grads) = self.grads.take() else {
            return Err(AccelerateError::UnexpectedGradients { rank: comm.rank() });
        };
        if !comm.is_distributed() {
            let sum_sq = grads.clone().square().sum().into_scalar::<f32>();
            self.grads = Some(grads);
            return Ok(f64::from(sum_sq));
        }
        let device = grads.device();
        // One host copy, which then becomes the averaged tensor's buffer.
        let mut values = params::to_host_f32(grads);
        comm.timed(|group| wire.all_reduce_mean(&mut values, group))?;
        let sum_sq = accelerate_kernels::sum_of_squares(&values);
        self.grads = Some(params::upload(values, &device));
        Ok(sum_sq)
    }

    /// One cubecl kernel per segment (a copy for segments without a gradient), writing the
    /// parameters to a new buffer.
    #[cfg(feature = "device-kernels")]
    pub fn step(
        &mut self,
        plan: &mut FlatPlan,
        optimizer: &FusedOptimizer,
        lr: &ModuleLearningRate,
        grad_scale: f32,
    ) {
        use crate::device_kernels::{FusedPlan, PlannedSegment, UpdateRule};

        let mut segments = Vec::with_capacity(plan.segments.len());
        for index in 0..plan.segments.len() {
            let update = plan.has_grad[index].then(|| {
                plan.times[index] += 1;
                (plan.times[index], plan.rate(index, lr))
            });
            let segment = &plan.segments[index];
            segments.push(PlannedSegment {
                offset: segment.offset,
                len: segment.len,
                update,
            });
        }
        let Some(grads) = self.grads.take() else {
            return;
        };
        let rule = match (optimizer, optimizer.sgd_hyper()) {
            (FusedOptimizer::Adam { hyper, amsgrad }, _) => UpdateRule::Adam {
                hyper: *hyper,
                amsgrad: *amsgrad,
            },
            (FusedOptimizer::Sgd { .. }, Some(hyper)) => UpdateRule::Sgd(hyper),
            (FusedOptimizer::Sgd { .. }, None) => return,
        };
        let plan = FusedPlan {
            rule,
            grad_scale,
            segments,
        };
        let state = std::mem::take(&mut self.state);
        let (params, state) =
            crate::device_kernels::fused_update(self.params.clone(), grads, state, plan);
        self.params = params;
        self.state = state;
    }

    /// Without a cubecl backend in the build the buffers are never put on a device (the
    /// reducer only does so when the backend has device kernels), so there is nothing to do.
    #[cfg(not(feature = "device-kernels"))]
    pub fn step(&mut self, _: &mut FlatPlan, _: &FusedOptimizer, _: &ModuleLearningRate, _: f32) {}

    /// Views of the flat parameter buffer, one per segment (no copy).
    pub fn values(&self, plan: &FlatPlan) -> Vec<Tensor<1>> {
        plan.segments
            .iter()
            .map(|s| self.params.clone().narrow(0, s.offset, s.len))
            .collect()
    }

    /// The optimizer state copied to the host (for a checkpoint).
    pub fn state_to_host(&self) -> Vec<Vec<f32>> {
        self.state
            .iter()
            .map(|s| params::to_host_f32(s.clone()))
            .collect()
    }

    /// Replaces the optimizer state with `state` (from a checkpoint).
    pub fn set_state(&mut self, state: Vec<Vec<f32>>) {
        let device = self.params.device();
        self.state = state
            .into_iter()
            .map(|values| params::upload(values, &device))
            .collect();
    }

    /// Bytes of optimizer state held.
    pub fn state_bytes(&self) -> usize {
        self.state
            .iter()
            .map(|s| s.shape().num_elements() * 4)
            .sum()
    }
}
