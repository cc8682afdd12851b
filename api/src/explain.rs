//! The gateway admin API's explain question (`POST /v1/explain`), read
//! once: the admin route, the `egress-gateway policy explain` command and
//! the fuzz targets all read it here, so they refuse the same questions
//! with the same words.

use std::net::SocketAddr;

use egress_policy::{Hostname, StreamProtocol};
use serde::{Deserialize, Serialize};

/// `POST /v1/explain`'s body: the claims of a flow, as a sandbox would
/// present them, and optionally one request on it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Explain {
    pub sandbox: String,
    pub dst: SocketAddr,
    #[serde(default)]
    pub tls: bool,
    /// The ClientHello carries `encrypted_client_hello` (`sni` is then its outer name).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ech: bool,
    #[serde(default)]
    pub sni: Option<String>,
    #[serde(default)]
    pub host: Option<String>,
    /// The protocol of a stream that is neither TLS nor HTTP (no `tls`, no
    /// `host`), as the peek names it: `ssh`. Absent: unreadable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamProtocol>,
    /// A request on the flow, judged by the per-request rules: its method…
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// …and its target (`/path?query`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// The question's claims as the dataplane reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    /// The server name: `None` when absent or an IP literal (no name).
    pub sni: Option<Hostname>,
    pub host: Option<Hostname>,
    /// The `Host` is an address (`203.0.113.7`, `[2001:db8::1]`): HTTP
    /// with no name, as the dataplane reads such a request (`host` is then
    /// `None`).
    pub address_host: bool,
    /// The request asked about: `(method, target)`.
    pub request: Option<(String, String)>,
}

/// Why a question cannot be asked: the field to blame and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unasked {
    pub field: &'static str,
    pub message: String,
}

impl Explain {
    /// Reads the claims the way the dataplane reads them: a server name the
    /// peek refuses is refused, a `Host` must be a hostname, and a request
    /// needs both a valid method and a path.
    pub fn question(&self) -> Result<Question, Unasked> {
        let sni = match self
            .sni
            .as_deref()
            .map(|s| (s, egress_policy::server_name(s)))
        {
            None => None,
            Some((_, Ok(sni))) => sni,
            Some((s, Err(e))) => {
                let message = format!(
                    "invalid sni {s:?}: {e} (the gateway resets such a ClientHello: malformed_client_hello)"
                );
                return Err(Unasked {
                    field: "sni",
                    message,
                });
            }
        };
        let address = |h: &str| {
            let bare = h.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
            bare.unwrap_or(h).parse::<std::net::IpAddr>().is_ok()
        };
        let address_host = self.host.as_deref().is_some_and(address);
        let host = match self.host.as_deref().map(|h| (h, Hostname::parse(h))) {
            None => None,
            Some((_, Ok(h))) => Some(h),
            Some((h, Err(_))) if address(h) => None,
            Some((h, Err(e))) => {
                let message = format!("invalid host {h:?}: {e}");
                return Err(Unasked {
                    field: "host",
                    message,
                });
            }
        };
        let request = self.request()?;
        Ok(Question {
            sni,
            host,
            address_host,
            request,
        })
    }

    /// The request asked about: `method` and `path` together, or neither.
    fn request(&self) -> Result<Option<(String, String)>, Unasked> {
        match (&self.method, &self.path) {
            (None, None) => Ok(None),
            (Some(m), Some(p)) if http::Method::from_bytes(m.as_bytes()).is_ok() => {
                Ok(Some((m.clone(), p.clone())))
            }
            (Some(m), Some(_)) => Err(Unasked {
                field: "method",
                message: format!("invalid method {m:?}"),
            }),
            (Some(_), None) | (None, Some(_)) => Err(Unasked {
                field: if self.method.is_some() {
                    "path"
                } else {
                    "method"
                },
                message: "a request needs both method and path".into(),
            }),
        }
    }

    /// The question in normal form: each claim as the dataplane reads it,
    /// and only the claims that apply (a ClientHello alone carries ECH; only
    /// a stream that is neither TLS nor HTTP is named).
    pub fn normal(&self, q: &Question) -> Self {
        Self {
            sandbox: self.sandbox.clone(),
            dst: self.dst,
            tls: self.tls,
            ech: self.tls && self.ech,
            sni: q.sni.as_ref().map(ToString::to_string),
            host: q.host.as_ref().map(ToString::to_string),
            stream: self.stream.filter(|_| !self.tls && q.host.is_none()),
            method: self.method.clone(),
            path: self.path.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(v: serde_json::Value) -> Result<Question, Unasked> {
        let e: Explain = serde_json::from_value(v).expect("an explain body");
        e.question()
    }

    #[test]
    fn claims_are_read_as_the_dataplane_reads_them() {
        let q = asked(serde_json::json!({
            "sandbox": "a", "dst": "198.51.100.7:443", "tls": true,
            "sni": "198.51.100.7", "host": "A.test.", "method": "GET", "path": "/x"
        }))
        .expect("a question");
        assert_eq!(q.sni, None, "an IP literal is no server name");
        assert_eq!(q.host.map(|h| h.to_string()).as_deref(), Some("a.test"));
        assert_eq!(q.request, Some(("GET".into(), "/x".into())));
    }

    #[test]
    fn each_refusal_names_its_field() {
        let base = serde_json::json!({"sandbox": "a", "dst": "198.51.100.7:443"});
        let with = |k: &str, v: &str| {
            let mut b = base.clone();
            b[k] = serde_json::json!(v);
            b
        };
        let field = |v| asked(v).err().map(|u| u.field);
        assert_eq!(field(with("sni", "a\u{0}b.test")), Some("sni"));
        assert_eq!(field(with("host", "a b")), Some("host"));
        assert_eq!(field(with("method", "GET")), Some("path"));
        assert_eq!(field(with("path", "/")), Some("method"));
        let mut bad_method = with("method", "G T");
        bad_method["path"] = serde_json::json!("/");
        assert_eq!(field(bad_method), Some("method"));
        let refused = asked(with("sni", "a\u{0}b.test")).expect_err("refused");
        assert!(
            refused.message.contains("malformed_client_hello"),
            "{refused:?}"
        );
    }
}
