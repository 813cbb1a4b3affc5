//! Who draws the Learner's progress: the main process alone. burn-train builds its renderer in
//! `SupervisedTraining::launch`, before any strategy runs, and picks its terminal UI whenever
//! stdout is a terminal, which under torchrun is every process's; each would take the
//! terminal over. [`AcceleratorStrategy::renderer`] gives the main process burn-train's
//! default and the others a [`SilentRenderer`].

use burn::train::Interrupter;
use burn::train::LearnerSummary;
use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::MetricDefinition;
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, default_renderer,
};

use super::strategy::AcceleratorStrategy;
use crate::backend::AcceleratorBackend;

/// A renderer that shows nothing (the Learner's metrics still reach its loggers).
#[derive(Debug, Default, Clone, Copy)]
pub struct SilentRenderer;

impl<B: AcceleratorBackend> AcceleratorStrategy<B> {
    /// The renderer for this process: burn-train's default on the main process (its terminal
    /// UI on a terminal, else its plain output), a [`SilentRenderer`] on the others. Give it
    /// to `SupervisedTraining::renderer`, with the training's interrupter (so that the UI's
    /// stop key stops every process) and the epoch it resumes from:
    ///
    /// ```text
    /// let training = SupervisedTraining::new(dir, train, valid);
    /// let renderer = strategy.renderer(training.interrupter(), None);
    /// let training = training.renderer(renderer).with_training_strategy(strategy.into());
    /// ```
    pub fn renderer(
        &self,
        interrupter: Interrupter,
        checkpoint: Option<usize>,
    ) -> Box<dyn MetricsRenderer> {
        if self.accelerator().is_main_process() {
            default_renderer(interrupter, checkpoint)
        } else {
            Box::new(SilentRenderer)
        }
    }
}

impl MetricsRendererTraining for SilentRenderer {
    fn update_train(&mut self, _state: MetricState) {}

    fn update_valid(&mut self, _state: MetricState) {}

    fn on_train_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl MetricsRendererEvaluation for SilentRenderer {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}

    fn on_test_end(
        &mut self,
        _summary: Option<LearnerSummary>,
    ) -> Result<(), Box<dyn core::error::Error>> {
        Ok(())
    }
}

impl TrainingProgressLogger for SilentRenderer {
    fn start(
        &mut self,
        _epochs: usize,
        _first: usize,
        _items: Option<usize>,
        _label: Option<&str>,
    ) {
    }

    fn update_epoch(&mut self, _epoch: usize) {}

    fn start_split(&mut self, _split: &str, _total_items: usize) {}

    fn update_split(&mut self, _items_processed: usize) {}

    fn end_split(&mut self) {}

    fn end(&mut self) {}

    fn log_event_training(&mut self, _event: String) {}
}

impl EvaluationProgressLogger for SilentRenderer {
    fn start_global_progress(&mut self, _total_tests: usize) {}

    fn start_test(&mut self, _name: &str, _total_items: usize) {}

    fn update_test_progress(&mut self, _items_processed: usize) {}

    fn end_test(&mut self) {}

    fn end_global_progress(&mut self) {}

    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for SilentRenderer {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, _definition: MetricDefinition) {}
}
