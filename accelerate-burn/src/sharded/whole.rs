//! What a sharded unit keeps whole: the tensors it does not train (a batch norm's running
//! statistics, frozen parameters) stay in its skeleton on every process, so that what a forward
//! pass writes into them is still there at the next gather (FSDP does not shard buffers either).
//! These two filters visit and map them there, passing over the skeleton's placeholders of the
//! sharded parameters (which the shards stand for).

use burn::module::{Flag, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Bool, Int, Tensor};

/// Visits the whole tensors of a skeleton with `inner`.
pub(super) struct WholeVisitor<'a, V> {
    pub inner: &'a mut V,
    /// Ids of the unit's sharded parameters.
    pub sharded: &'a [ParamId],
}

impl<V: ModuleVisitor> ModuleVisitor for WholeVisitor<'_, V> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !self.sharded.contains(&param.id) {
            self.inner.visit_float(param);
        }
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
        self.inner.visit_int(param);
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
        self.inner.visit_bool(param);
    }

    fn visit_flag(&mut self, flag: &Param<Flag>) {
        self.inner.visit_flag(flag);
    }

    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.inner.enter_module(name, container_type);
    }

    fn exit_module(&mut self, name: &str, container_type: &str) {
        self.inner.exit_module(name, container_type);
    }

    fn visit_float_with_path<const D: usize>(
        &mut self,
        path: &[String],
        id: ParamId,
        tensor: &Tensor<D>,
    ) {
        if !self.sharded.contains(&id) {
            self.inner.visit_float_with_path(path, id, tensor);
        }
    }

    fn visit_int_with_path<const D: usize>(
        &mut self,
        path: &[String],
        id: ParamId,
        tensor: &Tensor<D, Int>,
    ) {
        self.inner.visit_int_with_path(path, id, tensor);
    }

    fn visit_bool_with_path<const D: usize>(
        &mut self,
        path: &[String],
        id: ParamId,
        tensor: &Tensor<D, Bool>,
    ) {
        self.inner.visit_bool_with_path(path, id, tensor);
    }
}

/// Maps the whole tensors of a skeleton with `inner`; the placeholders stay as they are.
pub(super) struct WholeMapper<'a, M> {
    pub inner: &'a mut M,
    /// Ids of the unit's sharded parameters.
    pub sharded: &'a [ParamId],
}

impl<M: ModuleMapper> ModuleMapper for WholeMapper<'_, M> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if self.sharded.contains(&param.id) {
            param
        } else {
            self.inner.map_float(param)
        }
    }

    fn map_int<const D: usize>(&mut self, param: Param<Tensor<D, Int>>) -> Param<Tensor<D, Int>> {
        self.inner.map_int(param)
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<D, Bool>>,
    ) -> Param<Tensor<D, Bool>> {
        self.inner.map_bool(param)
    }

    fn map_flag(&mut self, flag: Param<Flag>) -> Param<Flag> {
        self.inner.map_flag(flag)
    }

    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.inner.enter_module(name, container_type);
    }

    fn exit_module(&mut self, name: &str, container_type: &str) {
        self.inner.exit_module(name, container_type);
    }
}
