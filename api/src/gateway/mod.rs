//! The gateway's admin API: its routes and the documents they carry. The
//! gateway serves them; the controller's push client and the fuzz targets
//! write and read the same types.
//!
//! | route | body |
//! | --- | --- |
//! | `PUT /v1/sandboxes/{id}` | [`PutSandbox`] |
//! | `PUT /v1/sandboxes` | [`Resync`], or NDJSON: one [`SandboxDoc`] per line |
//! | `GET`/`DELETE /v1/sandboxes/{id}`, `GET /v1/sandboxes` | |
//! | `POST /v1/explain` | [`crate::explain::Explain`] |
//! | `PUT /v1/sandboxes/{id}/shadow` | [`PutShadow`] |
//! | `GET /v1/sandboxes/{id}/proposals`, `…/attribution`, `…/shadow/report` | |

pub mod credentials;
pub mod proxy;

use std::net::IpAddr;

use egress_policy::Policy;
use serde::{Deserialize, Serialize};

use credentials::Credential;
use proxy::ProxyChoice;

/// Every sandbox: `GET` lists, `PUT` replaces them all (a resync).
pub const SANDBOXES: &str = "/v1/sandboxes";
/// The explain route.
pub const EXPLAIN: &str = "/v1/explain";
/// The content type of a streamed resync: one [`SandboxDoc`] per line.
pub const NDJSON: &str = "application/x-ndjson";

/// One sandbox's route (`GET`, `PUT`, `DELETE`).
pub fn sandbox(id: &str) -> String {
    format!("{SANDBOXES}/{id}")
}

/// A route under one sandbox: `proposals`, `attribution`, `shadow`, `shadow/report`.
pub fn sandbox_sub(id: &str, sub: &str) -> String {
    format!("{SANDBOXES}/{id}/{sub}")
}

/// `PUT /v1/sandboxes/{id}`'s body.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PutSandbox {
    pub addresses: Vec<IpAddr>,
    pub policy: Policy,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub credentials: Vec<Credential>,
    /// `"direct"` or a proxy of the gateway's `[upstream_proxy.proxies]`;
    /// absent: the worker's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_proxy: Option<ProxyChoice>,
    /// The writer's revision of the sandbox (the controller's generation
    /// of it): a push below the revision the gateway holds for the
    /// sandbox, or for its delete, is refused `409` (`"field": "revision"`),
    /// nothing applied. Absent: not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
}

/// The query parameter of `DELETE /v1/sandboxes/{id}` that names the
/// writer's revision of the delete ([`PutSandbox::revision`]).
pub const REVISION: &str = "revision";

/// A sandbox's addresses: none that cannot name one sandbox's traffic.
/// The unspecified address and multicast ones are no source; a link-local
/// one (`fe80::/10`, `169.254.0.0/16`) is the same address on every
/// interface, so a sandbox on another link could send from it. Mapped
/// IPv4 forms are read as IPv4.
pub fn sandbox_addresses(addresses: &[IpAddr]) -> Result<(), String> {
    for a in addresses {
        let why = match a.to_canonical() {
            IpAddr::V4(v4) if v4.is_unspecified() || v4.is_broadcast() => "no source address",
            IpAddr::V4(v4) if v4.is_multicast() => "a multicast address",
            IpAddr::V4(v4) if v4.is_link_local() => "link-local: the same address on every link",
            IpAddr::V6(v6) if v6.is_unspecified() => "no source address",
            IpAddr::V6(v6) if v6.is_multicast() => "a multicast address",
            IpAddr::V6(v6) if v6.is_unicast_link_local() => {
                "link-local: the same address on every link"
            }
            _ => continue,
        };
        return Err(format!(
            "{a}: {why}; a sandbox needs an address no other link can send from"
        ));
    }
    Ok(())
}

/// A resync's ids: each a valid sandbox id, none twice; else the index of
/// the first bad one and the message.
pub fn resync_ids(docs: &[SandboxDoc]) -> Result<(), (usize, String)> {
    let mut seen = std::collections::HashSet::new();
    for (i, s) in docs.iter().enumerate() {
        egress_policy::SandboxId::parse(&s.id).map_err(|e| (i, e.to_string()))?;
        if !seen.insert(s.id.as_str()) {
            return Err((i, format!("sandbox {:?} appears twice", s.id)));
        }
    }
    Ok(())
}

/// `PUT /v1/sandboxes`'s JSON body.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Resync {
    pub sandboxes: Vec<SandboxDoc>,
}

/// One sandbox as pushed in a resync, listed, and persisted by the gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxDoc {
    pub id: String,
    pub addresses: Vec<IpAddr>,
    pub policy: Policy,
    /// Host-bound credentials: references to where the gateway reads each
    /// value, never a value.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub credentials: Vec<Credential>,
    /// Its own way out: `"direct"` or a configured proxy's name; absent:
    /// the worker's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_proxy: Option<ProxyChoice>,
    /// A candidate policy judged beside `policy` (`PUT …/shadow`); kept by
    /// a push that does not name one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shadow: Option<Box<ShadowDoc>>,
    /// The writer's revision of the sandbox ([`PutSandbox::revision`]):
    /// what a resync sets and a push is checked against; listed, but never
    /// written to the gateway's state directory (a build before revisions
    /// could not read it back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<u64>,
}

/// A shadow as pushed and persisted: the candidate and since when.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShadowDoc {
    pub policy: Policy,
    pub since: String,
    /// RFC 3339: when a push last changed the sandbox's policy under the
    /// shadow. Its report counts from then, and it is not promoted (put it
    /// again over the new policy first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_changed: Option<String>,
}

/// `PUT /v1/sandboxes/{id}/shadow`'s body.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PutShadow {
    pub policy: Policy,
}

#[cfg(test)]
mod tests {
    use super::sandbox_addresses;

    #[test]
    fn an_address_any_link_could_send_from_is_no_sandbox_address() {
        let check = |a: &str| sandbox_addresses(&[a.parse().expect(a)]);
        for ok in ["100.64.1.2", "2001:db8::7", "fd00::1", "127.0.0.2"] {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
        for bad in [
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "169.254.1.1",
            "::",
            "ff02::1",
            "fe80::a",
            "::ffff:169.254.1.1",
        ] {
            let e = check(bad).expect_err(bad);
            assert!(e.starts_with(bad), "{e}");
        }
    }
}
