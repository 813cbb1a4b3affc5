//! A user's own crate, as the README's "Use it in your project" tells a user to write it. CI
//! creates a new cargo project, gives it the README's dependency lines and this file, and
//! builds it against the packaged accelerate-rs crates (never the repository's sources), so a
//! file missing from a package fails CI. It trains an MLP on digit-like 8x8 images it makes
//! itself, checks the test accuracy, saves the model and loads it back with plain Burn.
//!
//! Runs as one process (`cargo run`) or several (`accelerate-rs launch -n 2 ...`).

use accelerate_burn::metrics::Accuracy;
use accelerate_burn::{Accelerator, DataLoader, DefaultBackend};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamWConfig;
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{Device, Int, Tensor, TensorData};

const PIXELS: usize = 64;
const CLASSES: usize = 10;

/// One image and its class.
#[derive(Clone, Debug)]
struct Image {
    pixels: Vec<f32>,
    label: i64,
}

/// A small xorshift generator: the data are the same on every process and every run.
struct Rng(u64);

impl Rng {
    fn next_unit(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// `n` images: each class is a fixed random 8x8 pattern, each image that pattern with noise.
fn images(n: usize, seed: u64) -> Vec<Image> {
    let mut patterns = Rng(0x9e37_79b9_7f4a_7c15);
    let prototypes: Vec<Vec<f32>> = (0..CLASSES)
        .map(|_| (0..PIXELS).map(|_| patterns.next_unit()).collect())
        .collect();
    let mut noise = Rng(seed);
    (0..n)
        .map(|i| {
            let label = i % CLASSES;
            let pixels = prototypes[label]
                .iter()
                .map(|p| p + 0.8 * (noise.next_unit() - 0.5))
                .collect();
            Image {
                pixels,
                label: label as i64,
            }
        })
        .collect()
}

#[derive(Clone)]
struct ImageBatcher;

impl Batcher<Image, (Tensor<2>, Tensor<1, Int>)> for ImageBatcher {
    fn batch(&self, items: Vec<Image>, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        let n = items.len();
        let pixels: Vec<f32> = items
            .iter()
            .flat_map(|i| i.pixels.iter().copied())
            .collect();
        let labels: Vec<i64> = items.iter().map(|i| i.label).collect();
        (
            Tensor::from_data(TensorData::new(pixels, [n, PIXELS]), device),
            Tensor::from_data(TensorData::new(labels, [n]), device),
        )
    }
}

#[derive(Module, Debug)]
struct Net {
    hidden: Linear,
    output: Linear,
    activation: Relu,
}

impl Net {
    fn new(device: &Device) -> Self {
        Net {
            hidden: LinearConfig::new(PIXELS, 32).init(device),
            output: LinearConfig::new(32, CLASSES).init(device),
            activation: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.output
            .forward(self.activation.forward(self.hidden.forward(x)))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = std::env::args().nth(1).unwrap_or_else(|| "out".to_string());
    let acc = Accelerator::<DefaultBackend>::from_env()?;
    let device = acc.device();
    let train = DataLoader::builder(ImageBatcher)
        .batch_size(32)
        .shuffle(7)
        .build(InMemDataset::new(images(640, 1)));
    let test = DataLoader::builder(ImageBatcher)
        .batch_size(100)
        .build(InMemDataset::new(images(200, 2)));
    let model = Net::new(&device);
    let (mut model, mut optim, train, test) =
        acc.prepare((model, AdamWConfig::new(), train, test))?;
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    for epoch in 0..4 {
        train.set_epoch(epoch);
        for batch in train.iter() {
            let (x, y) = batch?;
            let loss = loss_fn.forward(model.forward(x), y);
            let grads = acc.backward(loss, &model)?;
            model = optim.step(1e-2, model, grads)?;
        }
    }

    let model = acc.unwrap_model(model);
    let mut accuracy = Accuracy::new();
    for batch in test.iter() {
        let (x, y) = batch?;
        accuracy.update(&acc, model.forward(x), y)?;
    }
    let accuracy = accuracy.compute(&acc)?;
    let path = acc.save_model(&model, &out_dir)?;
    acc.print(format!(
        "user project: test accuracy {:.3} on {} process(es), {} updates, saved {}",
        accuracy.value,
        acc.num_processes(),
        optim.updates(),
        path.display()
    ));
    if accuracy.value < 0.9 {
        return Err(format!("test accuracy {:.3} is below 0.9", accuracy.value).into());
    }
    if acc.is_main_process() {
        // The saved file loads into a plain Burn model on a plain Burn device.
        let mut reloaded = Net::new(&Device::default());
        reloaded.load_from(&mut SafetensorsStore::from_file(&path))?;
        let scores = |net: &Net, device: &Device| -> Vec<f32> {
            let (x, _) = ImageBatcher.batch(images(4, 3), device);
            net.forward(x)
                .into_data()
                .convert::<f32>()
                .iter::<f32>()
                .collect()
        };
        let (trained, loaded) = (
            scores(&model, &device),
            scores(&reloaded, &Device::default()),
        );
        let worst = trained
            .iter()
            .zip(&loaded)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0_f32, f32::max);
        if worst > 1e-6 {
            return Err(format!("the reloaded model's scores differ by {worst}").into());
        }
        println!("user project: the saved model loads into plain Burn");
    }
    Ok(())
}
