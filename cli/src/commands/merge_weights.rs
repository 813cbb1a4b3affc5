//! `accelerate-rs merge-weights`: a sharded model (the Hugging Face layout that
//! `save_model_sharded` writes) consolidated offline into one `model.safetensors` that plain
//! Burn loads.

use std::path::PathBuf;
use std::process::ExitCode;

use accelerate_core::weights::merge_sharded;
use anyhow::Context;
use clap::Args;

/// Arguments of `accelerate-rs merge-weights`.
#[derive(Debug, Args)]
pub struct MergeWeightsArgs {
    /// The sharded model: a directory with `model.safetensors.index.json` and its shards.
    checkpoint_dir: PathBuf,

    /// Where `model.safetensors` is written (created if missing; an existing
    /// `model.safetensors` there is not replaced).
    output_dir: PathBuf,
}

/// Merges, and says what was written.
pub fn run(args: MergeWeightsArgs) -> anyhow::Result<ExitCode> {
    let report = merge_sharded(&args.checkpoint_dir, &args.output_dir).with_context(|| {
        format!(
            "merging the sharded model in {}",
            args.checkpoint_dir.display()
        )
    })?;
    println!(
        "merged {} tensors ({} bytes) from {} shard file{} into {}",
        report.tensors,
        report.bytes,
        report.files,
        if report.files == 1 { "" } else { "s" },
        report.output.display()
    );
    Ok(ExitCode::SUCCESS)
}
