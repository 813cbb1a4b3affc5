//! The model's float parameters in module visit order: the one place that walks a module.
//!
//! [`ParamLayout`] is built once at prepare (ids, paths, shapes, ranks, trainable flags); it is
//! what every rank, reducer and checkpoint agrees on. Parameters are matched across processes
//! by this order, never by `ParamId` (Burn draws ids at random per process).
//!
//! Gradients move between Burn's [`GradientsParams`] and our visit-order lists without walking
//! the module again: the layout knows each parameter's id and tensor rank, and a rank is
//! dispatched to Burn's const-generic `remove::<D>` / `register::<D>` by [`with_rank!`].

use std::ops::Range;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor, TensorData};

/// Gradients (or values) in layout order, flattened to one dimension; `None` where a
/// parameter has none.
pub(crate) type ParamList = Vec<Option<Tensor<1>>>;

/// Largest tensor rank a parameter may have (Burn's modules use at most 5).
pub(crate) const MAX_RANK: usize = 8;

/// One float parameter of the model.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ParamEntry {
    /// Burn's id (the same on every rank after prepare).
    pub id: ParamId,
    /// Module path, e.g. `layers.0.weight` (per-group learning rates, messages).
    pub path: String,
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Elements.
    pub numel: usize,
    /// False for frozen parameters (no gradient is ever taken for them).
    pub trainable: bool,
}

/// The model's float parameters in visit order.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ParamLayout {
    /// Every float parameter, in visit order.
    pub entries: Vec<ParamEntry>,
}

/// Calls `$body` with `const $d: usize` set to `$rank` (1 to [`MAX_RANK`]); `$otherwise` for
/// any other rank.
macro_rules! with_rank {
    ($rank:expr, $d:ident => $body:expr, _ => $otherwise:expr) => {
        match $rank {
            1 => {
                const $d: usize = 1;
                $body
            }
            2 => {
                const $d: usize = 2;
                $body
            }
            3 => {
                const $d: usize = 3;
                $body
            }
            4 => {
                const $d: usize = 4;
                $body
            }
            5 => {
                const $d: usize = 5;
                $body
            }
            6 => {
                const $d: usize = 6;
                $body
            }
            7 => {
                const $d: usize = 7;
                $body
            }
            8 => {
                const $d: usize = 8;
                $body
            }
            _ => $otherwise,
        }
    };
}

impl ParamLayout {
    /// The layout of `model`.
    pub fn of<M: Module>(model: &M) -> Self {
        struct Collect {
            path: Vec<String>,
            entries: Vec<ParamEntry>,
        }
        impl ModuleVisitor for Collect {
            fn enter_module(&mut self, name: &str, _container_type: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _name: &str, _container_type: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let shape = param.lazy_shape().as_slice().to_vec();
                self.entries.push(ParamEntry {
                    id: param.id,
                    path: self.path.join("."),
                    numel: shape.iter().product(),
                    shape,
                    trainable: param.val().is_require_grad(),
                });
            }
        }
        let mut collect = Collect {
            path: Vec::new(),
            entries: Vec::new(),
        };
        model.visit(&mut collect);
        Self {
            entries: collect.entries,
        }
    }

    /// Parameter ids in visit order.
    pub fn ids(&self) -> Vec<u64> {
        self.entries.iter().map(|e| e.id.val()).collect()
    }

    /// Consecutive entries grouped into buckets of at least `bucket_bytes` (their trainable
    /// elements as f32), the last one possibly smaller, and cut also wherever `unit_of`
    /// changes (a unit's bucket then holds only that unit's parameters).
    pub fn buckets(
        &self,
        bucket_bytes: usize,
        unit_of: impl Fn(ParamId) -> Option<u64>,
    ) -> Vec<Range<usize>> {
        let units: Vec<Option<u64>> = self.entries.iter().map(|e| unit_of(e.id)).collect();
        let mut buckets = Vec::new();
        let (mut start, mut bytes) = (0, 0usize);
        for (i, entry) in self.entries.iter().enumerate() {
            if i > start && units[i] != units[i - 1] {
                buckets.push(start..i);
                (start, bytes) = (i, 0);
            }
            if entry.trainable {
                bytes = bytes.saturating_add(entry.numel.saturating_mul(4));
            }
            if bytes >= bucket_bytes {
                buckets.push(start..i + 1);
                (start, bytes) = (i + 1, 0);
            }
        }
        if start < self.entries.len() {
            buckets.push(start..self.entries.len());
        }
        buckets
    }

    /// Parameter shapes in visit order.
    pub fn shapes(&self) -> Vec<Vec<usize>> {
        self.entries.iter().map(|e| e.shape.clone()).collect()
    }

    /// The same layout with `ids` (visit order) in place of its own.
    pub fn with_ids(mut self, ids: &[u64]) -> Self {
        for (entry, id) in self.entries.iter_mut().zip(ids) {
            entry.id = ParamId::from(*id);
        }
        self
    }

    /// Takes this layout's gradients out of `grads`, flattened, in visit order. Gradients left
    /// over belong to parameters the layout does not know: the model is not the one prepared,
    /// which the error describes.
    pub fn take_grads(&self, mut grads: GradientsParams) -> Result<ParamList, UnknownGradients> {
        let list = self
            .entries
            .iter()
            .map(|entry| {
                let id = entry.id;
                let numel = entry.numel;
                with_rank!(entry.shape.len(), D => grads.remove::<D>(id).map(|g| g.reshape([numel])), _ => None)
            })
            .collect();
        if !grads.is_empty() {
            return Err(UnknownGradients {
                found: grads.len(),
                prepared: self.entries.len(),
            });
        }
        Ok(list)
    }

    /// Burn's gradient set from a visit-order list (each reshaped to its parameter's shape).
    pub fn to_grads(&self, list: ParamList) -> GradientsParams {
        let mut grads = GradientsParams::new();
        for (entry, grad) in self.entries.iter().zip(list) {
            let Some(grad) = grad else { continue };
            let id = entry.id;
            with_rank!(entry.shape.len(), D => {
                let dims: [usize; D] = std::array::from_fn(|i| entry.shape[i]);
                grads.register::<D>(id, grad.reshape(dims));
            }, _ => ());
        }
        grads
    }

    /// The first parameter whose rank this crate cannot move gradients for, if any.
    pub fn unsupported_rank(&self) -> Option<&ParamEntry> {
        self.entries
            .iter()
            .find(|e| e.shape.is_empty() || e.shape.len() > MAX_RANK)
    }
}

/// Every float parameter's value, flattened, in visit order (plain tensors, no autodiff).
pub(crate) fn values<M: Module>(model: &M) -> Vec<Tensor<1>> {
    struct Values(Vec<Tensor<1>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.val().inner();
            let n = value.shape().num_elements();
            self.0.push(value.reshape([n]));
        }
    }
    let mut collect = Values(Vec::new());
    model.visit(&mut collect);
    collect.0
}

/// Copies `data` into `target` as f32 (a plain copy when it already is f32). `target` must
/// have exactly as many elements.
pub(crate) fn copy_f32(data: TensorData, target: &mut [f32]) {
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

/// `data` as f32: itself when it already is (no copy).
pub(crate) fn into_f32(data: TensorData) -> TensorData {
    if data.dtype() == DType::F32 {
        data
    } else {
        data.convert::<f32>()
    }
}

/// `data`'s values as an f32 vector: its own buffer when it already is one and nothing else
/// shares it (no copy), else converted or copied.
pub(crate) fn into_f32_vec(data: TensorData) -> Result<Vec<f32>, burn::tensor::DataError> {
    into_f32(data).try_into_vec::<f32>()
}

/// Appends `values` to `out` as little-endian f32 bytes (one copy on a little-endian CPU,
/// where checkpoints' flat state and shards are serialised on the training thread).
pub(crate) fn extend_le_bytes(out: &mut Vec<u8>, values: &[f32]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(values));
    } else {
        out.reserve(values.len().saturating_mul(4));
        for v in values {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// A tensor's values as f32 on the host.
pub(crate) fn to_host_f32(tensor: Tensor<1>) -> Vec<f32> {
    let mut out = vec![0.0; tensor.shape().num_elements()];
    copy_f32(tensor.into_data(), &mut out);
    out
}

/// New values (and ids) for a model's float parameters, in visit order.
pub(crate) struct Replacement {
    /// New flat values per parameter; `None` keeps a parameter's value.
    pub values: ParamList,
    /// New ids per parameter (visit order); empty keeps the ids.
    pub ids: Vec<u64>,
}

/// `model` with `replacement` applied. A value keeps its parameter's dtype, autodiff tracking
/// and gradient-checkpointing strategy; values that are plain tensors on the model's backend
/// (views of a flat device buffer) join the model's autodiff graph here.
pub(crate) fn replace<M: Module>(model: M, replacement: Replacement) -> M {
    struct Replace {
        values: std::vec::IntoIter<Option<Tensor<1>>>,
        ids: std::vec::IntoIter<u64>,
    }
    impl ModuleMapper for Replace {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let id = self.ids.next().map(ParamId::from);
            match self.values.next() {
                Some(Some(value)) => with_value(param, value, id),
                _ => with_value_id(param, id),
            }
        }
    }
    model.map(&mut Replace {
        values: replacement.values.into_iter(),
        ids: replacement.ids.into_iter(),
    })
}

/// `param` holding `value` (flat, its element count) in its place: the same shape, dtype,
/// autodiff association, checkpointing strategy and gradient setting; under `id` when given.
pub(crate) fn with_value<const D: usize>(
    param: Param<Tensor<D>>,
    value: Tensor<1>,
    id: Option<ParamId>,
) -> Param<Tensor<D>> {
    let (own_id, tensor, mapper) = param.consume();
    let value = Placement::of(&tensor).place(value.reshape(tensor.shape()));
    Param::from_mapped_value(id.unwrap_or(own_id), value, mapper)
}

/// How a parameter's tensor sits in its model: what a new value takes from it.
struct Placement {
    autodiff: bool,
    strategy: Option<burn::tensor::GradientCheckpointingStrategy>,
    dtype: DType,
    require_grad: bool,
}

impl Placement {
    fn of<const D: usize>(tensor: &Tensor<D>) -> Self {
        Self {
            autodiff: tensor.is_autodiff(),
            strategy: tensor.gradient_checkpointing_strategy(),
            dtype: tensor.dtype(),
            require_grad: tensor.is_require_grad(),
        }
    }

    /// `value` (the parameter's shape) placed as the parameter was.
    fn place<const D: usize>(&self, mut value: Tensor<D>) -> Tensor<D> {
        if self.autodiff {
            value = match self.strategy {
                Some(strategy) => value
                    .autodiff()
                    .with_gradient_checkpointing_strategy(strategy),
                None => value.autodiff(),
            };
        }
        if value.dtype() != self.dtype {
            value = value.cast(self.dtype);
        }
        if self.require_grad {
            value = value.require_grad();
        }
        value
    }
}

/// New values computed from the current ones, one parameter at a time
/// ([`update_each`]).
pub(crate) trait ParamUpdate {
    /// Whether float parameter `index` (visit order) takes a new value.
    fn updates(&self, index: usize) -> bool;
    /// The new value of parameter `index` (flat) from its current values (flat, moved out of
    /// the model: a uniquely owned tensor hands its storage over uncopied).
    fn update(&mut self, index: usize, current: TensorData) -> Tensor<1>;
}

/// `model` with each float parameter that `update` updates replaced, one at a time: the old
/// value is let go before the next parameter is read, so at most one parameter exists twice.
pub(crate) fn update_each<M: Module>(model: M, update: &mut dyn ParamUpdate) -> M {
    struct Each<'a> {
        next: usize,
        update: &'a mut dyn ParamUpdate,
    }
    impl ModuleMapper for Each<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let index = self.next;
            self.next += 1;
            if !self.update.updates(index) {
                return param;
            }
            let (id, tensor, mapper) = param.consume();
            let placement = Placement::of(&tensor);
            let shape = tensor.shape();
            let numel = shape.num_elements();
            let current = tensor.detach().reshape([numel]).into_data();
            let value = self.update.update(index, current).reshape(shape);
            Param::from_mapped_value(id, placement.place(value), mapper)
        }
    }
    model.map(&mut Each { next: 0, update })
}

/// `param` under `id` when given, its value as it is.
pub(crate) fn with_value_id<const D: usize>(
    param: Param<Tensor<D>>,
    id: Option<ParamId>,
) -> Param<Tensor<D>> {
    match id {
        Some(id) => {
            let (_, tensor, mapper) = param.consume();
            Param::from_mapped_value(id, tensor, mapper)
        }
        None => param,
    }
}

/// The id of `model`'s first float parameter (what tells prepared models apart).
pub(crate) fn first_id<M: Module>(model: &M) -> Option<ParamId> {
    struct First(Option<ParamId>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.get_or_insert(param.id);
        }
    }
    let mut first = First(None);
    model.visit(&mut first);
    first.0
}

/// `model` trained on `device`: its float parameters take the device's autodiff association
/// and gradient-checkpointing strategy. Burn's `fork` keeps each tensor's own, so a model built
/// on a plain device would train without gradients and one built on another autodiff device
/// would keep that device's strategy (Burn panics when an operation mixes two strategies).
pub(crate) fn adopt_device<M: Module>(model: M, device: &burn::tensor::Device) -> M {
    struct Adopt(Option<burn::tensor::GradientCheckpointingStrategy>);
    impl ModuleMapper for Adopt {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(strategy) = self.0 else {
                return param;
            };
            let (id, tensor, mapper) = param.consume();
            let tensor = if tensor.gradient_checkpointing_strategy() == Some(strategy) {
                tensor
            } else {
                tensor.with_gradient_checkpointing_strategy(strategy)
            };
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    let model = model.fork(device);
    let model = if device.is_autodiff() {
        // `train` enables autodiff on parameters that lack it, each requiring gradients as its
        // module configured (frozen ones stay frozen).
        model.train()
    } else {
        model
    };
    model.map(&mut Adopt(device.gradient_checkpointing_strategy()))
}

/// A flat f32 host buffer as a plain tensor of shape `[len]` on `device`.
pub(crate) fn upload(values: Vec<f32>, device: &burn::tensor::Device) -> Tensor<1> {
    let len = values.len();
    Tensor::<1>::from_data(TensorData::new(values, [len]), device)
}

/// Converts a gradient to f32 when it is not already.
pub(crate) fn as_f32(tensor: Tensor<1>) -> Tensor<1> {
    if tensor.dtype() == DType::F32 {
        tensor
    } else {
        tensor.cast(DType::F32)
    }
}
/// Gradients of parameters a layout does not know ([`ParamLayout::take_grads`]): the model
/// is not the one prepared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "{found} gradients belong to parameters that are not among the {prepared} the model was \
     prepared with"
)]
pub(crate) struct UnknownGradients {
    /// Gradients left over.
    pub found: usize,
    /// Parameters of the prepared model.
    pub prepared: usize,
}
