use std::net::{Ipv4Addr, Ipv6Addr};

use hickory_proto::op::{Message, MessageType, OpCode, Query};
use hickory_proto::rr::rdata::svcb::{
    Alpn, EchConfigList, IpHint, Mandatory, SvcParamKey, SvcParamValue, Unknown, SVCB,
};
use hickory_proto::rr::rdata::{A, AAAA, HTTPS};
use hickory_proto::rr::{Name, RData, Record, RecordType};

use super::*;

fn name(s: &str) -> Name {
    Name::from_ascii(s).expect(s)
}

const ECH: &[u8] = b"\x00\x45\xfe\x0d\x00\x41an-ech-config-list";

/// Every kind of parameter hickory knows, and an unknown one, in key order.
fn params(ech: bool, mandatory: Vec<SvcParamKey>) -> Vec<(SvcParamKey, SvcParamValue)> {
    let mut p = Vec::new();
    if !mandatory.is_empty() {
        p.push((
            SvcParamKey::Mandatory,
            SvcParamValue::Mandatory(Mandatory(mandatory)),
        ));
    }
    p.push((
        SvcParamKey::Alpn,
        SvcParamValue::Alpn(Alpn(vec!["h2".into(), "h3".into()])),
    ));
    p.push((SvcParamKey::Port, SvcParamValue::Port(8443)));
    p.push((
        SvcParamKey::Ipv4Hint,
        SvcParamValue::Ipv4Hint(IpHint(vec![A(Ipv4Addr::new(192, 0, 2, 1))])),
    ));
    if ech {
        p.push((
            SvcParamKey::EchConfigList,
            SvcParamValue::EchConfigList(EchConfigList(ECH.to_vec())),
        ));
    }
    p.push((
        SvcParamKey::Ipv6Hint,
        SvcParamValue::Ipv6Hint(IpHint(vec![AAAA(Ipv6Addr::new(
            0x2001, 0xdb8, 0, 0, 0, 0, 0, 1,
        ))])),
    ));
    p.push((
        SvcParamKey::Unknown(65000),
        SvcParamValue::Unknown(Unknown(b"opaque".to_vec())),
    ));
    p
}

fn https(owner: &str, params: Vec<(SvcParamKey, SvcParamValue)>) -> Record {
    Record::from_rdata(
        name(owner),
        300,
        RData::HTTPS(HTTPS(SVCB::new(1, name("."), params))),
    )
}

fn answer(records: Vec<Record>) -> Message {
    let mut m = Message::new(0x1234, MessageType::Response, OpCode::Query);
    m.add_query(Query::query(name("www.example.test."), RecordType::HTTPS));
    for r in records {
        m.add_answer(r);
    }
    m
}

/// What hickory reads from the wire: the proxy strips parsed answers.
fn wire(m: &Message) -> Message {
    Message::from_vec(&m.to_vec().expect("encode")).expect("parse")
}

#[test]
fn without_ech_nothing_is_rewritten() {
    let m = wire(&answer(vec![
        https("www.example.test.", params(false, vec![SvcParamKey::Alpn])),
        Record::from_rdata(
            name("www.example.test."),
            60,
            RData::A(A::new(203, 0, 113, 7)),
        ),
    ]));
    assert!(!has_ech(&m));
    assert_eq!(
        strip_ech(&m).expect("fine"),
        None,
        "the bytes pass as they are"
    );
}

#[test]
fn ech_goes_and_every_other_parameter_stays() {
    let m = wire(&answer(vec![
        https(
            "www.example.test.",
            params(true, vec![SvcParamKey::Alpn, SvcParamKey::EchConfigList]),
        ),
        Record::from_rdata(
            name("www.example.test."),
            60,
            RData::A(A::new(203, 0, 113, 7)),
        ),
    ]));
    assert!(has_ech(&m));
    let s = strip_ech(&m).expect("rewritable").expect("rewritten");
    assert_eq!(s.removed, 1);
    let got = Message::from_vec(&s.bytes).expect("the sandbox can parse it");
    assert_eq!(got, s.message);
    assert!(!has_ech(&got));
    let want = wire(&answer(vec![
        https("www.example.test.", params(false, vec![SvcParamKey::Alpn])),
        Record::from_rdata(
            name("www.example.test."),
            60,
            RData::A(A::new(203, 0, 113, 7)),
        ),
    ]));
    assert_eq!(got, want, "the original minus ech, nothing else changed");
    assert_eq!(got.metadata.id, 0x1234);
}

#[test]
fn a_mandatory_list_of_ech_alone_goes_with_it() {
    let m = wire(&answer(vec![https(
        "www.example.test.",
        params(true, vec![SvcParamKey::EchConfigList]),
    )]));
    let s = strip_ech(&m).expect("rewritable").expect("rewritten");
    let RData::HTTPS(h) = &s.message.answers[0].data else {
        panic!("still an HTTPS record: {:?}", s.message.answers[0]);
    };
    assert_eq!(h.0.svc_params, params(false, vec![]));
}

#[test]
fn svcb_records_in_every_section_are_stripped() {
    let svcb = |owner: &str| {
        Record::from_rdata(
            name(owner),
            300,
            RData::SVCB(SVCB::new(
                2,
                name("svc.example.test."),
                params(true, vec![]),
            )),
        )
    };
    let mut m = answer(vec![svcb("_dns.example.test.")]);
    m.add_authority(svcb("a.example.test."));
    m.add_additional(svcb("b.example.test."));
    let m = wire(&m);
    let s = strip_ech(&m).expect("rewritable").expect("rewritten");
    assert_eq!(s.removed, 3);
    assert!(!has_ech(&s.message));
    for r in s
        .message
        .answers
        .iter()
        .chain(&s.message.authorities)
        .chain(&s.message.additionals)
    {
        let RData::SVCB(svcb) = &r.data else {
            panic!("{r:?}");
        };
        assert_eq!(svcb.svc_params, params(false, vec![]));
        assert_eq!(svcb.target_name, name("svc.example.test."));
    }
}

/// A hand-encoded answer (not hickory's encoder): the rewritten RDATA is the
/// original's, byte for byte, with the `ech` parameter cut out.
#[test]
fn hand_encoded_answer_loses_exactly_the_ech_bytes() {
    let alpn: &[u8] = b"\x00\x01\x00\x03\x02h2";
    let ipv4hint: &[u8] = b"\x00\x04\x00\x04\xc0\x00\x02\x01";
    let ech: &[u8] = b"\x00\x05\x00\x04\xde\xad\xbe\xef";
    let unknown: &[u8] = b"\xfd\xe8\x00\x02hi";
    let rdata = |with_ech: bool| {
        let mut r = b"\x00\x01\x00".to_vec(); // priority 1, target "."
        r.extend_from_slice(alpn);
        r.extend_from_slice(ipv4hint);
        if with_ech {
            r.extend_from_slice(ech);
        }
        r.extend_from_slice(unknown);
        let mut rr = u16::try_from(r.len())
            .expect("short")
            .to_be_bytes()
            .to_vec();
        rr.extend_from_slice(&r);
        rr
    };
    let mut msg = b"\xab\xcd\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00".to_vec();
    msg.extend_from_slice(b"\x03www\x07example\x04test\x00\x00\x41\x00\x01");
    msg.extend_from_slice(b"\xc0\x0c\x00\x41\x00\x01\x00\x00\x01\x2c");
    msg.extend_from_slice(&rdata(true));
    let parsed = Message::from_vec(&msg).expect("hand-encoded answer parses");
    let s = strip_ech(&parsed).expect("rewritable").expect("rewritten");
    let want = rdata(false);
    assert!(
        s.bytes.windows(want.len()).any(|w| w == want.as_slice()),
        "{:02x?} lacks {want:02x?}",
        s.bytes
    );
    assert!(
        !s.bytes.windows(ech.len()).any(|w| w == ech),
        "the ech parameter is gone"
    );
    assert_eq!(s.bytes.len(), msg.len() - ech.len());
}
