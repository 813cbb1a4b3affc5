//! The Learner's training loop over the accelerator's processes: each process trains on its
//! share of every round, gradients are summed over an accumulation window on each process and
//! averaged across the processes once per window (our reducer, in buckets), then Burn's
//! optimizer inside the Learner steps identically on every process. Outputs are put together
//! for the main process, which alone reports metrics, checkpoints and decides early stopping.

use std::sync::Arc;

use accelerate_core::MixedPrecision;
use burn::data::dataloader::Progress;
use burn::tensor::DType;
use burn::train::{
    EventProcessorTraining, InferenceStep, Learner, LearnerEvent, LearnerModel, LearningResult,
    SupervisedLearningStrategy, SupervisedTrainingEventProcessor, TrainLoader, TrainStep,
    TrainingComponents, TrainingStrategy, ValidLoader,
};

use super::epoch::{EpochRun, failure};
use super::outputs::GatherOutput;
use crate::accelerator::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::error::AccelerateError;
use crate::reducer::GradientReducer;

/// burn-train's Learner on an [`Accelerator`]: pass it to
/// `SupervisedTraining::with_training_strategy` and the same training runs on one process or
/// many (`accelerate-rs launch`, torchrun, mpirun, srun; one host or several), with the
/// accelerator's settings:
///
/// - every process trains on its share of each round (the loaders of
///   [`Accelerator::learner_loader`] / [`Accelerator::learner_eval_loader`]);
/// - with `grads_accumulation(k)`, gradients are summed over `k` batches on each process (as
///   burn-train does on one device) and averaged across the processes once per window;
///   [`clip_grad_norm`](Self::clip_grad_norm) clips the averaged gradients by their global
///   norm before the Learner's optimizer steps;
/// - `mixed_precision: bf16` runs each step's forward and backward on a bf16 copy of the
///   weights and updates the f32 weights;
/// - the main process alone runs the renderer, metrics (over every process's outputs, see
///   [`GatherOutput`]), the checkpointer and early stopping, whose decision every process
///   follows; a stop asked on any process (the TUI's `q`) stops every process.
///
/// ```text
/// let acc = Arc::new(Accelerator::<DefaultBackend>::from_env()?);
/// let train = acc.learner_loader(DataLoader::builder(batcher).batch_size(64).shuffle(42).build(train_set))?;
/// let valid = acc.learner_eval_loader(DataLoader::builder(batcher).batch_size(64).build(test_set))?;
/// let result = SupervisedTraining::new(dir, train, valid)
///     .metrics((AccuracyMetric::new(), LossMetric::new()))
///     .num_epochs(3)
///     .with_training_strategy(AcceleratorStrategy::new(acc.clone()).into())
///     .launch(Learner::new(model, AdamConfig::new().init(), 1e-3));
/// ```
pub struct AcceleratorStrategy<B: AcceleratorBackend> {
    acc: Arc<Accelerator<B>>,
    max_grad_norm: Option<f32>,
}

impl<B: AcceleratorBackend> AcceleratorStrategy<B> {
    /// A strategy training on `acc`'s processes.
    pub fn new(acc: Arc<Accelerator<B>>) -> Self {
        Self {
            acc,
            max_grad_norm: None,
        }
    }

    /// Clips the averaged gradients of every window so that their global L2 norm (over every
    /// parameter together) is at most `max_norm` (burn-train's optimizers clip each tensor on
    /// its own).
    pub fn clip_grad_norm(mut self, max_norm: f32) -> Self {
        self.max_grad_norm = Some(max_norm);
        self
    }

    /// The accelerator the strategy trains on.
    pub fn accelerator(&self) -> &Arc<Accelerator<B>> {
        &self.acc
    }
}

impl<B, M> From<AcceleratorStrategy<B>> for TrainingStrategy<M>
where
    B: AcceleratorBackend,
    M: LearnerModel,
    <M as TrainStep>::Output: GatherOutput,
    <M as InferenceStep>::Output: GatherOutput,
{
    fn from(strategy: AcceleratorStrategy<B>) -> Self {
        TrainingStrategy::Custom(Arc::new(strategy))
    }
}

impl<B, M> SupervisedLearningStrategy<M> for AcceleratorStrategy<B>
where
    B: AcceleratorBackend,
    M: LearnerModel,
    <M as TrainStep>::Output: GatherOutput,
    <M as InferenceStep>::Output: GatherOutput,
{
    /// burn-train's `train`, with the renderer's events on the main process only.
    fn train(
        &self,
        learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        mut components: TrainingComponents<M>,
    ) -> LearningResult<M> {
        let starting_epoch = components.checkpoint.unwrap_or(0) + 1;
        let summary_config = components.summary.clone();
        let interrupter = components.interrupter.clone();
        let main = self.acc.is_main_process();
        if main {
            interrupter.fail_on_error(components.event_processor.process_train(
                LearnerEvent::Start {
                    total_epochs: components.num_epochs,
                    starting_epoch,
                    label: components.label.clone(),
                },
            ));
        }
        let (model, mut processor) = self.fit(
            components,
            learner,
            dataloader_train,
            dataloader_valid,
            starting_epoch,
        );
        if main {
            // burn-train's own strategies also name the model in the summary, through a
            // setter private to burn-train.
            let summary = summary_config.and_then(|summary| summary.init().ok());
            interrupter.fail_on_error(processor.process_train(LearnerEvent::End(summary)));
        }
        let model = model.valid();
        interrupter.fail_on_error(processor.flush());
        LearningResult {
            model,
            renderer: processor.renderer(),
            interrupted: interrupter.interruption(),
            error: interrupter.error(),
        }
    }

    fn fit(
        &self,
        components: TrainingComponents<M>,
        mut learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let acc = &*self.acc;
        let TrainingComponents {
            num_epochs,
            mut checkpointer,
            grad_accumulation,
            interrupter,
            mut early_stopping,
            mut event_processor,
            event_store,
            ..
        } = components;
        let reducer = match self.setup(&mut learner) {
            Ok(reducer) => reducer,
            Err(error) => {
                interrupter.fail(failure(acc.process_index(), error));
                return (learner.model(), event_processor);
            }
        };
        let device = acc.device();
        let train = dataloader_train.to_device(&device);
        let valid = dataloader_valid.to_device(&device.clone().inner());
        let mut run = EpochRun {
            acc,
            interrupter: &interrupter,
            processor: &mut event_processor,
            reducer,
            main: acc.is_main_process(),
            max_grad_norm: self.max_grad_norm,
        };
        for epoch in starting_epoch..=num_epochs {
            let progress = Progress::new(epoch, num_epochs, Some("epochs".to_string()));
            // Epochs count from 1 in burn-train, from 0 in our loaders; the random stream
            // restarts from (seed, epoch) so that a run resumed at an epoch draws what the
            // uninterrupted run drew.
            let index = (epoch as u64).saturating_sub(1);
            acc.links.set_train_epoch(index);
            acc.set_seed(self.epoch_seed(index));
            if run.main {
                interrupter.fail_on_error(run.processor.process_train(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: train.num_items(),
                }));
            }
            run.train_epoch(&mut learner, &train, grad_accumulation, &progress);
            if run.main {
                interrupter
                    .fail_on_error(run.processor.process_train(LearnerEvent::EndSplit(epoch)));
            }
            if run.stop_agreed() {
                break;
            }
            if run.main {
                interrupter.fail_on_error(run.processor.process_valid(LearnerEvent::StartSplit {
                    epoch_number: epoch,
                    total_items: valid.num_items(),
                }));
            }
            run.valid_epoch(&learner, &valid, &progress);
            if run.main {
                interrupter
                    .fail_on_error(run.processor.process_valid(LearnerEvent::EndSplit(epoch)));
                interrupter
                    .fail_on_error(run.processor.process_train(LearnerEvent::EndEpoch(epoch)));
                if checkpointer.is_some() || early_stopping.is_some() {
                    interrupter.fail_on_error(run.processor.flush());
                }
            }
            if run.stop_agreed() {
                break;
            }
            // Every process holds the same learner: the main process writes it.
            if run.main
                && let Some(checkpointer) = &mut checkpointer
            {
                checkpointer.checkpoint(&learner, epoch, &event_store);
            }
            // Metrics live on the main process: it decides, every process follows.
            let stop_early = run.main
                && early_stopping
                    .as_mut()
                    .is_some_and(|early| early.should_stop(epoch, &event_store));
            match acc.sum_across_processes([f64::from(u8::from(stop_early))]) {
                Ok([stops]) if stops > 0.0 => break,
                Ok(_) => {}
                Err(error) => {
                    run.fail(error);
                    break;
                }
            }
        }
        (learner.model(), event_processor)
    }
}

impl<B: AcceleratorBackend> AcceleratorStrategy<B> {
    /// Checks the configuration, gives every process rank 0's model and returns the reducer
    /// of its gradients.
    fn setup<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
    ) -> Result<Box<dyn GradientReducer>, AccelerateError> {
        let acc = &*self.acc;
        let rank = acc.process_index();
        let config = acc.config();
        if config.mixed_precision == MixedPrecision::Fp16 {
            return Err(AccelerateError::Misuse {
                rank,
                what: "mixed_precision fp16 with burn-train's Learner: fp16 needs the loss \
                       scaled before backward, and the Learner's loss is computed and \
                       backpropagated inside the model's TrainStep::step"
                    .to_string(),
                hint: "use bf16 (f32's range, no loss scaling), or a loop of your own with \
                       Accelerator::backward",
            });
        }
        if config.zero_stage >= 2 {
            return Err(AccelerateError::Misuse {
                rank,
                what: format!(
                    "zero_stage {} with burn-train's Learner, whose optimizer updates whole \
                     parameters from whole gradients",
                    config.zero_stage
                ),
                hint: "set zero_stage 0 (or train a loop of your own with a fused optimizer)",
            });
        }
        if acc.num_processes() > 1 {
            if acc.links.learner_train_casts().is_none() {
                return Err(AccelerateError::Misuse {
                    rank,
                    what: "the Learner's training loader was not prepared by the accelerator"
                        .to_string(),
                    hint: "build it with acc.learner_loader(DataLoader::builder(batcher)...): \
                           each process then trains on its own share of every round",
                });
            }
            if !acc.links.has_learner_eval_loader() {
                return Err(AccelerateError::Misuse {
                    rank,
                    what: "the Learner's validation loader was not prepared by the accelerator"
                        .to_string(),
                    hint: "build it with acc.learner_eval_loader(DataLoader::builder(batcher)...)",
                });
            }
        }
        if acc.compute_dtype() != DType::F32 && acc.links.learner_train_casts() != Some(true) {
            return Err(AccelerateError::Misuse {
                rank,
                what: format!(
                    "mixed_precision {:?} with burn-train's Learner and a training loader whose \
                     batches stay f32: the step runs on a {:?} copy of the weights, and Burn's \
                     operations do not mix dtypes",
                    config.mixed_precision,
                    acc.compute_dtype()
                ),
                hint: "implement accelerate_burn::Autocast for the batch type (cast its float \
                       tensors) and build the training loader with acc.learner_loader_autocast",
            });
        }
        learner.fork(&acc.device());
        if acc.num_processes() > 1 {
            let model = acc.prepare_model(learner.model())?;
            learner.load_model(model.into_record());
        }
        // The layout of the model as the Learner now holds it (the ids its steps report).
        acc.window_reducer(&learner.model())
    }

    /// The random stream's seed for epoch `epoch` (from 0) on this process.
    fn epoch_seed(&self, epoch: u64) -> u64 {
        let seed = self.acc.config().seed.unwrap_or(0);
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(epoch.wrapping_mul(0x0001_0000_01B3))
            .wrapping_add(self.acc.process_index() as u64)
    }
}
