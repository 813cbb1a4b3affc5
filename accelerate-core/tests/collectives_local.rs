//! Every collective against a serial reference, with threads as ranks on the in-process
//! transport: world sizes 1 to 4, every dtype, every reduction, both all-reduce algorithms.

mod common;

use std::time::Duration;

use accelerate_core::CommError;
use accelerate_core::comm::{AllReduceAlgorithm, GroupOptions, ProcessGroup, Reduction};
use half::{bf16, f16};

fn options(algorithm: AllReduceAlgorithm) -> GroupOptions {
    GroupOptions {
        algorithm,
        timeout: Duration::from_secs(20),
        // Small segments so the ring's multi-window path runs too.
        segment_bytes: 4096,
        ..GroupOptions::default()
    }
}

fn on_threads(world: usize, options: &GroupOptions, body: impl Fn(&mut ProcessGroup) + Sync) {
    let groups = ProcessGroup::local(world, options);
    std::thread::scope(|scope| {
        let handles: Vec<_> = groups
            .into_iter()
            .map(|mut group| {
                let body = &body;
                scope.spawn(move || body(&mut group))
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
}

#[test]
fn every_collective_matches_the_reference() {
    for algorithm in [
        AllReduceAlgorithm::Ring,
        AllReduceAlgorithm::RecursiveDoubling,
        AllReduceAlgorithm::Auto,
    ] {
        for world in 1..=4 {
            on_threads(world, &options(algorithm), |group| {
                common::check_all::<f32>(group, &common::LENS);
                common::check_all::<f16>(group, &common::LENS);
                common::check_all::<bf16>(group, &common::LENS);
                // In-process groups keep shared buffers on the heap.
                assert!(!common::check_shared::<f32>(group, &common::LENS));
            });
        }
    }
}

#[test]
fn results_are_bit_identical_on_every_rank() {
    // Non-integer inputs: rounding happens, and every rank must still see the same bits.
    for world in 2..=4 {
        let results = std::sync::Mutex::new(Vec::new());
        on_threads(world, &options(AllReduceAlgorithm::Ring), |group| {
            let mut buf: Vec<f32> = (0..10_007)
                .map(|i| ((i * (group.rank() + 3)) as f32).sin() / 3.0)
                .collect();
            group.all_reduce(&mut buf, Reduction::Mean).unwrap();
            results.lock().unwrap().push(buf);
        });
        let results = results.into_inner().unwrap();
        assert!(results.windows(2).all(|w| w[0] == w[1]), "world {world}");
    }
}

#[test]
fn mismatched_sizes_fail_on_both_ranks_naming_both_calls() {
    let errors = std::sync::Mutex::new(Vec::new());
    on_threads(2, &options(AllReduceAlgorithm::Auto), |group| {
        let mut buf = vec![1.0_f32; 100 + group.rank()];
        let err = group.all_reduce(&mut buf, Reduction::Sum).unwrap_err();
        errors.lock().unwrap().push(err.clone());
        // The group stays failed with the same error.
        assert_eq!(group.barrier().unwrap_err(), err);
    });
    for err in errors.into_inner().unwrap() {
        let msg = err.to_string();
        assert!(
            matches!(
                err,
                CommError::Mismatch { .. } | CommError::PeerFailed { .. }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("all_reduce #0 (100 x f32, sum)") || msg.contains("101 x f32"),
            "{msg}"
        );
    }
}

#[test]
fn a_rank_that_never_calls_times_out_naming_it() {
    let opts = GroupOptions {
        timeout: Duration::from_millis(300),
        ..options(AllReduceAlgorithm::Auto)
    };
    on_threads(3, &opts, |group| {
        if group.rank() == 2 {
            // Rank 2 skips the call but stays alive until the others gave up.
            std::thread::sleep(Duration::from_millis(1500));
            return;
        }
        let err = group.barrier().unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(&err, CommError::Timeout { missing, .. } if missing.contains(&2))
                || matches!(&err, CommError::PeerFailed { reason, .. } if reason.contains("rank 2")),
            "{msg}"
        );
    });
}

#[test]
fn a_shared_buffer_of_another_group_is_refused() {
    let mut first = ProcessGroup::local(1, &GroupOptions::default());
    let mut second = ProcessGroup::local(1, &GroupOptions::default());
    let mut buf = first[0].shared_buffer::<f32>(4).unwrap();
    let err = second[0]
        .all_reduce_shared(&mut buf, Reduction::Sum)
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("allocated by another process group"),
        "{err}"
    );
}

#[test]
fn usage_errors_are_reported_before_any_communication() {
    let mut groups = ProcessGroup::local(2, &GroupOptions::default());
    let group = &mut groups[0];
    let err = group.all_gather(&[1.0_f32; 3], &mut [0.0; 5]).unwrap_err();
    assert!(
        err.to_string()
            .contains("output holds 5 elements, 3 x 2 ranks expected"),
        "{err}"
    );
    let err = group.broadcast(&mut [0.0_f32; 2], 7).unwrap_err();
    assert!(err.to_string().contains("root 7"), "{err}");
    let err = group
        .reduce_scatter_counts(&[1.0_f32; 4], &mut [0.0; 1], &[1, 2], Reduction::Sum)
        .unwrap_err();
    assert!(err.to_string().contains("adding up to Some(3)"), "{err}");
}

/// Ranks that cut a reduce-scatter into different counts fail naming the mismatch (the
/// counts travel as a fingerprint), instead of reducing each other's chunks.
#[test]
fn ranks_cutting_a_reduce_scatter_differently_fail_on_both() {
    on_threads(2, &options(AllReduceAlgorithm::Ring), |group| {
        let counts = if group.rank() == 0 { [1, 3] } else { [3, 1] };
        let mut out = vec![0.0_f32; counts[group.rank()]];
        let err = group
            .reduce_scatter_counts(&[1.0_f32; 4], &mut out, &counts, Reduction::Sum)
            .unwrap_err();
        assert!(err.to_string().contains("counts"), "{err}");
    });
}

/// A rank announcing the largest value an object may be, in a group of five: padded for every
/// rank the gather would need 1.25 GiB, so every honest rank refuses it, naming that rank,
/// without allocating it.
#[test]
fn an_object_gather_too_large_once_padded_is_refused_naming_the_rank() {
    let announced = accelerate_core::comm::MAX_OBJECT_BYTES as u64;
    on_threads(5, &options(AllReduceAlgorithm::Ring), |group| {
        if group.rank() == 4 {
            // Rank 4 speaks the gather's first step itself, announcing the length.
            let mut lens = vec![0u8; 8 * 5];
            group
                .all_gather_raw(&announced.to_le_bytes(), &mut lens)
                .unwrap();
            return;
        }
        let err = group
            .all_gather_object(&String::from("small"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 4's value of 268435456 bytes") && err.contains("1073741824"),
            "{err}"
        );
    });
}
