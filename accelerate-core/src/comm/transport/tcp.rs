//! TCP transport: one connection per pair of ranks, for ranks on different hosts.
//!
//! The higher rank of each pair connects to the lower one's listener (advertised through the
//! rendezvous) and opens with a handshake carrying the job token's hash and its rank, so a
//! stray connection is refused. Each connection has a writer thread fed by a queue, so a send
//! never waits for the peer to read (ring schedules send before they receive); reads happen on
//! the caller's thread with a deadline, and a closed or reset connection is reported as the
//! peer being gone at once.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::comm::call::{HEADER_BYTES, Header};
use crate::comm::link::{Link, LinkError};
use crate::comm::rendezvous::PeerInfo;
use crate::error::CommError;

const HANDSHAKE_MAGIC: u32 = 0x4143_4354; // "ACCT"
/// A writer that cannot hand bytes to the kernel for this long gives up on its peer (a peer
/// that reads nothing for 30 s is stuck or gone; this also bounds how long dropping a link
/// waits for its queues to drain).
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

struct Peer {
    reader: TcpStream,
    queue: Option<Sender<Vec<u8>>>,
    writer: Option<JoinHandle<()>>,
    write_error: Arc<Mutex<Option<String>>>,
}

/// One rank's connections to every other rank.
pub struct TcpLink {
    rank: usize,
    peers: Vec<Option<Peer>>,
}

impl TcpLink {
    /// Connects to every peer: connects to lower ranks, accepts higher ones on `listener`.
    pub fn connect(
        rank: usize,
        table: &[PeerInfo],
        listener: &TcpListener,
        token_hash: u64,
        deadline: Instant,
    ) -> Result<Self, CommError> {
        let world_size = table.len();
        let mut streams: Vec<Option<TcpStream>> = (0..world_size).map(|_| None).collect();
        for peer in table.iter().filter(|p| p.rank < rank) {
            let mut stream = loop {
                match TcpStream::connect_timeout(&peer.listen, Duration::from_secs(2)) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(peer = peer.rank, "connect failed, retrying: {e}");
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    Err(e) => {
                        return Err(CommError::io(
                            rank,
                            format!("connecting to rank {} at {}", peer.rank, peer.listen),
                            e,
                        ));
                    }
                }
            };
            let mut hello = Vec::with_capacity(16);
            hello.extend_from_slice(&HANDSHAKE_MAGIC.to_le_bytes());
            hello.extend_from_slice(&token_hash.to_le_bytes());
            hello.extend_from_slice(&(rank as u32).to_le_bytes());
            stream.write_all(&hello).map_err(|e| {
                CommError::io(rank, format!("handshake with rank {}", peer.rank), e)
            })?;
            streams[peer.rank] = Some(stream);
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| CommError::io(rank, "peer listener", e))?;
        let mut expected = world_size - 1 - rank;
        while expected > 0 {
            let (mut stream, from) = match listener.accept() {
                Ok(conn) => conn,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (rank + 1..world_size)
                            .filter(|r| streams[*r].is_none())
                            .collect();
                        return Err(CommError::Timeout {
                            call: "setup (tcp connections)".into(),
                            rank,
                            world_size,
                            missing,
                            elapsed_s: 0.0,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) => return Err(CommError::io(rank, "accepting a peer", e)),
            };
            stream
                .set_nonblocking(false)
                .and_then(|()| stream.set_read_timeout(Some(Duration::from_secs(10))))
                .map_err(|e| CommError::io(rank, "peer socket", e))?;
            let mut hello = [0u8; 16];
            if stream.read_exact(&mut hello).is_err() {
                tracing::warn!(%from, "a connection without a handshake was dropped");
                continue;
            }
            let magic = u32::from_le_bytes([hello[0], hello[1], hello[2], hello[3]]);
            let hash = u64::from_le_bytes(hello[4..12].try_into().unwrap_or_default());
            let peer = u32::from_le_bytes([hello[12], hello[13], hello[14], hello[15]]) as usize;
            if magic != HANDSHAKE_MAGIC || hash != token_hash || peer <= rank || peer >= world_size
            {
                tracing::warn!(%from, "refused a peer connection with a wrong handshake or job token");
                continue;
            }
            if streams[peer].replace(stream).is_none() {
                expected -= 1;
            }
        }
        let peers = streams
            .into_iter()
            .enumerate()
            .map(|(peer, stream)| stream.map(|s| spawn_peer(rank, peer, s)).transpose())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { rank, peers })
    }

    fn peer(&mut self, peer: usize) -> Result<&mut Peer, LinkError> {
        self.peers
            .get_mut(peer)
            .and_then(Option::as_mut)
            .ok_or_else(|| LinkError::Lost("no connection".into()))
    }
}

fn spawn_peer(rank: usize, peer: usize, stream: TcpStream) -> Result<Peer, CommError> {
    let setup = |e| CommError::io(rank, format!("connection to rank {peer}"), e);
    stream.set_nodelay(true).map_err(setup)?;
    let mut writer_stream = stream.try_clone().map_err(setup)?;
    writer_stream
        .set_write_timeout(Some(WRITE_TIMEOUT))
        .map_err(setup)?;
    let (queue, frames) = mpsc::channel::<Vec<u8>>();
    let write_error = Arc::new(Mutex::new(None));
    let error_slot = Arc::clone(&write_error);
    let writer = std::thread::Builder::new()
        .name(format!("accelerate-tcp-{rank}-to-{peer}"))
        .spawn(move || {
            for frame in frames {
                if let Err(e) = writer_stream.write_all(&frame) {
                    *error_slot.lock().unwrap_or_else(PoisonError::into_inner) =
                        Some(e.to_string());
                    return;
                }
            }
            let _ = writer_stream.shutdown(Shutdown::Write);
        })
        .map_err(setup)?;
    Ok(Peer {
        reader: stream,
        queue: Some(queue),
        writer: Some(writer),
        write_error,
    })
}

/// Reads exactly `buf.len()` bytes before `deadline`.
fn read_full(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), LinkError> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(LinkError::Timeout);
        }
        stream
            .set_read_timeout(Some(left.min(Duration::from_millis(200))))
            .map_err(|e| LinkError::Lost(e.to_string()))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(LinkError::Lost("its connection closed".into())),
            Ok(n) => filled += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(LinkError::Lost(format!("connection error: {e}"))),
        }
    }
    Ok(())
}

impl Link for TcpLink {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.peers.len()
    }

    fn name(&self) -> &'static str {
        "tcp"
    }

    fn send(&mut self, peer: usize, header: &Header, payload: &[u8]) -> Result<(), LinkError> {
        let p = self.peer(peer)?;
        if let Some(e) = p
            .write_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
        {
            return Err(LinkError::Lost(format!("writing to it failed: {e}")));
        }
        let mut frame = Vec::with_capacity(HEADER_BYTES + payload.len());
        frame.extend_from_slice(&header.encode());
        frame.extend_from_slice(payload);
        p.queue
            .as_ref()
            .ok_or_else(|| LinkError::Lost("closed".into()))?
            .send(frame)
            .map_err(|_| LinkError::Lost("its writer stopped".into()))
    }

    fn recv(&mut self, peer: usize, deadline: Instant) -> Result<(Header, Vec<u8>), LinkError> {
        let p = self.peer(peer)?;
        let mut raw = [0u8; HEADER_BYTES];
        read_full(&mut p.reader, &mut raw, deadline)?;
        let header = Header::decode(&raw)
            .ok_or_else(|| LinkError::Lost("it sent bytes that are not a message header".into()))?;
        let mut payload = vec![0u8; header.payload_len as usize];
        read_full(&mut p.reader, &mut payload, deadline)?;
        Ok((header, payload))
    }
}

impl Drop for TcpLink {
    fn drop(&mut self) {
        // Closing the queues lets each writer flush what is queued (the last messages of the
        // last collective) and shut its direction down; wait for that, bounded by the write
        // timeout, so a normal exit never truncates a peer's final message.
        for peer in self.peers.iter_mut().flatten() {
            peer.queue.take();
        }
        for peer in self.peers.iter_mut().flatten() {
            if let Some(writer) = peer.writer.take() {
                let _ = writer.join();
            }
        }
    }
}
