//! Property tests of every decoder that reads a peer's bytes: random and mutated frames never
//! panic, and only well-formed frames are accepted. `cargo test` runs a few hundred cases each;
//! the long run, documented in the README, is
//!
//! ```text
//! PROPTEST_CASES=1000000 cargo test --release -p accelerate-core --test wire_fuzz
//! ```
//!
//! (a million cases of each property; about 9 s on 2 cores).

use std::time::{Duration, Instant};

use accelerate_core::comm::auth::{self, ANSWER_BYTES, CHALLENGE_BYTES, Claim, Purpose};
use accelerate_core::comm::call::{HEADER_BYTES, Header};
use accelerate_core::comm::collective::MessageEngine;
use accelerate_core::comm::engine::Engine;
use accelerate_core::comm::hierarchical::{HierarchicalEngine, Layout};
use accelerate_core::comm::link::{Link, LinkError};
use accelerate_core::comm::rendezvous::{decode_hello, decode_reply};
use accelerate_core::comm::{
    AllReduceAlgorithm, CallDesc, GroupOptions, MAX_OBJECT_BYTES, OpKind, ProcessGroup,
};
use accelerate_kernels::{DType, ReduceOp};
use proptest::prelude::*;

/// A valid encoded header, to mutate.
fn valid_header() -> [u8; HEADER_BYTES] {
    Header {
        call: CallDesc {
            count: 1000,
            dtype: Some(DType::F32),
            reduce: Some(ReduceOp::Sum),
            ..CallDesc::new(OpKind::AllReduce, 3)
        },
        sender: 1,
        payload_len: 4000,
    }
    .encode()
}

/// `bytes` with `flips` (index, xor) applied.
fn mutate(mut bytes: Vec<u8>, flips: &[(usize, u8)]) -> Vec<u8> {
    if !bytes.is_empty() {
        for &(i, x) in flips {
            let n = bytes.len();
            bytes[i % n] ^= x;
        }
    }
    bytes
}

/// A link whose peer sends whatever the test scripted: headers and payload lengths that may
/// or may not match the call, payloads of random bytes, or a lost connection.
struct ScriptedLink {
    rank: usize,
    world_size: usize,
    frames: Vec<(Header, bool)>,
    fill: u8,
}

impl Link for ScriptedLink {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn send(&mut self, _: usize, _: &Header, _: &[u8]) -> Result<(), LinkError> {
        Ok(())
    }
    fn recv_header(&mut self, _: usize, _: Instant) -> Result<Header, LinkError> {
        self.frames.pop().map(|(h, _)| h).ok_or(LinkError::Timeout)
    }
    fn recv_payload(
        &mut self,
        _: usize,
        buf: &mut Vec<u8>,
        len: usize,
        _: Instant,
    ) -> Result<(), LinkError> {
        // The engine asks only for lengths it checked: never more than a call's buffer.
        assert!(len <= 4 << 20, "asked for {len} bytes");
        if self.fill == 0 {
            return Err(LinkError::Lost("reset".into()));
        }
        *buf = vec![self.fill; len];
        Ok(())
    }
}

fn dtype(code: u8) -> DType {
    [DType::F32, DType::F16, DType::BF16][code as usize % 3]
}

/// A scripted frame: the expected call or another, a payload length of some kind, a sender.
fn frame_strategy() -> impl Strategy<Value = (bool, u8, u64, u32, u8, u8)> {
    (
        any::<bool>(),
        0u8..6,
        any::<u64>(),
        0u32..6,
        1u8..10,
        any::<u8>(),
    )
}

/// The call of kind `op` (all-reduce, broadcast from 1, all-gather, reduce-scatter, barrier)
/// over `elems` elements of the type `code` picks.
fn call_of(op: u8, elems: usize, code: u8) -> (CallDesc, DType) {
    let dtype = dtype(code);
    let mut call = CallDesc::new(OpKind::AllReduce, 0);
    call.count = elems as u64;
    call.dtype = Some(dtype);
    call.reduce = Some(ReduceOp::Sum);
    match op {
        1 => {
            call.op = OpKind::Broadcast;
            call.reduce = None;
            call.root = Some(1);
        }
        2 => {
            call.op = OpKind::AllGather;
            call.reduce = None;
        }
        3 => call.op = OpKind::ReduceScatter,
        4 => call = CallDesc::new(OpKind::Barrier, 0),
        _ => {}
    }
    (call, dtype)
}

/// Each scripted frame is the expected call with a plausible or hostile length, or a random
/// call, from the right or a wrong sender.
fn frames(
    call: &CallDesc,
    dtype: DType,
    world_size: usize,
    script: Vec<(bool, u8, u64, u32, u8, u8)>,
) -> Vec<(Header, bool)> {
    let bytes = call.count as usize * dtype.size();
    script
        .into_iter()
        .map(|(same, len_kind, random_len, sender, opcode, seq)| {
            let payload_len = match len_kind {
                0 => bytes as u64,
                1 => (bytes / world_size) as u64,
                2 => bytes.div_ceil(world_size).next_multiple_of(dtype.size()) as u64,
                3 => 0,
                4 => u64::MAX,
                _ => random_len,
            };
            let frame_call = if same {
                *call
            } else if opcode == 6 {
                CallDesc::new(OpKind::Abort, u64::MAX)
            } else {
                let mut other = *call;
                other.seq = u64::from(seq % 3);
                other.count = random_len % 1000;
                other
            };
            (
                Header {
                    call: frame_call,
                    sender,
                    payload_len,
                },
                true,
            )
        })
        .collect()
}

/// Runs `call` on `engine` as rank `rank` of `world_size`.
fn run_call(
    engine: &mut impl Engine,
    call: &CallDesc,
    dtype: DType,
    elems: usize,
    world_size: usize,
    rank: usize,
) -> Result<(), accelerate_core::error::CommError> {
    let bytes = elems * dtype.size();
    let mut buf = vec![0u8; bytes];
    match call.op {
        OpKind::AllReduce => engine.all_reduce(call, &mut buf, Some(0.5)),
        OpKind::Broadcast => engine.broadcast(call, &mut buf, 1),
        OpKind::AllGather => {
            let mut out = vec![0u8; bytes * world_size];
            engine.all_gather(call, &buf, &mut out)
        }
        OpKind::ReduceScatter => {
            let counts = accelerate_core::comm::engine::even_counts(elems, world_size);
            let mut mine = vec![0u8; counts[rank] * dtype.size()];
            engine.reduce_scatter(call, &buf, &mut mine, &counts)
        }
        _ => engine.barrier(call),
    }
}

proptest! {
    // Failures are shrunk and printed; there is no source directory to persist them beside.
    #![proptest_config(ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn headers_decode_only_what_they_encode(
        random in proptest::collection::vec(any::<u8>(), HEADER_BYTES),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
    ) {
        for bytes in [random, mutate(valid_header().to_vec(), &flips)] {
            let raw: [u8; HEADER_BYTES] = bytes.clone().try_into().unwrap();
            if let Some(header) = Header::decode(&raw) {
                prop_assert_eq!(header.encode().to_vec(), bytes);
            }
        }
    }

    #[test]
    fn handshakes_accept_only_the_token_holder(
        random in proptest::collection::vec(any::<u8>(), ANSWER_BYTES),
        flips in proptest::collection::vec((any::<usize>(), 1u8..), 1..4),
        nonce in any::<[u8; 32]>(),
    ) {
        let challenge = auth::challenge(&nonce);
        let claim = Claim { purpose: Purpose::Rendezvous, rank: 1, world_size: 2 };
        let genuine = auth::answer(b"token", &challenge, claim, &[3; 32]);
        prop_assert_eq!(auth::verify_answer(b"token", &challenge, &genuine), Ok(claim));
        let random: [u8; ANSWER_BYTES] = random.try_into().unwrap();
        prop_assert!(auth::verify_answer(b"token", &challenge, &random).is_err());
        let mutated: [u8; ANSWER_BYTES] =
            mutate(genuine.to_vec(), &flips).try_into().unwrap();
        if mutated != genuine {
            prop_assert!(auth::verify_answer(b"token", &challenge, &mutated).is_err());
        }
        let mut frame = [0u8; CHALLENGE_BYTES];
        frame.copy_from_slice(&mutate(challenge.to_vec(), &flips));
        let _ = auth::decode_challenge(&frame);
    }

    #[test]
    fn rendezvous_lines_never_panic(
        random in proptest::collection::vec(any::<u8>(), 0..300),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        world_size in 0usize..5,
    ) {
        let hello = br#"{"rank":1,"world_size":2,"host":"h/b","listen":"127.0.0.1:9","settings":{"shm_slot_bytes":4096,"segment_bytes":4096}}"#;
        prop_assert!(decode_hello(hello).is_ok());
        let welcome = br#"{"Welcome":{"peers":[{"rank":0,"host":"h","listen":"127.0.0.1:1"},{"rank":1,"host":"h","listen":"127.0.0.1:2"}],"shared_memory":true}}"#;
        prop_assert_eq!(decode_reply(welcome, 2).is_ok(), true);
        for line in [random.clone(), mutate(hello.to_vec(), &flips)] {
            let _ = decode_hello(&line);
        }
        for line in [random, mutate(welcome.to_vec(), &flips)] {
            if let Ok(accelerate_core::comm::rendezvous::Reply::Welcome { peers, .. }) =
                decode_reply(&line, world_size)
            {
                prop_assert_eq!(peers.len(), world_size);
            }
        }
    }

    #[test]
    fn collectives_survive_any_frames_from_a_peer(
        rank in 0usize..4,
        world_size in 2usize..5,
        op in 0u8..5,
        elems in 0usize..300,
        code in any::<u8>(),
        algorithm in 0u8..2,
        fill in any::<u8>(),
        script in proptest::collection::vec(frame_strategy(), 0..12),
    ) {
        // Every role: rank 0, the broadcast's root (rank 1), the ring's last rank, ...
        let rank = rank % world_size;
        let (call, dtype) = call_of(op, elems, code);
        let frames = frames(&call, dtype, world_size, script);
        let link = ScriptedLink { rank, world_size, frames, fill };
        let algorithm = if algorithm == 0 { AllReduceAlgorithm::Ring } else { AllReduceAlgorithm::RecursiveDoubling };
        let mut engine = MessageEngine::new(link, Duration::from_secs(1), algorithm, 64);
        // Success is possible (a well-formed script); anything else is an error, not a panic.
        let _ = run_call(&mut engine, &call, dtype, elems, world_size, rank);
    }

    #[test]
    fn hierarchical_engines_survive_any_frames_from_a_peer(
        rank in 0usize..4,
        hosts in proptest::collection::vec(1usize..3, 1..3),
        alone_at in 0usize..3,
        op in 0u8..5,
        large in any::<bool>(),
        elems in 0usize..300,
        code in any::<u8>(),
        fill in any::<u8>(),
        script in proptest::collection::vec(frame_strategy(), 0..12),
    ) {
        // Hosts of one or two ranks, this rank alone on its host (so no shared memory): small
        // calls go flat, large all-reduces through the leaders when this rank leads its host.
        let mut hosts = hosts;
        hosts.insert(alone_at % (hosts.len() + 1), 1);
        let mut layout_hosts = Vec::new();
        let mut next = 0;
        for size in hosts {
            layout_hosts.push((next..next + size).collect::<Vec<usize>>());
            next += size;
        }
        let world_size = next;
        let alone: Vec<usize> = layout_hosts.iter().filter(|h| h.len() == 1).map(|h| h[0]).collect();
        let rank = alone[rank % alone.len()];
        // Above the flat limit (64 KiB) for the leaders' path.
        let elems = if large { (64 << 10) / 2 + elems } else { elems };
        let (call, dtype) = call_of(op, elems, code);
        let frames = frames(&call, dtype, world_size, script);
        let link = ScriptedLink { rank, world_size, frames, fill };
        let layout = Layout { hosts: layout_hosts, rank };
        let mut engine = HierarchicalEngine::new(
            link, &layout, None, Duration::from_secs(1), AllReduceAlgorithm::Ring, 64 << 10,
        );
        let _ = run_call(&mut engine, &call, dtype, elems, world_size, rank);
    }

    #[test]
    fn object_gathers_survive_any_length_and_bytes_from_a_peer(
        hostile in 0usize..2,
        value in proptest::collection::vec(any::<u32>(), 0..6),
        len_kind in 0u8..5,
        random_len in any::<u64>(),
        payload in proptest::collection::vec(any::<u8>(), 0..200),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
    ) {
        // The hostile rank sends what an honest one would (the JSON of a value), mutated, or
        // random bytes, under an announced length that may match, exceed or not be a length.
        let genuine = serde_json::to_vec(&value).unwrap();
        let bytes = match len_kind % 2 {
            0 => mutate(genuine.clone(), &flips),
            _ => payload,
        };
        let announced: u64 = match len_kind {
            0 | 1 => bytes.len() as u64,
            2 => random_len % 4096,
            3 => MAX_OBJECT_BYTES as u64 + 1,
            _ => random_len | (1 << 63),
        };
        let options = GroupOptions { timeout: Duration::from_secs(20), ..GroupOptions::default() };
        let groups = ProcessGroup::local(2, &options);
        let honest_value = vec![7u32, 8, 9];
        let outcome = std::thread::scope(|s| {
            let handles: Vec<_> = groups
                .into_iter()
                .map(|mut group| {
                    let bytes = &bytes;
                    let honest_value = &honest_value;
                    s.spawn(move || {
                        if group.rank() != hostile {
                            return Some(group.all_gather_object::<Vec<u32>>(honest_value));
                        }
                        // The hostile rank speaks the object gather's two raw gathers itself.
                        let mut lens = vec![0u8; 16];
                        group.all_gather_raw(&announced.to_le_bytes(), &mut lens).ok()?;
                        if announced > 4096 {
                            return None; // the honest rank refuses the length: no second gather
                        }
                        let honest = u64::from_le_bytes(lens[8 * (1 - hostile)..][..8].try_into().unwrap());
                        let longest = announced.max(honest) as usize;
                        let mut mine = bytes.clone();
                        mine.resize(longest, b' ');
                        let mut all = vec![0u8; 2 * longest];
                        group.all_gather_raw(&mine, &mut all).ok()?;
                        None
                    })
                })
                .collect();
            handles.into_iter().filter_map(|h| h.join().unwrap()).next()
        });
        let result = outcome.expect("the honest rank returns");
        match result {
            Ok(values) => {
                // Accepted only what decodes to a value, in rank order, the honest one intact.
                prop_assert!(announced as usize <= MAX_OBJECT_BYTES);
                prop_assert_eq!(&values[1 - hostile], &honest_value);
                let theirs: Vec<u32> = serde_json::from_slice(&{
                    let mut b = bytes.clone();
                    b.resize(announced as usize, b' ');
                    b
                }).unwrap();
                prop_assert_eq!(&values[hostile], &theirs);
            }
            Err(e) => {
                let text = e.to_string();
                prop_assert!(text.contains(&format!("rank {hostile}")), "{}", text);
            }
        }
    }
}
