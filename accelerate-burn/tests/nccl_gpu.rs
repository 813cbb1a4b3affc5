//! The NCCL reducer against the host path on one GPU (world size 1, NCCL required so that it
//! runs): the same model, batches and optimizer give the same parameters bit for bit over 30
//! updates, for the fused update, the fused update with ZeRO-1 (reduce-scatter, update of the
//! shard, all-gather), Burn's AdamW (buckets), and ZeRO-3's sharded units (each parameter
//! all-gathered by NCCL in forward and again in backward, its gradient reduce-scattered), in
//! f32 and under bf16 autocast (the gather then carries bf16). With one rank NCCL's average
//! multiplies by 1.0 and its scatter and gather copy, so any difference is a bug in our
//! plumbing, not rounding. A required NCCL that cannot be loaded is an error naming the
//! library.
//!
//! Needs an NVIDIA GPU and libnccl (the `nvidia-nccl-cu12`/`-cu13` wheel or the system's);
//! elsewhere each test says why it is skipped. Built by `.ci/run` (feature `nccl`); the GPU
//! bundle of `benches/gpu/` runs the same comparison (`gpu_figures nccl`, which includes this
//! file).

use accelerate_burn::burn;
use accelerate_burn::{
    AccelerateError, Accelerator, Cuda, DataLoader, FusedOptimizer, MixedPrecision, NcclMode,
    OptimizerSource, ProcessState, Sharded,
};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::{Linear, Relu};
use burn::optim::AdamWConfig;
use burn::tensor::Tensor;

/// Why this machine cannot run the tests, if it cannot.
pub fn unavailable() -> Option<String> {
    let driver = ["/proc/driver/nvidia/version", "/dev/nvidiactl"]
        .iter()
        .any(|p| std::path::Path::new(p).exists());
    if !driver {
        return Some("no NVIDIA driver".into());
    }
    accelerate_core::nccl::NcclLibrary::find(&accelerate_core::state::ProcessEnv)
        .err()
        .map(|e| e.to_string())
}

#[path = "support/tiny_net.rs"]
mod tiny_net;

use tiny_net::{Net, Rows, data, values};

/// `Net` with both layers sharded (ZeRO-3).
#[derive(Module, Debug)]
struct ShardedNet {
    hidden: Sharded<Linear>,
    out: Sharded<Linear>,
    act: Relu,
}

/// A model the comparison trains: how it is built on an accelerator, and its loss.
trait Trained: Module + Sized {
    fn build(acc: &Accelerator<Cuda>) -> Result<Self, AccelerateError>;
    fn loss(&self, batch: (Tensor<2>, Tensor<2>)) -> Tensor<1>;
}

impl Trained for Net {
    fn build(acc: &Accelerator<Cuda>) -> Result<Self, AccelerateError> {
        // 8*33 + 33 + 33*2 + 2 parameters: not a multiple of anything, so ZeRO pads.
        Ok(Net::with_hidden(&acc.device(), 33))
    }

    fn loss(&self, batch: (Tensor<2>, Tensor<2>)) -> Tensor<1> {
        Net::loss(self, batch)
    }
}

impl Trained for ShardedNet {
    fn build(acc: &Accelerator<Cuda>) -> Result<Self, AccelerateError> {
        let net = Net::build(acc)?;
        Ok(Self {
            hidden: acc.shard(net.hidden)?,
            out: acc.shard(net.out)?,
            act: net.act,
        })
    }

    fn loss(&self, (x, y): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
        let h = self.act.forward(self.hidden.gather().forward(x));
        (self.out.gather().forward(h) - y).square().mean()
    }
}

fn bits<M: Module>(model: &M) -> Vec<u32> {
    values(model).into_iter().map(f32::to_bits).collect()
}

/// How one run is set up besides NCCL.
#[derive(Clone, Copy)]
struct Setup {
    zero_stage: u8,
    precision: MixedPrecision,
}

/// The parameters after 30 updates, whether NCCL averaged them, and the sharded units'
/// gathers.
fn train<M: Trained, S: OptimizerSource>(
    optimizer: S,
    nccl: NcclMode,
    setup: Setup,
) -> Result<(Vec<u32>, bool, u64), AccelerateError> {
    let acc = Accelerator::<Cuda>::builder()
        .process_state(ProcessState::single())
        .nccl(nccl)
        .zero_stage(setup.zero_stage)
        .mixed_precision(setup.precision)
        .seed(5)
        .build()?;
    let model = M::build(&acc)?;
    let loader = DataLoader::builder(Rows)
        .batch_size(8)
        .shuffle(1)
        .build(InMemDataset::new(data(80)));
    let (mut model, mut optim, train) = acc.prepare((model, optimizer, loader))?;
    for epoch in 0..3 {
        train.set_epoch(epoch);
        for batch in train.iter() {
            let batch = batch?;
            let loss = acc.autocast(&model, |m, c| m.loss((c.input(batch.0), batch.1)));
            let mut grads = acc.backward(loss, &model)?;
            acc.clip_grad_norm(&model, &mut grads, 0.5)?;
            model = optim.step(1e-2, model, grads)?;
        }
    }
    assert_eq!(optim.updates(), 30);
    Ok((bits(&model), acc.uses_nccl(), acc.sharded_gathers()))
}

/// One optimizer path trained with and without NCCL.
pub struct Parity {
    /// The path.
    pub name: &'static str,
    /// Parameters whose bits differ between the two runs.
    pub differing: usize,
    /// Parameters.
    pub total: usize,
}

fn parity<M: Trained, S: OptimizerSource>(
    name: &'static str,
    make: impl Fn() -> S,
    setup: Setup,
) -> Result<Parity, AccelerateError> {
    let (host, host_nccl, host_gathers) = train::<M, S>(make(), NcclMode::Off, setup)?;
    let (device, device_nccl, device_gathers) = train::<M, S>(make(), NcclMode::Require, setup)?;
    assert!(
        !host_nccl && device_nccl,
        "{name}: the paths were not the ones asked for"
    );
    assert_eq!(host_gathers, device_gathers, "{name}: gathers");
    Ok(Parity {
        name,
        differing: host.iter().zip(&device).filter(|(a, b)| a != b).count(),
        total: host.len(),
    })
}

/// The fused update, the fused update with ZeRO-1, Burn's AdamW and ZeRO-3's sharded units
/// (fused, f32 and bf16 autocast), each with and without NCCL.
pub fn compare_paths() -> Result<Vec<Parity>, AccelerateError> {
    let adamw = || AdamWConfig::new().with_weight_decay(0.05);
    let fused = || FusedOptimizer::adamw(&adamw()).expect("AdamW fuses");
    let setup = |zero_stage, precision| Setup {
        zero_stage,
        precision,
    };
    let f32 = MixedPrecision::No;
    Ok(vec![
        parity::<Net, _>("fused AdamW", fused, setup(0, f32))?,
        parity::<Net, _>("fused AdamW, ZeRO-1", fused, setup(1, f32))?,
        parity::<Net, _>("Burn's AdamW (buckets)", || adamw().init(), setup(0, f32))?,
        parity::<ShardedNet, _>("fused AdamW, ZeRO-3", fused, setup(3, f32))?,
        parity::<ShardedNet, _>(
            "fused AdamW, ZeRO-3, bf16 autocast",
            fused,
            setup(3, MixedPrecision::Bf16),
        )?,
    ])
}

#[test]
fn nccl_on_one_gpu_gives_the_host_paths_parameters_bit_for_bit() {
    if let Some(why) = unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    for row in compare_paths().unwrap() {
        println!(
            "{}: {} of {} parameters differ in their bits",
            row.name, row.differing, row.total
        );
        assert_eq!(row.differing, 0, "{}", row.name);
    }
}

#[test]
fn a_required_nccl_that_cannot_be_loaded_is_an_error_naming_the_library() {
    const CHILD: &str = "ACCELERATE_NCCL_GPU_CHILD";
    if std::env::var_os(CHILD).is_some() {
        let built = Accelerator::<Cuda>::builder()
            .process_state(ProcessState::single())
            .strict_nccl()
            .build();
        match built {
            Ok(_) => println!("BUILT"),
            Err(e) => println!("ERROR {e}"),
        }
        return;
    }
    let driver = std::path::Path::new("/proc/driver/nvidia/version").exists();
    if !driver {
        eprintln!("skipped: no NVIDIA driver");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "a_required_nccl_that_cannot_be_loaded_is_an_error_naming_the_library",
            "--exact",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env("ACCELERATE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("ERROR") && stdout.contains("/nonexistent/libnccl.so.2"),
        "{stdout}"
    );
}
