//! A client for PyTorch's `TCPStore`, the key-value store torchrun's agent hosts at
//! `MASTER_ADDR:MASTER_PORT` (it tells its workers so with `TORCHELASTIC_USE_AGENT_STORE=True`).
//!
//! A job that torchrun spans over several hosts finds rank 0's rendezvous address here: rank 0
//! cannot listen on `MASTER_PORT` (the agent does), so it listens on a port of its own and
//! publishes it under a key of this attempt; the other ranks read it. Only the address goes
//! through the store: it is not authenticated, so the job secret never does.
//!
//! The protocol, as PyTorch 2.x speaks it (little-endian): a client opens with `VALIDATE` and a
//! magic number, then `PING` with a nonce the server echoes. Keys and values travel as a `u64`
//! length and the bytes. `SET key value` has no answer; `CHECK n keys` answers one byte (0: all
//! present); `GET key` answers a value (asked only once `CHECK` said the key is there, so the
//! server never blocks on our behalf).

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::auth::random_bytes;

/// PyTorch's query types (`c10d::detail::QueryType`).
mod query {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const GET: u8 = 3;
    pub const CHECK: u8 = 5;
    pub const PING: u8 = 13;
}

/// The number a client sends after `VALIDATE`.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// `CHECK`'s answer when every key is present.
const READY: u8 = 0;
/// Longest value read back (an address is ~50 bytes); a longer one is not ours.
const MAX_VALUE_BYTES: u64 = 4096;
/// How long one request may take once connected.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the store could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// No connection could be made before the deadline.
    #[error(
        "cannot reach torchrun's store at {addr}: {reason}. hint: MASTER_ADDR/MASTER_PORT must \
         name torchrun's store, reachable from this host"
    )]
    Connect {
        /// The store's address.
        addr: String,
        /// The last error.
        reason: String,
    },
    /// The store answered something PyTorch's store would not, or the connection broke.
    #[error("torchrun's store at {addr}: {reason}")]
    Protocol {
        /// The store's address.
        addr: String,
        /// What went wrong.
        reason: String,
    },
}

/// One connection to a PyTorch `TCPStore` (over any byte stream: a TCP connection in a job,
/// scripted replies in the fuzz tests).
#[derive(Debug)]
pub struct TorchStore<S = TcpStream> {
    stream: S,
    addr: String,
}

impl TorchStore<TcpStream> {
    /// Connects to the store at `addr` (`host:port`), retrying until `deadline` (the agent
    /// starts its store before its workers, but a restarted one may be a moment late).
    pub fn connect(addr: &str, deadline: Instant) -> Result<Self, StoreError> {
        let connect_error = |reason: String| StoreError::Connect {
            addr: addr.to_string(),
            reason,
        };
        let mut last = String::from("no attempt");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(connect_error(last));
            }
            let resolved: Vec<SocketAddr> = match addr.to_socket_addrs() {
                Ok(all) => all.collect(),
                Err(e) => return Err(connect_error(format!("cannot resolve it: {e}"))),
            };
            for target in &resolved {
                match TcpStream::connect_timeout(target, left.min(Duration::from_secs(2))) {
                    Ok(stream) => {
                        let io = |e: std::io::Error| StoreError::Protocol {
                            addr: addr.to_string(),
                            reason: e.to_string(),
                        };
                        stream.set_nodelay(true).map_err(io)?;
                        stream.set_read_timeout(Some(IO_TIMEOUT)).map_err(io)?;
                        stream.set_write_timeout(Some(IO_TIMEOUT)).map_err(io)?;
                        return TorchStore::open(stream, addr);
                    }
                    Err(e) => last = format!("{target}: {e}"),
                }
            }
            std::thread::sleep(Duration::from_millis(50).min(left));
        }
    }

    /// The address of this end of the connection: an address of this host from which the
    /// store's host is reachable.
    pub fn local_ip(&self) -> Result<IpAddr, StoreError> {
        self.stream
            .local_addr()
            .map(|a| a.ip())
            .map_err(|e| self.protocol(e.to_string()))
    }
}

impl<S: Read + Write> TorchStore<S> {
    /// Opens the store protocol over `stream` (validation and a ping the store must echo);
    /// `addr` names the store in errors.
    fn open(stream: S, addr: &str) -> Result<Self, StoreError> {
        let mut store = Self {
            stream,
            addr: addr.to_string(),
        };
        store.handshake()?;
        Ok(store)
    }

    fn handshake(&mut self) -> Result<(), StoreError> {
        let nonce = u32::from_le_bytes(
            random_bytes().map_err(|e| self.protocol(format!("no random nonce: {e}")))?,
        );
        let mut hello = vec![query::VALIDATE];
        hello.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        hello.push(query::PING);
        hello.extend_from_slice(&nonce.to_le_bytes());
        self.send(&hello)?;
        let echoed = u32::from_le_bytes(self.recv_array()?);
        if echoed != nonce {
            return Err(self.protocol(format!(
                "answered the ping with {echoed:#x}, not {nonce:#x}: not a PyTorch TCPStore"
            )));
        }
        Ok(())
    }

    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let mut request = vec![query::SET];
        put_bytes(&mut request, key.as_bytes());
        put_bytes(&mut request, value);
        self.send(&request)
    }

    /// The value of `key`, or `None` while nobody has set it.
    pub fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut check = vec![query::CHECK];
        check.extend_from_slice(&1u64.to_le_bytes());
        put_bytes(&mut check, key.as_bytes());
        self.send(&check)?;
        if self.recv_array::<1>()?[0] != READY {
            return Ok(None);
        }
        let mut get = vec![query::GET];
        put_bytes(&mut get, key.as_bytes());
        self.send(&get)?;
        let len = u64::from_le_bytes(self.recv_array()?);
        if len > MAX_VALUE_BYTES {
            return Err(self.protocol(format!(
                "the value of {key} is {len} bytes long, more than any this job sets"
            )));
        }
        let mut value = vec![0; len as usize];
        self.stream
            .read_exact(&mut value)
            .map_err(|e| self.protocol(e.to_string()))?;
        Ok(Some(value))
    }

    fn send(&mut self, bytes: &[u8]) -> Result<(), StoreError> {
        self.stream
            .write_all(bytes)
            .map_err(|e| self.protocol(e.to_string()))
    }

    fn recv_array<const N: usize>(&mut self) -> Result<[u8; N], StoreError> {
        let mut bytes = [0; N];
        self.stream
            .read_exact(&mut bytes)
            .map_err(|e| self.protocol(e.to_string()))?;
        Ok(bytes)
    }

    fn protocol(&self, reason: impl Into<String>) -> StoreError {
        StoreError::Protocol {
            addr: self.addr.clone(),
            reason: reason.into(),
        }
    }
}

/// Appends a length-prefixed byte string.
fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A server that is not a TCPStore (it echoes a wrong nonce) is refused with a message.
    #[test]
    fn a_server_that_is_not_a_store_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut hello = [0u8; 10];
            conn.read_exact(&mut hello).unwrap();
            conn.write_all(&[1, 2, 3, 4]).unwrap();
        });
        let err = TorchStore::connect(&addr, Instant::now() + Duration::from_secs(5)).unwrap_err();
        server.join().unwrap();
        assert!(err.to_string().contains("not a PyTorch TCPStore"), "{err}");
    }

    /// Nobody listening: the error names the address, after the deadline.
    #[test]
    fn an_unreachable_store_is_reported_with_its_address() {
        let addr = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let err =
            TorchStore::connect(&addr, Instant::now() + Duration::from_millis(300)).unwrap_err();
        assert!(err.to_string().contains(&addr), "{err}");
    }

    /// A store that answers with scripted bytes: the ping's nonce (echoed, or not), then
    /// whatever the case says, then end of stream.
    struct ScriptedStore {
        echo: bool,
        replies: Vec<u8>,
        read: std::io::Cursor<Vec<u8>>,
    }

    impl Read for ScriptedStore {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.read.read(buf)
        }
    }

    impl Write for ScriptedStore {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            // The hello is the one write that ends with a ping (10 bytes).
            if buf.len() == 10 && buf[5] == query::PING && self.read.get_ref().is_empty() {
                let mut answer = if self.echo {
                    buf[6..10].to_vec()
                } else {
                    Vec::new()
                };
                answer.extend_from_slice(&self.replies);
                self.read = std::io::Cursor::new(answer);
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn ask(echo: bool, replies: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError> {
        let stream = ScriptedStore {
            echo,
            replies,
            read: std::io::Cursor::new(Vec::new()),
        };
        TorchStore::open(stream, "store:1")?.try_get("accelerate-rs/addr")
    }

    /// A genuine exchange reads the value back.
    #[test]
    fn a_scripted_store_answers_like_pytorchs() {
        let mut replies = vec![READY];
        replies.extend_from_slice(&5u64.to_le_bytes());
        replies.extend_from_slice(b"value");
        assert_eq!(ask(true, replies).unwrap(), Some(b"value".to_vec()));
        assert_eq!(ask(true, vec![1]).unwrap(), None);
        assert!(ask(false, vec![READY]).is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            failure_persistence: None,
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Whatever a store (or whoever answers at its address) replies: an error or a value
        /// no longer than any this job sets, never a panic or a large allocation; a
        /// well-formed reply with a mutated length is read exactly or refused.
        #[test]
        fn store_replies_never_panic(
            echo in proptest::prelude::any::<bool>(),
            random in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            len in proptest::prelude::any::<u64>(),
            value in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80),
        ) {
            if let Ok(Some(v)) = ask(echo, random) {
                proptest::prop_assert!(v.len() as u64 <= MAX_VALUE_BYTES);
            }
            let mut replies = vec![READY];
            replies.extend_from_slice(&len.to_le_bytes());
            replies.extend_from_slice(&value);
            match ask(echo, replies) {
                Ok(Some(v)) => {
                    proptest::prop_assert!(echo);
                    proptest::prop_assert_eq!(v.len() as u64, len);
                    proptest::prop_assert_eq!(&v[..], &value[..v.len()]);
                }
                Ok(None) => proptest::prop_assert!(false, "READY read as absent"),
                Err(_) => proptest::prop_assert!(!echo || len > value.len() as u64),
            }
        }
    }
}
