//! The fake internet: an authoritative DNS server for a test zone (which
//! counts the queries it receives, by name), HTTPS origins whose certificates are minted per SNI under a test CA, a plain
//! HTTP origin, and a non-HTTP TLS service (a line protocol standing in for
//! TURN-over-TLS). It runs inside a network namespace whose addresses are
//! documentation ranges only (203.0.113.0/24, 198.51.100.0/24).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use egress_certs::{CertificateAuthority, LeafMinter, LeafResolver, MintConfig};
use hickory_proto::op::{Metadata, ResponseCode};
use hickory_proto::rr::rdata::svcb::{
    Alpn, EchConfigList, IpHint, Mandatory, SvcParamKey, SvcParamValue, SVCB,
};
use hickory_proto::rr::rdata::{A, AAAA, CNAME, HTTPS, TXT};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use hickory_server::net::runtime::Time;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponseBuilder;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, UdpSocket};

/// The DNS server's address.
pub const DNS_IP: &str = "203.0.113.53";
/// The TURN-like service's address: TLS, then `PING\n` → `PONG\n`.
pub const TURN_IP: &str = "203.0.113.30";
/// An origin that resets one connection in ten (right after accepting it).
pub const RESET_IP: &str = "203.0.113.60";
/// An origin that accepts connections and never says a word.
pub const STALL_IP: &str = "203.0.113.61";

/// Requests each origin answered, by the `Host` (or `:authority`) it saw;
/// `GET /_counts` (plain HTTP, any address) returns them as JSON.
static COUNTS: std::sync::LazyLock<std::sync::Mutex<HashMap<String, u64>>> =
    std::sync::LazyLock::new(|| std::sync::Mutex::new(HashMap::new()));

/// What the origins received, one line per request (the last 10,000):
/// `METHOD host path authorization=… x-api-key=…`; `GET /_seen` (plain
/// HTTP, any address) returns them as a JSON array.
static SEEN: std::sync::LazyLock<std::sync::Mutex<std::collections::VecDeque<String>>> =
    std::sync::LazyLock::new(|| std::sync::Mutex::new(std::collections::VecDeque::new()));

/// Set by `GET /_release`: every `/hold` request is answered (and later
/// ones at once), so a test decides when held requests end, not a clock.
static RELEASE: std::sync::LazyLock<tokio::sync::watch::Sender<bool>> =
    std::sync::LazyLock::new(|| tokio::sync::watch::Sender::new(false));

/// What the origin at `ip` does with a new connection.
enum Behaviour {
    Serve,
    Reset,
    Stall,
}

fn behaviour(ip: IpAddr) -> Behaviour {
    static ACCEPTED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let is = |s: &str| s.parse::<IpAddr>().is_ok_and(|x| x == ip);
    if is(STALL_IP) {
        Behaviour::Stall
    } else if is(RESET_IP)
        && ACCEPTED
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .is_multiple_of(10)
    {
        Behaviour::Reset
    } else {
        Behaviour::Serve
    }
}

/// Applies the origin's behaviour to a new connection: `false` when it
/// must not be served.
async fn greet(tcp: &tokio::net::TcpStream, ip: IpAddr) -> bool {
    match behaviour(ip) {
        Behaviour::Serve => true,
        Behaviour::Reset => {
            let _ = socket2::SockRef::from(tcp).set_linger(Some(Duration::ZERO));
            false
        }
        Behaviour::Stall => {
            tokio::time::sleep(Duration::from_secs(60)).await;
            false
        }
    }
}

/// One name in the test zone.
#[derive(Clone, Debug)]
pub enum Entry {
    A(Ipv4Addr, u32),
    Cname(&'static str, u32),
}

/// The test zone: names, addresses, CNAME chains, TTL-0 and short TTLs.
pub fn zone() -> HashMap<&'static str, Entry> {
    let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap_or(Ipv4Addr::UNSPECIFIED);
    HashMap::from([
        ("api.example.test", Entry::A(ip("203.0.113.10"), 300)),
        ("other.example.test", Entry::A(ip("203.0.113.11"), 300)),
        ("zero.example.test", Entry::A(ip("203.0.113.12"), 0)),
        ("a.relay.example.test", Entry::A(ip("203.0.113.20"), 300)),
        ("short.relay.example.test", Entry::A(ip("203.0.113.21"), 1)),
        ("turn.example.test", Entry::A(ip(TURN_IP), 300)),
        // Its HTTPS record carries `ech` (see `ech_https`).
        (ECH_NAME, Entry::A(ip("203.0.113.10"), 300)),
        (
            "www.chain.example.test",
            Entry::Cname("cdn.chain.example.test", 120),
        ),
        (
            "cdn.chain.example.test",
            Entry::Cname("edge.cdn.example.test", 60),
        ),
        ("edge.cdn.example.test", Entry::A(ip("198.51.100.10"), 300)),
        ("plain.example.test", Entry::A(ip("198.51.100.20"), 300)),
        // The replay sample's world: registries, git, an API, a blocked site, a deb mirror.
        (
            "registry.npm.example.test",
            Entry::A(ip("203.0.113.40"), 300),
        ),
        ("files.pypi.example.test", Entry::A(ip("203.0.113.41"), 300)),
        ("crates.example.test", Entry::A(ip("203.0.113.42"), 300)),
        ("git.example.test", Entry::A(ip("203.0.113.43"), 300)),
        ("blocked.example.test", Entry::A(ip("203.0.113.44"), 300)),
        ("deb.example.test", Entry::A(ip("198.51.100.21"), 300)),
        // A DoH server's name at a reserved resolver, as the real zone has
        // it: a client bootstraps its DoH URL through port 53. Nothing
        // serves at 8.8.8.8 in the fake internet (`addresses` leaves the
        // reserved resolvers out): the gateway answers DoH there itself.
        ("dns.google", Entry::A(ip("8.8.8.8"), 300)),
        // Faults: an origin that resets, one that stalls.
        ("reset.example.test", Entry::A(ip(RESET_IP), 300)),
        ("stall.example.test", Entry::A(ip(STALL_IP), 300)),
    ])
}

/// The IPv6 addresses (AAAA) of some names, in 2001:db8:f::/48: the same
/// origins, reachable over IPv6 as well.
pub fn zone6() -> HashMap<&'static str, (Ipv6Addr, u32)> {
    let ip = |s: &str| s.parse::<Ipv6Addr>().unwrap_or(Ipv6Addr::UNSPECIFIED);
    HashMap::from([
        ("api.example.test", (ip("2001:db8:f::10"), 300)),
        ("other.example.test", (ip("2001:db8:f::11"), 300)),
        ("a.relay.example.test", (ip("2001:db8:f::20"), 300)),
        ("edge.cdn.example.test", (ip("2001:db8:f::100:10"), 300)),
        ("plain.example.test", (ip("2001:db8:f::100:20"), 300)),
    ])
}

/// Every IPv6 address the fake internet serves on.
pub fn addresses6() -> Vec<Ipv6Addr> {
    let mut v: Vec<Ipv6Addr> = zone6().values().map(|(ip, _)| *ip).collect();
    v.sort();
    v
}

/// Every address the fake internet serves on.
pub fn addresses() -> Vec<Ipv4Addr> {
    let mut v: Vec<Ipv4Addr> = zone()
        .values()
        .filter_map(|e| match e {
            Entry::A(ip, _) => Some(*ip),
            Entry::Cname(..) => None,
        })
        .filter(|ip| !egress_policy::RESERVED_RESOLVERS.contains(&IpAddr::V4(*ip)))
        .collect();
    v.push(DNS_IP.parse().unwrap_or(Ipv4Addr::UNSPECIFIED));
    v.sort();
    v.dedup();
    v
}

// === DNS ===

/// The zone's name whose HTTPS (type 65) record publishes an ECH
/// configuration: `1 . mandatory=alpn,ech alpn="h2" ipv4hint=203.0.113.10 ech=…`.
pub const ECH_NAME: &str = "ech.example.test";

/// Under this zone every name has a TXT record (`"ok"`): the shape of a DNS
/// exfiltration channel, data going out in the names and coming back in TXT.
pub const EXFIL_ZONE: &str = "exfil.example.test";

/// Queries the DNS server received, by question name (lower case, without
/// the trailing dot); `GET /_dns_counts` (plain HTTP, any address) returns
/// them as JSON.
static DNS_COUNTS: std::sync::LazyLock<std::sync::Mutex<HashMap<String, u64>>> =
    std::sync::LazyLock::new(|| std::sync::Mutex::new(HashMap::new()));

struct Zone(HashMap<&'static str, Entry>);

#[async_trait::async_trait]
impl RequestHandler for Zone {
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        handle: R,
    ) -> ResponseInfo {
        let mut metadata = Metadata::response_from_request(&request.metadata);
        metadata.authoritative = true;
        let (qname, qtype) = request
            .queries
            .queries()
            .first()
            .map_or((String::new(), RecordType::A), |q| {
                (q.name().to_string(), q.query_type())
            });
        let qname = qname.trim_end_matches('.').to_ascii_lowercase();
        if let Ok(mut c) = DNS_COUNTS.lock() {
            *c.entry(qname.clone()).or_insert(0) += 1;
        }
        let records = match exfil_txt(&qname, qtype) {
            Some(txt) => Some(vec![txt]),
            None => self.lookup(qname, qtype),
        };
        if records.is_none() {
            metadata.response_code = ResponseCode::NXDomain;
        }
        answer(request, handle, metadata, &records.unwrap_or_default()).await
    }
}

impl Zone {
    /// The records answering `qtype` for `qname`, CNAMEs followed inside the
    /// zone as an authoritative server does; `None`: no such name.
    fn lookup(&self, qname: String, qtype: RecordType) -> Option<Vec<Record>> {
        let mut records = Vec::new();
        let mut current = qname;
        let mut found = false;
        for _ in 0..8 {
            let Some(entry) = self.0.get(current.as_str()) else {
                break;
            };
            found = true;
            let owner = Name::from_ascii(format!("{current}.")).unwrap_or_default();
            match entry {
                Entry::A(ip, ttl) => {
                    match qtype {
                        RecordType::A => {
                            records.push(Record::from_rdata(owner, *ttl, RData::A(A(*ip))))
                        }
                        RecordType::AAAA => {
                            records.extend(zone6().get(current.as_str()).map(|(ip6, ttl6)| {
                                Record::from_rdata(owner, *ttl6, RData::AAAA(AAAA(*ip6)))
                            }))
                        }
                        RecordType::HTTPS if current == ECH_NAME => records.push(ech_https(owner)),
                        _ => {}
                    }
                    break;
                }
                Entry::Cname(target, ttl) => {
                    let t = Name::from_ascii(format!("{target}.")).unwrap_or_default();
                    records.push(Record::from_rdata(owner, *ttl, RData::CNAME(CNAME(t))));
                    current = (*target).to_owned();
                }
            }
        }
        found.then_some(records)
    }
}

/// [`ECH_NAME`]'s HTTPS record, `ech` included (and named mandatory).
fn ech_https(owner: Name) -> Record {
    let params = vec![
        (
            SvcParamKey::Mandatory,
            SvcParamValue::Mandatory(Mandatory(vec![
                SvcParamKey::Alpn,
                SvcParamKey::EchConfigList,
            ])),
        ),
        (
            SvcParamKey::Alpn,
            SvcParamValue::Alpn(Alpn(vec!["h2".to_owned()])),
        ),
        (
            SvcParamKey::Ipv4Hint,
            SvcParamValue::Ipv4Hint(IpHint(vec![A::new(203, 0, 113, 10)])),
        ),
        (
            SvcParamKey::EchConfigList,
            SvcParamValue::EchConfigList(EchConfigList(
                b"\x00\x13\xfe\x0d\x00\x0ffake-ech-config".to_vec(),
            )),
        ),
    ];
    Record::from_rdata(
        owner,
        300,
        RData::HTTPS(HTTPS(SVCB::new(1, Name::root(), params))),
    )
}

/// The TXT answer for a name under [`EXFIL_ZONE`].
fn exfil_txt(qname: &str, qtype: RecordType) -> Option<Record> {
    let under = qname.strip_suffix(EXFIL_ZONE)?.ends_with('.');
    (under && qtype == RecordType::TXT).then(|| {
        let owner = Name::from_ascii(format!("{qname}.")).unwrap_or_default();
        Record::from_rdata(owner, 60, RData::TXT(TXT::new(vec!["ok".to_owned()])))
    })
}

/// Sends `records` as the answer section of the response to `request`.
pub async fn answer<R: ResponseHandler>(
    request: &Request,
    mut handle: R,
    metadata: Metadata,
    records: &[Record],
) -> ResponseInfo {
    let response = MessageResponseBuilder::from_message_request(request).build(
        metadata,
        records.iter(),
        [],
        [],
        [],
    );
    match handle.send_response(response).await {
        Ok(info) => info,
        Err(_) => ResponseInfo::from(hickory_proto::op::Header {
            metadata,
            counts: Default::default(),
        }),
    }
}

/// Serves the zone on UDP and TCP `addr` until the task is dropped.
pub async fn serve_dns(addr: SocketAddr) -> std::io::Result<()> {
    let udp = UdpSocket::bind(addr).await?;
    let tcp = TcpListener::bind(addr).await?;
    let mut server = hickory_server::Server::new(Zone(zone()));
    server.register_socket(udp);
    server.register_listener(tcp, Duration::from_secs(10), 65_535);
    server
        .block_until_done()
        .await
        .map_err(std::io::Error::other)
}

// === origins ===

/// Loads or creates the fake internet's CA in `dir` and a minter for its origins.
pub fn origin_minter(dir: &Path) -> Result<Arc<LeafMinter>, egress_certs::CertError> {
    let ca = CertificateAuthority::load_or_create_named(dir, "fake internet test CA")?;
    Ok(Arc::new(LeafMinter::new(
        Arc::new(ca),
        MintConfig::default(),
    )?))
}

/// HTTPS on `addr`: certificates per SNI (or per local IP without SNI); the
/// TURN address speaks the line protocol instead of HTTP.
pub async fn serve_tls(addr: SocketAddr, minter: Arc<LeafMinter>) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    loop {
        let (tcp, _) = listener.accept().await?;
        let minter = minter.clone();
        tokio::spawn(async move {
            let Ok(local) = tcp.local_addr() else { return };
            // A dual-stack listener sees IPv4 as `::ffff:a.b.c.d`.
            let local = SocketAddr::new(local.ip().to_canonical(), local.port());
            if !greet(&tcp, local.ip()).await {
                return;
            }
            let turn = local.ip()
                == TURN_IP
                    .parse::<IpAddr>()
                    .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
            let mut config = rustls::ServerConfig::builder()
                .with_no_client_auth()
                .with_cert_resolver(Arc::new(LeafResolver::new(minter, Some(local.ip()))));
            if !turn {
                config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
            }
            let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
            let Ok(Ok(mut tls)) =
                tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await
            else {
                return;
            };
            if turn {
                let mut line = [0u8; 5];
                if tls.read_exact(&mut line).await.is_ok() && &line == b"PING\n" {
                    let _ = tls.write_all(b"PONG\n").await;
                    let _ = tls.shutdown().await;
                }
                return;
            }
            let service = hyper::service::service_fn(|req| async move {
                Ok::<_, std::convert::Infallible>(respond(req).await)
            });
            // Streams at once on one HTTP/2 connection: more than hyper's
            // 200, as the gateway multiplexes a sandbox's requests to an
            // origin onto one upstream connection and the drain test holds
            // a thousand of them open at the origin.
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder.http2().max_concurrent_streams(4096);
            let _ = builder
                .serve_connection_with_upgrades(TokioIo::new(tls), service)
                .await;
        });
    }
}

/// An SSH server's first words on `addr` (port 22): its identification
/// string, then an echo of what the client sends (bounded: 64 KiB, 10 s),
/// so a test sees a stream pass both ways.
pub async fn serve_ssh(addr: SocketAddr) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    loop {
        let (mut tcp, _) = listener.accept().await?;
        tokio::spawn(async move {
            if tcp.write_all(b"SSH-2.0-fake-internet\r\n").await.is_err() {
                return;
            }
            let mut buf = vec![0u8; 65_536];
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut buf)).await
            {
                let _ = tcp.write_all(&buf[..n]).await;
            }
            let _ = tcp.shutdown().await;
        });
    }
}

/// Plain HTTP on `addr`.
pub async fn serve_http(addr: SocketAddr) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    loop {
        let (tcp, _) = listener.accept().await?;
        tokio::spawn(async move {
            if let Ok(local) = tcp.local_addr() {
                if !greet(&tcp, local.ip().to_canonical()).await {
                    return;
                }
            }
            let service = hyper::service::service_fn(|req| async move {
                Ok::<_, std::convert::Infallible>(respond(req).await)
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tcp), service)
                .with_upgrades()
                .await;
        });
    }
}

/// `/bytes/N`, `/echo` (the request body back), `/slow` (answers after 2 s;
/// `/slow/N`: after N seconds, at most 30), `/hold` (answers once
/// `GET /_release` was asked, or after 120 s),
/// `/ws` (an upgrade that echoes), `/reflect` and `/reflect-gzip` (see
/// [`reflect`]), anything else: a line naming the request
/// and the `Host` headers and authority it arrived with.
async fn respond(mut req: hyper::Request<hyper::body::Incoming>) -> hyper::Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    // Every Host header it received (so a test sees a second one), else the
    // HTTP/2 :authority; and the :authority (or absolute-form) on its own.
    let hosts: Vec<&str> = req
        .headers()
        .get_all("host")
        .iter()
        .map(|h| h.to_str().unwrap_or("<not ASCII>"))
        .collect();
    let authority = req
        .uri()
        .authority()
        .map_or_else(|| "-".to_owned(), ToString::to_string);
    let host = if hosts.is_empty() {
        authority.clone()
    } else {
        hosts.join(",")
    };
    if let Some(answer) = control(&path) {
        return answer;
    }
    record(&req, &host);
    if path == "/ws" && req.headers().contains_key(hyper::header::UPGRADE) {
        return upgrade(&mut req);
    }
    if let Some(answer) = timed(&path).await {
        return answer;
    }
    match path.as_str() {
        "/reflect" | "/reflect-gzip" => reflect(&req, path == "/reflect-gzip"),
        "/echo" => {
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            hyper::Response::new(Full::new(body))
        }
        _ => {
            let method = req.method().clone();
            read_whole(req.into_body()).await;
            hyper::Response::new(Full::new(Bytes::from(format!(
                "fake internet: {method} {path} host={host} authority={authority}\n"
            ))))
        }
    }
}

/// Reads a request's body before it is answered, as most origins do (up
/// to 1 MiB, for at most 5 s; past either the answer goes anyway). An
/// HTTP/2 answer sent before the body ends is followed by a `NO_ERROR`
/// reset of the stream (RFC 9113 §8.1), which curl 7.88 takes for a
/// failure (exit 92, no status) when it had not sent its body yet: a test
/// would then see a refusal where the gateway let the request through.
async fn read_whole(body: hyper::body::Incoming) {
    let limited = http_body_util::Limited::new(body, 1 << 20);
    let _ = tokio::time::timeout(Duration::from_secs(5), limited.collect()).await;
}

/// An origin that sends a request's headers back, as some do: `Origin` in
/// `access-control-allow-origin` (a CORS echo), every header in the body
/// (an echo service). `gzip`: the answer says it is gzip (it is not).
fn reflect(
    req: &hyper::Request<hyper::body::Incoming>,
    gzip: bool,
) -> hyper::Response<Full<Bytes>> {
    let mut body = String::new();
    for (name, value) in req.headers() {
        body.push_str(&format!(
            "{name}: {}\n",
            String::from_utf8_lossy(value.as_bytes())
        ));
    }
    let mut resp = hyper::Response::builder().header("content-length", body.len());
    if let Some(origin) = req.headers().get("origin") {
        resp = resp.header("access-control-allow-origin", origin);
    }
    if gzip {
        resp = resp.header("content-encoding", "gzip");
    }
    resp.body(Full::new(Bytes::from(body))).expect("response")
}

/// The tests' own paths: `/_counts`, `/_dns_counts`, `/_seen`, `/_release`.
fn control(path: &str) -> Option<hyper::Response<Full<Bytes>>> {
    let body = match path {
        "/_counts" => {
            let counts = COUNTS.lock().map(|c| c.clone()).unwrap_or_default();
            serde_json::to_string(&counts).unwrap_or_default()
        }
        "/_dns_counts" => {
            let counts = DNS_COUNTS.lock().map(|c| c.clone()).unwrap_or_default();
            serde_json::to_string(&counts).unwrap_or_default()
        }
        "/_seen" => {
            let seen: Vec<String> = SEEN
                .lock()
                .map(|s| s.iter().cloned().collect())
                .unwrap_or_default();
            serde_json::to_string(&seen).unwrap_or_default()
        }
        "/_release" => {
            RELEASE.send_replace(true);
            "released\n".to_owned()
        }
        _ => return None,
    };
    Some(hyper::Response::new(Full::new(Bytes::from(body))))
}

/// Counts the request by host and keeps its line in `SEEN`.
fn record(req: &hyper::Request<hyper::body::Incoming>, host: &str) {
    if let Ok(mut c) = COUNTS.lock() {
        let name = host.split(':').next().unwrap_or("").to_owned();
        *c.entry(name).or_insert(0) += 1;
    }
    if let Ok(mut seen) = SEEN.lock() {
        let header = |name: &str| {
            req.headers()
                .get_all(name)
                .iter()
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .collect::<Vec<_>>()
                .join(",")
        };
        if seen.len() >= 10_000 {
            seen.pop_front();
        }
        seen.push_back(format!(
            "{} {} {} authorization={} x-api-key={}",
            req.method(),
            host.split(':').next().unwrap_or(""),
            req.uri().path(),
            header("authorization"),
            header("x-api-key"),
        ));
    }
}

/// `/ws`: switches protocols and echoes what arrives.
fn upgrade(req: &mut hyper::Request<hyper::body::Incoming>) -> hyper::Response<Full<Bytes>> {
    let on = hyper::upgrade::on(req);
    tokio::spawn(async move {
        if let Ok(up) = on.await {
            let mut io = TokioIo::new(up);
            let mut buf = [0u8; 4096];
            while let Ok(n) = io.read(&mut buf).await {
                if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    });
    hyper::Response::builder()
        .status(101)
        .header("connection", "upgrade")
        .header("upgrade", "websocket")
        .body(Full::new(Bytes::new()))
        .unwrap_or_default()
}

/// The paths whose answer is about size or time: `/bytes/N`, `/hold`,
/// `/slow/N`, `/slow`.
async fn timed(path: &str) -> Option<hyper::Response<Full<Bytes>>> {
    if let Some(n) = path
        .strip_prefix("/bytes/")
        .and_then(|n| n.parse::<usize>().ok())
    {
        return Some(hyper::Response::new(Full::new(Bytes::from(vec![
            b'x';
            n.min(
                64 << 20
            )
        ]))));
    }
    let wait = if path == "/hold" {
        let mut released = RELEASE.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(120), released.wait_for(|r| *r)).await;
        return Some(hyper::Response::new(Full::new(Bytes::from_static(
            b"held\n",
        ))));
    } else if path == "/slow" {
        2
    } else {
        path.strip_prefix("/slow/")?.parse::<u64>().ok()?.min(30)
    };
    tokio::time::sleep(Duration::from_secs(wait)).await;
    Some(hyper::Response::new(Full::new(Bytes::from_static(
        b"slow done\n",
    ))))
}
