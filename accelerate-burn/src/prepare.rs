//! [`Prepare`]: what [`Accelerator::prepare`](crate::Accelerator::prepare) accepts.

use burn::module::Module;
use burn::optim::ModuleOptimizer;

use crate::accelerator::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::data::{DataLoader, PreparedDataLoader};
use crate::error::AccelerateError;
use crate::optim::PreparedOptimizer;

/// Something an accelerator can prepare: an optimizer, a data loader, or the tuples
/// `(model, optim)`, `(model, optim, train_loader)` and `(model, optim, train_loader,
/// eval_loader)`. A model alone goes through
/// [`prepare_model`](crate::Accelerator::prepare_model).
pub trait Prepare<B: AcceleratorBackend> {
    /// The prepared form.
    type Prepared;

    /// Prepares `self` for `acc`.
    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError>;
}

impl<B: AcceleratorBackend> Prepare<B> for ModuleOptimizer {
    type Prepared = PreparedOptimizer;

    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError> {
        Ok(acc.prepare_optimizer(self))
    }
}

impl<B: AcceleratorBackend, I, O> Prepare<B> for DataLoader<I, O> {
    type Prepared = PreparedDataLoader<I, O>;

    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError> {
        acc.prepare_data_loader(self)
    }
}

impl<B: AcceleratorBackend, M: Module> Prepare<B> for (M, ModuleOptimizer) {
    type Prepared = (M, PreparedOptimizer);

    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError> {
        Ok((acc.prepare_model(self.0)?, acc.prepare_optimizer(self.1)))
    }
}

impl<B: AcceleratorBackend, M: Module, I, O> Prepare<B> for (M, ModuleOptimizer, DataLoader<I, O>) {
    type Prepared = (M, PreparedOptimizer, PreparedDataLoader<I, O>);

    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError> {
        let (model, optim) = acc.prepare((self.0, self.1))?;
        Ok((model, optim, acc.prepare_data_loader(self.2)?))
    }
}

impl<B: AcceleratorBackend, M: Module, I, O, J, P> Prepare<B>
    for (M, ModuleOptimizer, DataLoader<I, O>, DataLoader<J, P>)
{
    type Prepared = (
        M,
        PreparedOptimizer,
        PreparedDataLoader<I, O>,
        PreparedDataLoader<J, P>,
    );

    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError> {
        let (model, optim, train) = acc.prepare((self.0, self.1, self.2))?;
        Ok((model, optim, train, acc.prepare_eval_data_loader(self.3)?))
    }
}
