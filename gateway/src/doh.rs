//! Encrypted DNS: what the gateway does with DNS a sandbox sends over TLS.
//!
//! DNS over HTTPS to the reserved resolvers (Chromium, Firefox and curl
//! upgrade 8.8.8.8 and 1.1.1.1 to `dns.google` and `cloudflare-dns.com` on
//! their own) is terminated and answered here, through the DNS proxy's own
//! path: the same admission, the same attribution committed before the
//! answer. Nothing of such a flow goes to the real resolver. Every other
//! kind of encrypted DNS it recognises — DNS over TLS (port 853) anywhere,
//! DoH to another well-known resolver (by its name, or its address on
//! port 443) — would resolve names the gateway never sees, so it is refused
//! (`encrypted_dns`) unless the policy allows that name by name. A DoH
//! server it does not know (a private one, by address) is not recognised:
//! only the policy's allows keep a sandbox from it.
//! Clients then fall back to port 53 (docs/attribution.md says which do).

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use dns_attrib::doh::{self, DohError};
use dns_attrib::{DnsProxy, Transport};
use egress_policy::{embedded_ipv4, EncryptedDns, Hostname, RESERVED_RESOLVERS};
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};

use crate::pool::Body;
use crate::reply::text;

/// The port of DNS over TLS (RFC 7858).
pub(crate) const DOT_PORT: u16 = 853;
/// Plain DNS's port: over TCP, a stream the DNS proxy never got.
pub(crate) const DNS_PORT: u16 = 53;

/// The port a DoH server listens on at the reserved resolvers.
const DOH_PORT: u16 = 443;

/// How long a DoH request's body may take to arrive.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Well-known public DoH servers' names (besides the reserved resolvers,
/// which are answered): the operator adds to them with `dns.doh_names`.
pub const BUILTIN_DOH_NAMES: &[&str] = &[
    "dns.google",
    "dns.google.com",
    "dns64.dns.google",
    "cloudflare-dns.com",
    "one.one.one.one",
    "1dot1dot1dot1.cloudflare-dns.com",
    "mozilla.cloudflare-dns.com",
    "chrome.cloudflare-dns.com",
    "security.cloudflare-dns.com",
    "family.cloudflare-dns.com",
    "dns.quad9.net",
    "dns9.quad9.net",
    "dns10.quad9.net",
    "dns11.quad9.net",
    "doh.opendns.com",
    "doh.familyshield.opendns.com",
    "dns.nextdns.io",
    "doh.cleanbrowsing.org",
    "dns.adguard.com",
    "dns.adguard-dns.com",
    "doh.mullvad.net",
    "dns.mullvad.net",
    "doh.dns.sb",
    "dns.alidns.com",
    "doh.pub",
    "dns.controld.com",
    "freedns.controld.com",
];

/// Well-known public DoH servers' addresses (besides the reserved
/// resolvers): a client given `https://1.0.0.1/dns-query` sends no name, so
/// on port 443 the address alone tells it.
pub const BUILTIN_DOH_ADDRESSES: &[&str] = &[
    "8.8.4.4",
    "2001:4860:4860::8888",
    "2001:4860:4860::8844",
    "1.0.0.1",
    "1.1.1.2",
    "1.0.0.2",
    "1.1.1.3",
    "1.0.0.3",
    "2606:4700:4700::1111",
    "2606:4700:4700::1001",
    "2606:4700:4700::1112",
    "2606:4700:4700::1002",
    "2606:4700:4700::1113",
    "2606:4700:4700::1003",
    "9.9.9.9",
    "149.112.112.112",
    "9.9.9.10",
    "149.112.112.10",
    "9.9.9.11",
    "149.112.112.11",
    "2620:fe::fe",
    "2620:fe::9",
    "2620:fe::10",
    "2620:fe::11",
    "208.67.222.222",
    "208.67.220.220",
    "208.67.222.123",
    "208.67.220.123",
    "2620:119:35::35",
    "2620:119:53::53",
    "94.140.14.14",
    "94.140.15.15",
    "94.140.14.15",
    "94.140.15.16",
    "2a10:50c0::ad1:ff",
    "2a10:50c0::ad2:ff",
    "185.228.168.9",
    "185.228.169.9",
    "185.228.168.168",
    "194.242.2.2",
    "185.222.222.222",
    "45.11.45.11",
    "223.5.5.5",
    "223.6.6.6",
    "1.12.12.12",
    "120.53.53.53",
    "76.76.2.0",
    "76.76.10.0",
    "45.90.28.0",
    "45.90.30.0",
];

/// The names and addresses of well-known DoH servers: built in, plus the
/// operator's names.
#[derive(Debug)]
pub struct DohNames {
    names: HashSet<Hostname>,
    addresses: HashSet<IpAddr>,
}

impl DohNames {
    /// The built-in lists and `extra`.
    pub fn new(extra: &[Hostname]) -> Self {
        let builtin = BUILTIN_DOH_NAMES
            .iter()
            .filter_map(|n| Hostname::parse(n).ok());
        Self {
            names: builtin.chain(extra.iter().cloned()).collect(),
            addresses: BUILTIN_DOH_ADDRESSES
                .iter()
                .filter_map(|a| a.parse().ok())
                .collect(),
        }
    }

    /// What a stream to `dst` is by its port alone: DNS over TLS (853), or
    /// DNS over TCP (53) that reached the transparent listener rather than
    /// the DNS proxy (another resolver, or a reserved one by another
    /// address form).
    pub fn by_port(dst: SocketAddr) -> Option<EncryptedDns> {
        match dst.port() {
            DOT_PORT => Some(EncryptedDns::Dot),
            DNS_PORT => Some(EncryptedDns::TcpDns),
            _ => None,
        }
    }

    /// No names at all: for judging what can never be encrypted DNS.
    pub fn empty() -> Self {
        Self {
            names: HashSet::new(),
            addresses: HashSet::new(),
        }
    }

    /// What kind of DNS the gateway would not see a TLS flow to `dst` is,
    /// judged on its address (a reserved resolver in any form that embeds
    /// it: IPv4-mapped or NAT64, as policy reads addresses; another
    /// well-known DoH server's on port 443), its port, its server name and
    /// the names attributed to its address.
    pub fn kind(
        &self,
        dst: SocketAddr,
        sni: Option<&Hostname>,
        attributed: &[Hostname],
    ) -> Option<EncryptedDns> {
        let ip = embedded_ipv4(dst.ip()).map_or(dst.ip(), IpAddr::V4);
        if dst.port() == DOH_PORT && RESERVED_RESOLVERS.contains(&ip) {
            return Some(EncryptedDns::ReservedDoh);
        }
        if let Some(kind) = Self::by_port(dst) {
            return Some(kind);
        }
        if dst.port() == DOH_PORT && self.addresses.contains(&ip.to_canonical()) {
            return Some(EncryptedDns::KnownDoh);
        }
        let known = |n: &Hostname| self.names.contains(n);
        (sni.is_some_and(known) || attributed.iter().any(known)).then_some(EncryptedDns::KnownDoh)
    }
}

/// Answers one request on a DoH flow to the reserved resolver `dst`, from
/// sandbox address `src`, through `proxy`. Never forwards anything. Once
/// the gateway is `draining`, `503`: it has handed its attribution over (or
/// is about to), so an answer recorded now would be lost to its successor,
/// whose DNS the client reaches once this one fails.
pub(crate) async fn answer<B>(
    proxy: &DnsProxy,
    (src, dst): (IpAddr, SocketAddr),
    req: Request<B>,
    draining: impl Fn() -> bool,
) -> Response<Body>
where
    B: hyper::body::Body<Data = Bytes, Error = hyper::Error>,
{
    let (parts, body) = req.into_parts();
    let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .map(HeaderValue::as_bytes);
    // A source reads at most its share of bodies at once: each is held
    // before the query in it can be judged.
    let Some(reading) = proxy.doh_read(src) else {
        return text(
            StatusCode::TOO_MANY_REQUESTS,
            "too many DNS-over-HTTPS requests being read from this address\n",
        );
    };
    let body = match read_body(body).await {
        Ok(b) => b,
        Err(e) => return refused(&e),
    };
    drop(reading);
    if draining() {
        return text(StatusCode::SERVICE_UNAVAILABLE, "draining\n");
    }
    let query = match doh::query(parts.method.as_str(), target, content_type, &body) {
        Ok(q) => q,
        Err(e) => return refused(&e),
    };
    // The query is a flow to the resolver's DNS port, admitted as one.
    let resolver = SocketAddr::new(dst.ip().to_canonical(), 53);
    let answer = proxy
        .answer_bounded(&query, src, resolver, Transport::Tcp)
        .await;
    // A drain begun while the query was out: what the answer recorded may
    // have missed the attribution handed to a successor, so the client asks
    // it instead.
    if draining() {
        return text(StatusCode::SERVICE_UNAVAILABLE, "draining\n");
    }
    match answer {
        Some(answer) => {
            let most = proxy.cache().lifetime(u32::MAX).as_secs();
            dns_message(answer, u32::try_from(most).unwrap_or(u32::MAX))
        }
        None => refused(&DohError::Bad("not a DNS query")),
    }
}

/// The body, at most one DNS query (and a byte, to tell it was more).
async fn read_body<B: hyper::body::Body<Data = Bytes, Error = hyper::Error>>(
    body: B,
) -> Result<Bytes, DohError> {
    let limited = Limited::new(body, doh::MAX_QUERY + 1);
    match tokio::time::timeout(BODY_TIMEOUT, limited.collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(DohError::TooLarge),
        Ok(Err(_)) => Err(DohError::Bad("the body could not be read")),
        Err(_) => Err(DohError::Bad("the body did not arrive in time")),
    }
}

fn dns_message(answer: Vec<u8>, most: u32) -> Response<Body> {
    let max_age = doh::max_age(&answer, most);
    let mut resp = Response::new(
        Full::new(Bytes::from(answer))
            .map_err(|never| match never {})
            .boxed(),
    );
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(doh::DNS_MESSAGE),
    );
    if let Some(age) = max_age.and_then(|a| HeaderValue::from_str(&format!("max-age={a}")).ok()) {
        headers.insert(header::CACHE_CONTROL, age);
    }
    resp
}

fn refused(e: &DohError) -> Response<Body> {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
    text(status, &format!("{e}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect(s)
    }

    fn name(s: &str) -> Hostname {
        Hostname::parse(s).expect(s)
    }

    #[test]
    fn kinds_of_encrypted_dns() {
        let names = DohNames::new(&[name("doh.corp.example")]);
        let kind = |dst: &str, sni: Option<&str>, attributed: &[&str]| {
            let sni = sni.map(name);
            let attributed: Vec<Hostname> = attributed.iter().map(|n| name(n)).collect();
            names.kind(addr(dst), sni.as_ref(), &attributed)
        };
        use EncryptedDns::*;
        assert_eq!(
            kind("8.8.8.8:443", Some("dns.google"), &[]),
            Some(ReservedDoh)
        );
        assert_eq!(kind("1.1.1.1:443", None, &[]), Some(ReservedDoh));
        assert_eq!(kind("[::ffff:1.1.1.1]:443", None, &[]), Some(ReservedDoh));
        assert_eq!(kind("8.8.8.8:853", Some("dns.google"), &[]), Some(Dot));
        assert_eq!(kind("203.0.113.9:853", None, &[]), Some(Dot));
        assert_eq!(
            kind("203.0.113.9:443", Some("dns.quad9.net"), &[]),
            Some(KnownDoh)
        );
        assert_eq!(
            kind("203.0.113.9:443", None, &["dns.quad9.net"]),
            Some(KnownDoh)
        );
        assert_eq!(
            kind("203.0.113.9:443", Some("doh.corp.example"), &[]),
            Some(KnownDoh)
        );
        assert_eq!(
            kind("203.0.113.9:443", Some("api.example.test"), &["x.test"]),
            None
        );
        assert_eq!(
            kind("198.51.100.4:443", Some("api.example.test"), &[]),
            None
        );
        // Another well-known DoH server by its address (no name sent), in
        // either family, on 443 only.
        assert_eq!(kind("1.0.0.1:443", None, &[]), Some(KnownDoh));
        assert_eq!(
            kind("9.9.9.9:443", Some("api.example.test"), &[]),
            Some(KnownDoh)
        );
        assert_eq!(kind("[2620:fe::fe]:443", None, &[]), Some(KnownDoh));
        assert_eq!(kind("[::ffff:8.8.4.4]:443", None, &[]), Some(KnownDoh));
        assert_eq!(kind("1.0.0.1:80", None, &[]), None);
        // A reserved resolver by its NAT64 address, as policy reads it.
        assert_eq!(kind("[64:ff9b::808:808]:443", None, &[]), Some(ReservedDoh));
        // Port 53 over TCP, past the DNS proxy: any address, any form.
        assert_eq!(kind("[64:ff9b::808:808]:53", None, &[]), Some(TcpDns));
        assert_eq!(kind("203.0.113.9:53", None, &[]), Some(TcpDns));
        assert_eq!(DohNames::by_port(addr("203.0.113.9:53")), Some(TcpDns));
        assert_eq!(DohNames::by_port(addr("203.0.113.9:22")), None);
    }

    /// DNS over TCP that reached the transparent listener (a reserved
    /// resolver by its NAT64 address, or another resolver) is refused
    /// unless an allow names it: an address allow, the resolver's own
    /// included, or the default is not enough.
    #[test]
    fn a_stream_to_port_53_passes_only_on_an_allow_by_name() {
        use egress_policy::{AttributionGap, CompiledPolicy, PlatformDenies, Policy, Protocol};
        let judged = |doc: &str, dst: &str, attributed: &[&str]| {
            let policy = CompiledPolicy::new(
                Policy::from_json(doc).expect(doc),
                std::sync::Arc::new(PlatformDenies::builtin()),
            );
            let claims = crate::decide::Claims::asked(addr(dst), false, false, None, None);
            assert_eq!(claims.protocol, Protocol::Opaque(None));
            let attributed: Vec<Hostname> = attributed.iter().map(|n| name(n)).collect();
            let gap = AttributionGap::NoDnsSeen;
            let v = crate::decide::judge(&policy, &claims, &attributed, gap, &DohNames::empty());
            v.code().to_owned()
        };
        let resolver = r#"{"default": "deny", "allow": [{"ip": "8.8.8.8"}]}"#;
        assert_eq!(
            judged(resolver, "[64:ff9b::808:808]:53", &[]),
            "encrypted_dns"
        );
        assert_eq!(
            judged(resolver, "[64:ff9b::808:808]:80", &[]),
            "allow_address"
        );
        let open = r#"{"default": "allow"}"#;
        assert_eq!(judged(open, "203.0.113.9:53", &[]), "encrypted_dns");
        assert_eq!(judged(open, "203.0.113.9:5353", &[]), "allow_default");
        let named = r#"{"default": "deny", "allow": [{"domain": "ns.corp.test"}]}"#;
        assert_eq!(
            judged(named, "203.0.113.9:53", &["ns.corp.test"]),
            "allow_attributed_name"
        );
    }

    #[test]
    fn the_builtin_names_are_hostnames() {
        let builtin = DohNames::new(&[]);
        assert_eq!(builtin.names.len(), BUILTIN_DOH_NAMES.len());
        assert_eq!(builtin.addresses.len(), BUILTIN_DOH_ADDRESSES.len());
    }
}
