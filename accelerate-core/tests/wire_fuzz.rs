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
use accelerate_core::comm::link::{Link, LinkError};
use accelerate_core::comm::rendezvous::{decode_hello, decode_reply};
use accelerate_core::comm::{AllReduceAlgorithm, CallDesc, OpKind};
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
    world_size: usize,
    frames: Vec<(Header, bool)>,
    fill: u8,
}

impl Link for ScriptedLink {
    fn rank(&self) -> usize {
        0
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
        assert!(len <= 1 << 20, "asked for {len} bytes");
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
        world_size in 2usize..5,
        op in 0u8..5,
        elems in 0usize..300,
        code in any::<u8>(),
        algorithm in 0u8..2,
        fill in any::<u8>(),
        script in proptest::collection::vec(
            (any::<bool>(), 0u8..6, any::<u64>(), 0u32..6, 1u8..10, any::<u8>()),
            0..12,
        ),
    ) {
        let dtype = dtype(code);
        let mut call = CallDesc::new(OpKind::AllReduce, 0);
        call.count = elems as u64;
        call.dtype = Some(dtype);
        call.reduce = Some(ReduceOp::Sum);
        match op {
            1 => { call.op = OpKind::Broadcast; call.reduce = None; call.root = Some(1); }
            2 => { call.op = OpKind::AllGather; call.reduce = None; }
            3 => { call.op = OpKind::ReduceScatter; }
            4 => { call = CallDesc::new(OpKind::Barrier, 0); }
            _ => {}
        }
        let bytes = elems * dtype.size();
        // Each scripted frame is the expected call with a plausible or hostile length, or a
        // random call, from the right or a wrong sender.
        let frames = script
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
                    call
                } else {
                    let mut other = call;
                    other.seq = u64::from(seq % 3);
                    other.count = random_len % 1000;
                    if opcode == 6 { CallDesc::new(OpKind::Abort, u64::MAX) } else { other }
                };
                (Header { call: frame_call, sender, payload_len }, true)
            })
            .collect();
        let link = ScriptedLink { world_size, frames, fill };
        let algorithm = if algorithm == 0 { AllReduceAlgorithm::Ring } else { AllReduceAlgorithm::RecursiveDoubling };
        let mut engine = MessageEngine::new(link, Duration::from_secs(1), algorithm, 64);
        let mut buf = vec![0u8; bytes];
        let mut out = vec![0u8; bytes * world_size];
        let result = match call.op {
            OpKind::AllReduce => engine.all_reduce(&call, &mut buf, dtype, ReduceOp::Sum, Some(0.5)),
            OpKind::Broadcast => engine.broadcast(&call, &mut buf, 1),
            OpKind::AllGather => engine.all_gather(&call, &buf, &mut out),
            OpKind::ReduceScatter => {
                let chunk = accelerate_kernels::schedule::chunk_range(elems, world_size, 0).len();
                let mut mine = vec![0u8; chunk * dtype.size()];
                engine.reduce_scatter(&call, &buf, &mut mine, dtype, ReduceOp::Sum)
            }
            _ => engine.barrier(&call),
        };
        // Success is possible (a well-formed script); anything else is an error, not a panic.
        let _ = result;
    }
}
