//! The node's own addresses, read from the kernel over route netlink
//! (`RTM_GETADDR`: a dump of every interface's addresses). A gateway whose
//! listeners are on a wildcard address adds them to its platform denies:
//! a sandbox must not reach a service of the node (its SSH, its kubelet)
//! through the node's public address any more than through loopback.
//!
//! [`request`] and [`messages`] are pure (and tested on bytes); [`read`]
//! does the I/O: one socket, one request, the answer read to its end
//! (bounded in datagrams and by a 2 s timeout on each read).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use rustix::net::{self, netlink, sockopt, AddressFamily, RecvFlags, SendFlags, SocketType};

use crate::netlink::{attributes, Malformed, NLMSG_ERROR, NLMSG_HDRLEN, NLM_F_REQUEST};

const NLMSG_DONE: u16 = 3;
const NLM_F_DUMP: u16 = 0x300;
const RTM_NEWADDR: u16 = 20;
const RTM_GETADDR: u16 = 22;
/// The `ifaddrmsg` after each header: family, prefix length, flags, scope, index.
const IFADDRMSG_LEN: usize = 8;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
/// Datagrams one dump may take (dozens of addresses fit in each).
const MAX_DATAGRAMS: usize = 1_000;

/// What one message of the answer says.
#[derive(Debug, PartialEq, Eq)]
pub enum Part {
    Address(IpAddr),
    Done,
    /// The kernel's error (a negative errno; `0` is an acknowledgement).
    Error(i32),
    Other,
}

/// The dump request for every address of every family.
pub fn request(seq: u32) -> Vec<u8> {
    let len = NLMSG_HDRLEN + IFADDRMSG_LEN;
    let mut msg = Vec::with_capacity(len);
    msg.extend(u32::try_from(len).unwrap_or(u32::MAX).to_ne_bytes());
    msg.extend(RTM_GETADDR.to_ne_bytes());
    msg.extend((NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    msg.extend(seq.to_ne_bytes());
    msg.extend(0u32.to_ne_bytes());
    msg.extend([0u8; IFADDRMSG_LEN]);
    msg
}

/// Splits one datagram of the answer into its messages and reads each.
pub fn messages(datagram: &[u8]) -> Vec<Result<Part, Malformed>> {
    crate::netlink::split(datagram, part)
}

fn part(kind: u16, msg: &[u8]) -> Result<Part, Malformed> {
    let body = &msg[NLMSG_HDRLEN..];
    match kind {
        NLMSG_DONE => Ok(Part::Done),
        NLMSG_ERROR => crate::netlink::error_code(body).map(Part::Error),
        RTM_NEWADDR => address(body),
        _ => Ok(Part::Other),
    }
}

/// An address message: its local address (else its address).
fn address(body: &[u8]) -> Result<Part, Malformed> {
    let family = *body
        .first()
        .ok_or(Malformed("an address message cut short"))?;
    let attrs = attributes(body.get(IFADDRMSG_LEN..).unwrap_or(&[]))?;
    let find = |t: u16| attrs.iter().find(|(k, _)| *k == t).map(|(_, v)| *v);
    let Some(value) = find(IFA_LOCAL).or_else(|| find(IFA_ADDRESS)) else {
        return Ok(Part::Other);
    };
    let ip = match (family, value.len()) {
        (AF_INET, 4) => IpAddr::V4(Ipv4Addr::from(
            <[u8; 4]>::try_from(value).unwrap_or_default(),
        )),
        (AF_INET6, 16) => IpAddr::V6(Ipv6Addr::from(
            <[u8; 16]>::try_from(value).unwrap_or_default(),
        )),
        (AF_INET | AF_INET6, _) => return Err(Malformed("an address of the wrong length")),
        _ => return Ok(Part::Other),
    };
    Ok(Part::Address(ip))
}

/// Every address of every interface in this network namespace.
pub fn read() -> Result<Vec<IpAddr>, String> {
    // NETLINK_ROUTE is protocol 0, the default: no `Protocol` names it.
    let fd = net::socket(AddressFamily::NETLINK, SocketType::RAW, None)
        .map_err(|e| format!("a route netlink socket: {e}"))?;
    net::bind(&fd, &netlink::SocketAddrNetlink::new(0, 0))
        .map_err(|e| format!("binding the route netlink socket: {e}"))?;
    sockopt::set_socket_timeout(&fd, sockopt::Timeout::Recv, Some(Duration::from_secs(2)))
        .map_err(|e| format!("a receive timeout: {e}"))?;
    net::send(&fd, &request(1), SendFlags::empty())
        .map_err(|e| format!("sending the address dump request: {e}"))?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    for _ in 0..MAX_DATAGRAMS {
        let (n, _) = net::recv(&fd, &mut buf[..], RecvFlags::empty())
            .map_err(|e| format!("reading the address dump: {e}"))?;
        if n == 0 {
            return Err("the address dump ended without its end".into());
        }
        for p in messages(&buf[..n.min(buf.len())]) {
            match p.map_err(|e| format!("unreadable address dump from the kernel: {}", e.0))? {
                Part::Address(ip) if !out.contains(&ip) => out.push(ip),
                Part::Done => return Ok(out),
                Part::Error(e) if e != 0 => {
                    let why = std::io::Error::from_raw_os_error(-e);
                    return Err(format!("the kernel refused the address dump: {why}"));
                }
                _ => {}
            }
        }
    }
    Err(format!(
        "the address dump took more than {MAX_DATAGRAMS} datagrams"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One `RTM_NEWADDR` message of `family` with `attrs` (type, value).
    fn message(family: u8, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut body = vec![family, 24, 0, 0, 1, 0, 0, 0];
        for (t, v) in attrs {
            crate::netlink::attr(&mut body, *t, v);
        }
        let len = NLMSG_HDRLEN + body.len();
        let mut msg = Vec::new();
        msg.extend(u32::try_from(len).expect("len").to_ne_bytes());
        msg.extend(RTM_NEWADDR.to_ne_bytes());
        msg.extend(2u16.to_ne_bytes());
        msg.extend(1u32.to_ne_bytes());
        msg.extend(0u32.to_ne_bytes());
        msg.extend(body);
        msg
    }

    #[test]
    fn addresses_are_read_from_their_messages() {
        let v6: [u8; 16] = "2001:db8::7".parse::<Ipv6Addr>().expect("ip").octets();
        let mut datagram = message(
            AF_INET,
            &[
                (IFA_ADDRESS, &[198, 51, 100, 1]),
                (IFA_LOCAL, &[203, 0, 113, 9]),
            ],
        );
        datagram.extend(message(AF_INET6, &[(IFA_ADDRESS, &v6)]));
        datagram.extend(message(AF_INET, &[(IFA_LOCAL, &[1, 2, 3])]));
        let parts = messages(&datagram);
        assert_eq!(
            parts[0],
            Ok(Part::Address("203.0.113.9".parse().expect("ip"))),
            "the local one"
        );
        assert_eq!(
            parts[1],
            Ok(Part::Address("2001:db8::7".parse().expect("ip")))
        );
        assert!(parts[2].is_err(), "three bytes are no IPv4 address");
        assert_eq!(request(7).len(), NLMSG_HDRLEN + IFADDRMSG_LEN);
    }

    #[test]
    fn this_namespace_has_its_loopback_address() {
        let addrs = read().expect("the kernel answers");
        assert!(
            addrs.contains(&IpAddr::V4(Ipv4Addr::LOCALHOST)),
            "{addrs:?}"
        );
    }
}
