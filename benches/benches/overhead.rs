//! Interleaved A/B measurement of the accelerator's overhead on one training step.
//!
//! Separate criterion runs on a shared 2-core VM differ by about 10 % from run to run, more than
//! the overhead we want to bound (2 %). Here the two loops alternate step by step in one process,
//! so both see the same machine state, and the paired difference per round has a meaningful
//! standard error.
//!
//! ```text
//! cargo bench -p accelerate-benches --bench overhead [-- ROUNDS] [fused]
//! ```
//!
//! With `fused`, the accelerated loop uses the fused AdamW over flat parameters.

use std::time::Instant;

use accelerate_benches::StepBench;

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(300);
    let fused = std::env::args().any(|a| a == "fused");
    let mut bench = StepBench::with_options(128, accelerate_burn::MixedPrecision::No, fused);
    for _ in 0..10 {
        bench.plain_step();
        bench.accelerated_step();
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
        for is_plain in order {
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
    let diffs: Vec<f64> = accelerated.iter().zip(&plain).map(|(a, p)| a - p).collect();
    let d = mean(&diffs);
    let sd = (diffs.iter().map(|x| (x - d).powi(2)).sum::<f64>() / (diffs.len() - 1).max(1) as f64)
        .sqrt();
    let se = sd / (diffs.len() as f64).sqrt();
    let (p, a) = (mean(&plain), mean(&accelerated));
    println!(
        "rounds: {rounds} (batch 128, MLP 784-1024-1024-10, AdamW{})",
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
