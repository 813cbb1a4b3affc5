//! `accelerate-rs estimate-memory`: what each process would hold to train a model with a fused
//! optimizer, at each ZeRO stage, before anything is allocated.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use accelerate_core::memory_estimate::{MemoryEstimate, count_safetensors};
use anyhow::Context;
use clap::{Args, ValueEnum};

/// The optimizers whose state the estimate counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    /// AdamW or Adam: two moments per parameter.
    Adamw,
    /// AdamW with AMSGrad: three buffers per parameter.
    Amsgrad,
    /// SGD with momentum: one velocity per parameter.
    SgdMomentum,
    /// Plain SGD: no state.
    Sgd,
}

impl OptimizerKind {
    /// The name the flag takes.
    fn name(self) -> &'static str {
        match self {
            Self::Adamw => "adamw",
            Self::Amsgrad => "amsgrad",
            Self::SgdMomentum => "sgd-momentum",
            Self::Sgd => "sgd",
        }
    }

    /// f32 state buffers per parameter.
    fn state_buffers(self) -> u64 {
        match self {
            Self::Adamw => 2,
            Self::Amsgrad => 3,
            Self::SgdMomentum => 1,
            Self::Sgd => 0,
        }
    }
}

/// Arguments of `accelerate-rs estimate-memory`.
#[derive(Debug, Args)]
pub struct EstimateMemoryArgs {
    /// The model's weights: a safetensors file, or a directory holding a sharded model (its
    /// index and shards) or a model.safetensors. Only headers are read; floating-point
    /// tensors are counted as trainable f32 parameters.
    #[arg(required_unless_present = "parameters", conflicts_with = "parameters")]
    model: Option<PathBuf>,

    /// A parameter count instead of a file (e.g. 7000000000).
    #[arg(long)]
    parameters: Option<u64>,

    /// Processes in the job, every machine's together [default: 1].
    #[arg(long, default_value_t = 1)]
    num_processes: u64,

    /// Processes each shard is cut across under hybrid sharding (`--shard-group-size` of
    /// `launch`; e.g. the processes of one machine): a divisor of --num-processes [default:
    /// all of them].
    #[arg(long)]
    shard_group_size: Option<u64>,

    /// The fused optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    optimizer: OptimizerKind,

    /// Parameters of the largest unit ZeRO-3 shards (one layer) [default: from the model's
    /// names, each numbered block (`model.layers.12.*`) a unit; none with --parameters].
    #[arg(long)]
    largest_unit: Option<u64>,

    /// Checkpoints saved in the background (`async_checkpoints`): the main process's snapshot
    /// of what it writes is counted in the peak.
    #[arg(long)]
    async_checkpoints: bool,
}

/// Prints the table on stdout.
pub fn run(args: EstimateMemoryArgs) -> anyhow::Result<ExitCode> {
    let (parameters, source, unit) = match (&args.model, args.parameters) {
        (_, Some(count)) => (count, format!("{count} parameters"), None),
        (Some(path), None) => {
            let counts = count_safetensors(path).context("reading the model's header")?;
            let floats = counts.float_elements();
            (
                floats,
                format!(
                    "{}: {} tensors, {floats} floating-point values",
                    path.display(),
                    counts.tensors
                ),
                counts.largest_unit,
            )
        }
        (None, None) => anyhow::bail!("give a safetensors file or --parameters N"),
    };
    let unit = match args.largest_unit {
        Some(count) => Some(("given".to_string(), count)),
        None => unit,
    };
    let world = args.num_processes.max(1);
    let group = args.shard_group_size.unwrap_or(world);
    if group == 0 || !world.is_multiple_of(group) {
        anyhow::bail!(
            "--shard-group-size {group} does not divide --num-processes {world}: shard groups \
             are equal (give a divisor of {world})"
        );
    }
    print!(
        "{}",
        table(
            &source,
            parameters,
            (world, group),
            args.optimizer,
            unit.as_ref().map(|(name, count)| (name.as_str(), *count)),
            args.async_checkpoints,
        )
    );
    Ok(ExitCode::SUCCESS)
}

/// The table for `parameters` over `world` processes whose shards are cut across groups of
/// `group` (`world` without hybrid sharding); `unit` names the largest unit ZeRO-3 gathers
/// and its parameters; `snapshot` counts a background save's snapshot.
fn table(
    source: &str,
    parameters: u64,
    (world, group): (u64, u64),
    optimizer: OptimizerKind,
    unit: Option<(&str, u64)>,
    snapshot: bool,
) -> String {
    let mut out = String::new();
    let groups = match group < world {
        true => format!(" in shard groups of {group}"),
        false => String::new(),
    };
    let _ = writeln!(
        out,
        "{source}\nper process, {world} process{}{groups}, {} in f32 (activations not \
         included):\n",
        if world == 1 { "" } else { "es" },
        optimizer.name()
    );
    let snapshot_column = |text: &str| match snapshot {
        true => format!(" {text:>11}"),
        false => String::new(),
    };
    let _ = writeln!(
        out,
        "{:<6} {:>11} {:>11} {:>11} {:>11}{} {:>11}",
        "stage",
        "model",
        "gradients",
        "optimizer",
        "held",
        snapshot_column("snapshot"),
        "peak"
    );
    for stage in 0..=3u8 {
        let mut e = MemoryEstimate::new(parameters, optimizer.state_buffers(), group, stage)
            .with_largest_unit(unit.map_or(0, |(_, count)| count));
        if snapshot {
            e = e.with_async_checkpoints();
        }
        let _ = writeln!(
            out,
            "{:<6} {:>11} {:>11} {:>11} {:>11}{} {:>11}",
            format!("ZeRO-{stage}"),
            human(e.model_parameters),
            human(e.gradients),
            human(e.optimizer_state),
            human(e.held()),
            snapshot_column(&human(e.checkpoint_snapshot)),
            human(e.peak()),
        );
    }
    let _ = writeln!(
        out,
        "\nheld: kept between steps (the model's f32 parameters are updated in place: no\n\
         master copy; ZeRO-2's gradients are its shard of an accumulation window's sum, none\n\
         without accumulation); peak: held plus the gradients of one backward pass, which Burn\n\
         returns all at once, and at ZeRO-3 the largest sharded unit whole while it runs,\n\
         with its gradient ({}).{}{}",
        match unit {
            Some((name, count)) => format!(
                "{name}: {count} parameters, {}",
                human(count.saturating_mul(8))
            ),
            None => "not counted: give --largest-unit".to_string(),
        },
        if world == 1 {
            " One process shards nothing: give --num-processes."
        } else {
            ""
        },
        if snapshot {
            "\nsnapshot: what the main process holds while a background save writes (its model\n\
             and its part of the optimizer state; modules saved beside the model add theirs);\n\
             counted in the peak."
        } else {
            ""
        }
    );
    out
}

/// `bytes` in binary units, to three significant figures.
fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    let decimals = match value {
        v if v >= 100.0 => 0,
        v if v >= 10.0 => 1,
        _ => 2,
    };
    let text = format!("{value:.decimals$}");
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        &text
    };
    format!("{text} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_gives_each_stage_its_bytes_in_binary_units() {
        // 2^28 parameters (1 GiB in f32), AdamW, 4 processes.
        let text = table("m", 1 << 28, (4, 4), OptimizerKind::Adamw, None, false);
        let row = |text: &str, stage: &str| {
            text.lines()
                .find(|l| l.starts_with(stage))
                .unwrap()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(row(&text, "ZeRO-0"), "ZeRO-0 1 GiB 1 GiB 2 GiB 4 GiB 5 GiB");
        assert_eq!(
            row(&text, "ZeRO-1"),
            "ZeRO-1 1 GiB 0 B 512 MiB 1.5 GiB 2.5 GiB"
        );
        assert_eq!(
            row(&text, "ZeRO-2"),
            "ZeRO-2 1 GiB 256 MiB 512 MiB 1.75 GiB 2.75 GiB"
        );
        assert_eq!(
            row(&text, "ZeRO-3"),
            "ZeRO-3 256 MiB 0 B 512 MiB 768 MiB 1 GiB"
        );
        // Background saves: the main process's model and optimizer part, in the peak.
        let saving = table("m", 1 << 28, (4, 4), OptimizerKind::Adamw, None, true);
        assert_eq!(
            row(&saving, "ZeRO-0"),
            "ZeRO-0 1 GiB 1 GiB 2 GiB 4 GiB 3 GiB 8 GiB"
        );
        assert_eq!(
            row(&saving, "ZeRO-3"),
            "ZeRO-3 256 MiB 0 B 512 MiB 768 MiB 768 MiB 1.75 GiB"
        );
        assert!(saving.contains("snapshot: what the main process holds"));
        assert!(text.contains("not counted: give --largest-unit"), "{text}");
        // A unit of 2^24 parameters adds 128 MiB to ZeRO-3's peak.
        let with_unit = table(
            "m",
            1 << 28,
            (4, 4),
            OptimizerKind::Adamw,
            Some(("layers.0", 1 << 24)),
            false,
        );
        assert!(with_unit.contains("ZeRO-3     256 MiB"), "{with_unit}");
        assert!(with_unit.contains("1.12 GiB"), "{with_unit}");
        assert!(
            with_unit.contains("layers.0: 16777216 parameters, 128 MiB"),
            "{with_unit}"
        );
        // Hybrid sharding: 8 processes in shard groups of 4 hold what 4 processes do.
        let hybrid = table("m", 1 << 28, (8, 4), OptimizerKind::Adamw, None, false);
        assert!(
            hybrid.contains("8 processes in shard groups of 4"),
            "{hybrid}"
        );
        for stage in ["ZeRO-1", "ZeRO-2", "ZeRO-3"] {
            assert_eq!(row(&hybrid, stage), row(&text, stage));
        }
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(124_000_000 * 4), "473 MiB");
        assert_eq!(human(2_480_000_000), "2.31 GiB");
        assert_eq!(human(12), "12 B");
    }
}
