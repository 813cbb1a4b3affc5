//! The user behind a loopback TCP connection. TCP carries no credentials (`SO_PEERCRED` is for
//! Unix sockets), but on one host the kernel knows both ends: the peer's socket is the one
//! whose local address is the connection's source and whose remote address is ours, and the
//! kernel's socket diagnostics (netlink `sock_diag`, what `ss` uses) name its owner's uid in
//! one lookup by those four values, however many sockets the host has. Only an established
//! socket counts: one the peer already closed may be listed as root's.

use std::net::{IpAddr, SocketAddr};

/// The uid owning the peer end of the loopback connection from `peer` to `ours`, when the
/// kernel names it; `None` on other systems, for other addresses, or when it is gone.
pub fn owner(peer: SocketAddr, ours: SocketAddr) -> Option<u32> {
    if !peer.ip().is_loopback() && !is_mapped_loopback(peer.ip()) {
        return None;
    }
    #[cfg(target_os = "linux")]
    {
        sock_diag::owner(peer, ours)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = ours;
        None
    }
}

/// `::ffff:127.x.y.z`, as a dual-stack listener sees an IPv4 loopback peer.
fn is_mapped_loopback(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()))
}

/// The request and answer of one `SOCK_DIAG_BY_FAMILY` lookup, as bytes (`linux/inet_diag.h`).
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
mod wire {
    use std::net::{IpAddr, SocketAddr};

    /// `nlmsghdr`'s type for socket diagnostics.
    pub const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLM_F_REQUEST: u16 = 1;
    const NLMSG_HEADER: usize = 16;
    /// `inet_diag_sockid`: ports, two 16-byte addresses, interface, cookie.
    const SOCKID: usize = 48;
    /// The request: `nlmsghdr` and `inet_diag_req_v2` (family, protocol, ext, pad, states,
    /// then the socket id).
    pub const REQUEST: usize = NLMSG_HEADER + 8 + SOCKID;
    /// Where `inet_diag_msg`'s fields lie in an answer: its state, and its uid (after family,
    /// state, timer, retransmits, the socket id, expires, rqueue and wqueue).
    const STATE_AT: usize = NLMSG_HEADER + 1;
    const UID_AT: usize = NLMSG_HEADER + 4 + SOCKID + 12;
    const TCP_ESTABLISHED: u8 = 1;

    /// The lookup of the TCP socket bound to `local` and connected to `remote`.
    pub fn request(local: SocketAddr, remote: SocketAddr, seq: u32) -> [u8; REQUEST] {
        let mut out = [0u8; REQUEST];
        let len = REQUEST as u32;
        out[0..4].copy_from_slice(&len.to_ne_bytes());
        out[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        out[6..8].copy_from_slice(&NLM_F_REQUEST.to_ne_bytes());
        out[8..12].copy_from_slice(&seq.to_ne_bytes());
        let family = match local.ip() {
            IpAddr::V4(_) => libc::AF_INET,
            IpAddr::V6(_) => libc::AF_INET6,
        };
        let body = &mut out[NLMSG_HEADER..];
        body[0] = family as u8;
        body[1] = libc::IPPROTO_TCP as u8;
        // Every state: the answer's own state is checked instead.
        body[4..8].copy_from_slice(&u32::MAX.to_ne_bytes());
        let id = &mut body[8..];
        id[0..2].copy_from_slice(&local.port().to_be_bytes());
        id[2..4].copy_from_slice(&remote.port().to_be_bytes());
        put_address(&mut id[4..20], local.ip());
        put_address(&mut id[20..36], remote.ip());
        // No cookie (INET_DIAG_NOCOOKIE): look the socket up by its addresses alone.
        id[40..48].copy_from_slice(&[0xff; 8]);
        out
    }

    fn put_address(slot: &mut [u8], ip: IpAddr) {
        match ip {
            IpAddr::V4(v4) => slot[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => slot.copy_from_slice(&v6.octets()),
        }
    }

    /// The uid in the answer `answer` to request `seq`, if it describes an established socket.
    pub fn owner(answer: &[u8], seq: u32) -> Option<u32> {
        let word = |at: usize| -> Option<u32> {
            Some(u32::from_ne_bytes(answer.get(at..at + 4)?.try_into().ok()?))
        };
        let kind = u16::from_ne_bytes(answer.get(4..6)?.try_into().ok()?);
        let established = *answer.get(STATE_AT)? == TCP_ESTABLISHED;
        (kind == SOCK_DIAG_BY_FAMILY && word(8)? == seq && established)
            .then(|| word(UID_AT))
            .flatten()
    }
}

#[cfg(target_os = "linux")]
mod sock_diag {
    use std::net::SocketAddr;
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicU32, Ordering};

    use nix::sys::socket::{
        AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, recv, sendto,
        setsockopt, socket, sockopt,
    };
    use nix::sys::time::TimeVal;

    static SEQ: AtomicU32 = AtomicU32::new(1);

    /// One lookup: a netlink socket of its own, answered at once (or in 100 ms at most).
    pub fn owner(peer: SocketAddr, ours: SocketAddr) -> Option<u32> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkSockDiag,
        )
        .ok()?;
        setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(0, 100_000)).ok()?;
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let request = super::wire::request(peer, ours, seq);
        let kernel = NetlinkAddr::new(0, 0);
        sendto(fd.as_raw_fd(), &request, &kernel, MsgFlags::empty()).ok()?;
        let mut answer = [0u8; 512];
        let got = recv(fd.as_raw_fd(), &mut answer, MsgFlags::empty()).ok()?;
        super::wire::owner(answer.get(..got)?, seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection of this process's own: the kernel names its uid as the owner of the
    /// connecting end, and nobody as the owner of an address nothing is connected from.
    #[test]
    fn the_owner_of_a_loopback_connection_is_its_process_user() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server_end, from) = listener.accept().unwrap();
        let ours = server_end.local_addr().unwrap();
        assert_eq!(from, client.local_addr().unwrap());
        // The kernel makes /proc/self owned by the process's effective user.
        let uid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap());
        assert_eq!(owner(from, ours), Some(uid));
        let elsewhere = SocketAddr::new(from.ip(), from.port().wrapping_add(1));
        assert_eq!(owner(elsewhere, ours), None);
        let remote: SocketAddr = "192.0.2.1:4000".parse().unwrap();
        assert_eq!(owner(remote, ours), None);
    }

    #[test]
    fn an_answer_counts_only_for_its_request_and_an_established_socket() {
        let local: SocketAddr = "127.0.0.1:41652".parse().unwrap();
        let remote: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        let request = wire::request(local, remote, 7);
        assert_eq!(&request[4..6], &wire::SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        assert_eq!(&request[24..26], &41652u16.to_be_bytes());
        assert_eq!(&request[28..32], &[127, 0, 0, 1]);
        let mut answer = vec![0u8; 16 + 72];
        answer[4..6].copy_from_slice(&wire::SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        answer[8..12].copy_from_slice(&7u32.to_ne_bytes());
        answer[17] = 1;
        answer[80..84].copy_from_slice(&1000u32.to_ne_bytes());
        assert_eq!(wire::owner(&answer, 7), Some(1000));
        assert_eq!(wire::owner(&answer, 8), None, "another request's answer");
        answer[17] = 6;
        assert_eq!(wire::owner(&answer, 7), None, "TIME_WAIT");
        assert_eq!(wire::owner(&answer[..40], 7), None, "cut short");
        assert!(is_mapped_loopback("::ffff:127.0.0.1".parse().unwrap()));
    }
}
