//! Who sends which part of a buffer to whom, step by step: the algorithm schedules of the
//! collectives, as pure functions (no sockets, no memory), tested by simulation.
//!
//! - Ring (bandwidth-optimal for large buffers): the buffer is cut into `n` chunks; in
//!   `n - 1` reduce-scatter steps each rank passes one chunk to its right neighbour, which
//!   reduces it, so that rank `r` ends with the fully reduced chunk `r`; `n - 1` all-gather
//!   steps then circulate the reduced chunks. Each rank sends `2 (n - 1) / n` of the buffer.
//! - Recursive doubling (latency-optimal for small buffers): `log2 n` rounds of pairwise
//!   exchanges of the whole buffer. For `n` not a power of two, the first `2 * extra` ranks
//!   fold pairwise beforehand (the even one hands its data to the odd one and waits for the
//!   result), leaving a power of two.

use std::ops::Range;

/// Chunk `index` of `len` elements cut into `parts` nearly equal chunks (the first
/// `len % parts` chunks hold one more element).
pub fn chunk_range(len: usize, parts: usize, index: usize) -> Range<usize> {
    debug_assert!(index < parts);
    let base = len / parts;
    let extra = len % parts;
    let start = index * base + index.min(extra);
    let size = base + usize::from(index < extra);
    start..start + size
}

/// The ring neighbours of `rank`: (left, right) = (sender to us, receiver from us).
pub fn ring_neighbours(rank: usize, n: usize) -> (usize, usize) {
    ((rank + n - 1) % n, (rank + 1) % n)
}

/// Reduce-scatter step `step` (`0..n-1`) of `rank`: (chunk to send right, chunk to receive
/// from the left and reduce). After the last step `rank` holds the reduced chunk `rank`.
pub fn ring_reduce_scatter_step(rank: usize, n: usize, step: usize) -> (usize, usize) {
    let send = (rank + 2 * n - step - 1) % n;
    let recv = (rank + 2 * n - step - 2) % n;
    (send, recv)
}

/// All-gather step `step` (`0..n-1`) of `rank`, starting from each rank owning chunk `rank`:
/// (chunk to send right, chunk to receive from the left and store).
pub fn ring_all_gather_step(rank: usize, n: usize, step: usize) -> (usize, usize) {
    let send = (rank + n - step) % n;
    let recv = (rank + 2 * n - step - 1) % n;
    (send, recv)
}

/// A rank's part in recursive doubling over `n` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DoublingRole {
    /// Hands its buffer to `partner` before the rounds and receives the result after.
    Folded {
        /// The rank that represents this one.
        partner: usize,
    },
    /// Takes part in the rounds.
    Active {
        /// A folded rank whose buffer is reduced in first and who gets the result after.
        folded: Option<usize>,
        /// The exchange partner of each round, in order.
        rounds: Vec<usize>,
    },
}

/// The recursive-doubling role of `rank` among `n` ranks.
pub fn recursive_doubling(rank: usize, n: usize) -> DoublingRole {
    let p = if n.is_power_of_two() {
        n
    } else {
        n.next_power_of_two() / 2
    };
    let extra = n - p;
    // Ranks below 2 * extra pair up: the even one folds into the odd one.
    if rank < 2 * extra && rank.is_multiple_of(2) {
        return DoublingRole::Folded { partner: rank + 1 };
    }
    let virtual_rank = |r: usize| if r < 2 * extra { r / 2 } else { r - extra };
    let real_rank = |v: usize| if v < extra { 2 * v + 1 } else { v + extra };
    let me = virtual_rank(rank);
    let mut rounds = Vec::new();
    let mut mask = 1;
    while mask < p {
        rounds.push(real_rank(me ^ mask));
        mask <<= 1;
    }
    DoublingRole::Active {
        folded: (rank < 2 * extra).then(|| rank - 1),
        rounds,
    }
}

/// The children of `rank` in a binomial broadcast tree rooted at `root` over `n` ranks, in
/// the order they are sent to, and its parent (`None` for the root).
pub fn binomial_tree(rank: usize, root: usize, n: usize) -> (Option<usize>, Vec<usize>) {
    let relative = (rank + n - root) % n;
    let mut parent = None;
    let mut mask = 1;
    while mask < n {
        if relative & mask != 0 {
            parent = Some((relative - mask + root) % n);
            break;
        }
        mask <<= 1;
    }
    let mut children = Vec::new();
    mask >>= 1;
    while mask > 0 {
        if relative + mask < n {
            children.push((relative + mask + root) % n);
        }
        mask >>= 1;
    }
    (parent, children)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORLDS: std::ops::RangeInclusive<usize> = 1..=16;
    const LENS: [usize; 7] = [0, 1, 2, 7, 13, 64, 1021];

    fn inputs(n: usize, len: usize) -> Vec<Vec<u64>> {
        (0..n)
            .map(|r| (0..len).map(|i| ((r + 1) * 1000 + i) as u64).collect())
            .collect()
    }

    fn expected(n: usize, len: usize) -> Vec<u64> {
        (0..len)
            .map(|i| (0..n).map(|r| ((r + 1) * 1000 + i) as u64).sum())
            .collect()
    }

    #[test]
    fn chunks_tile_the_buffer() {
        for parts in WORLDS {
            for len in LENS {
                let mut next = 0;
                for i in 0..parts {
                    let r = chunk_range(len, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == len / parts || r.len() == len / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn simulated_ring_all_reduce_sums_everywhere() {
        for n in WORLDS {
            for len in LENS {
                let mut bufs = inputs(n, len);
                for step in 0..n - 1 {
                    let sent: Vec<Vec<u64>> = (0..n)
                        .map(|r| {
                            let c = chunk_range(len, n, ring_reduce_scatter_step(r, n, step).0);
                            bufs[r][c].to_vec()
                        })
                        .collect();
                    for (r, buf) in bufs.iter_mut().enumerate() {
                        let (left, _) = ring_neighbours(r, n);
                        let (_, recv) = ring_reduce_scatter_step(r, n, step);
                        assert_eq!(recv, ring_reduce_scatter_step(left, n, step).0);
                        let c = chunk_range(len, n, recv);
                        for (x, y) in buf[c].iter_mut().zip(&sent[left]) {
                            *x += y;
                        }
                    }
                }
                let want = expected(n, len);
                for (r, buf) in bufs.iter().enumerate() {
                    let c = chunk_range(len, n, r);
                    assert_eq!(
                        buf[c.clone()],
                        want[c],
                        "reduce-scatter n={n} len={len} r={r}"
                    );
                }
                for step in 0..n - 1 {
                    let sent: Vec<Vec<u64>> = (0..n)
                        .map(|r| {
                            let c = chunk_range(len, n, ring_all_gather_step(r, n, step).0);
                            bufs[r][c].to_vec()
                        })
                        .collect();
                    for (r, buf) in bufs.iter_mut().enumerate() {
                        let (left, _) = ring_neighbours(r, n);
                        let (_, recv) = ring_all_gather_step(r, n, step);
                        assert_eq!(recv, ring_all_gather_step(left, n, step).0);
                        let c = chunk_range(len, n, recv);
                        buf[c].copy_from_slice(&sent[left]);
                    }
                }
                assert!(
                    bufs.iter().all(|b| *b == want),
                    "all-reduce n={n} len={len}"
                );
            }
        }
    }

    #[test]
    fn simulated_recursive_doubling_sums_everywhere() {
        for n in WORLDS {
            let len = 5;
            let mut bufs = inputs(n, len);
            let roles: Vec<_> = (0..n).map(|r| recursive_doubling(r, n)).collect();
            // Fold.
            for (r, role) in roles.iter().enumerate() {
                if let DoublingRole::Folded { partner } = role {
                    let theirs = bufs[r].clone();
                    assert_eq!(
                        roles[*partner],
                        DoublingRole::Active {
                            folded: Some(r),
                            rounds: match &roles[*partner] {
                                DoublingRole::Active { rounds, .. } => rounds.clone(),
                                _ => unreachable!(),
                            }
                        }
                    );
                    for (x, y) in bufs[*partner].iter_mut().zip(theirs) {
                        *x += y;
                    }
                }
            }
            let rounds = roles
                .iter()
                .find_map(|r| match r {
                    DoublingRole::Active { rounds, .. } => Some(rounds.len()),
                    _ => None,
                })
                .unwrap();
            for k in 0..rounds {
                let snapshot = bufs.clone();
                for (r, role) in roles.iter().enumerate() {
                    if let DoublingRole::Active { rounds, .. } = role {
                        let peer = rounds[k];
                        match &roles[peer] {
                            DoublingRole::Active { rounds: theirs, .. } => assert_eq!(theirs[k], r),
                            _ => panic!("n={n}: rank {r} pairs with folded rank {peer}"),
                        }
                        for (x, y) in bufs[r].iter_mut().zip(&snapshot[peer]) {
                            *x += y;
                        }
                    }
                }
            }
            for (r, role) in roles.iter().enumerate() {
                if let DoublingRole::Folded { partner } = role {
                    bufs[r] = bufs[*partner].clone();
                }
            }
            let want = expected(n, len);
            assert!(bufs.iter().all(|b| *b == want), "n={n}");
        }
    }

    #[test]
    fn binomial_tree_reaches_every_rank_once() {
        for n in WORLDS {
            for root in 0..n {
                let mut reached = vec![false; n];
                reached[root] = true;
                let mut frontier = vec![root];
                while let Some(r) = frontier.pop() {
                    let (_, children) = binomial_tree(r, root, n);
                    for c in children {
                        assert!(!reached[c], "n={n} root={root}: {c} reached twice");
                        assert_eq!(binomial_tree(c, root, n).0, Some(r));
                        reached[c] = true;
                        frontier.push(c);
                    }
                }
                assert!(reached.iter().all(|&x| x), "n={n} root={root}");
                assert_eq!(binomial_tree(root, root, n).0, None);
            }
        }
    }
}
