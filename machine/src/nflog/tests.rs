use super::*;

/// A netlink attribute, padded.
fn nla(kind: u16, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    attr(&mut out, kind, value);
    out
}

/// A whole nfnetlink_log packet message with these attributes.
fn packet_msg(attrs: &[Vec<u8>]) -> Vec<u8> {
    let body: Vec<u8> = attrs.concat();
    let len = NLMSG_HDRLEN + NFGEN_LEN + body.len();
    let mut m = Vec::new();
    m.extend(u32::try_from(len).expect("small").to_ne_bytes());
    m.extend((SUBSYS_ULOG | MSG_PACKET).to_ne_bytes());
    m.extend(0u16.to_ne_bytes());
    m.extend(0u32.to_ne_bytes());
    m.extend(0u32.to_ne_bytes());
    m.extend([2, 0, 0, 7]);
    m.extend(body);
    m
}

/// An IPv4 TCP SYN's first bytes to 203.0.113.11:80.
fn ipv4_tcp() -> Vec<u8> {
    let mut ip = vec![0x45, 0, 0, 60, 0, 1, 0x40, 0, 64, 6, 0, 0];
    ip.extend([100, 64, 0, 2, 203, 0, 113, 11]);
    ip.extend([0xc0, 0x01, 0, 80, 0, 0, 0, 1]);
    ip
}

/// An IPv6 UDP datagram to 2001:db8::53 port 53, behind a hop-by-hop
/// extension header.
fn ipv6_udp_hbh() -> Vec<u8> {
    let mut ip = vec![0x60, 0, 0, 0, 0, 16, 0, 64];
    ip.extend("2001:db8::2".parse::<Ipv6Addr>().expect("ip").octets());
    ip.extend("2001:db8::53".parse::<Ipv6Addr>().expect("ip").octets());
    ip.extend([17, 0, 0, 0, 0, 0, 0, 0]); // hop-by-hop, 8 bytes, next UDP
    ip.extend([0x30, 0x39, 0, 53, 0, 8, 0, 0]);
    ip
}

fn full_tcp_event() -> Vec<u8> {
    let mut ts = 1_700_000_000u64.to_be_bytes().to_vec();
    ts.extend(250_000u64.to_be_bytes());
    packet_msg(&[
        nla(1, &[8, 0, 3, 0]), // packet header: ignored
        nla(ATTR_PREFIX, b"egm r vm-1.a\0"),
        nla(ATTR_TIMESTAMP, &ts),
        nla(ATTR_SEQ | 0x4000, &41u32.to_be_bytes()),
        nla(ATTR_PAYLOAD, &ipv4_tcp()),
    ])
}

#[test]
fn a_refused_ipv4_packet_is_read_whole() {
    let got = messages(&full_tcp_event());
    let [Ok(Message::Packet(e))] = got.as_slice() else {
        panic!("{got:?}");
    };
    assert_eq!(e.vm, "vm-1.a");
    assert_eq!(e.outcome, Outcome::Refused);
    assert_eq!(e.addr, "203.0.113.11".parse::<IpAddr>().expect("ip"));
    assert_eq!((e.proto, e.port), (Proto::Tcp, 80));
    assert_eq!(e.seq, Some(41));
    assert_eq!(
        e.time,
        Some(SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_250))
    );
}

#[test]
fn ipv6_behind_an_extension_header_and_would_refuse() {
    let m = packet_msg(&[
        nla(ATTR_PREFIX, b"egm w q\0"),
        nla(ATTR_PAYLOAD, &ipv6_udp_hbh()),
    ]);
    let got = messages(&m);
    let [Ok(Message::Packet(e))] = got.as_slice() else {
        panic!("{got:?}");
    };
    assert_eq!(e.outcome, Outcome::WouldRefuse);
    assert_eq!(e.addr, "2001:db8::53".parse::<IpAddr>().expect("ip"));
    assert_eq!((e.proto, e.port), (Proto::Udp, 53));
    assert_eq!((e.seq, e.time), (None, None));
}

#[test]
fn batched_messages_and_acks_are_split() {
    let mut d = full_tcp_event();
    let mut ack = Vec::new();
    ack.extend(36u32.to_ne_bytes());
    ack.extend(NLMSG_ERROR.to_ne_bytes());
    ack.extend([0; 10]);
    ack.extend((-16i32).to_ne_bytes()); // EBUSY
    ack.extend([0; 16]);
    d.extend(&ack);
    d.extend(full_tcp_event());
    let got = messages(&d);
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(matches!(got[0], Ok(Message::Packet(_))));
    assert_eq!(got[1], Ok(Message::Ack(-16)));
    assert!(matches!(got[2], Ok(Message::Packet(_))));
}

#[test]
fn every_prefix_of_a_message_is_refused_never_a_panic() {
    let whole = full_tcp_event();
    for n in 0..whole.len() {
        for r in messages(&whole[..n]) {
            assert!(r.is_err(), "cut at {n}: {r:?}");
        }
    }
    // Cut payloads inside a well-formed message: refused too.
    // Up to the destination port: 20 bytes of header, 4 of transport.
    let payload = ipv4_tcp();
    for n in 0..24 {
        let m = packet_msg(&[
            nla(ATTR_PREFIX, b"egm r vm1\0"),
            nla(ATTR_PAYLOAD, &payload[..n]),
        ]);
        assert!(messages(&m)[0].is_err(), "payload cut at {n}");
    }
    let payload = ipv6_udp_hbh();
    for n in 0..52 {
        let m = packet_msg(&[
            nla(ATTR_PREFIX, b"egm r vm1\0"),
            nla(ATTR_PAYLOAD, &payload[..n]),
        ]);
        assert!(messages(&m)[0].is_err(), "IPv6 payload cut at {n}");
    }
}

#[test]
fn malformed_fields_are_refused() {
    let bad_prefixes: [&[u8]; 7] = [
        b"egm x vm1\0",
        b"egm r\0",
        b"egm r vm/1\0",
        b"other r vm1\0",
        b"egm r vm1 extra\0",
        b"egm r \xff\0",
        b"",
    ];
    for p in bad_prefixes {
        let m = packet_msg(&[nla(ATTR_PREFIX, p), nla(ATTR_PAYLOAD, &ipv4_tcp())]);
        assert!(messages(&m)[0].is_err(), "{p:?}");
    }
    // No prefix, no payload.
    assert!(messages(&packet_msg(&[nla(ATTR_PAYLOAD, &ipv4_tcp())]))[0].is_err());
    assert!(messages(&packet_msg(&[nla(ATTR_PREFIX, b"egm r vm1\0")]))[0].is_err());
    // ICMP, a later fragment, an IPv4 header length under 20, version 5.
    let mut icmp = ipv4_tcp();
    icmp[9] = 1;
    let mut frag = ipv4_tcp();
    frag[7] = 8;
    let mut short_ihl = ipv4_tcp();
    short_ihl[0] = 0x44;
    let mut v5 = ipv4_tcp();
    v5[0] = 0x55;
    for p in [icmp, frag, short_ihl, v5] {
        let m = packet_msg(&[nla(ATTR_PREFIX, b"egm r vm1\0"), nla(ATTR_PAYLOAD, &p)]);
        assert!(messages(&m)[0].is_err(), "{p:?}");
    }
    // A time stamp with a million microseconds; an attribute longer than
    // its message; a netlink length past the datagram or under a header.
    let mut ts = 1u64.to_be_bytes().to_vec();
    ts.extend(1_000_000u64.to_be_bytes());
    let m = packet_msg(&[
        nla(ATTR_PREFIX, b"egm r vm1\0"),
        nla(ATTR_TIMESTAMP, &ts),
        nla(ATTR_PAYLOAD, &ipv4_tcp()),
    ]);
    assert!(messages(&m)[0].is_err());
    let mut long_attr = full_tcp_event();
    long_attr[NLMSG_HDRLEN + NFGEN_LEN] = 0xff;
    assert!(messages(&long_attr)[0].is_err());
    let mut long_msg = full_tcp_event();
    long_msg[0] = long_msg[0].wrapping_add(4);
    assert!(messages(&long_msg)[0].is_err());
    assert!(messages(&[8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])[0].is_err());
}

#[test]
fn arbitrary_bytes_never_panic() {
    // A cheap deterministic scramble of a valid datagram (the fuzz target
    // does this properly).
    let base = full_tcp_event();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..20_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mut d = base.clone();
        let at = (state as usize) % d.len();
        d[at] = (state >> 32) as u8;
        let cut = ((state >> 40) as usize) % (d.len() + 1);
        let _ = messages(&d[..cut]);
    }
}

#[test]
fn the_bind_message_is_what_the_kernel_expects() {
    let m = bind_group(7, 1, 32, 1);
    assert_eq!(
        m.len(),
        usize::try_from(u32::from_ne_bytes(m[..4].try_into().expect("4"))).expect("len")
    );
    assert_eq!(u16::from_ne_bytes([m[4], m[5]]), (4 << 8) | 1);
    assert_eq!(u16::from_ne_bytes([m[6], m[7]]), NLM_F_REQUEST | NLM_F_ACK);
    assert_eq!(
        &m[16..20],
        &[0, 0, 0, 7],
        "AF_UNSPEC, v0, group 7 big-endian"
    );
    // The command attribute first: length 5, type 1, BIND, padded to 8.
    assert_eq!(&m[20..28], &[5, 0, 1, 0, CMD_BIND, 0, 0, 0]);
    // The copy mode: range 96 big-endian, COPY_PACKET.
    assert_eq!(&m[28..40], &[10, 0, 2, 0, 0, 0, 0, 96, 2, 0, 0, 0]);
    assert_eq!(m.len() % 4, 0);
}
