//! The device kernels against the host kernels, bit for bit, on every cubecl runtime this build
//! links: wgpu (lavapipe on CI, a real GPU elsewhere) with `--features cubecl-wgpu`, and the
//! CPU runtime (Burn's `cpu` backend) with `--features cubecl-cpu`.
#![cfg(any(feature = "cubecl-wgpu", feature = "cubecl-cpu"))]

use accelerate_kernels::amp;
use accelerate_kernels::convert;
use accelerate_kernels::cube::{self, Client, Half, Handle, NonFiniteFlag};
use half::{bf16, f16};

/// A client for each linked runtime, with its name for failure messages.
// Each push is behind its own feature, which `vec![...]` cannot express.
#[allow(clippy::vec_init_then_push)]
fn clients() -> Vec<(&'static str, Client)> {
    let mut clients = Vec::new();
    #[cfg(feature = "cubecl-wgpu")]
    clients.push((
        "wgpu",
        cubecl::Device::Wgpu(cubecl::device::WgpuDevice::default()).client(),
    ));
    #[cfg(feature = "cubecl-cpu")]
    clients.push((
        "cpu",
        cubecl::Device::cpu()
            .expect("the CPU runtime is linked")
            .client(),
    ));
    clients
}

fn upload(client: &Client, values: &[f32]) -> Handle {
    client.create_from_slice(bytemuck::cast_slice(values))
}

fn read_f32(client: &Client, handle: Handle, len: usize) -> Vec<f32> {
    let bytes = client.read_one(handle).expect("read back");
    bytemuck::pod_collect_to_vec::<u8, f32>(&bytes[..len * 4])
}

fn read_u16(client: &Client, handle: Handle, len: usize) -> Vec<u16> {
    let bytes = client.read_one(handle).expect("read back");
    bytemuck::pod_collect_to_vec::<u8, u16>(&bytes[..len * 2])
}

/// Gradients of a scaled loss: mixed signs and magnitudes, including values near f32's limits
/// once unscaled, deterministic.
fn gradients(n: usize) -> Vec<f32> {
    let mut state = 0x9e37_79b9_u32;
    (0..n)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            let mantissa = (state >> 9) as f32 / (1u32 << 23) as f32 - 0.5;
            let exponent = (i % 61) as i32 - 30;
            mantissa * 2f32.powi(exponent) * 65536.0
        })
        .collect()
}

fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}: element {i}: device {g:e} vs host {w:e}"
        );
    }
}

#[test]
fn unscaling_equals_the_host_kernel_bit_for_bit() {
    for (runtime, client) in clients() {
        for n in [1, 2, 255, 4096, 100_003] {
            for inv_scale in [1.0 / 65536.0, 1.0 / 3.0, 1.0] {
                let values = gradients(n);
                let handle = upload(&client, &values);
                let found = cube::unscale_and_check(&client, handle.clone(), n, inv_scale)
                    .expect("kernel runs");
                let mut want = values.clone();
                let host_found = amp::unscale_and_check(&mut want, inv_scale);
                assert_eq!(found, host_found, "{runtime}: n {n}");
                assert!(!found, "{runtime}: finite gradients flagged (n {n})");
                let got = read_f32(&client, handle, n);
                assert_bits_eq(
                    &got,
                    &want,
                    &format!("{runtime} n {n} 1/{}", 1.0 / inv_scale),
                );
            }
        }
    }
}

#[test]
fn any_infinity_or_nan_anywhere_is_flagged() {
    for (runtime, client) in clients() {
        for n in [1, 17, 4099] {
            for at in [0, n / 2, n - 1] {
                for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                    let mut values = gradients(n);
                    values[at] = bad;
                    let handle = upload(&client, &values);
                    let found =
                        cube::unscale_and_check(&client, handle.clone(), n, 0.5).expect("runs");
                    assert!(found, "{runtime}: {bad} at {at} of {n} not flagged");
                    let mut want = values.clone();
                    amp::unscale_and_check(&mut want, 0.5);
                    let got = read_f32(&client, handle, n);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let same = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
                        assert!(same, "{runtime}: element {i}: {g} vs {w}");
                    }
                }
            }
        }
        // Finite before, infinite after: unscaling by more than one can overflow too.
        let handle = upload(&client, &[1.0, f32::MAX]);
        assert!(cube::unscale_and_check(&client, handle, 2, 2.0).expect("runs"));
        // The largest finite values are finite.
        let handle = upload(&client, &[f32::MAX, -f32::MAX, f32::MIN_POSITIVE]);
        assert!(!cube::unscale_and_check(&client, handle, 3, 1.0).expect("runs"));
    }
}

#[test]
fn one_flag_collects_many_buffers() {
    for (runtime, client) in clients() {
        let flag = NonFiniteFlag::new(&client);
        let buffers: Vec<Vec<f32>> = vec![gradients(100), vec![1.0, f32::NAN, 2.0], gradients(7)];
        for values in &buffers {
            cube::unscale_and_flag(&client, upload(&client, values), values.len(), 0.25, &flag);
        }
        assert!(
            flag.read(&client).expect("runs"),
            "{runtime}: NaN in the second buffer"
        );

        let flag = NonFiniteFlag::new(&client);
        for values in [&buffers[0], &buffers[2]] {
            cube::unscale_and_flag(&client, upload(&client, values), values.len(), 0.25, &flag);
        }
        assert!(
            !flag.read(&client).expect("runs"),
            "{runtime}: finite buffers"
        );
    }
}

/// The host conversion tests' probes (every f32 near each f16 and bf16 value and halfway
/// point, a stride through all bit patterns) and the specials.
fn probes() -> Vec<f32> {
    let specials = [
        0x7f80_0000,
        0xff80_0000,
        0x7fc0_0000,
        0x7f80_0001,
        0xffff_ffff,
        1,
        0,
    ];
    convert::narrowing_probes(4099)
        .chain(specials.map(f32::from_bits))
        .collect()
}

#[test]
fn narrowing_equals_the_host_conversion_bit_for_bit() {
    let values = probes();
    let n = values.len();
    let mut f16_want = vec![f16::ZERO; n];
    convert::f32_to_f16_slice(&values, &mut f16_want);
    let mut bf16_want = vec![bf16::ZERO; n];
    convert::f32_to_bf16_slice(&values, &mut bf16_want);
    for (runtime, client) in clients() {
        for (half, want) in [
            (
                Half::F16,
                f16_want.iter().map(|h| h.to_bits()).collect::<Vec<_>>(),
            ),
            (Half::Bf16, bf16_want.iter().map(|h| h.to_bits()).collect()),
        ] {
            // Odd lengths leave the last word half used.
            for len in [n, n - 1, 1] {
                let packed =
                    cube::narrow_to_half(&client, upload(&client, &values), len, half, 1.0);
                let got = read_u16(&client, packed, len);
                for (i, (g, w)) in got.iter().zip(&want[..len]).enumerate() {
                    assert_eq!(
                        g,
                        w,
                        "{runtime} {half:?}: {:e} ({:#010x}) gave {g:#06x}, host {w:#06x} (at {i})",
                        values[i],
                        values[i].to_bits()
                    );
                }
            }
        }
    }
}

#[test]
fn narrowing_with_a_scale_equals_scaling_then_narrowing() {
    let values = gradients(10_001);
    let factor = 1.0 / 3.0;
    let mut scaled = values.clone();
    accelerate_kernels::scale_in_place(&mut scaled, factor);
    let mut want = vec![f16::ZERO; values.len()];
    convert::f32_to_f16_slice(&scaled, &mut want);
    for (runtime, client) in clients() {
        let packed = cube::narrow_to_half(
            &client,
            upload(&client, &values),
            values.len(),
            Half::F16,
            factor,
        );
        let got = read_u16(&client, packed, values.len());
        let want: Vec<u16> = want.iter().map(|h| h.to_bits()).collect();
        assert_eq!(got, want, "{runtime}");
    }
}

#[test]
fn widening_every_half_equals_the_host_conversion_bit_for_bit() {
    let all: Vec<u16> = (0..=u16::MAX).collect();
    for (runtime, client) in clients() {
        for half in [Half::F16, Half::Bf16] {
            // Odd length: the last word's high half is padding and must not be written out.
            for len in [all.len(), all.len() - 1] {
                let packed = client.create_from_slice(bytemuck::cast_slice(&all));
                let widened = cube::widen_from_half(&client, packed, len, half);
                let got = read_f32(&client, widened, len);
                let want: Vec<f32> = all[..len]
                    .iter()
                    .map(|&bits| match half {
                        Half::F16 => convert::f16_bits_to_f32(bits),
                        Half::Bf16 => convert::bf16_bits_to_f32(bits),
                    })
                    .collect();
                assert_bits_eq(&got, &want, &format!("{runtime} {half:?} len {len}"));
            }
        }
    }
}

#[test]
fn empty_buffers_launch_nothing() {
    for (_, client) in clients() {
        let handle = upload(&client, &[1.0]);
        assert!(!cube::unscale_and_check(&client, handle.clone(), 0, f32::INFINITY).expect("runs"));
        let _ = cube::narrow_to_half(&client, handle.clone(), 0, Half::F16, 1.0);
        let _ = cube::widen_from_half(&client, handle, 0, Half::Bf16);
    }
}

mod fused_updates {
    use super::*;
    use accelerate_kernels::optim::{self, AdamHyper, SgdHyper, SgdMomentum};
    use cube::FlatBuffers;

    const STEPS: usize = 5;

    /// One update of a segment on the device: buffers, start, count, step, learning rate.
    type DeviceStep<'a> = &'a dyn Fn(&Client, &FlatBuffers, usize, usize, usize, f64);
    /// The same on the host: parameters, gradients, state slices, step, learning rate.
    type HostStep<'a> = &'a dyn Fn(&mut [f32], &[f32], &mut [Vec<f32>], usize, f64);

    fn buffers(client: &Client, params: &[f32], state: usize) -> FlatBuffers {
        let len = params.len();
        FlatBuffers {
            params: upload(client, params),
            grads: upload(client, &vec![0.0; len]),
            state: (0..state)
                .map(|_| upload(client, &vec![0.0; len]))
                .collect(),
            out: client.empty(len * 4),
            len,
            params_range: 0..len,
            grads_range: 0..len,
        }
    }

    /// Device and host may differ by the device's rounding of division and square root and by
    /// fused multiply-adds; over 5 updates the values stay within 2e-6 of each other relative
    /// to their size (observed: bit-identical on lavapipe, at most 4.2e-7 on cubecl's CPU
    /// runtime, which contracts multiply-adds).
    fn assert_near(got: &[f32], want: &[f32], what: &str) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 2e-6 * w.abs().max(1.0),
                "{what}: element {i}: device {g} vs host {w}"
            );
        }
    }

    /// Runs `STEPS` updates on the device and on the host from the same values, the second
    /// half of the buffer as one segment, the first half as another with its own learning
    /// rate, and compares the parameters and the state.
    fn compare(name: &str, state: usize, device_step: DeviceStep<'_>, host_step: HostStep<'_>) {
        let n = 10_001;
        let split = 4_000;
        let initial: Vec<f32> = gradients(n).iter().map(|g| g / 65536.0).collect();
        for (runtime, client) in clients() {
            let mut host = initial.clone();
            let mut host_state = vec![vec![0.0f32; n]; state];
            let mut flat = buffers(&client, &initial, state);
            for step in 0..STEPS {
                let grads: Vec<f32> = gradients(n)
                    .iter()
                    .enumerate()
                    .map(|(i, g)| g / 65536.0 * ((i + step) % 7) as f32 * 0.3)
                    .collect();
                flat.grads = upload(&client, &grads);
                let before = read_f32(&client, flat.params.clone(), n);
                for (start, end, lr) in [(0, split, 1e-2), (split, n, 3e-3)] {
                    device_step(&client, &flat, start, end - start, step + 1, lr);
                    let mut views: Vec<Vec<f32>> =
                        host_state.iter().map(|s| s[start..end].to_vec()).collect();
                    host_step(
                        &mut host[start..end],
                        &grads[start..end],
                        &mut views,
                        step + 1,
                        lr,
                    );
                    for (s, v) in host_state.iter_mut().zip(views) {
                        s[start..end].copy_from_slice(&v);
                    }
                }
                // The old parameters are untouched; the new ones become the next input.
                assert_bits_eq(&read_f32(&client, flat.params.clone(), n), &before, "input");
                flat.params = std::mem::replace(&mut flat.out, client.empty(n * 4));
            }
            let got = read_f32(&client, flat.params.clone(), n);
            assert_near(&got, &host, &format!("{runtime} {name} parameters"));
            assert_ne!(got, initial, "{runtime} {name}: nothing was updated");
            for (k, (d, h)) in flat.state.iter().zip(&host_state).enumerate() {
                assert_near(
                    &read_f32(&client, d.clone(), n),
                    h,
                    &format!("{runtime} {name} state {k}"),
                );
            }
        }
    }

    fn adam(name: &str, hyper: AdamHyper, amsgrad: bool) {
        let state = if amsgrad { 3 } else { 2 };
        compare(
            name,
            state,
            &|client, flat, start, count, time, lr| {
                cube::adam_step(
                    client,
                    flat,
                    start,
                    count,
                    time as i32,
                    lr,
                    0.5,
                    &hyper,
                    amsgrad,
                )
            },
            &|p, g, s, time, lr| {
                let (m, rest) = s.split_at_mut(1);
                let (v, rest) = rest.split_at_mut(1);
                let max_v = rest.first_mut().map(|x| x.as_mut_slice());
                optim::adam_step(
                    p,
                    g,
                    &mut m[0],
                    &mut v[0],
                    max_v,
                    time as i32,
                    lr,
                    0.5,
                    &hyper,
                );
            },
        );
    }

    #[test]
    fn adamw_adam_and_amsgrad_follow_the_host_kernels() {
        let adamw = AdamHyper {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: 0.05,
            decoupled: true,
        };
        adam("AdamW", adamw, false);
        adam("AdamW AMSGrad", adamw, true);
        let l2 = AdamHyper {
            weight_decay: 0.01,
            decoupled: false,
            beta_2: 0.99,
            ..adamw
        };
        adam("Adam L2", l2, false);
    }

    #[test]
    fn sgd_with_and_without_momentum_follows_the_host_kernel() {
        let nesterov = SgdHyper {
            weight_decay: Some(0.01),
            momentum: Some(SgdMomentum {
                momentum: 0.9,
                dampening: 0.1,
                nesterov: true,
            }),
        };
        let plain = SgdHyper {
            weight_decay: None,
            momentum: None,
        };
        for (name, hyper, state) in [("SGD Nesterov", nesterov, 1), ("SGD", plain, 0)] {
            compare(
                name,
                state,
                &|client, flat, start, count, time, lr| {
                    cube::sgd_step(client, flat, start, count, time == 1, lr, 0.5, &hyper)
                },
                &|p, g, s, time, lr| {
                    let velocity = s.first_mut().map(|x| x.as_mut_slice());
                    optim::sgd_step(p, g, velocity, time == 1, lr, 0.5, &hyper);
                },
            );
        }
    }

    /// An update whose parameters and gradients are one segment's own buffers (`params_range`
    /// and `grads_range` that segment) writes the same bits as the update of that segment
    /// within whole flat buffers, and leaves the same state.
    #[test]
    fn a_segment_in_buffers_of_its_own_updates_like_the_flat_buffers() {
        let hyper = AdamHyper {
            beta_1: 0.9,
            beta_2: 0.999,
            epsilon: 1e-5,
            weight_decay: 0.05,
            decoupled: true,
        };
        let (n, segment) = (1000, 300..700);
        let initial: Vec<f32> = gradients(n).iter().map(|g| g / 65536.0).collect();
        for (runtime, client) in clients() {
            let mut flat = buffers(&client, &initial, 2);
            let mut own = buffers(&client, &initial, 2);
            own.params = upload(&client, &initial[segment.clone()]);
            own.out = client.empty(segment.len() * 4);
            own.params_range = segment.clone();
            let grads = gradients(n);
            flat.grads = upload(&client, &grads);
            own.grads = upload(&client, &grads[segment.clone()]);
            own.grads_range = segment.clone();
            for time in 1..=3 {
                for buffers in [&flat, &own] {
                    cube::adam_step(
                        &client,
                        buffers,
                        segment.start,
                        segment.len(),
                        time,
                        1e-2,
                        0.5,
                        &hyper,
                        false,
                    );
                }
                flat.params = std::mem::replace(&mut flat.out, client.empty(n * 4));
                own.params = std::mem::replace(&mut own.out, client.empty(segment.len() * 4));
            }
            let whole = read_f32(&client, flat.params.clone(), n);
            let mine = read_f32(&client, own.params.clone(), segment.len());
            assert_bits_eq(&mine, &whole[segment.clone()], runtime);
            for (a, b) in flat.state.iter().zip(&own.state) {
                let (a, b) = (
                    read_f32(&client, a.clone(), n),
                    read_f32(&client, b.clone(), n),
                );
                assert_bits_eq(&b[segment.clone()], &a[segment.clone()], runtime);
            }
        }
    }

    #[test]
    fn segments_without_gradients_are_copied_unchanged() {
        for (runtime, client) in clients() {
            let values = gradients(1000);
            let flat = buffers(&client, &values, 0);
            cube::copy_params(&client, &flat, 0, 400);
            cube::copy_params(&client, &flat, 400, 600);
            assert_bits_eq(&read_f32(&client, flat.out, 1000), &values, runtime);
        }
    }
}

/// A length the buffer does not have stops at the wrapper, naming it, before any launch: safe
/// code cannot make a kernel write past a buffer.
#[test]
fn a_length_longer_than_the_buffer_is_refused_before_the_launch() {
    for (runtime, client) in clients() {
        let short = upload(&client, &[1.0; 4]);
        let launched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cube::narrow_to_half(&client, short.clone(), 1000, Half::F16, 1.0)
        }));
        let message = launched
            .err()
            .and_then(|p| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| panic!("{runtime}: a 16-byte buffer was accepted for 1000 values"));
        assert!(
            message.contains("narrow_to_half values: a buffer of 16 bytes"),
            "{runtime}: {message}"
        );
    }
}
