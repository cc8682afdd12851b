//! The admin API's request bodies, read as the admin reads them
//! (`egress_fuzz_harness::admin_body`).
//!
//! Input: `[route][body…]`; the route byte picks (mod 6) PUT sandbox,
//! resync (JSON), resync (NDJSON), explain, machine egress policy, VM
//! registration.
//!
//! Properties: reading is deterministic; an accepted body's normal form
//! (what the admin stores and answers with) is accepted by the same route
//! and is its own normal form.
#![no_main]

use egress_fuzz_harness::{admin_body, Route};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((&route, body)) = input.split_first() else {
        return;
    };
    let route = Route::from_byte(route);
    let first = admin_body(route, body);
    assert_eq!(
        first,
        admin_body(route, body),
        "{route:?}: not deterministic"
    );
    let Ok(normal) = first else { return };
    assert_eq!(
        admin_body(route, normal.as_bytes()).as_ref(),
        Ok(&normal),
        "{route:?}: the normal form is not stable"
    );
});
