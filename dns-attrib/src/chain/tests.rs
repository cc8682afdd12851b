use std::net::{Ipv4Addr, Ipv6Addr};

use hickory_proto::op::{Message, MessageType, OpCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME, TXT};
use hickory_proto::rr::{DNSClass, RData, Record};

use super::*;

fn n(s: &str) -> Name {
    Name::from_ascii(s).expect(s)
}

fn a(owner: &str, ttl: u32, ip: &str) -> Record {
    let ip: Ipv4Addr = ip.parse().expect(ip);
    Record::from_rdata(n(owner), ttl, RData::A(A(ip)))
}

fn aaaa(owner: &str, ttl: u32, ip: &str) -> Record {
    let ip: Ipv6Addr = ip.parse().expect(ip);
    Record::from_rdata(n(owner), ttl, RData::AAAA(AAAA(ip)))
}

fn cname(owner: &str, ttl: u32, target: &str) -> Record {
    Record::from_rdata(n(owner), ttl, RData::CNAME(CNAME(n(target))))
}

fn answer(records: Vec<Record>) -> Message {
    let mut m = Message::new(1, MessageType::Response, OpCode::Query);
    m.add_answers(records);
    m
}

fn names(a: &Attribution) -> Vec<&str> {
    a.names.iter().map(Hostname::as_str).collect()
}

#[test]
fn a_and_aaaa_for_the_question_name() {
    let m = answer(vec![
        a("api.test.", 300, "203.0.113.7"),
        aaaa("api.test.", 200, "2001:db8::7"),
    ]);
    let got = attribution(&n("api.test."), &m).expect("attributes");
    assert_eq!(names(&got), ["api.test"]);
    assert_eq!(
        got.addrs,
        [
            "203.0.113.7".parse::<IpAddr>().expect("ip"),
            "2001:db8::7".parse().expect("ip")
        ]
    );
    assert_eq!(got.ttl, 200);
}

#[test]
fn cname_chain_attributes_every_name_with_the_smallest_ttl() {
    // Out of order on purpose: the chain is followed by owner, not position.
    let m = answer(vec![
        a("edge.cdn.test.", 600, "198.51.100.9"),
        cname("www.shop.test.", 120, "shop.cdn.test."),
        cname("shop.cdn.test.", 60, "edge.cdn.test."),
    ]);
    let got = attribution(&n("WWW.Shop.Test"), &m).expect("attributes");
    assert_eq!(
        names(&got),
        ["www.shop.test", "shop.cdn.test", "edge.cdn.test"]
    );
    assert_eq!(got.addrs, ["198.51.100.9".parse::<IpAddr>().expect("ip")]);
    assert_eq!(got.ttl, 60);
}

#[test]
fn records_for_unasked_names_are_ignored() {
    let m = answer(vec![
        a("api.test.", 300, "203.0.113.7"),
        a("bank.test.", 300, "203.0.113.66"),
        cname("other.test.", 300, "api.test."),
    ]);
    let got = attribution(&n("api.test."), &m).expect("attributes");
    assert_eq!(names(&got), ["api.test"]);
    assert_eq!(got.addrs, ["203.0.113.7".parse::<IpAddr>().expect("ip")]);

    let only_unasked = answer(vec![a("bank.test.", 300, "203.0.113.66")]);
    assert_eq!(attribution(&n("api.test."), &only_unasked), None);

    let mut in_additional = answer(vec![]);
    in_additional.add_additional(a("api.test.", 300, "203.0.113.7"));
    in_additional.add_authority(a("api.test.", 300, "203.0.113.8"));
    assert_eq!(
        attribution(&n("api.test."), &in_additional),
        None,
        "only the answer section counts"
    );
}

#[test]
fn loops_and_dangling_chains_end_cleanly() {
    let looped = answer(vec![
        cname("a.test.", 30, "b.test."),
        cname("b.test.", 30, "a.test."),
    ]);
    assert_eq!(attribution(&n("a.test."), &looped), None);
    let dangling = answer(vec![cname("a.test.", 30, "b.test.")]);
    assert_eq!(attribution(&n("a.test."), &dangling), None);
    let long: Vec<Record> = (0..40)
        .map(|i| cname(&format!("n{i}.test."), 30, &format!("n{}.test.", i + 1)))
        .chain([a("n40.test.", 30, "203.0.113.1")])
        .collect();
    assert_eq!(
        attribution(&n("n0.test."), &answer(long)),
        None,
        "chains past the limit attribute nothing"
    );
}

#[test]
fn non_hostname_chain_names_are_skipped_and_other_rdata_ignored() {
    let m = answer(vec![
        cname("_svc.api.test.", 30, "api.test."),
        a("api.test.", 30, "203.0.113.7"),
        Record::from_rdata(n("api.test."), 30, RData::TXT(TXT::new(vec!["x".into()]))),
    ]);
    let got = attribution(&n("_svc.api.test."), &m).expect("attributes");
    assert_eq!(names(&got), ["api.test"]);
}

#[test]
fn names_whose_labels_need_escaping_or_read_as_addresses_are_skipped() {
    let raw = |labels: &[&[u8]]| Name::from_labels(labels.iter().copied()).expect("labels");
    let odd = [
        raw(&[b"a.b", b"test"]),
        raw(&[b"sp ace", b"test"]),
        raw(&[b"caf\xc3\xa9", b"test"]),
        raw(&[b"-edge", b"test"]),
        raw(&[b"10", b"0", b"0", b"1"]),
    ];
    for name in odd {
        let mut m = answer(vec![a("api.test.", 30, "203.0.113.7")]);
        m.add_answer(Record::from_rdata(
            name.clone(),
            30,
            RData::CNAME(CNAME(n("api.test."))),
        ));
        let got = attribution(&name, &m).expect("the rest of the chain still counts");
        assert_eq!(names(&got), ["api.test"], "{name:?}");
    }
    // Letters, digits and inner hyphens, in any case: lower-cased.
    let m = answer(vec![a("Xn--Bcher-Kva.Example.", 30, "203.0.113.8")]);
    let got = attribution(&n("XN--bcher-kva.example."), &m).expect("attributes");
    assert_eq!(names(&got), ["xn--bcher-kva.example"]);
}

#[test]
fn only_records_of_class_in_attribute() {
    let mut chaos = a("api.test.", 300, "198.51.100.66");
    chaos.dns_class = DNSClass::CH;
    let mut hop = cname("api.test.", 300, "evil.test.");
    hop.dns_class = DNSClass::HS;
    let m = answer(vec![
        chaos,
        hop,
        a("evil.test.", 300, "198.51.100.67"),
        a("api.test.", 300, "203.0.113.7"),
    ]);
    let got = attribution(&n("api.test."), &m).expect("attributes");
    assert_eq!(names(&got), ["api.test"]);
    assert_eq!(got.addrs, ["203.0.113.7".parse::<IpAddr>().expect("ip")]);
}

#[test]
fn only_the_chains_last_name_gives_addresses() {
    // The attacker's own zone puts an address beside its CNAME to an
    // allowed name: that address is not the allowed name's.
    let m = answer(vec![
        a("q.attacker.test.", 300, "203.0.113.66"),
        cname("q.attacker.test.", 300, "allowed.test."),
        a("allowed.test.", 300, "198.51.100.9"),
    ]);
    let got = attribution(&n("q.attacker.test."), &m).expect("attributes");
    assert_eq!(names(&got), ["q.attacker.test", "allowed.test"]);
    assert_eq!(got.addrs, ["198.51.100.9".parse::<IpAddr>().expect("ip")]);
    // An address owned by the middle of a chain is no one's either.
    let m = answer(vec![
        cname("a.test.", 300, "b.test."),
        a("b.test.", 300, "203.0.113.66"),
        cname("b.test.", 300, "c.test."),
        a("c.test.", 300, "198.51.100.9"),
    ]);
    let got = attribution(&n("a.test."), &m).expect("attributes");
    assert_eq!(got.addrs, ["198.51.100.9".parse::<IpAddr>().expect("ip")]);
}

#[test]
fn at_most_max_addrs_addresses_are_taken_from_one_answer() {
    let records: Vec<Record> = (0..1_000u32)
        .map(|i| {
            let ip = std::net::Ipv4Addr::from(0xc633_6400 + i); // 198.51.100.0 onwards
            a("many.test.", 300, &ip.to_string())
        })
        .collect();
    let got = attribution(&n("many.test."), &answer(records)).expect("attributes");
    assert_eq!(got.addrs.len(), super::MAX_ADDRS);
    assert_eq!(got.addrs[0], "198.51.100.0".parse::<IpAddr>().expect("ip"));
}

#[test]
fn a_ttl_with_the_top_bit_set_is_zero() {
    let m = answer(vec![
        cname("www.test.", 0x8000_0001, "edge.test."),
        a("edge.test.", 300, "203.0.113.7"),
    ]);
    let got = attribution(&n("www.test."), &m).expect("attributed");
    assert_eq!(got.ttl, 0, "RFC 2181: the top bit set reads as zero");
    let m = answer(vec![a("api.test.", u32::MAX, "203.0.113.7")]);
    assert_eq!(attribution(&n("api.test."), &m).expect("attributed").ttl, 0);
    let m = answer(vec![a("api.test.", 0x7fff_ffff, "203.0.113.7")]);
    assert_eq!(
        attribution(&n("api.test."), &m).expect("attributed").ttl,
        0x7fff_ffff
    );
}

#[test]
fn an_ipv4_mapped_aaaa_binds_the_ipv4_address() {
    // A dual-stack socket connecting to `::ffff:a.b.c.d` leaves over IPv4:
    // the flow carries `a.b.c.d`, and so does the evidence (once, with the A).
    let m = answer(vec![
        aaaa("api.test.", 300, "::ffff:203.0.113.7"),
        a("api.test.", 300, "203.0.113.7"),
        aaaa("api.test.", 300, "64:ff9b::cb00:7107"),
    ]);
    let at = attribution(&n("api.test."), &m).expect("attribution");
    let want: Vec<IpAddr> = vec![
        "203.0.113.7".parse().expect("ip"),
        "64:ff9b::cb00:7107".parse().expect("ip"),
    ];
    assert_eq!(at.addrs, want, "NAT64 stays as written: flows carry it so");
}

/// An HTTPS (or SVCB) record of `owner` with `priority` (0: alias mode),
/// `target`, and the address hints given.
fn https(owner: &str, ttl: u32, (priority, target): (u16, &str), hints: &[&str]) -> Record {
    use hickory_proto::rr::rdata::svcb::{IpHint, SvcParamKey, SvcParamValue, SVCB};
    let (v4, v6): (Vec<IpAddr>, Vec<IpAddr>) = hints
        .iter()
        .map(|h| h.parse::<IpAddr>().expect(h))
        .partition(IpAddr::is_ipv4);
    let mut params = vec![(
        SvcParamKey::Alpn,
        SvcParamValue::Alpn(hickory_proto::rr::rdata::svcb::Alpn(vec!["h2".into()])),
    )];
    let a4 = v4.iter().filter_map(|ip| match ip {
        IpAddr::V4(v) => Some(A(*v)),
        IpAddr::V6(_) => None,
    });
    let a6 = v6.iter().filter_map(|ip| match ip {
        IpAddr::V6(v) => Some(AAAA(*v)),
        IpAddr::V4(_) => None,
    });
    if !v4.is_empty() {
        params.push((
            SvcParamKey::Ipv4Hint,
            SvcParamValue::Ipv4Hint(IpHint(a4.collect())),
        ));
    }
    if !v6.is_empty() {
        params.push((
            SvcParamKey::Ipv6Hint,
            SvcParamValue::Ipv6Hint(IpHint(a6.collect())),
        ));
    }
    let svcb = SVCB::new(priority, n(target), params);
    let data = RData::HTTPS(hickory_proto::rr::rdata::HTTPS(svcb));
    Record::from_rdata(n(owner), ttl, data)
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().expect(s)).collect()
}

/// A client that reads an HTTPS answer may connect to its address hints for
/// the name it asked, whichever target the record names: they bind as the
/// A/AAAA records would, with the record's TTL, and an IPv4-mapped hint as
/// its IPv4 address.
#[test]
fn the_address_hints_of_a_service_mode_record_bind_the_name() {
    let m = answer(vec![https(
        "api.test.",
        120,
        (1, "svc.cdn.test."),
        &["203.0.113.7", "2001:db8::7", "::ffff:203.0.113.8"],
    )]);
    let got = attribution(&n("API.test."), &m).expect("attributes");
    assert_eq!(names(&got), ["api.test"]);
    assert_eq!(
        got.addrs,
        ips(&["203.0.113.7", "2001:db8::7", "203.0.113.8"])
    );
    assert_eq!(got.ttl, 120);

    // Beside the name's A records, with the smaller TTL of those taken.
    let m = answer(vec![
        a("api.test.", 300, "203.0.113.7"),
        https("api.test.", 60, (1, "."), &["203.0.113.7", "203.0.113.9"]),
    ]);
    let got = attribution(&n("api.test."), &m).expect("attributes");
    assert_eq!(got.addrs, ips(&["203.0.113.7", "203.0.113.9"]));
    assert_eq!(got.ttl, 60);

    // At the end of a CNAME chain: every name on it.
    let m = answer(vec![
        cname("www.shop.test.", 300, "edge.cdn.test."),
        https("edge.cdn.test.", 300, (2, "."), &["198.51.100.9"]),
    ]);
    let got = attribution(&n("www.shop.test."), &m).expect("attributes");
    assert_eq!(names(&got), ["www.shop.test", "edge.cdn.test"]);
    assert_eq!(got.addrs, ips(&["198.51.100.9"]));
}

/// Hints bind only where an A record would: in a service-mode record owned
/// by the chain's last name, in the answer section. An alias-mode record's
/// parameters are to be ignored; a record of another name, of a name that
/// has a CNAME, or in the additional section binds nothing.
#[test]
fn hints_elsewhere_bind_nothing() {
    let alias = answer(vec![https(
        "api.test.",
        300,
        (0, "svc.cdn.test."),
        &["203.0.113.7"],
    )]);
    assert_eq!(attribution(&n("api.test."), &alias), None);

    let other = answer(vec![https("bank.test.", 300, (1, "."), &["203.0.113.66"])]);
    assert_eq!(attribution(&n("api.test."), &other), None);

    let beside_cname = answer(vec![
        cname("q.attacker.test.", 300, "allowed.test."),
        https("q.attacker.test.", 300, (1, "."), &["203.0.113.66"]),
        a("allowed.test.", 300, "203.0.113.7"),
    ]);
    let got = attribution(&n("q.attacker.test."), &beside_cname).expect("attributes");
    assert_eq!(got.addrs, ips(&["203.0.113.7"]));

    let mut additional = answer(Vec::new());
    additional.add_additional(https("api.test.", 300, (1, "."), &["203.0.113.7"]));
    assert_eq!(attribution(&n("api.test."), &additional), None);

    // No hints: nothing (the record's target is resolved by a query of its own).
    let bare = answer(vec![https("api.test.", 300, (1, "svc.cdn.test."), &[])]);
    assert_eq!(attribution(&n("api.test."), &bare), None);
}

/// Hints count toward the most addresses one answer gives, as A records do.
#[test]
fn hints_count_toward_max_addrs() {
    let hints: Vec<String> = (0..=super::MAX_ADDRS)
        .map(|i| format!("198.51.100.{i}"))
        .collect();
    let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
    let m = answer(vec![
        a("many.test.", 30, "203.0.113.1"),
        https("many.test.", 300, (1, "."), &hints),
    ]);
    let got = attribution(&n("many.test."), &m).expect("attributes");
    assert_eq!(got.addrs.len(), super::MAX_ADDRS);
    assert_eq!(got.addrs[0], "203.0.113.1".parse::<IpAddr>().expect("ip"));
    assert_eq!(got.ttl, 30);
}
