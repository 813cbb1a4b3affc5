//! Whole-model operations on gradients, keyed by parameter and walked in module visit order:
//! summing two sets (accumulation), the global L2 norm and scaling (clipping).

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;

/// Adds every gradient of `addend` into `sum`, parameter by parameter.
pub(crate) fn add_into<M: Module>(sum: &mut GradientsParams, addend: GradientsParams, model: &M) {
    struct Add<'a> {
        sum: &'a mut GradientsParams,
        addend: GradientsParams,
    }
    impl ModuleVisitor for Add<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.addend.remove::<D>(param.id) {
                let total = match self.sum.remove::<D>(param.id) {
                    Some(previous) => previous + grad,
                    None => grad,
                };
                self.sum.register(param.id, total);
            }
        }
    }
    model.visit(&mut Add { sum, addend });
}

/// The L2 norm over all gradients of `model` in `grads`, computed on the device; `None` when
/// there are no gradients.
pub(crate) fn global_norm<M: Module>(grads: &GradientsParams, model: &M) -> Option<f32> {
    struct SumSquares<'a> {
        grads: &'a GradientsParams,
        total: Option<Tensor<1>>,
    }
    impl ModuleVisitor for SumSquares<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.grads.get::<D>(param.id) {
                let squares = grad.square().sum();
                self.total = Some(match self.total.take() {
                    Some(total) => total + squares,
                    None => squares,
                });
            }
        }
    }
    let mut visitor = SumSquares { grads, total: None };
    model.visit(&mut visitor);
    visitor.total.map(|total| total.sqrt().into_scalar::<f32>())
}

/// Multiplies every gradient of `model` in `grads` by `factor`.
pub(crate) fn scale<M: Module>(grads: &mut GradientsParams, factor: f32, model: &M) {
    struct Scale<'a> {
        grads: &'a mut GradientsParams,
        factor: f32,
    }
    impl ModuleVisitor for Scale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.grads.remove::<D>(param.id) {
                self.grads.register(param.id, grad.mul_scalar(self.factor));
            }
        }
    }
    model.visit(&mut Scale { grads, factor });
}

/// Unscales every gradient of `model` in `grads` on the device with our cubecl kernel (one
/// pass per tensor, in place) and says whether any value is not finite; one 4-byte read.
#[cfg(feature = "device-kernels")]
pub(crate) fn unscale_and_check_on_device<M: Module>(
    grads: &mut GradientsParams,
    inv_scale: f32,
    model: &M,
) -> bool {
    use crate::device_kernels::OverflowFlag;

    struct Unscale<'a> {
        grads: &'a mut GradientsParams,
        inv_scale: f32,
        flag: Option<OverflowFlag>,
    }
    impl ModuleVisitor for Unscale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.grads.remove::<D>(param.id) {
                let flag = self
                    .flag
                    .get_or_insert_with(|| OverflowFlag::new(&grad.device()));
                let grad = flag.unscale(grad, self.inv_scale);
                self.grads.register(param.id, grad);
            }
        }
    }
    let mut unscale = Unscale {
        grads,
        inv_scale,
        flag: None,
    };
    model.visit(&mut unscale);
    unscale.flag.is_some_and(OverflowFlag::found)
}
