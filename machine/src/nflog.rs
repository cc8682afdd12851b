//! The NFLOG messages of machine egress, as bytes: what the gateway sends
//! to bind its log group, and what it reads back for each refused (or, in
//! audit, would-be-refused) packet. Pure: no socket here ([`super::events`]
//! has it); the framing is [`crate::netlink`]'s.
//!
//! The rules log with a prefix that names the verdict and the VM
//! (`egm r <id>` refused, `egm w <id>` would refuse), and the kernel copies
//! the first [`COPY_RANGE`] bytes of the packet: the IP header and the
//! transport ports. Every message is checked against the lengths it
//! declares; anything that does not add up is refused, never guessed at,
//! and counted by the reader as unreadable.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, SystemTime};

use egress_policy::machine::Proto;

use crate::netlink::{
    self, attr, read_u16_be, read_u32_be, read_u64_be, NFGEN_LEN, NLMSG_ERROR, NLMSG_HDRLEN,
    NLM_F_REQUEST,
};

/// Bytes of each packet the kernel copies: an IPv6 header (40), a few
/// extension headers and the ports fit.
pub const COPY_RANGE: u32 = 96;

/// What the log prefix starts with.
pub const PREFIX: &str = "egm";

const NLM_F_ACK: u16 = 4;
/// `NFNL_SUBSYS_ULOG << 8`: nfnetlink_log.
const SUBSYS_ULOG: u16 = 4 << 8;
const MSG_PACKET: u16 = 0;
const MSG_CONFIG: u16 = 1;
// Configuration attributes (`enum nfulnl_attr_config`).
const CFG_CMD: u16 = 1;
const CFG_MODE: u16 = 2;
const CFG_TIMEOUT: u16 = 4;
const CFG_QTHRESH: u16 = 5;
const CFG_FLAGS: u16 = 6;
const CMD_BIND: u8 = 1;
const COPY_PACKET: u8 = 2;
/// `NFULNL_CFG_F_SEQ`: each message carries the group's sequence number,
/// so a gap is a lost event, counted.
const FLAG_SEQ: u16 = 1;
// Packet attributes (`enum nfulnl_attr_type`).
const ATTR_TIMESTAMP: u16 = 3;
const ATTR_PAYLOAD: u16 = 9;
const ATTR_PREFIX: u16 = 10;
const ATTR_SEQ: u16 = 12;

/// Refused, or (audit) only recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Refused,
    WouldRefuse,
}

impl Outcome {
    /// The letter in the log prefix.
    pub fn letter(self) -> char {
        match self {
            Self::Refused => 'r',
            Self::WouldRefuse => 'w',
        }
    }
}

/// One logged packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    pub vm: String,
    pub outcome: Outcome,
    pub addr: IpAddr,
    pub proto: Proto,
    pub port: u16,
    /// The group's sequence number (`NFULA_SEQ`).
    pub seq: Option<u32>,
    /// The packet's time stamp, when the kernel had one.
    pub time: Option<SystemTime>,
}

/// What one netlink message was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Packet(Event),
    /// An acknowledgement (`0`) or an error (a negative errno).
    Ack(i32),
    /// A message this reader has no use for (a type it does not read).
    Other,
}

/// Why a message was refused.
pub use crate::netlink::Malformed;

/// The configuration message that binds `group` to this socket: copy the
/// first [`COPY_RANGE`] bytes of each packet, send within `timeout`
/// hundredths of a second or `qthresh` packets, with sequence numbers.
pub fn bind_group(group: u16, seq: u32, qthresh: u32, timeout: u32) -> Vec<u8> {
    let mut attrs = Vec::new();
    attr(&mut attrs, CFG_CMD, &[CMD_BIND]);
    let mut mode = COPY_RANGE.to_be_bytes().to_vec();
    mode.extend([COPY_PACKET, 0]);
    attr(&mut attrs, CFG_MODE, &mode);
    attr(&mut attrs, CFG_QTHRESH, &qthresh.to_be_bytes());
    attr(&mut attrs, CFG_TIMEOUT, &timeout.to_be_bytes());
    attr(&mut attrs, CFG_FLAGS, &FLAG_SEQ.to_be_bytes());
    // nfgenmsg: AF_UNSPEC, NFNETLINK_V0, the group in network order.
    let [g0, g1] = group.to_be_bytes();
    let kind = SUBSYS_ULOG | MSG_CONFIG;
    netlink::request(kind, NLM_F_REQUEST | NLM_F_ACK, seq, [0, 0, g0, g1], &attrs)
}

/// Splits one datagram into its netlink messages and reads each
/// ([`netlink::split`]).
pub fn messages(datagram: &[u8]) -> Vec<Result<Message, Malformed>> {
    netlink::split(datagram, message)
}

/// One netlink message, its length already checked.
fn message(kind: u16, msg: &[u8]) -> Result<Message, Malformed> {
    let body = &msg[NLMSG_HDRLEN..];
    match kind {
        NLMSG_ERROR => netlink::error_code(body).map(Message::Ack),
        k if k == SUBSYS_ULOG | MSG_PACKET => packet(body).map(Message::Packet),
        _ => Ok(Message::Other),
    }
}

/// A packet message: nfgenmsg, then attributes.
fn packet(body: &[u8]) -> Result<Event, Malformed> {
    let attrs = body.get(NFGEN_LEN..).ok_or(Malformed("no nfgenmsg"))?;
    let (mut prefix, mut payload, mut seq, mut time) = (None, None, None, None);
    for (kind, value) in netlink::attributes(attrs)? {
        match kind {
            ATTR_PREFIX => prefix = Some(value),
            ATTR_PAYLOAD => payload = Some(value),
            ATTR_SEQ => seq = Some(read_u32_be(value, 0).ok_or(Malformed("a short sequence"))?),
            ATTR_TIMESTAMP => time = Some(timestamp(value)?),
            _ => {}
        }
    }
    let (vm, outcome) = parse_prefix(prefix.ok_or(Malformed("no prefix"))?)?;
    let (addr, proto, port) = destination(payload.ok_or(Malformed("no payload"))?)?;
    Ok(Event {
        vm,
        outcome,
        addr,
        proto,
        port,
        seq,
        time,
    })
}

/// `NFULA_TIMESTAMP`: seconds and microseconds, big-endian 64-bit.
fn timestamp(value: &[u8]) -> Result<SystemTime, Malformed> {
    let secs = read_u64_be(value, 0).ok_or(Malformed("a short time stamp"))?;
    let usecs = read_u64_be(value, 8).ok_or(Malformed("a short time stamp"))?;
    if usecs >= 1_000_000 {
        return Err(Malformed("a time stamp's microseconds out of range"));
    }
    SystemTime::UNIX_EPOCH
        .checked_add(Duration::from_secs(secs) + Duration::from_micros(usecs))
        .ok_or(Malformed("a time stamp out of range"))
}

/// `egm r <id>` or `egm w <id>`, NUL-terminated; the id as VM ids are.
pub fn parse_prefix(value: &[u8]) -> Result<(String, Outcome), Malformed> {
    let text = value.split(|b| *b == 0).next().unwrap_or(&[]);
    let text = std::str::from_utf8(text).map_err(|_| Malformed("a prefix that is not UTF-8"))?;
    let mut words = text.split(' ');
    let (Some(PREFIX), Some(letter), Some(vm), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return Err(Malformed("a prefix not of this gateway"));
    };
    let outcome = match letter {
        "r" => Outcome::Refused,
        "w" => Outcome::WouldRefuse,
        _ => return Err(Malformed("a prefix with an unknown outcome")),
    };
    super::valid_id(vm).map_err(|_| Malformed("a prefix with an invalid VM id"))?;
    Ok((vm.to_owned(), outcome))
}

/// The destination of the copied packet: address, protocol (TCP or UDP)
/// and port.
pub fn destination(ip: &[u8]) -> Result<(IpAddr, Proto, u16), Malformed> {
    let version = ip.first().ok_or(Malformed("an empty payload"))? >> 4;
    let (addr, proto, transport) = match version {
        4 => ipv4(ip)?,
        6 => ipv6(ip)?,
        _ => return Err(Malformed("a payload that is not IPv4 or IPv6")),
    };
    let proto = match proto {
        6 => Proto::Tcp,
        17 => Proto::Udp,
        _ => return Err(Malformed("a protocol other than TCP or UDP")),
    };
    let port = read_u16_be(transport, 2).ok_or(Malformed("a transport header cut short"))?;
    Ok((addr, proto, port))
}

/// IPv4: the destination, the protocol and what follows the header. A
/// fragment after the first has no ports.
fn ipv4(ip: &[u8]) -> Result<(IpAddr, u8, &[u8]), Malformed> {
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    if ihl < 20 || ip.len() < ihl {
        return Err(Malformed("an IPv4 header cut short"));
    }
    let offset = read_u16_be(ip, 6).unwrap_or(0) & 0x1fff;
    if offset != 0 {
        return Err(Malformed("an IPv4 fragment without ports"));
    }
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    Ok((IpAddr::V4(dst), ip[9], &ip[ihl..]))
}

/// IPv6: the destination, and the upper protocol after at most four
/// extension headers (hop-by-hop, routing, destination options; a fragment
/// after the first has no ports).
fn ipv6(ip: &[u8]) -> Result<(IpAddr, u8, &[u8]), Malformed> {
    let dst: [u8; 16] = ip
        .get(24..40)
        .and_then(|d| d.try_into().ok())
        .ok_or(Malformed("an IPv6 header cut short"))?;
    let mut next = ip[6];
    let mut rest = &ip[40..];
    for _ in 0..4 {
        let len = match next {
            0 | 43 | 60 => {
                (usize::from(*rest.get(1).ok_or(Malformed("an extension cut short"))?) + 1) * 8
            }
            44 => {
                let offset =
                    read_u16_be(rest, 2).ok_or(Malformed("a fragment header cut short"))?;
                if offset & 0xfff8 != 0 {
                    return Err(Malformed("an IPv6 fragment without ports"));
                }
                8
            }
            _ => break,
        };
        next = *rest.first().ok_or(Malformed("an extension cut short"))?;
        rest = rest.get(len..).ok_or(Malformed("an extension cut short"))?;
    }
    Ok((IpAddr::V6(Ipv6Addr::from(dst)), next, rest))
}

#[cfg(test)]
mod tests;
