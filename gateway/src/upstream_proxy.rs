//! The operator's HTTP CONNECT proxy: the way out of a worker that may not
//! reach the internet itself (`[upstream_proxy]`, worker-wide or per
//! sandbox).
//!
//! The proxy is a pipe, never a judge. Policy is decided on the original
//! destination exactly as without it; only then does the gateway ask the
//! proxy for `CONNECT <original-dst-ip>:<port>` — the address it decided on,
//! never a name the proxy would resolve on its own — and, on a `2xx`, uses
//! the stream as it would a direct TCP connection (TLS to the origin, the
//! splice, the kernel's sockmap: it is an ordinary socket). A proxy that
//! refuses, closes or stays silent fails the flow; nothing falls back to a
//! direct connection.
//!
//! The response head is read without taking one byte past its end (`peek`,
//! then a read of exactly what belongs to the head), so a server-first
//! origin's first bytes, arriving right behind the `200`, reach the sandbox
//! intact. The head is capped at [`MAX_HEAD`] and, with the connect to the
//! proxy, bounded by `timeouts.connect`.
//!
//! Proxy passwords are read from `password_file` at start and on SIGHUP
//! (like credential values) and never shown: [`Proxy`] has no `Debug` that
//! would print one.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub use egress_api::gateway::proxy::{ProxyChoice, ProxyName, DIRECT};

/// Largest response head read from a proxy (a `200` is a few dozen bytes).
const MAX_HEAD: usize = 8 * 1024;
/// Largest password file read.
const MAX_PASSWORD: u64 = 4 * 1024;

// === configuration ===

/// `[upstream_proxy]`: the proxies a worker may use, and its default.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamProxyConfig {
    /// The proxy every sandbox uses unless its registration says otherwise;
    /// unset: direct.
    pub default: Option<String>,
    /// Proxies by name (`[upstream_proxy.proxies.<name>]`).
    pub proxies: BTreeMap<String, ProxyConfig>,
}

/// One proxy.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// `IP:port`: an address, so reaching the proxy resolves nothing.
    pub address: SocketAddr,
    /// With `password_file`: `Proxy-Authorization: Basic`.
    #[serde(default)]
    pub username: Option<String>,
    /// The password, read at start and on SIGHUP; a trailing newline is dropped.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
}

impl UpstreamProxyConfig {
    /// The first key whose value is refused, and why.
    pub(crate) fn first_invalid(&self) -> Option<(&'static str, String)> {
        for (name, p) in &self.proxies {
            if let Err(why) = ProxyName::parse(name) {
                return Some(("upstream_proxy.proxies", why));
            }
            if let Some(user) = &p.username {
                if user.is_empty() || user.contains(':') || user.chars().any(char::is_control) {
                    let why = format!(
                        "{name}: username {user:?} is empty or holds ':' or a control character"
                    );
                    return Some(("upstream_proxy.proxies", why));
                }
            }
            if p.password_file.is_some() && p.username.is_none() {
                let why = format!("{name}: password_file needs a username");
                return Some(("upstream_proxy.proxies", why));
            }
            if p.address.port() == 0 || p.address.ip().is_unspecified() {
                let why = format!("{name}: address {} is not one to connect to", p.address);
                return Some(("upstream_proxy.proxies", why));
            }
        }
        match &self.default {
            Some(d) if !self.proxies.contains_key(d) => Some((
                "upstream_proxy.default",
                format!("{d:?} names no proxy in [upstream_proxy.proxies]"),
            )),
            _ => None,
        }
    }
}

// === the proxies in force ===

/// What goes in `Proxy-Authorization`, as the password file allows.
enum Authorization {
    None,
    /// `Basic <base64(user:password)>`.
    Basic(String),
    /// The password file could not be read: no connection through this proxy.
    Unavailable,
}

/// One configured proxy, with its credentials as last read.
pub(crate) struct Proxy {
    pub(crate) name: ProxyName,
    pub(crate) address: SocketAddr,
    username: Option<String>,
    password_file: Option<PathBuf>,
    authorization: ArcSwap<Authorization>,
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("name", &self.name)
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

/// The way out of one connection.
#[derive(Clone, Debug)]
pub(crate) enum Route {
    Direct,
    Via(Arc<Proxy>),
    /// The sandbox names a proxy this worker does not have (it was removed
    /// from the configuration since): fail closed, never direct.
    Missing(ProxyName),
}

impl Route {
    /// The proxy this way goes through, if any.
    pub(crate) fn proxy(&self) -> Option<&ProxyName> {
        match self {
            Self::Direct => None,
            Self::Via(p) => Some(&p.name),
            Self::Missing(name) => Some(name),
        }
    }
}

/// Every configured proxy, and the worker's default. Fixed at start
/// (`upstream_proxy` is restart-only), so a registration checked against
/// it stays valid; only the passwords change, on SIGHUP.
#[derive(Debug, Default)]
pub(crate) struct UpstreamProxies {
    by_name: HashMap<ProxyName, Arc<Proxy>>,
    default: Option<Arc<Proxy>>,
}

impl UpstreamProxies {
    /// The proxies of a validated configuration; passwords are read by [`Self::reload`].
    pub(crate) fn new(config: &UpstreamProxyConfig) -> Self {
        let by_name: HashMap<ProxyName, Arc<Proxy>> = config
            .proxies
            .iter()
            .filter_map(|(name, p)| {
                let name = ProxyName::parse(name).ok()?;
                let proxy = Proxy {
                    name: name.clone(),
                    address: p.address,
                    username: p.username.clone(),
                    password_file: p.password_file.clone(),
                    authorization: ArcSwap::from_pointee(Authorization::Unavailable),
                };
                Some((name, Arc::new(proxy)))
            })
            .collect();
        let default = config
            .default
            .as_deref()
            .and_then(|d| ProxyName::parse(d).ok())
            .and_then(|d| by_name.get(&d).cloned());
        let proxies = Self { by_name, default };
        for p in proxies.by_name.values() {
            if p.password_file.is_none() {
                p.authorization.store(Arc::new(match &p.username {
                    Some(user) => basic(user, ""),
                    None => Authorization::None,
                }));
            }
        }
        proxies
    }

    /// The configured names, for the metrics' series.
    pub(crate) fn names(&self) -> impl Iterator<Item = &ProxyName> {
        self.by_name.keys()
    }

    /// Reads every password file again (start, SIGHUP); returns what could
    /// not be read, by proxy and path (never a value). A proxy whose
    /// password cannot be read refuses connections until it can.
    pub(crate) fn reload(&self) -> Vec<String> {
        let mut failed = Vec::new();
        for p in self.by_name.values() {
            let (Some(path), Some(user)) = (&p.password_file, &p.username) else {
                continue;
            };
            let auth = match read_password(path) {
                Ok(password) => basic(user, &password),
                Err(e) => {
                    failed.push(format!("{}: {}: {e}", p.name, path.display()));
                    Authorization::Unavailable
                }
            };
            p.authorization.store(Arc::new(auth));
        }
        failed
    }

    /// The way out for a sandbox that chose `choice` (`None`: the default).
    pub(crate) fn route(&self, choice: Option<&ProxyChoice>) -> Route {
        match choice {
            None => self.default.clone().map_or(Route::Direct, Route::Via),
            Some(ProxyChoice::Direct) => Route::Direct,
            Some(ProxyChoice::Via(name)) => self
                .by_name
                .get(name)
                .map_or_else(|| Route::Missing(name.clone()), |p| Route::Via(p.clone())),
        }
    }

    /// Whether a registration may name `choice`: `direct` or a configured proxy.
    pub(crate) fn check(&self, choice: &ProxyChoice) -> Result<(), String> {
        match choice {
            ProxyChoice::Via(name) if !self.by_name.contains_key(name) => Err(format!(
                "upstream_proxy {:?}: no such proxy in this gateway's [upstream_proxy.proxies] (nor \"direct\")",
                name.as_str()
            )),
            _ => Ok(()),
        }
    }
}

fn basic(user: &str, password: &str) -> Authorization {
    let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    Authorization::Basic(format!("Basic {token}"))
}

fn read_password(path: &std::path::Path) -> std::io::Result<String> {
    egress_api::file::warn_if_open("an upstream proxy's password_file", path);
    let f = std::fs::File::open(path)?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(f, MAX_PASSWORD + 1), &mut text)?;
    if text.len() as u64 > MAX_PASSWORD {
        return Err(std::io::Error::other(format!(
            "longer than {MAX_PASSWORD} bytes"
        )));
    }
    let password = text.strip_suffix('\n').unwrap_or(&text);
    let password = password.strip_suffix('\r').unwrap_or(password);
    if password.is_empty() {
        // A file caught between a truncate and its write: refused, so
        // the proxy is unavailable and named, not blamed for a 407.
        return Err(std::io::Error::other("empty"));
    }
    Ok(password.to_owned())
}

// === CONNECT ===

/// A proxy that did not give a tunnel, and why.
#[derive(Debug, thiserror::Error)]
#[error("upstream proxy {proxy} {failure}")]
pub(crate) struct ProxyError {
    pub(crate) proxy: ProxyName,
    pub(crate) failure: ProxyFailure,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyFailure {
    #[error("is not configured on this gateway (named by the sandbox); not sent direct")]
    Missing,
    #[error("has no password: its password_file could not be read; not sent direct")]
    NoPassword,
    #[error("cannot be reached at {0}: {1}")]
    Connect(SocketAddr, std::io::Error),
    #[error("refused CONNECT {dst}: {status} {reason}")]
    Refused {
        dst: SocketAddr,
        status: u16,
        reason: String,
    },
    #[error("closed the connection before answering CONNECT {0}")]
    Closed(SocketAddr),
    #[error("did not answer CONNECT {dst} within {after:?}")]
    TimedOut { dst: SocketAddr, after: Duration },
    #[error("answered CONNECT {dst} with no HTTP/1.x response head: {why}")]
    BadResponse { dst: SocketAddr, why: String },
}

impl ProxyFailure {
    /// The `result` label of `egress_upstream_proxy_connects_total` (and
    /// the `x-egress-upstream-proxy` header's word).
    pub(crate) fn result(&self) -> &'static str {
        match self {
            Self::Missing | Self::NoPassword => "unavailable",
            Self::Connect(..) => "unreachable",
            Self::Refused { .. } => "refused",
            Self::Closed(_) => "closed",
            Self::TimedOut { .. } => "timeout",
            Self::BadResponse { .. } => "bad_response",
        }
    }
}

/// Every `result` label, `ok` first; the series exist from the start.
pub(crate) const RESULTS: &[&str] = &[
    "ok",
    "unreachable",
    "refused",
    "closed",
    "timeout",
    "bad_response",
    "unavailable",
];

/// A tunnel to `dst` through `proxy`, within `timeout` (the connect to the
/// proxy and its answer together): on `Ok`, the next byte read is the
/// origin's.
pub(crate) async fn connect(
    proxy: &Proxy,
    dst: SocketAddr,
    timeout: Duration,
) -> Result<TcpStream, ProxyFailure> {
    let authorization = match &**proxy.authorization.load() {
        Authorization::Unavailable => return Err(ProxyFailure::NoPassword),
        Authorization::None => None,
        Authorization::Basic(v) => Some(v.clone()),
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let mut tcp = match tokio::time::timeout_at(deadline, TcpStream::connect(proxy.address)).await {
        Ok(Ok(tcp)) => tcp,
        Ok(Err(e)) => return Err(ProxyFailure::Connect(proxy.address, e)),
        Err(_) => {
            let e = std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out");
            return Err(ProxyFailure::Connect(proxy.address, e));
        }
    };
    let _ = tcp.set_nodelay(true);
    let exchange = async {
        let request = connect_request(dst, authorization.as_deref());
        tcp.write_all(request.as_bytes())
            .await
            .map_err(|_| ProxyFailure::Closed(dst))?;
        let head = read_head(&mut tcp, dst).await?;
        tunnel_status(&head, dst)
    };
    match tokio::time::timeout_at(deadline, exchange).await {
        Ok(Ok(())) => Ok(tcp),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(ProxyFailure::TimedOut {
            dst,
            after: timeout,
        }),
    }
}

/// `CONNECT ip:port HTTP/1.1` with the same authority as `Host`, and
/// `Proxy-Authorization` when there is one.
pub(crate) fn connect_request(dst: SocketAddr, authorization: Option<&str>) -> String {
    let mut r = format!("CONNECT {dst} HTTP/1.1\r\nHost: {dst}\r\n");
    if let Some(a) = authorization {
        r.push_str("Proxy-Authorization: ");
        r.push_str(a);
        r.push_str("\r\n");
    }
    r.push_str("\r\n");
    r
}

/// Reads the response head up to and including its blank line, and not a
/// byte more: peeks at what has arrived, then consumes only the head's part.
async fn read_head(tcp: &mut TcpStream, dst: SocketAddr) -> Result<Vec<u8>, ProxyFailure> {
    let closed = |_| ProxyFailure::Closed(dst);
    let mut head = Vec::with_capacity(256);
    const WINDOW: usize = 1024;
    let mut window = [0u8; WINDOW];
    loop {
        let room = MAX_HEAD - head.len();
        if room == 0 {
            let why = format!("the head is longer than {MAX_HEAD} bytes");
            return Err(ProxyFailure::BadResponse { dst, why });
        }
        let n = tcp
            .peek(&mut window[..room.min(WINDOW)])
            .await
            .map_err(closed)?;
        if n == 0 {
            return Err(ProxyFailure::Closed(dst));
        }
        let end = end_of_head(&head, &window[..n]);
        let take = end.unwrap_or(n);
        // These bytes were peeked: the read returns them at once.
        tcp.read_exact(&mut window[..take]).await.map_err(closed)?;
        head.extend_from_slice(&window[..take]);
        if end.is_some() {
            return Ok(head);
        }
    }
}

/// How many bytes of `new` complete the head begun by `head` (its blank
/// line: `\r\n\r\n`, or a bare `\n\n`), if they do.
pub(crate) fn end_of_head(head: &[u8], new: &[u8]) -> Option<usize> {
    let at = |i: usize, back: usize| -> Option<u8> {
        match i.checked_sub(back) {
            Some(j) => new.get(j).copied(),
            None => head
                .len()
                .checked_sub(back - i)
                .and_then(|j| head.get(j).copied()),
        }
    };
    (0..new.len()).find_map(|i| {
        let blank = new[i] == b'\n'
            && (at(i, 1) == Some(b'\n') || (at(i, 1) == Some(b'\r') && at(i, 2) == Some(b'\n')));
        blank.then_some(i + 1)
    })
}

/// `Ok` for a `2xx` answer; otherwise what the proxy said.
pub(crate) fn tunnel_status(head: &[u8], dst: SocketAddr) -> Result<(), ProxyFailure> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut resp = httparse::Response::new(&mut headers);
    let bad = |why: String| ProxyFailure::BadResponse { dst, why };
    match resp.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(bad("an incomplete head".into())),
        Err(e) => return Err(bad(e.to_string())),
    }
    let status = resp.code.unwrap_or(0);
    if (200..300).contains(&status) {
        return Ok(());
    }
    // The reason phrase goes into logs and answers: printable, short.
    let reason: String = resp
        .reason
        .unwrap_or("")
        .chars()
        .filter(|c| c.is_ascii_graphic() || *c == ' ')
        .take(64)
        .collect();
    Err(ProxyFailure::Refused {
        dst,
        status,
        reason,
    })
}

#[cfg(test)]
mod tests;
