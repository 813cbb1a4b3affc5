//! NCCL's all-reduce on the GPUs as the accelerator runs it ([`Accelerator::reduce`] of a
//! tensor no other shares: in place), in nccl-tests' terms: `algbw` is bytes per second of
//! the buffer, `busbw` is `algbw * 2 (n - 1) / n`, what each GPU's links carry in a ring (0
//! for one GPU, where NCCL only copies). Under `accelerate-rs launch -n N` (one process per GPU)
//! it measures N GPUs; started alone, one.

use std::time::Instant;

use accelerate_burn::burn::tensor::Tensor;
use accelerate_burn::{Accelerator, DefaultBackend, ProcessState, Reduction};

/// Measures an f32 all-reduce (mean) of each size in `sizes_mib`, printing a table on the
/// main process.
pub fn run(sizes_mib: &[usize]) -> anyhow::Result<()> {
    let acc = Accelerator::<DefaultBackend>::builder()
        .process_state(ProcessState::from_env()?)
        .strict_nccl()
        .build()?;
    let n = acc.num_processes();
    let device = acc.device().inner();
    if acc.is_main_process() {
        println!("| size | world | time | algbw | busbw |");
        println!("|---|---|---|---|---|");
    }
    for &mib in sizes_mib {
        let len = (mib << 20) / 4;
        let mut values = Tensor::<1>::ones([len], &device);
        for _ in 0..3 {
            values = acc.reduce(values, Reduction::Mean)?;
        }
        let iterations = (2048 / mib.max(1)).clamp(5, 50);
        let started = Instant::now();
        for _ in 0..iterations {
            values = acc.reduce(values, Reduction::Mean)?;
        }
        let seconds = started.elapsed().as_secs_f64() / iterations as f64;
        let algbw = (len * 4) as f64 / seconds / 1e9;
        let busbw = algbw * 2.0 * (n - 1) as f64 / n as f64;
        if acc.is_main_process() {
            println!(
                "| {mib} MiB | {n} | {:.1} us | {algbw:.1} GB/s | {busbw:.1} GB/s |",
                seconds * 1e6
            );
        }
    }
    Ok(())
}
