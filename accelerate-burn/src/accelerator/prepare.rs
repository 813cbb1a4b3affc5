//! [`Prepare`]: what [`Accelerator::prepare`](crate::Accelerator::prepare) accepts.

use burn::module::Module;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig};

use super::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::data::{DataLoader, PreparedDataLoader};
use crate::error::AccelerateError;
use crate::fused::FusedOptimizer;
use crate::optim::PreparedOptimizer;
use crate::stream::{PreparedStreamLoader, StreamLoader};

/// Something an accelerator can prepare: a data loader, or the tuples `(model, optim)`,
/// `(model, optim, train_loader)` and `(model, optim, train_loader, eval_loader)` (an optimizer
/// is prepared for its model: its gradient reducer is built from the model's parameters). A
/// model alone goes through [`prepare_model`](crate::Accelerator::prepare_model).
pub trait Prepare<B: AcceleratorBackend> {
    /// The prepared form.
    type Prepared;

    /// Prepares `self` for `acc`.
    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError>;
}

/// An optimizer `prepare` accepts beside its model.
///
/// - Burn's configs [`AdamWConfig`], [`AdamConfig`] and [`SgdConfig`]: the fused update
///   ([`crate::fused`]) whenever it computes the same thing, else Burn's optimizer from
///   `config.init()`, with one debug-level message saying why (per-tensor gradient clipping,
///   cautious weight decay).
/// - A [`FusedOptimizer`]: always the fused update (settings it lacks are an error).
/// - Burn's [`ModuleOptimizer`] (what `config.init()` returns, or any optimizer of your own):
///   always Burn's optimizer, as given.
pub trait OptimizerSource {
    /// Prepares it for `model` (already prepared) on `acc`.
    fn prepare_for<B: AcceleratorBackend, M: Module>(
        self,
        acc: &Accelerator<B>,
        model: &M,
    ) -> Result<PreparedOptimizer, AccelerateError>;
}

impl OptimizerSource for ModuleOptimizer {
    fn prepare_for<B: AcceleratorBackend, M: Module>(
        self,
        acc: &Accelerator<B>,
        model: &M,
    ) -> Result<PreparedOptimizer, AccelerateError> {
        acc.prepare_optimizer(model, self)
    }
}

/// Burn's configs: the fused update when `fused` (built from the config) exists, else Burn's
/// optimizer, saying why at debug level.
fn fused_or_burn<B: AcceleratorBackend, M: Module>(
    acc: &Accelerator<B>,
    model: &M,
    fused: Result<FusedOptimizer, AccelerateError>,
    burn: impl FnOnce() -> ModuleOptimizer,
) -> Result<PreparedOptimizer, AccelerateError> {
    match fused {
        Ok(fused) => acc.prepare_fused_optimizer(model, fused),
        Err(why) => {
            tracing::debug!(
                rank = acc.state.rank,
                "Burn's optimizer, not the fused update: {why}"
            );
            acc.prepare_optimizer(model, burn())
        }
    }
}

macro_rules! config_source {
    ($config:ty, $fused:path) => {
        impl OptimizerSource for $config {
            fn prepare_for<B: AcceleratorBackend, M: Module>(
                self,
                acc: &Accelerator<B>,
                model: &M,
            ) -> Result<PreparedOptimizer, AccelerateError> {
                fused_or_burn(acc, model, $fused(&self), || self.init())
            }
        }
    };
}

config_source!(AdamWConfig, FusedOptimizer::adamw);
config_source!(AdamConfig, FusedOptimizer::adam);
config_source!(SgdConfig, FusedOptimizer::sgd);

impl OptimizerSource for FusedOptimizer {
    fn prepare_for<B: AcceleratorBackend, M: Module>(
        self,
        acc: &Accelerator<B>,
        model: &M,
    ) -> Result<PreparedOptimizer, AccelerateError> {
        acc.prepare_fused_optimizer(model, self)
    }
}

impl<B: AcceleratorBackend, I, O> Prepare<B> for DataLoader<I, O> {
    type Prepared = PreparedDataLoader<I, O>;

    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError> {
        acc.prepare_data_loader(self)
    }
}

impl<B: AcceleratorBackend, I, O> Prepare<B> for StreamLoader<I, O> {
    type Prepared = PreparedStreamLoader<I, O>;

    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError> {
        acc.prepare_stream_loader(self)
    }
}

impl<B: AcceleratorBackend, M: Module, S: OptimizerSource> Prepare<B> for (M, S) {
    type Prepared = (M, PreparedOptimizer);

    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError> {
        let model = acc.prepare_model(self.0)?;
        let optim = self.1.prepare_for(acc, &model)?;
        Ok((model, optim))
    }
}

impl<B: AcceleratorBackend, M: Module, S: OptimizerSource, I, O> Prepare<B>
    for (M, S, DataLoader<I, O>)
{
    type Prepared = (M, PreparedOptimizer, PreparedDataLoader<I, O>);

    fn prepare(self, acc: &Accelerator<B>) -> Result<Self::Prepared, AccelerateError> {
        let (model, optim) = acc.prepare((self.0, self.1))?;
        Ok((model, optim, acc.prepare_data_loader(self.2)?))
    }
}

impl<B: AcceleratorBackend, M: Module, S: OptimizerSource, I, O, J, P> Prepare<B>
    for (M, S, DataLoader<I, O>, DataLoader<J, P>)
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
