//! One rendezvous connection after its handshake: lines read under a deadline and a size
//! bound, each sealed with the handshake's session key so that nothing between two ranks can
//! alter, drop, reorder or replay one.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::auth::{self, AuthError, Purpose, SessionKey};
use super::wire::{Hello, MAX_HELLO_BYTES, TAG_HEX, WireError, decode_hello};

/// A connection with the bytes read past the last line.
pub(super) struct Conn {
    pub(super) stream: TcpStream,
    pub(super) pending: Vec<u8>,
    pub(super) seal: LineSeal,
}

/// The tags of one connection's lines: every line carries the tag of the handshake's key over
/// its number and sender, so a relay cannot alter, drop, reorder or replay a line (the peer
/// table above all) without the receiver noticing. Pure: the fuzz tests drive it with bytes.
pub(super) struct LineSeal {
    session: SessionKey,
    /// Which end this is.
    side: Side,
    /// Lines sealed and opened so far (each line's tag covers its number).
    sent: u64,
    received: u64,
}

impl LineSeal {
    pub(super) fn new(session: SessionKey, side: Side) -> Self {
        Self {
            session,
            side,
            sent: 0,
            received: 0,
        }
    }

    /// `message`, a space, its tag in hex, and the newline.
    pub(super) fn seal(&mut self, message: &[u8]) -> Vec<u8> {
        let tag = self.session.tag(self.side.label(), self.sent, message);
        self.sent += 1;
        let mut line = message.to_vec();
        line.push(b' ');
        line.extend_from_slice(super::secret::hex(&tag).as_bytes());
        line.push(b'\n');
        line
    }

    /// The message of the next line from the other end (newline removed), or an error when
    /// its tag is not the one that end would have written for it at this point.
    pub(super) fn open<'a>(&mut self, line: &'a [u8]) -> std::io::Result<&'a [u8]> {
        let unauthentic = || {
            std::io::Error::new(
                ErrorKind::InvalidData,
                "a line this connection's handshake does not authenticate (altered, replayed or \
                 out of order: something between the two ranks changed it)",
            )
        };
        let split = line
            .iter()
            .rposition(|&b| b == b' ')
            .ok_or_else(unauthentic)?;
        let (message, tag) = (&line[..split], &line[split + 1..]);
        let tag = super::secret::unhex(std::str::from_utf8(tag).map_err(|_| unauthentic())?)
            .ok_or_else(unauthentic)?;
        if !self
            .session
            .verify(self.side.other().label(), self.received, message, &tag)
        {
            return Err(unauthentic());
        }
        self.received += 1;
        Ok(message)
    }
}

/// Takes the first complete line (newline removed) out of `pending`; `Ok(None)` while none is
/// complete and `pending` holds at most `max` bytes, an error once it holds more.
pub(super) fn take_line(pending: &mut Vec<u8>, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    if let Some(end) = pending.iter().position(|&b| b == b'\n') {
        let rest = pending.split_off(end + 1);
        let mut line = std::mem::replace(pending, rest);
        line.pop();
        return Ok(Some(line));
    }
    if pending.len() > max {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            format!("a line longer than {max} bytes"),
        ));
    }
    Ok(None)
}

/// The two ends of a rendezvous connection, as they sign their lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    /// Rank 0.
    Server,
    /// Another rank.
    Client,
}

impl Side {
    pub(super) fn label(self) -> &'static [u8] {
        match self {
            Side::Server => b"accelerate-rs rendezvous rank 0",
            Side::Client => b"accelerate-rs rendezvous rank",
        }
    }

    pub(super) fn other(self) -> Self {
        match self {
            Side::Server => Side::Client,
            Side::Client => Side::Server,
        }
    }
}

impl Conn {
    pub(super) fn new(stream: TcpStream, session: SessionKey, side: Side) -> Self {
        Self {
            stream,
            pending: Vec::new(),
            seal: LineSeal::new(session, side),
        }
    }

    /// The next line, at most `max` bytes, complete before `deadline` however slowly it comes,
    /// with its tag checked and removed.
    pub(super) fn read_line(&mut self, deadline: Instant, max: usize) -> std::io::Result<Vec<u8>> {
        let line = self.read_raw_line(deadline, max.saturating_add(1 + 2 * TAG_HEX))?;
        self.seal.open(&line).map(<[u8]>::to_vec)
    }

    /// The next raw line, at most `max` bytes, complete before `deadline`.
    pub(super) fn read_raw_line(
        &mut self,
        deadline: Instant,
        max: usize,
    ) -> std::io::Result<Vec<u8>> {
        self.stream.set_nonblocking(false)?;
        loop {
            if let Some(line) = take_line(&mut self.pending, max)? {
                return Ok(line);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(
                    ErrorKind::TimedOut,
                    "no complete line before the deadline",
                ));
            }
            self.stream.set_read_timeout(Some(left))?;
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }

    pub(super) fn recv<T: for<'de> Deserialize<'de>>(
        &mut self,
        deadline: Instant,
        max: usize,
    ) -> std::io::Result<T> {
        let line = self.read_line(deadline, max)?;
        serde_json::from_slice(&line).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
    }

    /// `value` as one line: JSON, a space, the line's tag in hex, and the newline.
    pub(super) fn frame<T: Serialize>(&mut self, value: &T) -> std::io::Result<Vec<u8>> {
        let line = serde_json::to_vec(value).map_err(std::io::Error::other)?;
        Ok(self.seal.seal(&line))
    }

    pub(super) fn send<T: Serialize>(
        &mut self,
        value: &T,
        deadline: Instant,
    ) -> std::io::Result<()> {
        let line = self.frame(value)?;
        self.stream.set_nonblocking(false)?;
        let left = deadline.saturating_duration_since(Instant::now());
        self.stream
            .set_write_timeout(Some(left.max(Duration::from_millis(100))))?;
        self.stream.write_all(&line)?;
        self.stream.flush()
    }
}

/// Why rank 0 dropped a connection before its hello was accepted.
#[derive(Debug, thiserror::Error)]
pub(super) enum GreetError {
    /// The handshake failed (a wrong token, a timeout, a broken connection).
    #[error(transparent)]
    Handshake(#[from] AuthError),
    /// A peer link's handshake reached the rendezvous.
    #[error("a peer-link handshake sent to the rendezvous")]
    WrongPurpose,
    /// No hello line before the deadline.
    #[error("no hello: {0}")]
    NoHello(std::io::Error),
    /// The hello did not decode.
    #[error(transparent)]
    BadHello(#[from] WireError),
    /// The hello's rank or world size differ from the authenticated claim's.
    #[error("the hello contradicts the authenticated claim")]
    ContradictsClaim,
}

/// Authenticates a new connection and reads its hello, all before `by`.
pub(super) fn greet(
    stream: TcpStream,
    token: &[u8],
    by: Instant,
) -> Result<(Hello, Conn), GreetError> {
    let mut stream = stream;
    let (claim, session) = auth::serve(&mut stream, token, by)?;
    if claim.purpose != Purpose::Rendezvous {
        return Err(GreetError::WrongPurpose);
    }
    let mut conn = Conn::new(stream, session, Side::Server);
    let line = conn
        .read_line(by, MAX_HELLO_BYTES)
        .map_err(GreetError::NoHello)?;
    let hello = decode_hello(&line)?;
    // The claim was authenticated; the hello must agree with it.
    if u32::try_from(hello.rank).ok() != Some(claim.rank)
        || u32::try_from(hello.world_size).ok() != Some(claim.world_size)
    {
        return Err(GreetError::ContradictsClaim);
    }
    Ok((hello, conn))
}
