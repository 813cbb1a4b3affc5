//! [`WholeUnit<M>`]: a unit of a model whose parameters stay whole on every process (ZeRO 0
//! to 2), marked so that its gradients are averaged as soon as the backward pass has left it,
//! while backward goes on through the units before it (see [`crate::overlap`]).

use std::fmt;
use std::sync::Arc;

use burn::backend::Dispatch;
use burn::module::{
    Content, Devices, Module, ModuleDisplay, ModuleDisplayDefault, ModuleMapper, ModuleVisitor,
    Param,
};
use burn::tensor::{Device, Tensor};

use super::Unit;
use super::gather::{AnchorGate, ShardOps};
use crate::overlap::{TapHub, TapSpec};

/// A unit of a model kept whole on every process, made by
/// [`Accelerator::unit`](crate::Accelerator::unit): in a forward pass,
/// `unit.whole_for(&x).forward(x)` (the [`Unit`] trait, as for a sharded unit) puts a tap on
/// each of its trained parameters, so that backward hands their gradients to a communication
/// thread as soon as it has gone through the unit. Saved, loaded and displayed as `M` itself.
#[derive(Clone)]
pub struct WholeUnit<M> {
    module: M,
    hub: Arc<TapHub>,
}

impl<M: Module> WholeUnit<M> {
    pub(crate) fn new(module: M, hub: Arc<TapHub>) -> Self {
        Self { module, hub }
    }

    /// The module.
    pub fn inner(&self) -> &M {
        &self.module
    }

    /// The module, unmarked.
    pub fn into_inner(self) -> M {
        self.module
    }

    fn map_module(self, f: impl FnOnce(M) -> M) -> Self {
        Self {
            module: f(self.module),
            hub: self.hub,
        }
    }
}

impl<M: Module + ModuleDisplay> Unit<M> for WholeUnit<M> {
    fn whole(&self) -> M {
        self.module.clone()
    }

    fn whole_for<const D: usize>(&self, input: &Tensor<D>) -> M {
        if !self.hub.enabled() {
            return self.module.clone();
        }
        let gate = AnchorGate(Some(Arc::clone(&self.hub)));
        let anchor = <Dispatch as ShardOps>::shard_anchor(input.clone().into_dispatch(), gate);
        self.module.clone().map(&mut Tapper {
            anchor: Tensor::<1>::from_dispatch(anchor),
            hub: &self.hub,
        })
    }
}

/// Puts a tap on each trained float parameter.
struct Tapper<'a> {
    anchor: Tensor<1>,
    hub: &'a Arc<TapHub>,
}

impl ModuleMapper for Tapper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        // Every float tensor, whether a parameter (a leaf) or its autocast view (a cast of
        // one): a tap on a tensor autodiff does not track adds no node.
        let value = param.val();
        let tap = TapSpec {
            hub: Arc::clone(self.hub),
            id: param.id,
        };
        let tapped = <Dispatch as ShardOps>::unit_tap(
            value.into_dispatch(),
            self.anchor.clone().into_dispatch(),
            tap,
        );
        Param::initialized(param.id, Tensor::<D>::from_dispatch(tapped))
    }
}

impl<M: Module> Module for WholeUnit<M> {
    fn collect_devices(&self, devices: Devices) -> Devices {
        self.module.collect_devices(devices)
    }

    fn fork(self, device: &Device) -> Self {
        self.map_module(|m| m.fork(device))
    }

    fn to_device(self, device: &Device) -> Self {
        self.map_module(|m| m.to_device(device))
    }

    fn train(self) -> Self {
        self.map_module(Module::train)
    }

    fn valid(&self) -> Self {
        Self {
            module: self.module.valid(),
            hub: Arc::clone(&self.hub),
        }
    }

    fn materialize(self) -> Self {
        self.map_module(Module::materialize)
    }

    fn visit<V: ModuleVisitor>(&self, visitor: &mut V) {
        self.module.visit(visitor);
    }

    fn map<Mapper: ModuleMapper>(self, mapper: &mut Mapper) -> Self {
        self.map_module(|m| m.map(mapper))
    }
}

impl<M: Module + ModuleDisplay> ModuleDisplayDefault for WholeUnit<M> {
    fn content(&self, content: Content) -> Option<Content> {
        self.module.content(content)
    }

    fn num_params(&self) -> usize {
        Module::num_params(&self.module)
    }
}

impl<M: Module + ModuleDisplay> ModuleDisplay for WholeUnit<M> {}

impl<M: fmt::Debug> fmt::Debug for WholeUnit<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("WholeUnit").field(&self.module).finish()
    }
}
