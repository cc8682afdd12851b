//! `egress_machine::nflog::messages` — the reader of the NFLOG
//! group's datagrams, bytes from the kernel — and
//! `egress_machine::counters::messages` — the reader of the counter dump —
//! on arbitrary bytes.
//!
//! Properties:
//!
//! - neither panics, and each yields at most one result per 16 bytes (a
//!   netlink header each), so a datagram cannot make it loop;
//! - every packet accepted names a valid VM id, with a prefix that reads
//!   back the same, and a TCP or UDP destination;
//! - the counter reader reads the same bytes the same way twice.
#![no_main]

use egress_machine::{counters, nflog, valid_id};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let all = nflog::messages(input);
    assert!(all.len() <= input.len() / 16 + 1, "{} results", all.len());
    for m in all {
        if let Ok(nflog::Message::Packet(e)) = m {
            assert!(valid_id(&e.vm).is_ok(), "{:?}", e.vm);
            let prefix = format!("{} {} {}\0", nflog::PREFIX, e.outcome.letter(), e.vm);
            assert_eq!(
                nflog::parse_prefix(prefix.as_bytes()),
                Ok((e.vm.clone(), e.outcome))
            );
        }
    }
    let dump = counters::messages(input);
    assert!(dump.len() <= input.len() / 16 + 1, "{} parts", dump.len());
    assert_eq!(dump, counters::messages(input), "not deterministic");
});
