//! ZeRO-3 (fully sharded data parallel): [`Sharded<M>`] holds this rank's 1/N of a unit's
//! parameters, and [`Sharded::gather`] gives the unit back whole for its forward pass.
//!
//! Burn has no module hooks, so the model marks its units itself: a field `Sharded<Block>`
//! where it had `Block`, made by [`Accelerator::shard`](crate::Accelerator::shard), and
//! `self.block.gather_for(&x).forward(x)` in its forward pass. Each parameter is gathered by its own
//! differentiable operation ([`gather`]), so the gathered unit lives only while its forward
//! runs: Burn keeps the shard for backward and gathers again there (or keeps the gathered
//! parameter, with [`Sharded::reshard_after_forward`]`(false)`), and the backward pass
//! reduce-scatters each gradient into the shard's, averaged over the processes, as soon as it
//! has gone through the unit (`gather_for` anchors the gathers after the unit's input in the
//! graph; Burn's backward pass runs operations by depth). Optimizers,
//! Burn's or fused, see only the shards: every shard is a whole parameter to them. Tensors a
//! unit does not train (a batch norm's running statistics, frozen parameters) stay whole on
//! every process (`whole`).
//!
//! Gathering is a collective: every process gathers the same units in the same order (train
//! and evaluate on every process).

// Burn 0.22 deprecates its ndarray backend, which the gather still serves (the `ndarray`
// feature); the macro's code for it is generated inside this module.
#[allow(deprecated)]
mod gather;
mod group;
mod replicas;
mod whole;
mod whole_unit;

use std::fmt;
use std::sync::Arc;

use burn::backend::Dispatch;
use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
    Param, ParamId,
};
use burn::tensor::{Device, Tensor};

use crate::error::AccelerateError;
use crate::params;
use gather::{GatherSpec, ParamShard, ShardOps};
pub(crate) use group::ShardGroup;
pub(crate) use replicas::Averaged;
use whole::{WholeMapper, WholeVisitor};
pub use whole_unit::WholeUnit;

/// A unit of a model (a layer, a block) whose parameters are sharded over the processes:
/// this process holds `1/N` of each (ZeRO-3). Build it with
/// [`Accelerator::shard`](crate::Accelerator::shard); call [`gather`](Self::gather) in the
/// model's forward pass.
///
/// ```text
/// #[derive(Module, Debug)]
/// struct Model { blocks: Vec<Sharded<Block>>, head: Sharded<Linear> }
///
/// fn forward(&self, mut x: Tensor<3>) -> Tensor<3> {
///     for block in &self.blocks {
///         x = block.gather_for(&x).forward(x); // freed after its forward
///     }
///     self.head.gather_for(&x).forward(x)
/// }
/// ```
#[derive(Clone)]
pub struct Sharded<M> {
    /// This rank's shard of each trained float parameter (visit order of `M`), f32,
    /// `[shard_len]`.
    shards: Vec<Param<Tensor<1>>>,
    /// `M` with a one-element placeholder for each sharded parameter, and its tensors that are
    /// not trained (buffers such as a batch norm's running statistics, frozen parameters)
    /// whole: forward passes write into those, and the gathered units share them.
    skeleton: M,
    /// Each parameter's place in `M` and how it is cut.
    params: Arc<[UnitParam]>,
}

/// One parameter of a sharded unit.
struct UnitParam {
    id: ParamId,
    /// Its module path inside the unit (`["linear", "weight"]`).
    path: Vec<String>,
    spec: GatherSpec,
}

impl<M: Module> Sharded<M> {
    /// The unit, whole: every parameter gathered from every process (a collective). Under
    /// autodiff the gathered parameters are freed once the operations that use them ran, and
    /// gathered again in backward (see [`reshard_after_forward`](Self::reshard_after_forward)).
    ///
    /// In a forward pass prefer [`gather_for`](Self::gather_for): Burn's backward pass runs
    /// operations by their depth in the graph, and a gather with no input is at the bottom, so
    /// the reduce-scatters of this unit's gradients wait for the end of the backward pass,
    /// each gathered parameter's whole gradient held until then.
    pub fn gather(&self) -> M {
        self.gather_after(None)
    }

    /// The unit, whole, for a forward pass whose input is `input` (its values are not read):
    /// as [`gather`](Self::gather), and in backward each parameter's gradient is
    /// reduce-scattered into its shard and let go as soon as the backward pass has gone
    /// through the unit, so that one unit's whole gradients exist at a time rather than the
    /// whole model's.
    ///
    /// ```text
    /// x = block.gather_for(&x).forward(x);
    /// ```
    pub fn gather_for<const D: usize>(&self, input: &Tensor<D>) -> M {
        let gate = gather::AnchorGate::default();
        let anchor = <Dispatch as ShardOps>::shard_anchor(input.clone().into_dispatch(), gate);
        self.gather_after(Some(Tensor::<1>::from_dispatch(anchor)))
    }

    fn gather_after(&self, anchor: Option<Tensor<1>>) -> M {
        let mut gatherer = Gatherer {
            shards: self.shards.iter(),
            params: self.params.iter().peekable(),
            anchor,
        };
        self.skeleton.clone().map(&mut gatherer)
    }

    /// With `false`, the gathered parameters are kept from forward until backward instead of
    /// being gathered again there: one all-gather less per parameter and step, for the
    /// memory of the whole unit (FSDP's `reshard_after_forward`). `true` by default.
    pub fn reshard_after_forward(mut self, reshard: bool) -> Self {
        self.params = self
            .params
            .iter()
            .map(|param| UnitParam {
                id: param.id,
                path: param.path.clone(),
                spec: GatherSpec(Arc::new(ParamShard {
                    id: param.spec.0.id,
                    shape: param.spec.0.shape.clone(),
                    numel: param.spec.0.numel,
                    shard_len: param.spec.0.shard_len,
                    reshard,
                    group: param.spec.0.group.clone(),
                })),
            })
            .collect();
        self
    }

    /// Parameters of the whole unit (all ranks' shards together, without padding).
    pub fn num_params_gathered(&self) -> usize {
        self.params.iter().map(|p| p.spec.0.numel).sum()
    }

    /// The ids of the sharded parameters (their placeholders' in the skeleton).
    fn sharded_ids(&self) -> Vec<ParamId> {
        self.params.iter().map(|param| param.id).collect()
    }

    fn map_shards(
        self,
        f: impl Fn(Param<Tensor<1>>) -> Param<Tensor<1>>,
        skeleton: impl FnOnce(M) -> M,
    ) -> Self {
        Self {
            shards: self.shards.into_iter().map(f).collect(),
            skeleton: skeleton(self.skeleton),
            params: self.params,
        }
    }
}

impl<M: Module> Module for Sharded<M> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        let devices = self
            .shards
            .iter()
            .fold(devices, |devices, shard| shard.collect_devices(devices));
        self.skeleton.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        self.map_shards(|shard| shard.fork(device), |s| s.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        self.map_shards(|shard| shard.to_device(device), |s| s.to_device(device))
    }

    fn train(self) -> Self {
        self.map_shards(Module::train, Module::train)
    }

    fn valid(&self) -> Self {
        // The skeleton's own `valid` gives its whole tensors a copy of their own (a batch
        // norm's statistics as they are now), as an unsharded module's does.
        self.clone()
            .map_shards(|shard| shard.valid(), |skeleton| skeleton.valid())
    }

    fn materialize(self) -> Self {
        self
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        for (shard, param) in self.shards.iter().zip(self.params.iter()) {
            for name in &param.path {
                visitor.enter_module(name, "Sharded");
            }
            shard.visit(visitor);
            for name in param.path.iter().rev() {
                visitor.exit_module(name, "Sharded");
            }
        }
        let sharded = self.sharded_ids();
        self.skeleton.visit(&mut WholeVisitor {
            inner: visitor,
            sharded: &sharded,
        });
    }

    fn map<Mapper: ModuleMapper>(self, mapper: &mut Mapper) -> Self {
        let params = self.params.clone();
        let sharded = self.sharded_ids();
        let shards = self
            .shards
            .into_iter()
            .zip(params.iter())
            .map(|(shard, param)| {
                for name in &param.path {
                    mapper.enter_module(name, "Sharded");
                }
                let shard = Module::map(shard, mapper);
                for name in param.path.iter().rev() {
                    mapper.exit_module(name, "Sharded");
                }
                shard
            })
            .collect();
        let skeleton = self.skeleton.map(&mut WholeMapper {
            inner: mapper,
            sharded: &sharded,
        });
        Self {
            shards,
            skeleton,
            params,
        }
    }
}

impl<M: Module> ModuleDisplayDefault for Sharded<M> {
    fn content(&self, content: Content) -> Option<Content> {
        let whole = self.num_params_gathered();
        content
            .add_formatted(&format!(
                "Sharded {{ parameters: {}, elements: {whole} }}",
                self.params.len()
            ))
            .optional()
    }
}

impl<M: Module> ModuleDisplay for Sharded<M> {}

impl<M> fmt::Debug for Sharded<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sharded")
            .field("parameters", &self.params.len())
            .field("shards", &self.shards)
            .finish_non_exhaustive()
    }
}

/// A unit of a model that gives its module `M` whole: `M` itself, or a [`Sharded<M>`]
/// gathered. A model generic over it runs the same forward pass sharded or not:
///
/// ```text
/// struct Stack<L = Block> { blocks: Vec<L> }
/// impl<L: Unit<Block>> Stack<L> {
///     fn forward(&self, x: Tensor<3>) -> Tensor<3> {
///         self.blocks.iter().fold(x, |x, block| block.whole_for(&x).forward(x))
///     }
/// }
/// ```
pub trait Unit<M>: Module + ModuleDisplay {
    /// The module, whole (for a sharded unit, a collective: see [`Sharded::gather`]).
    fn whole(&self) -> M;

    /// The module, whole, for a forward pass on `input` (for a sharded unit
    /// [`Sharded::gather_for`], whose gradients are reduce-scattered as soon as backward has
    /// gone through it). [`whole`](Self::whole) unless a unit says otherwise.
    fn whole_for<const D: usize>(&self, input: &Tensor<D>) -> M {
        let _ = input;
        self.whole()
    }
}

impl<M: Module + ModuleDisplay> Unit<M> for M {
    fn whole(&self) -> M {
        self.clone()
    }
}

impl<M: Module> Unit<M> for Sharded<M> {
    fn whole(&self) -> M {
        self.gather()
    }

    fn whole_for<const D: usize>(&self, input: &Tensor<D>) -> M {
        self.gather_for(input)
    }
}

/// Replaces each placeholder of the skeleton with its gather; whole tensors stay.
struct Gatherer<'a> {
    shards: std::slice::Iter<'a, Param<Tensor<1>>>,
    params: std::iter::Peekable<std::slice::Iter<'a, UnitParam>>,
    /// What every gather follows in the graph: the input's anchor, or (none given) each
    /// gather's own shard, which leaves the gathers at the bottom of the graph.
    anchor: Option<Tensor<1>>,
}

impl ModuleMapper for Gatherer<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.params.peek().is_none_or(|next| next.id != param.id) {
            return param;
        }
        let (Some(shard), Some(unit_param)) = (self.shards.next(), self.params.next()) else {
            return param;
        };
        let shard = shard.val();
        // Without an input the shard is its own anchor: the gather stays at depth 1, and no
        // operation is added to the stream.
        let anchor = self.anchor.clone().unwrap_or_else(|| shard.clone());
        let gathered = Tensor::<D>::from_dispatch(<Dispatch as ShardOps>::shard_gather(
            shard.into_dispatch(),
            anchor.into_dispatch(),
            unit_param.spec.clone(),
        ));
        Param::initialized(param.id, gathered)
    }
}

/// `unit` sharded over `group`'s processes on `device`: each trained float parameter takes
/// rank 0's value and id, and this rank keeps its `ceil(numel / N)` elements (N the shard
/// group's processes; the last rank's padded with zeros); tensors not trained stay whole (`prepare` replicates rank 0's). One
/// parameter is whole at a time beyond the unit itself.
pub(crate) fn shard<M: Module>(
    unit: M,
    group: &Arc<ShardGroup>,
    device: &Device,
) -> Result<Sharded<M>, AccelerateError> {
    let unit = params::adopt_device(unit, device);
    // Rank 0's ids and values, over the whole job (each shard group cuts the same values).
    let job = group.job();
    let (rank, world) = group.shard_job();
    let ids: Vec<u64> = if job.is_distributed() {
        let layout = params::ParamLayout::of(&unit);
        job.lock().broadcast_object(Some(&layout.ids()), 0)?
    } else {
        params::ParamLayout::of(&unit).ids()
    };
    let mut cutter = Cutter {
        unit: group.new_unit(),
        group,
        device,
        rank,
        world,
        ids: ids.into_iter(),
        path: Vec::new(),
        shards: Vec::new(),
        params: Vec::new(),
        error: None,
    };
    let skeleton = unit.map(&mut cutter);
    if let Some(error) = cutter.error {
        return Err(error);
    }
    Ok(Sharded {
        shards: cutter.shards,
        skeleton,
        params: cutter.params.into(),
    })
}

/// Cuts each trained float parameter into this rank's shard, leaving a placeholder in its
/// place.
struct Cutter<'a> {
    /// The unit's number.
    unit: u64,
    group: &'a Arc<ShardGroup>,
    device: &'a Device,
    rank: usize,
    world: usize,
    ids: std::vec::IntoIter<u64>,
    path: Vec<String>,
    shards: Vec<Param<Tensor<1>>>,
    params: Vec<UnitParam>,
    error: Option<AccelerateError>,
}

impl Cutter<'_> {
    /// This rank's shard of `value` (rank 0's value, broadcast).
    fn cut(&mut self, value: Tensor<1>, shard_len: usize) -> Result<Vec<f32>, AccelerateError> {
        let mut whole = params::to_host_f32(value);
        let job = self.group.job();
        if job.is_distributed() {
            job.lock().broadcast(&mut whole, 0)?;
        }
        let start = (self.rank * shard_len).min(whole.len());
        let end = ((self.rank + 1) * shard_len).min(whole.len());
        let mut shard = whole[start..end].to_vec();
        shard.resize(shard_len, 0.0);
        Ok(shard)
    }
}

impl ModuleMapper for Cutter<'_> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let id = self.ids.next().map_or(param.id, ParamId::from);
        let value = param.val();
        if !value.is_require_grad() {
            // Not trained (a running statistic, a frozen parameter): whole, in the skeleton.
            return param;
        }
        let shape = value.shape();
        let numel = shape.num_elements();
        let shard_len = numel.div_ceil(self.world).max(1);
        if self.error.is_none() {
            match self.cut(value.reshape([numel]), shard_len) {
                Ok(shard) => {
                    let tensor = params::upload(shard, self.device).require_grad();
                    self.shards.push(Param::initialized(id, tensor));
                    self.group
                        .register(id, shape.as_slice().to_vec(), self.unit);
                }
                Err(e) => self.error = Some(e),
            }
        }
        self.params.push(UnitParam {
            id,
            path: self.path.clone(),
            spec: GatherSpec(Arc::new(ParamShard {
                id,
                shape: shape.as_slice().to_vec(),
                numel,
                shard_len,
                reshard: true,
                group: self.group.clone(),
            })),
        });
        // A placeholder the gather replaces: one element, so that the skeleton's own
        // `valid`, `fork` and `to_device` (for its whole tensors) cost nothing here.
        Param::initialized(id, Tensor::<D>::zeros([1; D], self.device))
    }
}
