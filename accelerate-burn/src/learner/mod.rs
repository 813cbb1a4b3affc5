//! burn-train's Learner on the accelerator (feature `train`): a Burn user who trains with
//! `SupervisedTraining` / `Learner` gets processes, hosts, bf16 and global clipping by passing
//! [`AcceleratorStrategy`] as the custom training strategy and building the two loaders with
//! [`Accelerator::learner_loader`](crate::Accelerator::learner_loader) and
//! [`Accelerator::learner_eval_loader`](crate::Accelerator::learner_eval_loader).
//!
//! The strategy reuses the accelerator's reducers, sampler and process group; the Learner keeps
//! its optimizer, scheduler, metrics, renderer and checkpointer.
//!
//! ```
//! use std::sync::Arc;
//!
//! use accelerate_burn::learner::{AcceleratorStrategy, SilentRenderer};
//! use accelerate_burn::{Accelerator, DataLoader, DefaultBackend};
//! use burn::data::dataloader::batcher::Batcher;
//! use burn::data::dataset::InMemDataset;
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::SgdConfig;
//! use burn::tensor::{Device, Tensor};
//! use burn::train::metric::LossMetric;
//! use burn::train::{InferenceStep, Learner, RegressionOutput, SupervisedTraining, TrainOutput, TrainStep};
//!
//! #[derive(Module, Debug)]
//! struct Line {
//!     linear: Linear,
//! }
//!
//! impl Line {
//!     fn regression(&self, (x, y): (Tensor<2>, Tensor<2>)) -> RegressionOutput {
//!         let output = self.linear.forward(x);
//!         let loss = (output.clone() - y.clone()).square().mean();
//!         RegressionOutput::new(loss, output, y)
//!     }
//! }
//!
//! impl TrainStep for Line {
//!     type Input = (Tensor<2>, Tensor<2>);
//!     type Output = RegressionOutput;
//!     fn step(&self, batch: Self::Input) -> TrainOutput<RegressionOutput> {
//!         let item = self.regression(batch);
//!         TrainOutput::new(self, item.loss.backward(), item)
//!     }
//! }
//!
//! impl InferenceStep for Line {
//!     type Input = (Tensor<2>, Tensor<2>);
//!     type Output = RegressionOutput;
//!     fn step(&self, batch: Self::Input) -> RegressionOutput {
//!         self.regression(batch)
//!     }
//! }
//!
//! #[derive(Clone)]
//! struct Pairs;
//! impl Batcher<[f32; 2], (Tensor<2>, Tensor<2>)> for Pairs {
//!     fn batch(&self, items: Vec<[f32; 2]>, device: &Device) -> (Tensor<2>, Tensor<2>) {
//!         let n = items.len();
//!         let x: Vec<f32> = items.iter().map(|p| p[0]).collect();
//!         let y: Vec<f32> = items.iter().map(|p| p[1]).collect();
//!         (
//!             Tensor::<1>::from_floats(x.as_slice(), device).reshape([n, 1]),
//!             Tensor::<1>::from_floats(y.as_slice(), device).reshape([n, 1]),
//!         )
//!     }
//! }
//!
//! // Learn y = 3x from 64 points.
//! let data: Vec<[f32; 2]> = (0..64).map(|i| [i as f32 / 64.0, 3.0 * i as f32 / 64.0]).collect();
//! let acc = Arc::new(Accelerator::<DefaultBackend>::from_env()?);
//! let loader = || DataLoader::builder(Pairs).batch_size(16).build(InMemDataset::new(data.clone()));
//! let train = acc.learner_loader(loader())?;
//! let valid = acc.learner_eval_loader(loader())?;
//! let dir = tempfile::tempdir()?;
//! let result = SupervisedTraining::new(dir.path(), train, valid)
//!     .metrics((LossMetric::new(),))
//!     .num_epochs(100)
//!     .renderer(Box::new(SilentRenderer))
//!     .with_application_logger(None)
//!     .with_training_strategy(AcceleratorStrategy::new(acc.clone()).into())
//!     .launch(Learner::new(
//!         Line { linear: LinearConfig::new(1, 1).init(&acc.device()) },
//!         SgdConfig::new().init(),
//!         0.5,
//!     ));
//! assert!(result.error.is_none());
//! let w: f32 = result.model.linear.weight.val().into_scalar();
//! assert!((w - 3.0).abs() < 0.05, "learned weight {w}");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod checkpoints;
mod epoch;
mod loader;
mod outputs;
mod renderer;
mod strategy;

pub use checkpoints::{DurableCheckpointer, durable_checkpointers, latest_learner_checkpoint};
pub use loader::LearnerLoader;
pub use outputs::{GatherOutput, gather_loss};
pub use renderer::SilentRenderer;
pub use strategy::AcceleratorStrategy;
