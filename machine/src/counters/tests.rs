use super::*;
use crate::netlink::{read_u16_ne, read_u32_ne};

/// One netlink message: header, nfgenmsg, attributes.
fn message(kind: u16, attrs: &[u8]) -> Vec<u8> {
    message_of(NFPROTO_INET, kind, attrs)
}

fn message_of(family: u8, kind: u16, attrs: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + NFGEN_LEN + attrs.len();
    let mut m = Vec::new();
    m.extend((len as u32).to_ne_bytes());
    m.extend(kind.to_ne_bytes());
    m.extend(2u16.to_ne_bytes()); // NLM_F_MULTI
    m.extend(1u32.to_ne_bytes());
    m.extend(0u32.to_ne_bytes());
    m.extend([family, 0, 0, 0]);
    m.extend(attrs);
    m
}

fn counter_object(name: &str, packets: u64, kind: u32) -> Vec<u8> {
    counter_object_of(NFPROTO_INET, name, packets, kind)
}

fn counter_object_of(family: u8, name: &str, packets: u64, kind: u32) -> Vec<u8> {
    let mut data = Vec::new();
    attr(&mut data, 1, &999u64.to_be_bytes()); // bytes
    attr(&mut data, COUNTER_PACKETS, &packets.to_be_bytes());
    let mut attrs = Vec::new();
    attr(&mut attrs, OBJ_TABLE, b"egress_machine\0");
    attr(&mut attrs, OBJ_NAME, format!("{name}\0").as_bytes());
    attr(&mut attrs, OBJ_TYPE, &kind.to_be_bytes());
    attr(&mut attrs, OBJ_DATA | 0x8000, &data); // NLA_F_NESTED
    message_of(family, SUBSYS_NFTABLES | MSG_NEWOBJ, &attrs)
}

#[test]
fn the_request_names_the_table_and_the_counter_type() {
    let r = request("egress_machine", 7);
    assert_eq!(read_u32_ne(&r, 0), Some(r.len() as u32));
    assert_eq!(read_u16_ne(&r, 4), Some(SUBSYS_NFTABLES | MSG_GETOBJ));
    assert_eq!(read_u16_ne(&r, 6), Some(NLM_F_REQUEST | NLM_F_DUMP));
    assert_eq!(r[NLMSG_HDRLEN], NFPROTO_UNSPEC, "every family's tables");
    let attrs = attributes(&r[NLMSG_HDRLEN + NFGEN_LEN..]).expect("attributes");
    assert_eq!(
        attrs,
        [
            (OBJ_TABLE, &b"egress_machine\0"[..]),
            (OBJ_TYPE, &OBJECT_COUNTER.to_be_bytes()[..])
        ]
    );
}

#[test]
fn a_dump_reads_as_its_counters_then_its_end() {
    let mut datagram = counter_object("refused_ab12", 42, OBJECT_COUNTER);
    datagram.extend(counter_object("quota_x", 1, 2)); // another type: skipped
    datagram.extend(counter_object_of(
        NFPROTO_NETDEV,
        "spoofed_ab12",
        0,
        OBJECT_COUNTER,
    ));
    // A table of the same name in a family the gateway does not write.
    datagram.extend(counter_object_of(2, "refused_ab12", 7, OBJECT_COUNTER));
    let mut done = message(NLMSG_DONE, &[]);
    done.truncate(NLMSG_HDRLEN + 4);
    done[..4].copy_from_slice(&((NLMSG_HDRLEN + 4) as u32).to_ne_bytes());
    datagram.extend(done);
    assert_eq!(
        messages(&datagram),
        [
            Ok(Part::Counter("refused_ab12".into(), 42)),
            Ok(Part::Other),
            Ok(Part::Counter("spoofed_ab12".into(), 0)),
            Ok(Part::Other),
            Ok(Part::Done),
        ]
    );
}

#[test]
fn errors_and_broken_messages_are_said_not_guessed() {
    let mut err = message(NLMSG_ERROR, &[]);
    err[NLMSG_HDRLEN..NLMSG_HDRLEN + 4].copy_from_slice(&(-2i32).to_ne_bytes());
    assert_eq!(messages(&err), [Ok(Part::Error(-2))]);
    // A counter whose data lost its packets is refused, not read as 0.
    let mut attrs = Vec::new();
    attr(&mut attrs, OBJ_NAME, b"refused_x\0");
    attr(&mut attrs, OBJ_TYPE, &OBJECT_COUNTER.to_be_bytes());
    attr(&mut attrs, OBJ_DATA, &[]);
    let m = message(SUBSYS_NFTABLES | MSG_NEWOBJ, &attrs);
    assert!(messages(&m)[0].is_err());
    // Every prefix of a good message: never a counter, never a panic.
    let good = counter_object("refused_ab12", 42, OBJECT_COUNTER);
    for cut in 0..good.len() {
        for p in messages(&good[..cut]) {
            assert!(!matches!(p, Ok(Part::Counter(..))), "cut at {cut}");
        }
    }
}

#[test]
fn a_rule_dump_names_its_table_and_chain_and_counts_inet_rules() {
    let r = rule_request("egress_machine", "forward", 3);
    assert_eq!(read_u16_ne(&r, 4), Some(SUBSYS_NFTABLES | MSG_GETRULE));
    assert_eq!(read_u16_ne(&r, 6), Some(NLM_F_REQUEST | NLM_F_DUMP));
    assert_eq!(r[NLMSG_HDRLEN], NFPROTO_INET);
    let attrs = attributes(&r[NLMSG_HDRLEN + NFGEN_LEN..]).expect("attributes");
    assert_eq!(
        attrs,
        [
            (RULE_TABLE, &b"egress_machine\0"[..]),
            (RULE_CHAIN, &b"forward\0"[..])
        ]
    );
    let mut datagram = message(SUBSYS_NFTABLES | MSG_NEWRULE, &[]);
    datagram.extend(message_of(
        NFPROTO_BRIDGE,
        SUBSYS_NFTABLES | MSG_NEWRULE,
        &[],
    ));
    let parts: Vec<_> = messages(&datagram)
        .into_iter()
        .map(|p| p.expect("read"))
        .collect();
    assert_eq!(
        parts,
        [Part::Rule, Part::Other],
        "another family's rule is not ours"
    );
}

/// The 'bridge' family, whose tables the gateway never writes.
const NFPROTO_BRIDGE: u8 = 7;

#[test]
fn a_link_rule_dump_names_its_table_and_reads_each_rules_chain() {
    let r = link_rule_request("egress_machine", 4);
    assert_eq!(read_u16_ne(&r, 4), Some(SUBSYS_NFTABLES | MSG_GETRULE));
    assert_eq!(r[NLMSG_HDRLEN], NFPROTO_NETDEV);
    let attrs = attributes(&r[NLMSG_HDRLEN + NFGEN_LEN..]).expect("attributes");
    assert_eq!(attrs, [(RULE_TABLE, &b"egress_machine\0"[..])]);
    let mut named = Vec::new();
    attr(&mut named, RULE_TABLE, b"egress_machine\0");
    attr(&mut named, RULE_CHAIN, b"link_vm1\0");
    let rule = message_of(NFPROTO_NETDEV, SUBSYS_NFTABLES | MSG_NEWRULE, &named);
    let mut datagram = rule.clone();
    datagram.extend(message(SUBSYS_NFTABLES | MSG_NEWRULE, &named));
    let parts: Vec<_> = messages(&datagram).into_iter().collect();
    assert_eq!(
        parts,
        [Ok(Part::LinkRule("link_vm1".into())), Ok(Part::Rule)],
        "a netdev rule and its chain; an inet one"
    );
    let mut table_only = Vec::new();
    attr(&mut table_only, RULE_TABLE, b"egress_machine\0");
    let unnamed = message_of(NFPROTO_NETDEV, SUBSYS_NFTABLES | MSG_NEWRULE, &table_only);
    assert_eq!(
        messages(&unnamed),
        [Err(Malformed("a rule without its chain"))]
    );
    for cut in NLMSG_HDRLEN + NFGEN_LEN..rule.len() {
        let mut cut_short = rule[..cut].to_vec();
        cut_short[..4].copy_from_slice(&(cut as u32).to_ne_bytes());
        for p in messages(&cut_short) {
            assert!(
                !matches!(p, Ok(Part::LinkRule(ref c)) if c != "link_vm1"),
                "cut at {cut}: {p:?}"
            );
        }
    }
}
