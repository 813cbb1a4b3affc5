//! A multi-layer perceptron classifier with ReLU activations.

use accelerate_burn::{Autocast, burn};
use burn::config::Config;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig, Relu};
use burn::tensor::{DType, Device, Int, Tensor};

/// Layer sizes of an [`Mlp`].
#[derive(Config, Debug)]
pub struct MlpConfig {
    /// Input features.
    pub input: usize,
    /// Width of each hidden layer, in order.
    pub hidden: Vec<usize>,
    /// Output classes.
    pub classes: usize,
    /// Probability of zeroing a hidden activation while training.
    #[config(default = 0.0)]
    pub dropout: f64,
}

/// Linear layers with ReLU (and dropout, if configured) between them.
#[derive(Module, Debug)]
pub struct Mlp {
    layers: Vec<Linear>,
    activation: Relu,
    dropout: Dropout,
}

/// The loss of a batch and the logits it came from.
pub struct Prediction {
    /// Mean cross-entropy over the batch.
    pub loss: Tensor<1>,
    /// One row of class scores per sample.
    pub logits: Tensor<2>,
}

impl Autocast for Prediction {
    fn autocast(self, dtype: DType) -> Self {
        Prediction {
            loss: self.loss.autocast(dtype),
            logits: self.logits.autocast(dtype),
        }
    }
}

impl MlpConfig {
    /// Builds the model with Burn's default initialisation on `device`.
    pub fn init(&self, device: &Device) -> Mlp {
        let mut sizes = vec![self.input];
        sizes.extend(&self.hidden);
        sizes.push(self.classes);
        let layers = sizes
            .windows(2)
            .map(|w| LinearConfig::new(w[0], w[1]).init(device))
            .collect();
        Mlp {
            layers,
            activation: Relu::new(),
            dropout: DropoutConfig::new(self.dropout).init(),
        }
    }
}

impl Mlp {
    /// Class scores for a `[batch, input]` tensor.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let last = self.layers.len() - 1;
        self.layers.iter().enumerate().fold(x, |x, (i, layer)| {
            let y = layer.forward(x);
            if i < last {
                self.dropout.forward(self.activation.forward(y))
            } else {
                y
            }
        })
    }

    /// Scores and mean cross-entropy against `targets`.
    pub fn forward_loss(&self, x: Tensor<2>, targets: Tensor<1, Int>) -> Prediction {
        let logits = self.forward(x);
        let loss = CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits.clone(), targets);
        Prediction { loss, logits }
    }
}
