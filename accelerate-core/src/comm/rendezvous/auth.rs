//! Proving knowledge of the job token without sending it: the challenge-response every
//! connection of a job (rendezvous and peer links) starts with.
//!
//! Three fixed-size frames, HMAC-SHA256 keyed by the token:
//!
//! ```text
//! server -> client  challenge: magic, version, server nonce (32 random bytes)
//! client -> server  answer:    magic, purpose, rank, world size, client nonce, MAC over both
//! server -> client  proof:     MAC over the challenge and the whole answer
//! ```
//!
//! Each MAC covers the other side's fresh nonce and a label saying who computed it, so a
//! recorded answer or proof is worthless in any later connection, and one side's MAC cannot be
//! reflected back as the other's. A server that does not like an answer closes the connection
//! without a word: a client without the token learns nothing. The comparison is constant-time
//! (`hmac`'s `verify_slice`), and nothing depends on the toolchain's hasher.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

const MAGIC: u32 = 0x4143_4341; // "ACCA"
const VERSION: u32 = 1;
const NONCE: usize = 32;
const TAG: usize = 32;
/// Bytes of the server's challenge.
pub const CHALLENGE_BYTES: usize = 8 + NONCE;
/// Bytes of the client's answer.
pub const ANSWER_BYTES: usize = 16 + NONCE + TAG;
/// Bytes of the server's proof.
pub const PROOF_BYTES: usize = TAG;

/// What a connection is for, inside the MAC so that a rendezvous answer cannot open a peer
/// link or the reverse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Purpose {
    /// A rank joining rank 0's rendezvous.
    Rendezvous = 1,
    /// A rank opening its TCP link to a lower rank.
    PeerLink = 2,
}

/// Who the client says it is; authentic once [`serve`] returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// What the connection is for.
    pub purpose: Purpose,
    /// The client's rank.
    pub rank: u32,
    /// The world size it expects.
    pub world_size: u32,
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The peer's bytes are not a frame of this protocol.
    #[error("not an accelerate-rs handshake ({0})")]
    Malformed(&'static str),
    /// The MAC does not verify: the peer does not know the job token.
    #[error("the peer does not know the job token")]
    BadProof,
    /// The connection failed or timed out.
    #[error("{0}")]
    Io(String),
}

impl From<std::io::Error> for AuthError {
    fn from(e: std::io::Error) -> Self {
        match e.kind() {
            ErrorKind::UnexpectedEof => AuthError::Io("the connection closed".into()),
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                AuthError::Io("no answer before the deadline".into())
            }
            _ => AuthError::Io(e.to_string()),
        }
    }
}

/// 32 bytes from the operating system's generator.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], AuthError> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes)
        .map_err(|e| AuthError::Io(format!("the system's random generator failed: {e}")))?;
    Ok(bytes)
}

fn mac(token: &[u8], label: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    let mut mac = match HmacSha256::new_from_slice(token) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC accepts keys of every length"),
    };
    mac.update(label);
    for part in parts {
        mac.update(part);
    }
    mac
}

/// Bytes of the signature of a published value ([`sign_published`]).
pub const SIGNATURE_BYTES: usize = 32;

/// The signature rank 0 puts beside a value it publishes where anyone who reaches the place
/// may write (torchrun's store): HMAC-SHA256 with the job token over the key and the value.
pub fn sign_published(token: &[u8], key: &str, value: &[u8]) -> [u8; SIGNATURE_BYTES] {
    published_mac(token, key, value)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `signature` is the job's signature of `value` under `key` (in constant time).
pub fn verify_published(token: &[u8], key: &str, value: &[u8], signature: &[u8]) -> bool {
    published_mac(token, key, value)
        .verify_slice(signature)
        .is_ok()
}

/// The MAC both [`sign_published`] and [`verify_published`] compute.
fn published_mac(token: &[u8], key: &str, value: &[u8]) -> HmacSha256 {
    let len = (key.len() as u64).to_le_bytes();
    mac(
        token,
        b"accelerate-rs published v1",
        &[&len, key.as_bytes(), value],
    )
}

/// The server's challenge frame.
pub fn challenge(nonce: &[u8; NONCE]) -> [u8; CHALLENGE_BYTES] {
    let mut out = [0u8; CHALLENGE_BYTES];
    out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&VERSION.to_le_bytes());
    out[8..].copy_from_slice(nonce);
    out
}

/// Checks a challenge frame (the client's side).
pub fn decode_challenge(frame: &[u8; CHALLENGE_BYTES]) -> Result<(), AuthError> {
    if frame[0..4] != MAGIC.to_le_bytes() {
        return Err(AuthError::Malformed("wrong magic"));
    }
    if frame[4..8] != VERSION.to_le_bytes() {
        return Err(AuthError::Malformed(
            "another protocol version: every rank must run the same accelerate-rs",
        ));
    }
    Ok(())
}

/// The client's answer to `challenge` for `claim`, with its own `nonce`.
pub fn answer(
    token: &[u8],
    challenge: &[u8; CHALLENGE_BYTES],
    claim: Claim,
    nonce: &[u8; NONCE],
) -> [u8; ANSWER_BYTES] {
    let mut out = [0u8; ANSWER_BYTES];
    out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&(claim.purpose as u32).to_le_bytes());
    out[8..12].copy_from_slice(&claim.rank.to_le_bytes());
    out[12..16].copy_from_slice(&claim.world_size.to_le_bytes());
    out[16..16 + NONCE].copy_from_slice(nonce);
    let tag = mac(
        token,
        b"accelerate-rs client",
        &[challenge, &out[..16 + NONCE]],
    )
    .finalize();
    out[16 + NONCE..].copy_from_slice(&tag.into_bytes());
    out
}

/// Verifies an answer to `challenge` (the server's side) and returns the authentic claim.
pub fn verify_answer(
    token: &[u8],
    challenge: &[u8; CHALLENGE_BYTES],
    frame: &[u8; ANSWER_BYTES],
) -> Result<Claim, AuthError> {
    if frame[0..4] != MAGIC.to_le_bytes() {
        return Err(AuthError::Malformed("wrong magic"));
    }
    mac(
        token,
        b"accelerate-rs client",
        &[challenge, &frame[..16 + NONCE]],
    )
    .verify_slice(&frame[16 + NONCE..])
    .map_err(|_| AuthError::BadProof)?;
    let word = |i: usize| u32::from_le_bytes([frame[i], frame[i + 1], frame[i + 2], frame[i + 3]]);
    let purpose = match word(4) {
        1 => Purpose::Rendezvous,
        2 => Purpose::PeerLink,
        _ => return Err(AuthError::Malformed("unknown purpose")),
    };
    Ok(Claim {
        purpose,
        rank: word(8),
        world_size: word(12),
    })
}

/// The server's proof that it knows the token too.
pub fn proof(
    token: &[u8],
    challenge: &[u8; CHALLENGE_BYTES],
    answer: &[u8; ANSWER_BYTES],
) -> [u8; PROOF_BYTES] {
    mac(token, b"accelerate-rs server", &[challenge, answer])
        .finalize()
        .into_bytes()
        .into()
}

/// Verifies the server's proof (the client's side).
pub fn verify_proof(
    token: &[u8],
    challenge: &[u8; CHALLENGE_BYTES],
    answer: &[u8; ANSWER_BYTES],
    frame: &[u8; PROOF_BYTES],
) -> Result<(), AuthError> {
    mac(token, b"accelerate-rs server", &[challenge, answer])
        .verify_slice(frame)
        .map_err(|_| AuthError::BadProof)
}

/// Reads exactly `buf.len()` bytes before `deadline`, however slowly they come: the deadline
/// is for the whole read, not for each byte.
pub(crate) fn read_exact_by(
    stream: &mut TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(ErrorKind::TimedOut, "deadline passed"));
        }
        stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_by(stream: &mut TcpStream, bytes: &[u8], deadline: Instant) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    stream.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
    stream.write_all(bytes)
}

/// How long a server waits for the answer to its challenge: a rank answers in
/// microseconds, so a connection silent this long is not one and gives its slot back.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(2);

/// A key both ends of one handshake derive from it and the job token, and nobody else can:
/// what authenticates the messages that follow on that connection (the rendezvous lines), so
/// that a relay between the two cannot change them. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKey([u8; TAG]);

impl std::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKey(<redacted>)")
    }
}

impl SessionKey {
    /// The key of the handshake made of `challenge` and `answer`, under `token`.
    pub fn derive(
        token: &[u8],
        challenge: &[u8; CHALLENGE_BYTES],
        answer: &[u8; ANSWER_BYTES],
    ) -> Self {
        Self(
            mac(token, b"accelerate-rs session v1", &[challenge, answer])
                .finalize()
                .into_bytes()
                .into(),
        )
    }

    /// The tag of the `counter`-th message `sender` sends on the connection.
    pub fn tag(&self, sender: &[u8], counter: u64, message: &[u8]) -> [u8; TAG] {
        self.mac(sender, counter, message)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `tag` is that of the `counter`-th message `sender` sent (in constant time).
    pub fn verify(&self, sender: &[u8], counter: u64, message: &[u8], tag: &[u8]) -> bool {
        self.mac(sender, counter, message).verify_slice(tag).is_ok()
    }

    /// The MAC both [`tag`](Self::tag) and [`verify`](Self::verify) compute.
    fn mac(&self, sender: &[u8], counter: u64, message: &[u8]) -> HmacSha256 {
        mac(&self.0, sender, &[&counter.to_le_bytes(), message])
    }
}

/// The server's side of the handshake on a fresh connection: the authentic claim and the
/// connection's [`SessionKey`], or an error after which the caller closes the connection. The
/// answer must come within [`ANSWER_DEADLINE`] (and `deadline`).
pub fn serve(
    stream: &mut TcpStream,
    token: &[u8],
    deadline: Instant,
) -> Result<(Claim, SessionKey), AuthError> {
    stream.set_nonblocking(false)?;
    let challenge = challenge(&random_bytes()?);
    write_by(stream, &challenge, deadline)?;
    let mut frame = [0u8; ANSWER_BYTES];
    let answer_by = deadline.min(crate::wait::deadline_after(ANSWER_DEADLINE));
    read_exact_by(stream, &mut frame, answer_by)?;
    let claim = verify_answer(token, &challenge, &frame)?;
    write_by(stream, &proof(token, &challenge, &frame), deadline)?;
    Ok((claim, SessionKey::derive(token, &challenge, &frame)))
}

/// The client's side: answers the challenge with `claim`, checks the server's proof, and
/// returns the connection's [`SessionKey`].
pub fn join(
    stream: &mut TcpStream,
    token: &[u8],
    claim: Claim,
    deadline: Instant,
) -> Result<SessionKey, AuthError> {
    stream.set_nonblocking(false)?;
    let mut challenge = [0u8; CHALLENGE_BYTES];
    read_exact_by(stream, &mut challenge, deadline)?;
    decode_challenge(&challenge)?;
    let answer = answer(token, &challenge, claim, &random_bytes()?);
    write_by(stream, &answer, deadline)?;
    let mut frame = [0u8; PROOF_BYTES];
    read_exact_by(stream, &mut frame, deadline).map_err(|e| match e.kind() {
        // The server closes on a wrong answer: the one cause an honest client meets.
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset => AuthError::BadProof,
        _ => e.into(),
    })?;
    verify_proof(token, &challenge, &answer, &frame)?;
    Ok(SessionKey::derive(token, &challenge, &answer))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLAIM: Claim = Claim {
        purpose: Purpose::PeerLink,
        rank: 3,
        world_size: 4,
    };

    #[test]
    fn a_published_value_verifies_only_unchanged_and_under_its_key() {
        let signature = sign_published(b"secret", "k", b"10.0.0.1:5");
        assert!(verify_published(b"secret", "k", b"10.0.0.1:5", &signature));
        assert!(!verify_published(b"secret", "k", b"10.0.0.2:5", &signature));
        assert!(!verify_published(
            b"secret",
            "other",
            b"10.0.0.1:5",
            &signature
        ));
        assert!(!verify_published(b"guess", "k", b"10.0.0.1:5", &signature));
        assert!(!verify_published(
            b"secret",
            "k",
            b"10.0.0.1:5",
            &signature[..31]
        ));
    }

    #[test]
    fn the_right_token_verifies_and_a_wrong_one_or_a_replay_does_not() {
        let c1 = challenge(&[1; NONCE]);
        let a1 = answer(b"secret", &c1, CLAIM, &[2; NONCE]);
        assert_eq!(verify_answer(b"secret", &c1, &a1), Ok(CLAIM));
        assert_eq!(verify_answer(b"other", &c1, &a1), Err(AuthError::BadProof));
        // A recorded answer replayed against a fresh challenge.
        let c2 = challenge(&[9; NONCE]);
        assert_eq!(verify_answer(b"secret", &c2, &a1), Err(AuthError::BadProof));
        // A changed claim breaks the MAC.
        let mut forged = a1;
        forged[8] = 0;
        assert_eq!(
            verify_answer(b"secret", &c1, &forged),
            Err(AuthError::BadProof)
        );
        let p = proof(b"secret", &c1, &a1);
        assert_eq!(verify_proof(b"secret", &c1, &a1, &p), Ok(()));
        assert_eq!(
            verify_proof(b"secret", &c2, &a1, &p),
            Err(AuthError::BadProof)
        );
        // The client's MAC is not a valid server proof (labels differ).
        let reflected: [u8; PROOF_BYTES] = a1[16 + NONCE..].try_into().unwrap();
        assert!(verify_proof(b"secret", &c1, &a1, &reflected).is_err());
    }
}
