//! One epoch of the Learner on every process: the training loop (the step, the window's
//! sum, its average over the processes, the Learner's optimizer step, the outputs put
//! together for the main process's metrics) and the validation loop, and the agreement of
//! every process on stopping.

use burn::data::dataloader::Progress;
use burn::data::dataset::DatasetError;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::{DType, Tensor};
use burn::train::train::WorkerFailure;
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel,
    SupervisedTrainingEventProcessor, TrainLoader, TrainOutput, TrainStep, TrainingError,
    TrainingItem, ValidLoader,
};

use super::outputs::GatherOutput;
use crate::accelerator::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::precision::leaf_view;
use crate::reducer::GradientReducer;

/// An accelerator error as the Learner reports a failed worker (the error names the rank).
pub(super) fn failure(rank: usize, error: AccelerateError) -> TrainingError {
    TrainingError::Workers(vec![WorkerFailure {
        device_id: rank,
        message: error.to_string(),
    }])
}

/// Batches between two checks that no process asked to stop (one small collective each; the
/// end of every split is checked too): a stop takes effect within this many batches.
const STOP_CHECK_BATCHES: usize = 8;

/// What one epoch's loops share.
pub(super) struct EpochRun<'a, B: AcceleratorBackend, M: LearnerModel> {
    /// The accelerator whose processes train.
    pub acc: &'a Accelerator<B>,
    /// The Learner's: errors and stops are recorded here.
    pub interrupter: &'a Interrupter,
    /// The Learner's events (metrics, renderer); fed on the main process only.
    pub processor: &'a mut SupervisedTrainingEventProcessor<M>,
    /// Averages the Learner's gradients over the processes.
    pub reducer: Box<dyn GradientReducer>,
    /// Whether this is the main process.
    pub main: bool,
    /// Clips each window's averaged gradients to this global norm.
    pub max_grad_norm: Option<f32>,
}

impl<B: AcceleratorBackend, M: LearnerModel> EpochRun<'_, B, M> {
    /// Records `error`, naming this rank; the loops stop.
    pub fn fail(&self, error: AccelerateError) {
        self.interrupter
            .fail(failure(self.acc.process_index(), error));
    }

    /// A batch from the loader, or `None` after recording the loader's error (the loop
    /// stops).
    fn loaded<T>(&self, batch: Result<T, DatasetError>) -> Option<T> {
        batch.map_err(|error| self.interrupter.fail(error)).ok()
    }

    /// `result`'s value, or `None` after recording its error (the loop stops).
    fn ok<T>(&self, result: Result<T, AccelerateError>) -> Option<T> {
        result.map_err(|error| self.fail(error)).ok()
    }

    /// Whether every process stops now: a stop asked on any process stops all. A process
    /// that failed stops at once without asking (the others may be waiting in another
    /// collective; they fail when it ends, naming it).
    pub fn stop_agreed(&self) -> bool {
        if self.interrupter.error().is_some() {
            return true;
        }
        let mine = self.interrupter.should_stop();
        match self.acc.sum_across_processes([f64::from(u8::from(mine))]) {
            Ok([stops]) => {
                if stops > 0.0 && !mine {
                    self.interrupter
                        .stop(Some("another process of the job stopped training"));
                }
                stops > 0.0
            }
            Err(error) => {
                self.fail(error);
                true
            }
        }
    }

    /// One step of the model on `item`: in f32, or on a bf16 copy of the weights whose
    /// gradients come back in f32.
    fn train_step(
        &self,
        learner: &Learner<M>,
        item: <M as TrainStep>::Input,
    ) -> TrainOutput<<M as TrainStep>::Output> {
        let dtype = self.acc.compute_dtype();
        if dtype == DType::F32 {
            return learner.train_step(item);
        }
        let master = learner.model();
        let view = leaf_view(&master, dtype);
        let TrainOutput { grads, item } = TrainStep::step(&view, item);
        TrainOutput {
            grads: grads_in_f32(&master, grads),
            item,
        }
    }

    /// The window's summed gradients averaged over the processes (and clipped), for the
    /// Learner's optimizer.
    fn reduce(
        &mut self,
        grads: GradientsParams,
    ) -> Result<Option<GradientsParams>, AccelerateError> {
        if self.acc.num_processes() == 1 && self.max_grad_norm.is_none() {
            // Nothing to average or clip: the Learner's own gradients, as burn-train has them.
            return Ok(Some(grads));
        }
        let mut reduced = self.acc.reduce_window(self.reducer.as_mut(), grads)?;
        if let Some(max_norm) = self.max_grad_norm {
            reduced.clip(max_norm);
        }
        Ok(reduced.to_params())
    }

    /// One training epoch: a step per batch, an update per window, each batch's outputs to
    /// the main process's metrics.
    pub fn train_epoch(
        &mut self,
        learner: &mut Learner<M>,
        loader: &TrainLoader<M>,
        accumulation: Option<usize>,
        epoch: &Progress,
    ) where
        <M as TrainStep>::Output: GatherOutput,
    {
        tracing::debug!(epoch = epoch.items_processed, "Learner: training epoch");
        let mut batches = loader.iter();
        let mut iteration = 0;
        let mut accumulator = GradientsAccumulator::<M>::new();
        let mut in_window = 0;
        while let Some(item) = batches.next() {
            let Some(item) = self.loaded(item) else { break };
            iteration += 1;
            let progress = batches.progress();
            let TrainOutput { grads, item } = self.train_step(learner, item);
            let due = match accumulation {
                Some(window) => {
                    accumulator.accumulate(&learner.model(), grads);
                    in_window += 1;
                    (in_window >= window || progress.is_completed()).then(|| {
                        in_window = 0;
                        accumulator.grads()
                    })
                }
                None => Some(grads),
            };
            if let Some(summed) = due {
                let reduced = self.reduce(summed);
                let Some(averaged) = self.ok(reduced) else {
                    break;
                };
                if let Some(averaged) = averaged {
                    learner.lr_step();
                    learner.optimizer_step(averaged);
                }
            }
            let Some(item) = self.ok(item.gather(self.acc)) else {
                break;
            };
            if self.main {
                let item =
                    TrainingItem::new(item, progress, Some(iteration), Some(learner.lr_current()));
                self.interrupter.fail_on_error(
                    self.processor
                        .process_train(LearnerEvent::ProcessedItem(item)),
                );
            }
            if iteration % STOP_CHECK_BATCHES == 0 && self.stop_agreed() {
                break;
            }
        }
    }

    /// One validation epoch on the model without autodiff, its outputs to the main process's
    /// metrics.
    pub fn valid_epoch(&mut self, learner: &Learner<M>, loader: &ValidLoader<M>, epoch: &Progress)
    where
        <M as InferenceStep>::Output: GatherOutput,
    {
        tracing::debug!(epoch = epoch.items_processed, "Learner: validation epoch");
        let model = learner.model().valid();
        let mut batches = loader.iter();
        let mut iteration = 0;
        while let Some(item) = batches.next() {
            let Some(item) = self.loaded(item) else { break };
            iteration += 1;
            let progress = batches.progress();
            let output = InferenceStep::step(&model, item).gather(self.acc);
            let Some(item) = self.ok(output) else { break };
            if self.main {
                let item = TrainingItem::new(item, progress, Some(iteration), None);
                self.interrupter.fail_on_error(
                    self.processor
                        .process_valid(LearnerEvent::ProcessedItem(item)),
                );
            }
            if iteration % STOP_CHECK_BATCHES == 0 && self.stop_agreed() {
                break;
            }
        }
    }
}

/// `grads` (of a low-precision copy of `master`, under the same ids) in f32.
fn grads_in_f32<M: Module>(master: &M, grads: GradientsParams) -> GradientsParams {
    struct ToF32(GradientsParams);
    impl ModuleVisitor for ToF32 {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let id: ParamId = param.id;
            if let Some(grad) = self.0.remove::<D>(id) {
                let grad = if grad.dtype() == DType::F32 {
                    grad
                } else {
                    grad.cast(DType::F32)
                };
                self.0.register(id, grad);
            }
        }
    }
    let mut visitor = ToF32(grads);
    master.visit(&mut visitor);
    visitor.0
}
