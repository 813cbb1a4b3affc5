//! The differentiable all-gather of one sharded parameter: a Burn backend extension whose
//! forward concatenates every rank's shard into the parameter (in its own shape) and whose
//! backward reduce-scatters the parameter's gradient back into this rank's shard, averaged
//! over the ranks.
//!
//! Burn has no module hooks, so ZeRO-3's "gather before use, free after" lives in the autodiff
//! graph: with `reshard` the gather is marked memory-bound with a retro-forward, so Burn keeps
//! the shard (not the gathered parameter) for backward and gathers again when an operation's
//! backward needs the parameter, whatever the model's checkpointing strategy. Without it the
//! gathered parameter is kept until backward (FSDP's `reshard_after_forward=False`).
//!
//! The collectives run on the host (the shard read back, the result uploaded), which serves
//! every inner backend with one implementation, except on the cuda backend of a job that uses
//! NCCL, where NCCL's all-gather and reduce-scatter run on the GPUs (`on_gpus`). Every rank issues them in the same order: the
//! forward in the order the model runs, the backward in the graph's order, which is the same
//! graph on every rank. A collective that fails cannot return an error from inside a Burn
//! operation: it is recorded in the [`ShardGroup`] (which `backward` turns into an error),
//! and the operation gives zeros without communicating again.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use accelerate_core::Reduction;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops};
use burn::backend::tensor::FloatTensor;
use burn::backend::{AutodiffBackend, Backend, TensorMetadata, backend_extension};
use burn::module::ParamId;
use burn::tensor::{DType, TensorData, bf16, f16, try_read_sync};

use super::group::ShardGroup;
use crate::overlap::{TapClaim, TapHub, TapReadError, TapSpec};

/// The fused GPU backends' gathers: resolved, then as on the unfused backend.
#[cfg(all(feature = "fusion", feature = "device-kernels"))]
mod fused;
/// The cuda backend's gathers and reduce-scatters with NCCL, where the job uses it.
#[cfg(feature = "device-kernels")]
mod on_gpus;

/// One sharded parameter as the gather sees it: its shape, and how it is cut.
pub(crate) struct ParamShard {
    /// The shard parameter's id when it was cut.
    pub id: ParamId,
    /// The parameter's dimensions.
    pub shape: Vec<usize>,
    /// Its elements.
    pub numel: usize,
    /// Elements of every rank's shard (the last one padded with zeros).
    pub shard_len: usize,
    /// Gather again in backward instead of keeping the gathered parameter.
    pub reshard: bool,
    /// The ranks it is sharded over.
    pub group: Arc<ShardGroup>,
}

impl fmt::Debug for ParamShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParamShard")
            .field("shape", &self.shape)
            .field("shard_len", &self.shard_len)
            .field("reshard", &self.reshard)
            .finish()
    }
}

/// What the gather operation is given besides the shard (shared, cheap to clone).
#[derive(Clone, Debug)]
pub(crate) struct GatherSpec(pub Arc<ParamShard>);

/// The gather as a Burn operation. Collectives are not lazy: under Burn's fusion the
/// operation resolves its input (the stream's earlier operations run first) and blocks, as on
/// the unfused backend (`fused`), so every rank runs its collectives in its program's order.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Cube: cfg(feature = "device-kernels"),
    Autodiff
)]
pub(crate) trait ShardOps: Backend {
    /// `input` as a new node that follows it in the autodiff graph (backward sends `input` no
    /// gradient through it): a gather's or a unit's anchor. No operation runs: the anchor is
    /// `input`'s buffer, and nothing reads it. Its backward runs when backward has gone
    /// through every operation after `input` that the anchor's followers feed (the unit) and
    /// before the operations that made `input`: there a unit's `gate` may hold backward until
    /// the unit's gradients are on their way (ZeRO-2's throttle).
    fn shard_anchor(input: FloatTensor<Self>, gate: AnchorGate) -> FloatTensor<Self>;

    /// Every rank's `shard` (`[shard_len]`), concatenated in rank order and cut to the
    /// parameter's shape; its gradient is reduce-scattered (mean) into the shard's. Under
    /// autodiff the gather comes right after `anchor` in the graph, so its backward (the
    /// reduce-scatter) runs as soon as every operation after the anchor has run backward
    /// (Burn runs backward by depth in the graph; see `Sharded::gather_for`).
    fn shard_gather(
        shard: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        spec: GatherSpec,
    ) -> FloatTensor<Self>;

    /// This rank's shard (`[shard_len]`, f32) of the mean over the ranks of `grad`, the
    /// gathered parameter's gradient: the gather's backward.
    fn shard_reduce_scatter(grad: FloatTensor<Self>, spec: GatherSpec) -> FloatTensor<Self>;

    /// `param` itself, after `anchor` in the graph: a unit's tap. Its backward hands the
    /// parameter's gradient to the accelerator's pipe (`tap`), which averages it while backward
    /// goes on, and passes it on to the parameter unchanged.
    fn unit_tap(
        param: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        tap: TapSpec,
    ) -> FloatTensor<Self>;
}

/// The CPU backends' operations: the host path.
#[cfg(any(feature = "flex", feature = "ndarray"))]
macro_rules! host_shard_ops {
    ($backend:ty) => {
        impl ShardOps for $backend {
            fn shard_anchor(input: FloatTensor<Self>, _: AnchorGate) -> FloatTensor<Self> {
                input
            }

            fn shard_gather(
                shard: FloatTensor<Self>,
                _: FloatTensor<Self>,
                spec: GatherSpec,
            ) -> FloatTensor<Self> {
                gather::<Self>(shard, &spec.0)
            }

            fn shard_reduce_scatter(
                grad: FloatTensor<Self>,
                spec: GatherSpec,
            ) -> FloatTensor<Self> {
                reduce_scatter::<Self>(grad, &spec.0)
            }

            fn unit_tap(
                param: FloatTensor<Self>,
                _: FloatTensor<Self>,
                _: TapSpec,
            ) -> FloatTensor<Self> {
                param
            }
        }
    };
}

#[cfg(feature = "flex")]
host_shard_ops!(burn::backend::Flex);
#[cfg(feature = "ndarray")]
host_shard_ops!(burn::backend::NdArray);

#[cfg(feature = "device-kernels")]
impl ShardOps for burn_cubecl::CubeBackend {
    fn shard_anchor(input: FloatTensor<Self>, _: AnchorGate) -> FloatTensor<Self> {
        input
    }

    fn shard_gather(
        shard: FloatTensor<Self>,
        _: FloatTensor<Self>,
        spec: GatherSpec,
    ) -> FloatTensor<Self> {
        match spec.0.group.comm().device_collectives() {
            Some(nccl) => on_gpus::gather(nccl, shard, &spec.0),
            None => gather::<Self>(shard, &spec.0),
        }
    }

    fn shard_reduce_scatter(grad: FloatTensor<Self>, spec: GatherSpec) -> FloatTensor<Self> {
        match spec.0.group.comm().device_collectives() {
            Some(nccl) => on_gpus::reduce_scatter(nccl, grad, &spec.0),
            None => reduce_scatter::<Self>(grad, &spec.0),
        }
    }

    fn unit_tap(param: FloatTensor<Self>, _: FloatTensor<Self>, _: TapSpec) -> FloatTensor<Self> {
        param
    }
}

impl<B: ShardOps, C: CheckpointStrategy> ShardOps for Autodiff<B, C> {
    fn shard_anchor(input: FloatTensor<Self>, gate: AnchorGate) -> FloatTensor<Self> {
        let value = B::shard_anchor(input.primitive().clone(), gate.clone());
        AnchorBackward { gate }
            .prepare::<C>([input.node()])
            .compute_bound()
            .stateless(value)
    }

    fn shard_gather(
        shard: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        spec: GatherSpec,
    ) -> FloatTensor<Self> {
        // The inner backend's gather ignores its anchor: the shard stands in.
        let gathered = B::shard_gather(
            shard.primitive().clone(),
            shard.primitive().clone(),
            spec.clone(),
        );
        let backward = GatherBackward { spec: spec.clone() };
        if spec.0.reshard {
            // Balanced checkpointing for this operation alone: Burn then recomputes (gathers
            // again) instead of storing the gathered parameter, on any model strategy. A
            // tracked anchor is checkpointed too (the recomputation's parents must be; it keeps
            // the unit's input, which the forward pass held anyway, until the end of backward),
            // and an untracked one cannot be (Burn would keep the gathered parameter);
            // a gather anchored on its own shard (no input given) checkpoints the shard once.
            let parents = if anchor.is_tracked() && anchor.id() != shard.id() {
                vec![&shard, &anchor]
            } else {
                vec![&shard]
            };
            backward
                .prepare::<BalancedCheckpointing>([shard.node(), anchor.node()])
                .memory_bound()
                .retro_forward(RetroGather::<B> {
                    input: shard.node().id(),
                    spec,
                    _backend: PhantomData,
                })
                .parents(parents)
                .stateless(gathered)
        } else {
            backward
                .prepare::<C>([shard.node(), anchor.node()])
                .compute_bound()
                .stateless(gathered)
        }
    }

    fn shard_reduce_scatter(grad: FloatTensor<Self>, spec: GatherSpec) -> FloatTensor<Self> {
        // Only the gather's backward calls it, on the inner backend; a direct call is a
        // constant to autodiff.
        Self::from_inner(B::shard_reduce_scatter(Self::inner(grad), spec))
    }

    fn unit_tap(
        param: FloatTensor<Self>,
        anchor: FloatTensor<Self>,
        tap: TapSpec,
    ) -> FloatTensor<Self> {
        let value = B::unit_tap(
            param.primitive().clone(),
            anchor.primitive().clone(),
            tap.clone(),
        );
        TapBackward { tap }
            .prepare::<C>([param.node(), anchor.node()])
            .compute_bound()
            .stateless(value)
    }
}

/// A tap's backward node: the parameter's gradient to the pipe, and on to the parameter.
#[derive(Debug)]
struct TapBackward {
    tap: TapSpec,
}

impl<B: ShardOps> Backward<B, 2> for TapBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [parent, _anchor] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let Some(parent) = parent else {
            return;
        };
        let read = |grad: FloatTensor<B>| match try_read_sync(B::float_into_data(grad)) {
            Some(Ok(data)) => Ok(data),
            Some(Err(e)) => Err(TapReadError::Backend(format!("{e:?}"))),
            None => Err(TapReadError::NotSynchronous),
        };
        let hub = &self.tap.hub;
        // A parameter is a leaf (order 0), whose gradient nothing in backward reads; anything
        // else (a cast under autocast, a computed weight) has a backward that consumes it.
        let leaf = parent.order == 0;
        match hub.claim(self.tap.id) {
            TapClaim::Pass => grads.register::<B>(parent.id, grad),
            // Let go here: the pipe reduces it into this rank's shard (ZeRO-2).
            TapClaim::Take(handover) if leaf => hub.hand_over(handover, || read(grad)),
            TapClaim::Copy(handover) | TapClaim::Take(handover) => {
                let copy = grad.clone();
                hub.hand_over(handover, || read(copy));
                grads.register::<B>(parent.id, grad);
            }
        }
    }
}

/// The backward node: the gathered parameter's gradient, averaged over the ranks, as the
/// shard's.
#[derive(Debug)]
struct GatherBackward {
    spec: GatherSpec,
}

impl<B: ShardOps> Backward<B, 2> for GatherBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        // The anchor gets no gradient: it only placed the gather in the graph.
        let [parent, _anchor] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            let shard = B::shard_reduce_scatter(grad, self.spec.clone());
            grads.register::<B>(parent.id, shard);
        }
    }
}

/// What an anchor's backward waits for: nothing, or a unit's hub (whose throttle holds
/// backward there while the unit's gradients wait to be reduced).
#[derive(Clone, Default)]
pub(crate) struct AnchorGate(pub Option<Arc<TapHub>>);

impl fmt::Debug for AnchorGate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AnchorGate")
            .field(&self.0.is_some())
            .finish()
    }
}

/// The anchor's backward node: nothing flows back through an anchor; a unit's anchor holds
/// backward at its gate before the operations before the unit run.
#[derive(Debug)]
struct AnchorBackward {
    gate: AnchorGate,
}

impl<B: Backend> Backward<B, 1> for AnchorBackward {
    type State = ();

    fn backward(self, _: Ops<Self::State, 1>, _: &mut Gradients, _: &mut Checkpointer) {
        if let Some(hub) = &self.gate.0 {
            hub.gate();
        }
    }
}

/// Gathers the parameter again when a backward pass needs it (reshard after forward).
struct RetroGather<B> {
    input: NodeId,
    spec: GatherSpec,
    _backend: PhantomData<fn() -> B>,
}

impl<B> fmt::Debug for RetroGather<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetroGather")
            .field("input", &self.input)
            .field("spec", &self.spec)
            .finish()
    }
}

impl<B: ShardOps> RetroForward for RetroGather<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let shard: FloatTensor<B> = states.get_state(&self.input);
        // The inner backend's gather ignores its anchor: the shard stands in (no operation).
        let anchor = shard.clone();
        states.save(out_node, B::shard_gather(shard, anchor, self.spec.clone()));
    }
}

/// The parameter from every rank's shard. A rank whose shard cannot be read takes part with
/// zeros, so its peers are not left waiting in the collective; the failure is recorded, and
/// `backward` makes every rank fail with it. Zeros of the shard's type come back on that rank,
/// and on every rank once the collective failed.
fn gather<B: Backend>(shard: FloatTensor<B>, param: &ParamShard) -> FloatTensor<B> {
    let device = shard.device();
    let dtype = shard.dtype();
    let data = read::<B>(shard, param);
    param.group.count_gather();
    let gathered = match dtype {
        DType::BF16 => all_gather::<bf16>(data.as_ref(), param),
        DType::F16 => all_gather::<f16>(data.as_ref(), param),
        _ => all_gather::<f32>(data.as_ref(), param),
    };
    let data = gathered
        .filter(|_| data.is_some())
        .unwrap_or_else(|| zeros(&param.shape, dtype));
    B::float_from_data(data, &device)
}

/// This rank's shard of the parameter's gradient `grad`, averaged over the ranks, in f32
/// whatever `grad`'s type: the shard is an f32 master parameter (under autocast through a
/// cast, whose backward takes the f32 gradient as it is), so a half-precision gradient is
/// averaged in f32 and rounded never, as data parallelism averages it at the other stages.
/// A gradient that cannot be read takes part as zeros, as in [`gather`].
fn reduce_scatter<B: Backend>(grad: FloatTensor<B>, param: &ParamShard) -> FloatTensor<B> {
    let device = grad.device();
    let dtype = grad.dtype();
    let data = read::<B>(grad, param).map(|data| data.convert::<f32>());
    let reduced = reduce_scatter_mean(data.as_ref(), param);
    // A gradient that could not be read gets zeros of its own type (which the shard has too).
    let data = match (reduced, &data) {
        (Some(reduced), Some(_)) => reduced,
        (Some(_), None) => zeros(&[param.shard_len], dtype),
        (None, _) => zeros(&[param.shard_len], DType::F32),
    };
    B::float_from_data(data, &device)
}

/// The tensor's values on the host, as the type it has; `None` (recorded) when reading failed.
fn read<B: Backend>(tensor: FloatTensor<B>, param: &ParamShard) -> Option<TensorData> {
    let read = try_read_sync(B::float_into_data(tensor));
    match read {
        Some(Ok(data)) if matches!(data.dtype(), DType::F32 | DType::BF16 | DType::F16) => {
            Some(data)
        }
        Some(Ok(data)) => {
            let dtype = data.dtype();
            param.group.record_other(format!(
                "a sharded parameter is {dtype:?}; f32, bf16 or f16 expected"
            ));
            None
        }
        Some(Err(e)) => {
            param
                .group
                .record_other(format!("reading a sharded parameter failed: {e:?}"));
            None
        }
        None => {
            param
                .group
                .record_other("this platform cannot read a tensor synchronously".into());
            None
        }
    }
}

/// The gathered parameter, from this rank's shard `data` (zeros in its place when it could
/// not be read, or is not of type `E`: the failure is recorded).
fn all_gather<E>(data: Option<&TensorData>, param: &ParamShard) -> Option<TensorData>
where
    E: accelerate_kernels::Element + burn::tensor::Element,
{
    let group = &param.group;
    let zeros = vec![E::zeroed(); param.shard_len];
    let shard = data
        .and_then(|data| group.check(data.as_slice::<E>()))
        .unwrap_or(&zeros);
    let mut all = vec![E::zeroed(); param.shard_len * group.world_size()];
    group.run(|g| g.all_gather(shard, &mut all))?;
    all.truncate(param.numel);
    Some(TensorData::new(all, param.shape.clone()))
}

/// This rank's shard of the mean of every rank's gradient `data` (f32, the parameter's shape;
/// zeros in its place when it could not be read): reduce-scattered over the shard group, then
/// averaged across its replicas under hybrid sharding.
fn reduce_scatter_mean(data: Option<&TensorData>, param: &ParamShard) -> Option<TensorData> {
    let group = &param.group;
    let padded_len = param.shard_len * group.world_size();
    let grad = data.and_then(|data| group.check(data.as_slice::<f32>()));
    // A copy only when the parameter does not divide evenly (the padding must be zeros).
    let padded;
    let input = match grad {
        Some(grad) if grad.len() == padded_len => grad,
        grad => {
            let mut zeros = vec![0.0_f32; padded_len];
            if let Some(grad) = grad {
                let len = grad.len().min(padded_len);
                zeros[..len].copy_from_slice(&grad[..len]);
            }
            padded = zeros;
            &padded[..]
        }
    };
    let mut shard = vec![0.0_f32; param.shard_len];
    group.run(|g| g.reduce_scatter(input, &mut shard, Reduction::Mean))?;
    group.average_replicas(param.id, &mut shard)?;
    Some(TensorData::new(shard, [param.shard_len]))
}

/// Zeros of `shape` in `dtype` (every float type's zero is all bits clear).
fn zeros(shape: &[usize], dtype: DType) -> TensorData {
    let numel: usize = shape.iter().product();
    TensorData::from_bytes_vec(vec![0; numel * dtype.size()], shape.to_vec(), dtype)
}
