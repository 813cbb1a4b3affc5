//! The small regression network and rows several test files train: 8 inputs, a ReLU hidden
//! layer, 2 outputs, deterministic weights and data (no draw from the process-wide generator,
//! which tests running in parallel share). Each including test crate uses part of it.

#![allow(dead_code)]

use accelerate_burn::burn;
use burn::data::dataloader::batcher::Batcher;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, Relu};
use burn::tensor::{Device, Tensor, TensorData};

#[derive(Module, Debug)]
pub struct Net {
    pub hidden: Linear,
    pub out: Linear,
    pub act: Relu,
}

/// A linear layer with fixed pseudo-random values.
pub fn linear(inputs: usize, outputs: usize, salt: usize, device: &Device) -> Linear {
    let value = |i: usize| ((i * 2654435761 + salt * 97) % 1000) as f32 / 1000.0 - 0.5;
    let weight: Vec<f32> = (0..inputs * outputs)
        .map(|i| value(i) / (inputs as f32).sqrt())
        .collect();
    let bias: Vec<f32> = (0..outputs).map(|i| value(i + 7) * 0.1).collect();
    Linear {
        weight: Param::from_tensor(Tensor::from_data(
            TensorData::new(weight, [inputs, outputs]),
            device,
        )),
        bias: Some(Param::from_tensor(Tensor::from_data(
            TensorData::new(bias, [outputs]),
            device,
        ))),
    }
}

impl Net {
    /// 32 hidden units.
    pub fn new(device: &Device) -> Self {
        Self::with_hidden(device, 32)
    }

    /// `hidden` hidden units.
    pub fn with_hidden(device: &Device, hidden: usize) -> Self {
        Self {
            hidden: linear(8, hidden, 1, device),
            out: linear(hidden, 2, 2, device),
            act: Relu::new(),
        }
    }

    /// Mean squared error on a batch.
    pub fn loss(&self, (x, y): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
        (self.out.forward(self.act.forward(self.hidden.forward(x))) - y)
            .square()
            .mean()
    }
}

/// Every float parameter's values, in visit order.
pub fn values<M: Module>(model: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.extend(param.val().into_data().iter::<f32>());
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

/// One row: 8 inputs, 2 targets.
pub type Item = ([f32; 8], [f32; 2]);

/// Batches rows into (inputs, targets).
#[derive(Clone)]
pub struct Rows;

impl Batcher<Item, (Tensor<2>, Tensor<2>)> for Rows {
    fn batch(&self, items: Vec<Item>, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|(x, _)| *x).collect();
        let y: Vec<f32> = items.iter().flat_map(|(_, y)| *y).collect();
        (
            Tensor::from_data(TensorData::new(x, [n, 8]), device),
            Tensor::from_data(TensorData::new(y, [n, 2]), device),
        )
    }
}

/// `rows` rows of a smooth target.
pub fn data(rows: usize) -> Vec<Item> {
    (0..rows)
        .map(|i| {
            let x: [f32; 8] = std::array::from_fn(|j| ((i * 7 + j * 3) % 11) as f32 / 5.0 - 1.0);
            let y = [x[0] * 2.0 - x[3], x[5] + 0.5 * x[1] * x[2]];
            (x, y)
        })
        .collect()
}
