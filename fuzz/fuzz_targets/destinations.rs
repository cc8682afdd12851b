//! Destination values and names: `Destination::parse` for every kind,
//! `Hostname::parse`, `WildcardDomain::parse`, and the peek's reading of a
//! server name (`authority::server_name`). Every parser reads the same text
//! (the whole input, UTF-8).
//!
//! Properties: whatever parses is in normal form — parse(normalise(x)) ==
//! x and normalising again changes nothing (normalise = `value()` or
//! `to_string()`); the JSON form `{"<kind>": "<value>"}` reads back equal;
//! an IPv4-mapped address or mapped range is held as IPv4; a hostname is
//! lower-case, without the trailing dot, at most 253 characters, never an IP
//! literal; a wildcard never matches its apex and matches one label in
//! front of it; `server_name` answers `None` exactly for IP literals and
//! otherwise agrees with `Hostname::parse`.
#![no_main]

use std::net::IpAddr;

use egress_gateway::authority;
use egress_policy::{Destination, Hostname, Kind, WildcardDomain};
use libfuzzer_sys::fuzz_target;

const KINDS: [Kind; 4] = [Kind::Ip, Kind::Cidr, Kind::Domain, Kind::WildcardDomain];

fn destination(kind: Kind, s: &str) {
    let Ok(d) = Destination::parse(kind, s) else {
        return;
    };
    assert_eq!(d.kind(), kind);
    let value = d.value();
    assert_eq!(
        Destination::parse(kind, &value).as_ref(),
        Ok(&d),
        "{kind} {s:?} → {value:?}"
    );
    assert_eq!(d.to_string(), format!("{kind} {value}"));
    let json = serde_json::to_string(&d).expect("serialises");
    let back: Destination = egress_policy::from_json(&json)
        .unwrap_or_else(|e| panic!("{json} does not read back: {e}"));
    assert_eq!(back, d, "{json}");
    match &d {
        Destination::Ip(IpAddr::V6(v6)) => {
            assert!(v6.to_ipv4_mapped().is_none(), "{s:?} held as mapped {v6}")
        }
        Destination::Cidr(ipnet::IpNet::V6(net)) if net.prefix_len() >= 96 => assert!(
            net.network().to_ipv4_mapped().is_none(),
            "{s:?} held as the mapped range {net}"
        ),
        Destination::Domain(h) => assert_eq!(Hostname::parse(s).as_ref(), Ok(h)),
        Destination::WildcardDomain(w) => assert_eq!(WildcardDomain::parse(s).as_ref(), Ok(w)),
        _ => {}
    }
}

fn hostname(s: &str) {
    let is_ip = s.parse::<IpAddr>().is_ok();
    let Ok(h) = Hostname::parse(s) else {
        return;
    };
    assert!(!is_ip, "IP literal {s:?} parsed as hostname {h}");
    let text = h.as_str();
    assert_eq!(Hostname::parse(text).as_ref(), Ok(&h), "{s:?} → {text:?}");
    assert_eq!(text, h.to_string());
    assert!(!text.ends_with('.') && text.len() <= 253, "{text:?}");
    assert!(!text.bytes().any(|b| b.is_ascii_uppercase()), "{text:?}");
    assert!(text.parse::<IpAddr>().is_err(), "{text:?} is an IP literal");
    assert!(
        s.trim_end_matches('.').eq_ignore_ascii_case(text) && s.len() - text.len() <= 1,
        "{s:?} → {text:?}: more than case and one trailing dot changed"
    );
}

fn wildcard(s: &str) {
    let Ok(w) = WildcardDomain::parse(s) else {
        return;
    };
    let text = w.to_string();
    assert_eq!(
        WildcardDomain::parse(&text).as_ref(),
        Ok(&w),
        "{s:?} → {text:?}"
    );
    assert_eq!(text, format!("*.{}", w.suffix()));
    assert!(!w.matches(w.suffix()), "{w} matches its apex");
    if let Ok(sub) = Hostname::parse(&format!("x.{}", w.suffix())) {
        assert!(w.matches(&sub), "{w} does not match {sub}");
    }
}

fn server_name(s: &str) {
    let is_ip = s.parse::<IpAddr>().is_ok();
    match authority::server_name(s) {
        Ok(None) => assert!(is_ip, "{s:?} read as an IP literal"),
        Ok(Some(h)) => {
            assert!(!is_ip, "IP literal {s:?} read as {h}");
            assert_eq!(Hostname::parse(s).as_ref(), Ok(&h));
            assert_eq!(
                authority::server_name(h.as_str()).as_ref(),
                Ok(&Some(h.clone()))
            );
        }
        Err(e) => {
            assert!(!is_ip, "IP literal {s:?} refused: {e}");
            assert_eq!(Hostname::parse(s).err(), Some(e));
        }
    }
}

fuzz_target!(|input: &[u8]| {
    let Ok(s) = std::str::from_utf8(input) else {
        return;
    };
    for kind in KINDS {
        destination(kind, s);
    }
    hostname(s);
    wildcard(s);
    server_name(s);
});
