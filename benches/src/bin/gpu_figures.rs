//! The GPU figures of `benches/gpu/run.sh` in one binary: the digits and `mlp_synthetic`
//! examples and the device-kernel throughput share one copy of the GPU runtime (with CUDA, its
//! LLVM makes each binary about 26 MB compressed; three would not fit the 64 MiB a GPU machine
//! may receive).
//!
//! ```text
//! gpu_figures digits [EPOCHS]          accuracy of the digits example (default 30 epochs)
//! gpu_figures mlp SAMPLES [--burn-optimizer]    mlp_synthetic's throughput line
//! gpu_figures kernels [MELEMS]         our cubecl kernels' GB/s (default 64 Mi elements)
//! gpu_figures transformer [FLAGS]      the transformer_lm example (its flags, e.g. --steps 60)
//! gpu_figures nccl                     NCCL vs the host path: parameters after 30 updates
//! gpu_figures nccl-allreduce [MIB..]   NCCL all-reduce on the GPUs: algbw / busbw per size
//! ```
//!
//! Precision comes from `ACCELERATE_MIXED_PRECISION`, as in the examples.

#[allow(dead_code)]
#[path = "../../../examples/digits.rs"]
mod digits_example;
#[allow(dead_code)]
#[path = "../../../examples/mlp_synthetic.rs"]
mod mlp_example;
#[cfg(feature = "nccl")]
#[allow(dead_code)]
#[path = "../../../accelerate-burn/tests/nccl_gpu.rs"]
mod nccl_parity;
#[allow(dead_code)]
#[path = "../../../examples/transformer_lm.rs"]
mod transformer_example;

use accelerate_burn::{Accelerator, DefaultBackend, ProcessState};
use anyhow::{Context, bail};

fn number(arg: Option<&String>, default: usize, what: &str) -> anyhow::Result<usize> {
    arg.map_or(Ok(default), |a| {
        a.parse()
            .with_context(|| format!("{what} expects a number, not {a}"))
    })
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("digits") => {
            let epochs = number(args.get(1), 30, "digits")?;
            digits_example::train(epochs as u64, None, None)?;
        }
        Some("mlp") => {
            let samples = number(args.get(1), 60_000, "mlp")?;
            mlp_example::run(samples, args.iter().any(|a| a == "--burn-optimizer"))?;
        }
        Some("kernels") => {
            let melems = number(args.get(1), 64, "kernels")?;
            // The accelerator's probe turns a missing driver into a one-line error.
            Accelerator::<DefaultBackend>::builder()
                .process_state(ProcessState::single())
                .build()?;
            accelerate_benches::device_kernels::run(melems);
        }
        Some("transformer") => {
            use clap::Parser;
            let flags = std::iter::once("transformer_lm".to_string()).chain(args[1..].to_vec());
            transformer_example::train(&transformer_example::Args::parse_from(flags))?;
        }
        #[cfg(feature = "nccl")]
        Some("nccl") => {
            if let Some(why) = nccl_parity::unavailable() {
                bail!("cannot compare the NCCL path here: {why}");
            }
            println!(
                "| path (30 updates, world size 1, NCCL required) | parameters whose bits differ |"
            );
            println!("|---|---|");
            for row in nccl_parity::compare_paths()? {
                println!("| {} | {} of {} |", row.name, row.differing, row.total);
            }
        }
        #[cfg(feature = "nccl")]
        Some("nccl-allreduce") => {
            let sizes: Vec<usize> = if args.len() > 1 {
                args[1..]
                    .iter()
                    .map(|a| number(Some(a), 0, "nccl-allreduce"))
                    .collect::<anyhow::Result<_>>()?
            } else {
                vec![1, 16, 256, 1024]
            };
            accelerate_benches::nccl_bandwidth::run(&sizes)?;
        }
        _ => bail!(
            "usage: gpu_figures digits [EPOCHS] | mlp SAMPLES [--burn-optimizer] | kernels \
             [MELEMS] | transformer [FLAGS] | nccl | nccl-allreduce [MIB..]"
        ),
    }
    Ok(())
}
