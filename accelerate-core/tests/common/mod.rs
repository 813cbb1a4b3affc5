//! Inputs and serial references shared by the collective tests: every rank's input is small
//! integers, so sums are exact in f32, f16 and bf16 whatever the order of combination, and any
//! difference from the reference is a bug, not rounding.

#![allow(dead_code)]

use accelerate_core::comm::{ProcessGroup, Reduction};
use accelerate_kernels::Element;
use accelerate_kernels::schedule::chunk_range;

/// Buffer lengths every collective is checked at.
pub const LENS: [usize; 9] = [0, 1, 2, 3, 7, 13, 100, 1021, 4099];
/// Every reduction.
pub const REDUCTIONS: [Reduction; 4] = [
    Reduction::Sum,
    Reduction::Mean,
    Reduction::Max,
    Reduction::Min,
];

/// Rank `rank`'s value at index `i`: an integer in -8..=8.
pub fn value(rank: usize, i: usize) -> f32 {
    (((rank * 7 + i * 5) % 17) as i32 - 8) as f32
}

/// Rank `rank`'s input of `len` elements.
pub fn input<T: Convert>(rank: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| T::from_f32(value(rank, i))).collect()
}

/// What `reduction` over `world` ranks gives at every index, rounded to `T` once.
pub fn reduced<T: Convert>(world: usize, len: usize, reduction: Reduction) -> Vec<T> {
    (0..len)
        .map(|i| {
            let values = (0..world).map(|r| value(r, i));
            let v = match reduction {
                Reduction::Sum => values.sum::<f32>(),
                Reduction::Mean => values.sum::<f32>() * (1.0 / world as f32),
                Reduction::Max => values.fold(f32::MIN, f32::max),
                Reduction::Min => values.fold(f32::MAX, f32::min),
            };
            T::from_f32(v)
        })
        .collect()
}

/// Element types the tests build from f32 (with [`Element::from_f32`]) and compare.
pub trait Convert: Element + PartialEq + std::fmt::Debug {}
impl<T: Element + PartialEq + std::fmt::Debug> Convert for T {}

/// Runs every collective on `group` for element type `T` and checks each against the serial
/// reference. Every rank of the group calls this with the same arguments.
pub fn check_all<T: Convert>(group: &mut ProcessGroup, lens: &[usize]) {
    let (rank, world) = (group.rank(), group.world_size());
    for &len in lens {
        for reduction in REDUCTIONS {
            let mut buf = input::<T>(rank, len);
            group.all_reduce(&mut buf, reduction).unwrap();
            assert_eq!(
                buf,
                reduced::<T>(world, len, reduction),
                "all_reduce {reduction:?} len {len} rank {rank}"
            );

            let full = input::<T>(rank, len);
            let mut out = vec![T::from_f32(0.0); group.chunk_len(len)];
            group.reduce_scatter(&full, &mut out, reduction).unwrap();
            let want = reduced::<T>(world, len, reduction)[chunk_range(len, world, rank)].to_vec();
            assert_eq!(
                out, want,
                "reduce_scatter {reduction:?} len {len} rank {rank}"
            );

            // Unequal chunks, the first ranks' small or empty, the last rank's the rest.
            let mut counts: Vec<usize> = (0..world).map(|r| len * r / (2 * world)).collect();
            let others: usize = counts[..world - 1].iter().sum();
            counts[world - 1] = len - others;
            let start: usize = counts[..rank].iter().sum();
            let mut out = vec![T::from_f32(0.0); counts[rank]];
            group
                .reduce_scatter_counts(&full, &mut out, &counts, reduction)
                .unwrap();
            let want = reduced::<T>(world, len, reduction)[start..start + counts[rank]].to_vec();
            assert_eq!(
                out, want,
                "reduce_scatter_counts {counts:?} {reduction:?} len {len} rank {rank}"
            );
        }
        let root = len % world;
        let mut buf = input::<T>(rank, len);
        group.broadcast(&mut buf, root).unwrap();
        assert_eq!(
            buf,
            input::<T>(root, len),
            "broadcast len {len} rank {rank}"
        );

        let mut gathered = vec![T::from_f32(0.0); len * world];
        group
            .all_gather(&input::<T>(rank, len), &mut gathered)
            .unwrap();
        let want: Vec<T> = (0..world).flat_map(|r| input::<T>(r, len)).collect();
        assert_eq!(gathered, want, "all_gather len {len} rank {rank}");
    }
    group.barrier().unwrap();
    let everyone = group.gather_object(&format!("rank {rank}"), 0).unwrap();
    if rank == 0 {
        let want: Vec<String> = (0..world).map(|r| format!("rank {r}")).collect();
        assert_eq!(everyone, Some(want));
    } else {
        assert_eq!(everyone, None);
    }
    let config = group
        .broadcast_object(Some(&vec![rank as u64, 42]), world - 1)
        .unwrap();
    assert_eq!(config, vec![(world - 1) as u64, 42]);
}

/// Checks `all_reduce_shared` on buffers from `shared_buffer`, each reused for every reduction.
/// Returns whether the buffers lived in shared memory.
pub fn check_shared<T: Convert>(group: &mut ProcessGroup, lens: &[usize]) -> bool {
    let (rank, world) = (group.rank(), group.world_size());
    let mut in_shared_memory = false;
    for &len in lens {
        let mut buf = group.shared_buffer::<T>(len).unwrap();
        assert!(
            buf.iter().all(|v| *v == T::from_f32(0.0)),
            "a new buffer is zeroed"
        );
        in_shared_memory |= buf.is_shared_memory();
        for reduction in REDUCTIONS {
            buf.copy_from_slice(&input::<T>(rank, len));
            group.all_reduce_shared(&mut buf, reduction).unwrap();
            assert_eq!(
                &buf[..],
                &reduced::<T>(world, len, reduction)[..],
                "all_reduce_shared {reduction:?} len {len} rank {rank}"
            );
        }
    }
    in_shared_memory
}
