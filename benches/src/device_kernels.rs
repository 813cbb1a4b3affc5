//! Throughput of our cubecl kernels on the default device of the linked runtime (CUDA with
//! `--features cuda`, wgpu with `--features wgpu`): the fused unscale-and-check, the
//! f32 <-> f16/bf16 packing of gradient communication and the fused AdamW update, over one flat
//! buffer. Run by `gpu_figures kernels [MELEMS]`.
//!
//! Prints one table row per kernel: elements, time per launch (median of 20 after 3 warm-ups)
//! and GB/s of memory traffic (bytes read plus bytes written).

use std::time::Instant;

use accelerate_kernels::cube::{self, Client, Half};

/// Measures every kernel over `melems` x 2^20 elements and prints the table.
pub fn run(melems: usize) {
    let len = melems << 20;
    let device = cubecl::Device::default();
    let client = device.client();
    println!("device: {} ({device:?})", client.name());
    let values: Vec<f32> = (0..len).map(|i| (i % 1000) as f32 * 0.25 - 100.0).collect();
    let grads = client.create_from_slice(bytemuck::cast_slice(&values));
    let packed = cube::narrow_to_half(&client, grads.clone(), len, Half::F16, 1.0);

    println!("| kernel | elements | ms | GB/s |");
    println!("|---|---|---|---|");
    let row = |name: &str, bytes_per_elem: usize, run: &dyn Fn()| {
        let ms = median_ms(&client, run);
        let gbs = (len * bytes_per_elem) as f64 / (ms * 1e-3) / 1e9;
        println!("| {name} | {len} | {ms:.3} | {gbs:.1} |");
    };
    row("unscale_and_check (f32 in place)", 8, &|| {
        let flag = cube::NonFiniteFlag::new(&client);
        cube::unscale_and_flag(&client, grads.clone(), len, 1.0, &flag);
    });
    row("narrow f32 -> f16", 6, &|| {
        let _ = cube::narrow_to_half(&client, grads.clone(), len, Half::F16, 0.5);
    });
    row("narrow f32 -> bf16", 6, &|| {
        let _ = cube::narrow_to_half(&client, grads.clone(), len, Half::Bf16, 1.0);
    });
    row("widen f16 -> f32", 6, &|| {
        let _ = cube::widen_from_half(&client, packed.clone(), len, Half::F16);
    });
    row("widen bf16 -> f32", 6, &|| {
        let _ = cube::widen_from_half(&client, packed.clone(), len, Half::Bf16);
    });
    // AdamW reads parameters, gradients and both moments and writes new parameters and the
    // moments: 28 bytes per element, like the host kernel.
    let zeros = vec![0.0f32; len];
    let flat = cube::FlatBuffers {
        params: grads.clone(),
        grads: grads.clone(),
        state: vec![
            client.create_from_slice(bytemuck::cast_slice(&zeros)),
            client.create_from_slice(bytemuck::cast_slice(&zeros)),
        ],
        out: client.empty(len * 4),
        len,
        params_range: 0..len,
        grads_range: 0..len,
    };
    let hyper = crate::BURN_ADAMW;
    row("fused AdamW update", 28, &|| {
        cube::adam_step(&client, &flat, 0, len, 2, 1e-3, 1.0, &hyper, false);
    });
}

/// Median wall time of `run`, each launch waited for.
fn median_ms(client: &Client, run: &dyn Fn()) -> f64 {
    let wait = || {
        if let Err(e) = cubecl::future::block_on(client.sync()) {
            eprintln!("device error: {e}");
            std::process::exit(1);
        }
    };
    for _ in 0..3 {
        run();
        wait();
    }
    let mut times: Vec<f64> = (0..20)
        .map(|_| {
            let started = Instant::now();
            run();
            wait();
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
