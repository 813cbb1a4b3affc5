//! Autocast: running a forward pass in bf16 or fp16 on a low-precision view of f32 master
//! weights.
//!
//! The view casts every float parameter (`Tensor::cast` is tracked by autodiff, so gradients
//! flow back to the f32 master parameters and arrive as f32), the inputs are cast with the
//! [`Caster`] the closure receives, and float outputs come back as f32 (so the loss and the
//! metrics are f32). Burn's CPU backend refuses to multiply an f16 weight by an f32 input,
//! which is why inputs go through the caster.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Bool, DType, Int, Tensor};

/// Values autocast converts: float tensors change dtype, everything else passes through.
/// Implement it for a batch or output type to pass it through autocast whole.
pub trait Autocast {
    /// `self` with its float tensors in `dtype`.
    fn autocast(self, dtype: DType) -> Self;
}

impl<const D: usize> Autocast for Tensor<D> {
    fn autocast(self, dtype: DType) -> Self {
        crate::nn::cast(self, dtype)
    }
}

impl<const D: usize> Autocast for Tensor<D, Int> {
    fn autocast(self, _dtype: DType) -> Self {
        self
    }
}

impl<const D: usize> Autocast for Tensor<D, Bool> {
    fn autocast(self, _dtype: DType) -> Self {
        self
    }
}

impl Autocast for DType {
    fn autocast(self, _dtype: DType) -> Self {
        self
    }
}

impl Autocast for () {
    fn autocast(self, _dtype: DType) -> Self {}
}

impl<T: Autocast> Autocast for Vec<T> {
    fn autocast(self, dtype: DType) -> Self {
        self.into_iter().map(|t| t.autocast(dtype)).collect()
    }
}

impl<T: Autocast> Autocast for Option<T> {
    fn autocast(self, dtype: DType) -> Self {
        self.map(|t| t.autocast(dtype))
    }
}

impl<A: Autocast, B: Autocast> Autocast for (A, B) {
    fn autocast(self, dtype: DType) -> Self {
        (self.0.autocast(dtype), self.1.autocast(dtype))
    }
}

impl<A: Autocast, B: Autocast, C: Autocast> Autocast for (A, B, C) {
    fn autocast(self, dtype: DType) -> Self {
        (
            self.0.autocast(dtype),
            self.1.autocast(dtype),
            self.2.autocast(dtype),
        )
    }
}

/// Casts inputs to the dtype of an autocast forward pass.
#[derive(Debug, Clone, Copy)]
pub struct Caster {
    dtype: DType,
}

impl Caster {
    pub(crate) fn new(dtype: DType) -> Self {
        Self { dtype }
    }

    /// `value` with its float tensors in the compute dtype.
    pub fn input<T: Autocast>(&self, value: T) -> T {
        value.autocast(self.dtype)
    }

    /// The compute dtype (f32 without mixed precision).
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

/// `model` with its float parameters in `dtype` as leaves of their own (same ids, gradients
/// required as in `model`): a step that takes its gradients from the copy itself (a Learner's
/// `TrainStep`) gets them under the master's ids, in `dtype`.
#[cfg(feature = "train")]
pub(crate) fn leaf_view<M: Module>(model: &M, dtype: DType) -> M {
    struct Leaf(DType);
    impl ModuleMapper for Leaf {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|t| {
                let grad = t.is_require_grad();
                // Detached after the cast: a cast is a node of the graph, not a leaf.
                let copy = crate::nn::cast(t, dtype).detach();
                if grad { copy.require_grad() } else { copy }
            })
        }
    }
    model.clone().map(&mut Leaf(dtype))
}

/// The view of `model` whose float parameters are cast to `dtype` (tracked: their gradients
/// reach the f32 masters), once per forward pass.
pub(crate) fn low_precision_view<M: Module>(model: &M, dtype: DType) -> M {
    struct Cast(DType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|t| crate::nn::cast(t, dtype))
        }
    }
    model.clone().map(&mut Cast(dtype))
}
