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
}

/// A resync's ids: each a valid sandbox id, none twice; else the message
/// and the field (`sandboxes[i].id`).
pub fn resync_ids(docs: &[SandboxDoc]) -> Result<(), (String, String)> {
    let mut seen = std::collections::HashSet::new();
    for (i, s) in docs.iter().enumerate() {
        let field = format!("sandboxes[{i}].id");
        egress_policy::SandboxId::parse(&s.id).map_err(|e| (e.to_string(), field.clone()))?;
        if !seen.insert(s.id.as_str()) {
            return Err((format!("sandbox {:?} appears twice", s.id), field));
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
