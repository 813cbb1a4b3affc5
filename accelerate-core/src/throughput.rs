//! Throughput and memory as users know them: tokens (or samples) per second over the whole
//! job, model FLOPs per second and MFU (model FLOPs utilisation: achieved over the hardware's
//! peak) when the model's FLOPs per token are known, and this process's peak resident bytes.
//! A [`ThroughputMeter`] is told what each update consumed and turns it into metrics for the
//! trackers, every `log_every` updates as the script decides.
//!
//! ```
//! use accelerate_core::throughput::{ThroughputMeter, transformer_flops_per_token};
//!
//! // A 3.3 M-parameter, 4-layer, 256-wide transformer on 128-token windows.
//! let flops = transformer_flops_per_token(3_300_000, 4, 256, 128);
//! assert_eq!(flops, 6.0 * 3.3e6 + 12.0 * 4.0 * 256.0 * 128.0);
//! let mut meter = ThroughputMeter::new(1).flops_per_token(flops).peak_flops(1e12);
//! meter.record(4096, 32);
//! let metrics = meter.metrics();
//! assert!(metrics.iter().any(|(name, _)| *name == "perf/mfu"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::time::{Duration, Instant};

/// FLOPs to train on one token of a decoder-only transformer (forward and backward): `6N` for
/// the weights' matrix products plus `12·L·d·T` for attention's scores and weighted sums
/// (PaLM's appendix B, the figure torchtitan and nanoGPT report MFU with).
pub fn transformer_flops_per_token(params: u64, layers: u64, d_model: u64, context: u64) -> f64 {
    6.0 * params as f64 + 12.0 * layers as f64 * d_model as f64 * context as f64
}

/// This process's peak resident memory so far (bytes; Linux's `VmHWM`), if the system says.
pub fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The peak FLOPs per second of one process's hardware, from `ACCELERATE_PEAK_FLOPS` (e.g.
/// `989e12` for an H100's dense bf16), when set to a positive number.
pub fn peak_flops_from_env() -> Option<f64> {
    std::env::var(crate::env_vars::PEAK_FLOPS)
        .ok()?
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|f| f.is_finite() && *f > 0.0)
}

/// Counts what updates consumed since the last report.
#[derive(Debug, Clone)]
pub struct ThroughputMeter {
    processes: usize,
    flops_per_token: Option<f64>,
    peak_flops: Option<f64>,
    since: Instant,
    tokens: u64,
    samples: u64,
}

impl ThroughputMeter {
    /// A meter for a job of `processes` processes, each consuming what [`record`](Self::record)
    /// is told (the main process's share stands for every rank's: the prepared loader gives
    /// each the same batch size). The peak FLOPs start as `ACCELERATE_PEAK_FLOPS` says.
    pub fn new(processes: usize) -> Self {
        Self {
            processes: processes.max(1),
            flops_per_token: None,
            peak_flops: peak_flops_from_env(),
            since: Instant::now(),
            tokens: 0,
            samples: 0,
        }
    }

    /// The model's training FLOPs per token (see [`transformer_flops_per_token`]).
    pub fn flops_per_token(mut self, flops: f64) -> Self {
        self.flops_per_token = Some(flops);
        self
    }

    /// One process's hardware peak, in FLOPs per second (for MFU).
    pub fn peak_flops(mut self, flops: f64) -> Self {
        self.peak_flops = Some(flops);
        self
    }

    /// This process consumed `tokens` tokens in `samples` samples (sequences) since the last
    /// call.
    pub fn record(&mut self, tokens: u64, samples: u64) {
        self.tokens = self.tokens.saturating_add(tokens);
        self.samples = self.samples.saturating_add(samples);
    }

    /// Restarts the interval (after warm-up, or a pause for evaluation the figures should not
    /// count), dropping what was recorded.
    pub fn restart(&mut self) {
        self.since = Instant::now();
        self.tokens = 0;
        self.samples = 0;
    }

    /// The interval's figures as tracker metrics, and a new interval: `perf/tokens_per_s` and
    /// `perf/samples_per_s` (the whole job), `perf/model_flops_per_s` (per process) and
    /// `perf/mfu` when known, `memory/peak_resident_bytes` (this process).
    pub fn metrics(&mut self) -> Vec<(&'static str, f64)> {
        let seconds = self
            .since
            .elapsed()
            .max(Duration::from_micros(1))
            .as_secs_f64();
        let tokens_per_s = self.tokens as f64 / seconds;
        let mut out = vec![
            ("perf/tokens_per_s", tokens_per_s * self.processes as f64),
            (
                "perf/samples_per_s",
                self.samples as f64 / seconds * self.processes as f64,
            ),
        ];
        if let Some(per_token) = self.flops_per_token {
            let achieved = tokens_per_s * per_token;
            out.push(("perf/model_flops_per_s", achieved));
            if let Some(peak) = self.peak_flops {
                out.push(("perf/mfu", achieved / peak));
            }
        }
        if let Some(bytes) = peak_resident_bytes() {
            out.push(("memory/peak_resident_bytes", bytes as f64));
        }
        self.restart();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_cover_the_job_and_mfu_is_achieved_over_peak() {
        let mut meter = ThroughputMeter::new(2)
            .flops_per_token(10.0)
            .peak_flops(1e3);
        meter.record(500, 5);
        std::thread::sleep(Duration::from_millis(200));
        let metrics: std::collections::BTreeMap<_, _> = meter.metrics().into_iter().collect();
        let per_process = metrics["perf/tokens_per_s"] / 2.0;
        assert!(per_process > 1000.0 && per_process <= 2500.0, "{metrics:?}");
        assert!(
            (metrics["perf/samples_per_s"] * 100.0 - metrics["perf/tokens_per_s"]).abs() < 1e-6
        );
        assert!((metrics["perf/model_flops_per_s"] - per_process * 10.0).abs() < 1e-6);
        assert!((metrics["perf/mfu"] - per_process * 10.0 / 1e3).abs() < 1e-9);
        assert!(metrics["memory/peak_resident_bytes"] > 1e6);
        // A new interval began.
        assert_eq!(meter.metrics()[0].1, 0.0);
    }
}
