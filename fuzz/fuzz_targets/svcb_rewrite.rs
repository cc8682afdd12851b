//! The SVCB/HTTPS rewriter: `dns_attrib::strip_ech` on upstream answers.
//!
//! Input, byte 0 chooses:
//!
//! - bit 7 clear — raw: the rest is one DNS message, parsed with
//!   `Message::from_vec` as the proxy parses an upstream reply.
//! - bit 7 set — built: the rest is read with `arbitrary` into SVCB/HTTPS
//!   records (priority, a target from a small pool, parameters as raw
//!   key/value pairs, ech among them or not, in any section), hand-encoded
//!   into an answer and parsed; answers hickory refuses are skipped, as the
//!   proxy treats them as a failed upstream.
//!
//! Properties (the round trip):
//!
//! - no record carries key 5 ⇔ `strip_ech` answers `Ok(None)` (the proxy
//!   passes the bytes as they came);
//! - `Ok(Some(s))`: `s.bytes` parses, equals `s.message`, and equals the
//!   model: the original with key 5 removed from every SVCB/HTTPS record
//!   that had it, key 5 removed from those records' `mandatory` list, and
//!   an emptied `mandatory` dropped; nothing else differs; no record of it
//!   carries key 5; `s.removed` counts the records that had it;
//! - `Err(_)` only for an answer that carried key 5 (the proxy answers
//!   SERVFAIL: the `ech` does not pass).
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use dns_attrib::strip_ech;
use hickory_proto::op::Message;
use hickory_proto::rr::rdata::svcb::{SvcParamValue, SVCB};
use hickory_proto::rr::{RData, Record};
use libfuzzer_sys::fuzz_target;

const ECH: u16 = 5;
const MANDATORY: u16 = 0;

const TARGETS: &[&[u8]] = &[b"\x00", b"\x03svc\x07example\x04test\x00", b"\xc0\x0c"];

#[derive(Arbitrary, Debug)]
struct Rr {
    https: bool,
    /// 0 answer, 1 authority, 2 additional.
    section: u8,
    priority: u16,
    target: u8,
    params: Vec<(u16, Vec<u8>)>,
    with_ech: Option<Vec<u8>>,
}

fn svcb_mut(r: &mut Record) -> Option<&mut SVCB> {
    match &mut r.data {
        RData::SVCB(s) => Some(s),
        RData::HTTPS(h) => Some(&mut h.0),
        _ => None,
    }
}

fn records_mut(m: &mut Message) -> impl Iterator<Item = &mut Record> {
    m.answers
        .iter_mut()
        .chain(m.authorities.iter_mut())
        .chain(m.additionals.iter_mut())
}

fn has_key5(s: &SVCB) -> bool {
    s.svc_params.iter().any(|(k, _)| u16::from(*k) == ECH)
}

/// The original minus `ech` (see the module docs), and how many records had it.
fn model(original: &Message) -> (Message, usize) {
    let mut m = original.clone();
    let mut n = 0;
    for r in records_mut(&mut m) {
        let Some(s) = svcb_mut(r) else { continue };
        if !has_key5(s) {
            continue;
        }
        n += 1;
        s.svc_params.retain(|(k, _)| u16::from(*k) != ECH);
        for (k, v) in &mut s.svc_params {
            if u16::from(*k) == MANDATORY {
                if let SvcParamValue::Mandatory(list) = v {
                    list.0.retain(|k| u16::from(*k) != ECH);
                }
            }
        }
        s.svc_params
            .retain(|(_, v)| !matches!(v, SvcParamValue::Mandatory(list) if list.0.is_empty()));
    }
    (m, n)
}

fn check(original: &Message) {
    let (want, with_ech) = model(original);
    match strip_ech(original) {
        Ok(None) => assert_eq!(with_ech, 0, "an ech was left in place"),
        Ok(Some(s)) => {
            assert!(with_ech > 0, "rewrote an answer without ech");
            assert_eq!(s.removed, with_ech);
            let got = Message::from_vec(&s.bytes).expect("what is left parses");
            assert_eq!(got, s.message);
            assert_eq!(got, want, "not the original minus ech");
            let mut got = got;
            assert!(
                records_mut(&mut got).all(|r| svcb_mut(r).is_none_or(|s| !has_key5(s))),
                "ech survived"
            );
        }
        Err(e) => assert!(with_ech > 0, "refused an answer without ech: {e}"),
    }
}

/// Hand-encodes an answer to `www.example.test HTTPS` holding `rrs`.
fn encode(rrs: &[Rr]) -> Vec<u8> {
    let mut sections: [Vec<u8>; 3] = Default::default();
    let mut counts = [0u16; 3];
    for rr in rrs.iter().take(8) {
        let mut rdata = rr.priority.to_be_bytes().to_vec();
        rdata.extend_from_slice(TARGETS[usize::from(rr.target) % TARGETS.len()]);
        let mut params: Vec<(u16, &[u8])> = rr
            .params
            .iter()
            .take(8)
            .map(|(k, v)| (*k, v.as_slice()))
            .collect();
        if let Some(ech) = &rr.with_ech {
            params.push((ECH, ech));
        }
        params.sort_by_key(|(k, _)| *k);
        params.dedup_by_key(|(k, _)| *k);
        for (k, v) in params {
            let Ok(len) = u16::try_from(v.len()) else {
                continue;
            };
            rdata.extend_from_slice(&k.to_be_bytes());
            rdata.extend_from_slice(&len.to_be_bytes());
            rdata.extend_from_slice(v);
        }
        let Ok(rdlen) = u16::try_from(rdata.len()) else {
            continue;
        };
        let i = usize::from(rr.section % 3);
        let rtype: u16 = if rr.https { 65 } else { 64 };
        sections[i].extend_from_slice(b"\xc0\x0c");
        sections[i].extend_from_slice(&rtype.to_be_bytes());
        sections[i].extend_from_slice(b"\x00\x01\x00\x00\x01\x2c");
        sections[i].extend_from_slice(&rdlen.to_be_bytes());
        sections[i].extend_from_slice(&rdata);
        counts[i] += 1;
    }
    let mut msg = b"\x12\x34\x81\x80\x00\x01".to_vec();
    for c in counts {
        msg.extend_from_slice(&c.to_be_bytes());
    }
    msg.extend_from_slice(b"\x03www\x07example\x04test\x00\x00\x41\x00\x01");
    for s in sections {
        msg.extend_from_slice(&s);
    }
    msg
}

fuzz_target!(|input: &[u8]| {
    let Some((&mode, rest)) = input.split_first() else {
        return;
    };
    let wire = if mode & 0x80 == 0 {
        rest.to_vec()
    } else {
        let Ok(rrs) = Unstructured::new(rest).arbitrary::<Vec<Rr>>() else {
            return;
        };
        encode(&rrs)
    };
    if let Ok(original) = Message::from_vec(&wire) {
        check(&original);
    }
});
