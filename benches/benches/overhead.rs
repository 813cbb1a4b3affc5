//! Interleaved A/B measurement of the accelerator's overhead on one training step.
//!
//! Separate criterion runs on a shared 2-core VM differ by about 10 % from run to run, more than
//! the overhead we want to bound (2 %). Here the two loops alternate step by step in one process,
//! so both see the same machine state, and the paired difference per round has a meaningful
//! standard error.
//!
//! ```text
//! cargo bench -p accelerate-benches --bench overhead [-- ROUNDS] [fused] [transformer] [only-plain|only-accelerated|observe]
//! ```
//!
//! With `observe`, the comparison is the accelerated step alone against the same step seen:
//! with the timeline's tracing layer recording its spans (`ACCELERATE_TRACE`'s layer, as the
//! thread's subscriber) and the CSV and TensorBoard trackers logging four values at every
//! step (the figures of issue 63: what watching a run costs).
//!
//! With `fused`, the accelerated loop uses the fused AdamW over flat parameters. With
//! `transformer`, the model is the transformer example's default (8 sequences of 128 bytes
//! per step) instead of the MLP (batch 128). `only-plain` or `only-accelerated` runs that loop
//! alone (no comparison), so that a profiler (`perf`, cubecl's kernel profile) sees one loop.

use std::time::Instant;

use accelerate_benches::{BenchModel, StepBench};

fn main() {
    let transformer = std::env::args().any(|a| a == "transformer");
    let fused = std::env::args().any(|a| a == "fused");
    if std::env::args().any(|a| a == "observe") {
        if transformer {
            observe(
                StepBench::transformer(8, fused),
                (60, 3),
                "transformer 4x256, 8 x 128 bytes",
            );
        } else {
            let bench = StepBench::with_options(128, accelerate_burn::MixedPrecision::No, fused);
            observe(bench, (300, 10), "batch 128, MLP 784-1024-1024-10");
        }
        return;
    }
    if transformer {
        let bench = StepBench::transformer(8, fused);
        measure(bench, (60, 3), "transformer 4x256, 8 x 128 bytes", fused);
    } else {
        let bench = StepBench::with_options(128, accelerate_burn::MixedPrecision::No, fused);
        measure(bench, (300, 10), "batch 128, MLP 784-1024-1024-10", fused);
    }
}

/// Runs both loops `warm_up` times, then `ROUNDS` times (default `default_rounds`)
/// interleaved, and prints the means and the paired difference.
fn measure<M: BenchModel>(
    mut bench: StepBench<M>,
    (default_rounds, warm_up): (usize, usize),
    what: &str,
    fused: bool,
) {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(default_rounds);
    let only = std::env::args().find_map(|a| match a.as_str() {
        "only-plain" => Some(true),
        "only-accelerated" => Some(false),
        _ => None,
    });
    let runs = |is_plain: bool| only.is_none_or(|only_plain| only_plain == is_plain);
    for _ in 0..warm_up {
        if runs(true) {
            bench.plain_step();
        }
        if runs(false) {
            bench.accelerated_step();
        }
    }
    bench.sync();
    let mut plain = Vec::with_capacity(rounds);
    let mut accelerated = Vec::with_capacity(rounds);
    for round in 0..rounds {
        // Alternate which loop goes first, so neither always follows the other's allocations.
        let order: [bool; 2] = if round % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for is_plain in order.into_iter().filter(|&p| runs(p)) {
            let started = Instant::now();
            if is_plain {
                bench.plain_step();
            } else {
                bench.accelerated_step();
            }
            bench.sync();
            let ms = started.elapsed().as_secs_f64() * 1e3;
            if is_plain {
                plain.push(ms)
            } else {
                accelerated.push(ms)
            }
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    if let Some(only_plain) = only {
        let (name, times) = if only_plain {
            ("plain burn step", &plain)
        } else {
            ("accelerated step", &accelerated)
        };
        println!(
            "rounds: {rounds} ({what}), {name} alone: {:.3} ms",
            mean(times)
        );
        return;
    }
    let diffs: Vec<f64> = accelerated.iter().zip(&plain).map(|(a, p)| a - p).collect();
    let d = mean(&diffs);
    let sd = (diffs.iter().map(|x| (x - d).powi(2)).sum::<f64>() / (diffs.len() - 1).max(1) as f64)
        .sqrt();
    let se = sd / (diffs.len() as f64).sqrt();
    let (p, a) = (mean(&plain), mean(&accelerated));
    println!(
        "rounds: {rounds} ({what}, AdamW{})",
        if fused {
            ", accelerated loop fused"
        } else {
            ""
        }
    );
    println!("plain burn step:  {p:.3} ms");
    println!("accelerated step: {a:.3} ms");
    println!(
        "overhead: {:+.2} % (paired difference {d:+.3} ms, 95 % interval +/- {:.3} ms)",
        100.0 * (a - p) / p,
        1.96 * se
    );
}

/// The accelerated step without and with observation (a trace layer on the thread and two
/// file trackers logging every step), interleaved, and the paired difference.
fn observe<M: BenchModel>(
    mut bench: StepBench<M>,
    (default_rounds, warm_up): (usize, usize),
    what: &str,
) {
    use accelerate_core::trace::{StepWindow, TraceLayer};
    use accelerate_core::tracking::{RunInfo, Tracker, Trackers};
    use tracing_subscriber::layer::SubscriberExt;

    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(default_rounds);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut trackers = Trackers::new(true);
    for kind in [Tracker::Csv, Tracker::TensorBoard] {
        trackers.add(kind.open(Some(dir.path())).expect("file trackers open"));
    }
    trackers
        .start(&RunInfo::new("overhead"))
        .expect("the run starts");
    let layer = TraceLayer::new(dir.path(), 0, StepWindow::Last(20));
    let timeline = layer.timeline();
    let subscriber = std::sync::Arc::new(tracing_subscriber::registry().with(layer));
    let mut meter = accelerate_core::throughput::ThroughputMeter::new(1);
    let mut step = 0u64;
    let mut observed_step = |bench: &mut StepBench<M>| {
        tracing::subscriber::with_default(subscriber.clone(), || bench.accelerated_step());
        step += 1;
        meter.record(1024, 8);
        let mut metrics = vec![("train/loss", 1.0)];
        metrics.extend(meter.metrics());
        trackers.log(step, &metrics).expect("the trackers write");
    };
    for _ in 0..warm_up {
        bench.accelerated_step();
        observed_step(&mut bench);
    }
    bench.sync();
    let (mut off, mut on) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for round in 0..rounds {
        for observed in if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        } {
            let started = Instant::now();
            if observed {
                observed_step(&mut bench);
            } else {
                bench.accelerated_step();
            }
            bench.sync();
            let ms = started.elapsed().as_secs_f64() * 1e3;
            if observed { on.push(ms) } else { off.push(ms) }
        }
    }
    timeline.write().expect("the trace is written");
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let diffs: Vec<f64> = on.iter().zip(&off).map(|(a, p)| a - p).collect();
    let d = mean(&diffs);
    let sd = (diffs.iter().map(|x| (x - d).powi(2)).sum::<f64>() / (diffs.len() - 1).max(1) as f64)
        .sqrt();
    let (p, a) = (mean(&off), mean(&on));
    println!("rounds: {rounds} ({what}, AdamW)");
    println!("accelerated step:          {p:.3} ms");
    println!("traced and tracked step:   {a:.3} ms");
    println!(
        "overhead: {:+.2} % (paired difference {d:+.3} ms, 95 % interval +/- {:.3} ms)",
        100.0 * (a - p) / p,
        1.96 * sd / (diffs.len() as f64).sqrt()
    );
}
