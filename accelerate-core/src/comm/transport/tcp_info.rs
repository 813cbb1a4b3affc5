//! The kernel's view of one TCP connection (`TCP_INFO`), which the TCP transport reads to tell
//! a peer whose host is gone from one that is alive but not reading. The only unsafe code of
//! the TCP transport: one `getsockopt` into a plain C struct.
#![allow(unsafe_code)]

use std::net::TcpStream;
use std::time::Duration;

/// What the kernel knows of the data this side sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Delivery {
    /// Segments sent and not yet acknowledged.
    pub unacked: u32,
    /// Time since the peer's kernel last acknowledged anything (zero-window probes included).
    pub since_last_ack: Duration,
}

/// The delivery state of `stream`; `None` where the kernel does not say.
#[cfg(target_os = "linux")]
pub(super) fn delivery(stream: &TcpStream) -> Option<Delivery> {
    use std::os::fd::AsRawFd;
    let mut info = std::mem::MaybeUninit::<libc::tcp_info>::zeroed();
    let mut len = libc::socklen_t::try_from(size_of::<libc::tcp_info>()).ok()?;
    // SAFETY: `info` is a writable `tcp_info` of `len` bytes and `len` a valid length pointer;
    // the kernel writes at most `len` bytes and updates `len`. The descriptor is the stream's,
    // open for the duration of the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: zero-initialised, then (partly) filled by the kernel: every bit pattern is a
    // valid `tcp_info` (integers only).
    let info = unsafe { info.assume_init() };
    Some(Delivery {
        unacked: info.tcpi_unacked,
        since_last_ack: Duration::from_millis(u64::from(info.tcpi_last_ack_recv)),
    })
}

/// The delivery state of `stream`; `None` where the kernel does not say.
#[cfg(not(target_os = "linux"))]
pub(super) fn delivery(_stream: &TcpStream) -> Option<Delivery> {
    None
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_connection_whose_data_was_acknowledged_has_none_unacked() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        std::io::Write::write_all(&mut client, b"hello").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let delivery = delivery(&client).unwrap();
        assert_eq!(delivery.unacked, 0);
        assert!(
            delivery.since_last_ack < Duration::from_secs(5),
            "{delivery:?}"
        );
    }
}
