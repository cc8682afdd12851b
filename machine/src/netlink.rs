//! The netfilter netlink framing machine egress reads twice — the NFLOG
//! group's datagrams ([`crate::nflog`]) and the counter dump
//! ([`crate::counters`]) — written once: the socket, the split of a
//! datagram into messages checked against their declared lengths, and the
//! attribute and integer readers. Pure but for [`socket`].

use std::time::Duration;

use rustix::fd::OwnedFd;
use rustix::net::{self, netlink, sockopt, AddressFamily, SocketType};

pub(crate) const NLMSG_HDRLEN: usize = 16;
/// The nfgenmsg after each header: family, version, resource id.
pub(crate) const NFGEN_LEN: usize = 4;
pub(crate) const NLMSG_ERROR: u16 = 2;
pub(crate) const NLM_F_REQUEST: u16 = 1;
/// An attribute's type without its nested/byte-order flags.
pub(crate) const NLA_TYPE_MASK: u16 = 0x3fff;

/// Bytes that do not add up; refused, never guessed at.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unreadable netlink message: {0}")]
pub struct Malformed(pub &'static str);

/// A netfilter netlink socket, bound, whose reads wait at most 2 s.
pub(crate) fn socket() -> Result<OwnedFd, String> {
    let fd = net::socket(
        AddressFamily::NETLINK,
        SocketType::RAW,
        Some(netlink::NETFILTER),
    )
    .map_err(|e| format!("a netfilter netlink socket: {e}"))?;
    net::bind(&fd, &netlink::SocketAddrNetlink::new(0, 0))
        .map_err(|e| format!("binding the netlink socket: {e}"))?;
    sockopt::set_socket_timeout(&fd, sockopt::Timeout::Recv, Some(Duration::from_secs(2)))
        .map_err(|e| format!("a receive timeout: {e}"))?;
    Ok(fd)
}

/// Splits one datagram into its netlink messages and reads each with
/// `read(type, message)`. A message whose declared length does not fit
/// ends the datagram (nothing after it can be found), so there is at most
/// one result per header's worth of bytes.
pub(crate) fn split<T>(
    datagram: &[u8],
    mut read: impl FnMut(u16, &[u8]) -> Result<T, Malformed>,
) -> Vec<Result<T, Malformed>> {
    let mut out = Vec::new();
    let mut rest = datagram;
    while !rest.is_empty() {
        let Some(len) = read_u32_ne(rest, 0).map(|l| l as usize) else {
            out.push(Err(Malformed("a netlink header cut short")));
            break;
        };
        if len < NLMSG_HDRLEN || len > rest.len() {
            out.push(Err(Malformed("a netlink length that does not fit")));
            break;
        }
        let msg = &rest[..len];
        out.push(match read_u16_ne(msg, 4) {
            Some(kind) => read(kind, msg),
            None => Err(Malformed("no message type")),
        });
        rest = rest.get(align(len)..).unwrap_or(&[]);
    }
    out
}

/// The code of an `NLMSG_ERROR` message's body (`0`: an acknowledgement).
pub(crate) fn error_code(body: &[u8]) -> Result<i32, Malformed> {
    let code = body.get(..4).and_then(|c| c.try_into().ok());
    code.map(i32::from_ne_bytes)
        .ok_or(Malformed("an error message cut short"))
}

/// The attributes of a run of bytes: (type without flags, value).
pub(crate) fn attributes(mut rest: &[u8]) -> Result<Vec<(u16, &[u8])>, Malformed> {
    let mut out = Vec::new();
    while rest.len() >= 4 {
        let len = read_u16_ne(rest, 0).ok_or(Malformed("an attribute cut short"))? as usize;
        let kind = read_u16_ne(rest, 2).ok_or(Malformed("an attribute cut short"))?;
        if len < 4 || len > rest.len() {
            return Err(Malformed("an attribute length that does not fit"));
        }
        out.push((kind & NLA_TYPE_MASK, &rest[4..len]));
        rest = rest.get(align(len)..).unwrap_or(&[]);
    }
    Ok(out)
}

/// Appends one attribute, padded to 4 bytes.
pub(crate) fn attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    out.extend(u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    out.extend(kind.to_ne_bytes());
    out.extend(value);
    out.resize(align(out.len()), 0);
}

/// A request: header, nfgenmsg, attributes.
pub(crate) fn request(kind: u16, flags: u16, seq: u32, nfgen: [u8; 4], attrs: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + NFGEN_LEN + attrs.len();
    let mut msg = Vec::with_capacity(len);
    // A request is a few hundred bytes at most: the length fits.
    msg.extend(u32::try_from(len).unwrap_or(u32::MAX).to_ne_bytes());
    msg.extend(kind.to_ne_bytes());
    msg.extend(flags.to_ne_bytes());
    msg.extend(seq.to_ne_bytes());
    msg.extend(0u32.to_ne_bytes());
    msg.extend(nfgen);
    msg.extend(attrs);
    msg
}

pub(crate) fn align(n: usize) -> usize {
    n.saturating_add(3) & !3
}

pub(crate) fn read_u16_ne(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

pub(crate) fn read_u32_ne(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

pub(crate) fn read_u16_be(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

pub(crate) fn read_u32_be(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

pub(crate) fn read_u64_be(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
}
