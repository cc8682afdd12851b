//! Builds a gateway with test origins, a scripted DNS upstream and sandbox clients.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use egress_gateway::config::Config;
use egress_gateway::flowlog::FlowLog;
use egress_gateway::{Gateway, OriginalDst};
use egress_policy::Policy;
use egress_policy::SandboxId;
use hickory_proto::op::{Message, MessageType, Metadata, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use hickory_server::net::runtime::Time;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponseBuilder;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};

pub const SANDBOX_A: &str = "127.0.0.2";
pub const SANDBOX_B: &str = "127.0.0.3";
pub const STRANGER: &str = "127.0.0.9";

/// Origins live on their own loopback addresses, so attribution (by IP) tells them apart.
pub const API_IP: &str = "127.0.0.10";
pub const RELAY_IP: &str = "127.0.0.11";
pub const WRONG_CERT_IP: &str = "127.0.0.12";
pub const TURN_IP: &str = "127.0.0.13";
pub const PLAIN_IP: &str = "127.0.0.14";
pub const H1_ONLY_IP: &str = "127.0.0.15";
pub const GOAWAY_IP: &str = "127.0.0.16";
/// For an origin a test starts itself (`pause.example.test`).
pub const PAUSE_IP: &str = "127.0.0.18";

// === the test CA for origins ===

pub struct OriginCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pub cert_pem: String,
}

impl OriginCa {
    pub fn new() -> Self {
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::default();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "test origin CA");
        let cert = params.self_signed(&key).expect("CA");
        Self {
            cert_pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// A server config for `names`, offering `alpn`.
    pub fn server(&self, names: &[&str], alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let key = rcgen::KeyPair::generate().expect("key");
        let params =
            rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .expect("params");
        let cert = params.signed_by(&key, &self.issuer).expect("leaf");
        let mut c = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            )
            .expect("server config");
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(c)
    }
}

// === origins ===

/// An HTTPS origin (HTTP/1.1 and HTTP/2) answering `origin=<label> <method> <path> host=<host>`,
/// `/bytes/N` with N bytes, and echoing POST bodies.
pub async fn https_origin(
    ip: &str,
    config: Arc<rustls::ServerConfig>,
    label: &'static str,
) -> SocketAddr {
    let listener = TcpListener::bind((ip.parse::<IpAddr>().expect("ip"), 0))
        .await
        .expect("bind origin");
    let addr = listener.local_addr().expect("addr");
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| async move {
                        Ok::<_, std::convert::Infallible>(respond(req, label).await)
                    },
                );
                let mut builder =
                    hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                // Larger heads than the gateway lets through, so its bound is what refuses.
                builder.http2().max_header_list_size(1 << 20);
                let _ = builder
                    .serve_connection_with_upgrades(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    addr
}

/// A plain HTTP origin with the same answers.
pub async fn http_origin(ip: &str, label: &'static str) -> SocketAddr {
    let listener = TcpListener::bind((ip.parse::<IpAddr>().expect("ip"), 0))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| async move {
                        Ok::<_, std::convert::Infallible>(respond(req, label).await)
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    addr
}

async fn respond(
    mut req: hyper::Request<hyper::body::Incoming>,
    label: &str,
) -> hyper::Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    if path == "/no-upgrade" {
        // An upgrade refused, with connection-specific fields.
        return hyper::Response::builder()
            .status(407)
            .header("proxy-authenticate", "Basic realm=\"x\"")
            .header("connection", "x-hop")
            .header("keep-alive", "timeout=5")
            .header("x-hop", "1")
            .header("x-end", "1")
            .body(Full::new(Bytes::from_static(b"no")))
            .expect("response");
    }
    if let Some(asked) = req.headers().get(hyper::header::UPGRADE).cloned() {
        // Switches to what was asked (`/other-protocol`: to `h2c` whatever
        // was asked), then echoes.
        let to = if path == "/other-protocol" {
            hyper::header::HeaderValue::from_static("h2c")
        } else {
            asked
        };
        let on = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            if let Ok(up) = on.await {
                let mut io = TokioIo::new(up);
                let mut buf = [0u8; 1024];
                while let Ok(n) = io.read(&mut buf).await {
                    if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        });
        return hyper::Response::builder()
            .status(101)
            .header("connection", "upgrade")
            .header("upgrade", to)
            .body(Full::new(Bytes::new()))
            .expect("response");
    }
    if path == "/te" {
        // The `TE` the request arrived with.
        let te = req.headers().get("te").map(|v| v.as_bytes().to_vec());
        let te = String::from_utf8_lossy(&te.unwrap_or_default()).into_owned();
        return hyper::Response::new(Full::new(Bytes::from(format!("te={te}"))));
    }
    if path == "/wait" {
        // Answered after a moment: requests sent together overlap.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    if path == "/hop" {
        // Connection-specific fields, one of them named in `connection`.
        return hyper::Response::builder()
            .header("connection", "x-hop")
            .header("keep-alive", "timeout=5")
            .header("x-hop", "1")
            .header("x-end", "1")
            .body(Full::new(Bytes::from_static(b"hop")))
            .expect("response");
    }
    if let Some(n) = path
        .strip_prefix("/bytes/")
        .and_then(|n| n.parse::<usize>().ok())
    {
        return hyper::Response::new(Full::new(Bytes::from(vec![b'x'; n])));
    }
    let host = req
        .headers()
        .get("host")
        .and_then(|h| h.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.uri().authority().map(|a| a.to_string()))
        .unwrap_or_default();
    let method = req.method().to_string();
    let version = format!("{:?}", req.version());
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let text = format!(
        "origin={label} {method} {path} host={host} version={version} body={}",
        String::from_utf8_lossy(&body)
    );
    hyper::Response::new(Full::new(Bytes::from(text)))
}

/// An HTTP/2-only origin (the `h2` crate's server) that says GOAWAY when it
/// is asked for `/fast`, and finishes the streams in flight: `/slow` is
/// answered after a second, everything else at once. The answer is
/// `conn=<n>`, its connections numbered from 1. On its first connection,
/// `/hold` is never answered: 300 ms later the origin says GOAWAY with it as
/// the last stream, refusing the streams opened since, and closes.
/// `/bighead` is answered with a 96 KiB response head.
pub async fn goaway_origin(ip: &str, config: Arc<rustls::ServerConfig>) -> SocketAddr {
    let listener = TcpListener::bind((ip.parse::<IpAddr>().expect("ip"), 0))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    tokio::spawn(async move {
        let mut conns = 0u32;
        while let Ok((tcp, _)) = listener.accept().await {
            conns += 1;
            let (n, acceptor) = (conns, acceptor.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut conn) = h2::server::handshake(tls).await else {
                    return;
                };
                while let Some(Ok((req, mut respond))) = conn.accept().await {
                    if req.uri().path() == "/hold" && n == 1 {
                        // Streams the client opens meanwhile stay unread:
                        // the GOAWAY names this one as the last processed,
                        // and the connection closes.
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                        continue;
                    }
                    if req.uri().path() == "/bighead" {
                        // 96 KiB of response head, a few hundred bytes of
                        // HPACK once the field is in the dynamic table.
                        let mut head = http::Response::builder();
                        for i in 0..24 {
                            head = head.header(format!("x-big-{i}"), "v".repeat(4_000));
                        }
                        let head = head.body(()).expect("head");
                        let _ = respond.send_response(head, true);
                        continue;
                    }
                    let slow = req.uri().path() == "/slow";
                    if req.uri().path() == "/fast" {
                        conn.graceful_shutdown();
                    }
                    tokio::spawn(async move {
                        if slow {
                            tokio::time::sleep(Duration::from_millis(1_000)).await;
                        }
                        if let Ok(mut body) = respond.send_response(http::Response::new(()), false)
                        {
                            let _ = body.send_data(Bytes::from(format!("conn={n}")), true);
                        }
                    });
                }
            });
        }
    });
    addr
}

/// An origin a test writes itself: a TLS listener on `ip` (any port) that
/// hands each accepted, handshaken connection to `serve`, in a task of its own.
pub async fn tls_origin<F, Fut>(ip: &str, config: Arc<rustls::ServerConfig>, serve: F) -> SocketAddr
where
    F: Fn(tokio_rustls::server::TlsStream<TcpStream>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind((ip.parse::<IpAddr>().expect("ip"), 0))
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let serve = Arc::new(serve);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, serve) = (acceptor.clone(), serve.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    serve(tls).await;
                }
            });
        }
    });
    addr
}

/// A TLS service speaking a line protocol, not HTTP: `PING` → `PONG`.
pub async fn turn_origin(ip: &str, config: Arc<rustls::ServerConfig>) -> SocketAddr {
    tls_origin(ip, config, |mut tls| async move {
        let mut buf = [0u8; 5];
        if tls.read_exact(&mut buf).await.is_ok() && &buf == b"PING\n" {
            let _ = tls.write_all(b"PONG\n").await;
            let _ = tls.shutdown().await;
        }
    })
    .await
}

// === DNS upstream ===

/// The names and what was asked of them, in order.
struct Zone(HashMap<String, (Ipv4Addr, u32)>, Asked);

/// The names the DNS upstream was asked for, in order.
pub type Asked = Arc<std::sync::Mutex<Vec<String>>>;

#[async_trait::async_trait]
impl RequestHandler for Zone {
    async fn handle_request<R: ResponseHandler, T: Time>(
        &self,
        request: &Request,
        mut handle: R,
    ) -> ResponseInfo {
        let mut metadata = Metadata::response_from_request(&request.metadata);
        let q = request
            .queries
            .queries()
            .first()
            .map(|q| q.name().to_string())
            .unwrap_or_default();
        let key = q.trim_end_matches('.').to_ascii_lowercase();
        self.1.lock().expect("asked").push(key.clone());
        // An upstream slow to answer, for a drain that begins meanwhile.
        if key.starts_with("slow.") {
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        let records: Vec<Record> = match self.0.get(&key) {
            Some((ip, ttl)) => vec![Record::from_rdata(
                Name::from_ascii(&q).expect("name"),
                *ttl,
                RData::A(A(*ip)),
            )],
            None => {
                metadata.response_code = ResponseCode::NXDomain;
                vec![]
            }
        };
        let response = MessageResponseBuilder::from_message_request(request).build(
            metadata,
            records.iter(),
            [],
            [],
            [],
        );
        handle.send_response(response).await.expect("answer")
    }
}

async fn dns_upstream(zone: HashMap<String, (Ipv4Addr, u32)>) -> (SocketAddr, Asked) {
    let udp = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
    let addr = udp.local_addr().expect("addr");
    let asked = Asked::default();
    let mut server = hickory_server::Server::new(Zone(zone, asked.clone()));
    server.register_socket(udp);
    tokio::spawn(async move {
        let _ = server.block_until_done().await;
    });
    (addr, asked)
}

// === original destinations ===

/// The test's stand-in for `SO_ORIGINAL_DST`: clients register where they meant to go.
#[derive(Default)]
pub struct Redirects(Mutex<HashMap<SocketAddr, SocketAddr>>);

impl OriginalDst for Redirects {
    fn original_dst(&self, stream: &TcpStream) -> std::io::Result<SocketAddr> {
        let peer = stream.peer_addr()?;
        self.0
            .lock()
            .expect("lock")
            .get(&peer)
            .copied()
            .ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::NotFound, "no redirect recorded")
            })
    }
}

// === the flow log ===

#[derive(Clone, Default)]
pub struct Lines(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::Write::write(&mut *self.0.lock().expect("lock"), buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    pub fn records(&self) -> Vec<serde_json::Value> {
        let bytes = self.0.lock().expect("lock").clone();
        String::from_utf8(bytes)
            .expect("utf-8")
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect()
    }
}

// === the whole setup ===

pub struct Origins {
    pub api: SocketAddr,
    pub relay: SocketAddr,
    pub wrong_cert: SocketAddr,
    pub turn: SocketAddr,
    pub plain: SocketAddr,
    pub h1_only: SocketAddr,
    pub goaway: SocketAddr,
}

pub struct Env {
    pub gateway: Gateway,
    /// Attribution lifetimes run on this clock: tests move it, never sleep.
    pub clock: Arc<dns_attrib::ManualClock>,
    pub redirects: Arc<Redirects>,
    pub origins: Origins,
    pub origin_ca: OriginCa,
    pub flows: Lines,
    /// What the DNS upstream was asked.
    pub dns_asked: Asked,
    _dir: tempfile::TempDir,
}

pub struct Options {
    pub min_ttl: &'static str,
    pub max_ttl: &'static str,
    pub peek: &'static str,
    pub idle: &'static str,
    pub request_head: &'static str,
    /// `timeouts.drain`.
    pub drain: &'static str,
    pub max_connections: usize,
    /// With more than 0: `limits.thread_per_core` with this many worker threads.
    pub workers: usize,
    /// `splice.kernel`.
    pub splice: &'static str,
    /// `policy.opaque_streams`.
    pub opaque_streams: &'static str,
    /// `tls.ca_cert` and `tls.ca_key`; without, a CA made in the state directory.
    pub ca_files: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// More configuration, appended (e.g. an `[upstream_proxy]` section).
    pub extra: String,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            min_ttl: "30s",
            max_ttl: "1h",
            peek: "2s",
            idle: "10s",
            request_head: "30s",
            drain: "30s",
            max_connections: 10_000,
            workers: 0,
            splice: "off",
            opaque_streams: "allow",
            ca_files: None,
            extra: String::new(),
        }
    }
}

pub async fn env(opts: Options) -> Env {
    let ca = OriginCa::new();
    let both: &[&[u8]] = &[b"h2", b"http/1.1"];
    let origins = Origins {
        api: https_origin(
            API_IP,
            ca.server(&["api.example.test", "alias.example.test"], both),
            "api",
        )
        .await,
        relay: https_origin(
            RELAY_IP,
            ca.server(&["a.relay.example.test", "relay.example.test"], both),
            "relay",
        )
        .await,
        wrong_cert: https_origin(
            WRONG_CERT_IP,
            ca.server(&["other.example.test"], both),
            "wrong",
        )
        .await,
        turn: turn_origin(TURN_IP, ca.server(&["turn.example.test"], &[])).await,
        plain: http_origin(PLAIN_IP, "plain").await,
        h1_only: https_origin(
            H1_ONLY_IP,
            ca.server(&["h1.example.test"], &[b"http/1.1"]),
            "h1",
        )
        .await,
        goaway: goaway_origin(GOAWAY_IP, ca.server(&["goaway.example.test"], &[b"h2"])).await,
    };
    let ip = |s: &str| s.parse::<Ipv4Addr>().expect("ip");
    let zone: HashMap<String, (Ipv4Addr, u32)> = [
        ("api.example.test", (ip(API_IP), 300)),
        ("alias.example.test", (ip(API_IP), 300)),
        ("a.relay.example.test", (ip(RELAY_IP), 300)),
        ("relay.example.test", (ip(RELAY_IP), 300)),
        ("other.example.test", (ip(WRONG_CERT_IP), 300)),
        ("turn.example.test", (ip(TURN_IP), 300)),
        ("plain.example.test", (ip(PLAIN_IP), 300)),
        ("h1.example.test", (ip(H1_ONLY_IP), 300)),
        ("goaway.example.test", (ip(GOAWAY_IP), 300)),
        ("pause.example.test", (ip(PAUSE_IP), 300)),
        ("slow.example.test", (ip(API_IP), 300)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let (dns, dns_asked) = dns_upstream(zone).await;

    let dir = tempfile::tempdir().expect("temp dir");
    let roots = dir.path().join("origin-ca.pem");
    std::fs::write(&roots, &ca.cert_pem).expect("write roots");
    let toml = format!(
        r#"
        state_dir = "{state}"
        [listen]
        transparent = "127.0.0.1:0"
        dns = "127.0.0.1:0"
        dns_alt = "127.0.0.1:0"
        admin = "127.0.0.1:0"
        [dns]
        upstreams = ["{dns}"]
        min_ttl = "{min_ttl}"
        max_ttl = "{max_ttl}"
        [tls]
        extra_upstream_roots = ["{roots}"]
        {ca_files}
        [policy]
        platform_deny = [{{cidr = "169.254.0.0/16"}}, {{cidr = "10.0.0.0/8"}}]
        opaque_streams = "{opaque_streams}"
        [timeouts]
        peek = "{peek}"
        connect = "2s"
        tls_handshake = "2s"
        idle = "{idle}"
        request_head = "{request_head}"
        drain = "{drain}"
        [limits]
        max_connections = {max_connections}
        {per_core}
        [splice]
        kernel = "{splice}"
        {extra}
        "#,
        extra = opts.extra,
        state = dir.path().join("state").display(),
        roots = roots.display(),
        min_ttl = opts.min_ttl,
        max_ttl = opts.max_ttl,
        peek = opts.peek,
        idle = opts.idle,
        request_head = opts.request_head,
        drain = opts.drain,
        max_connections = opts.max_connections,
        splice = opts.splice,
        opaque_streams = opts.opaque_streams,
        ca_files = match &opts.ca_files {
            None => String::new(),
            Some((cert, key)) => format!(
                "ca_cert = \"{}\"\nca_key = \"{}\"",
                cert.display(),
                key.display()
            ),
        },
        per_core = match opts.workers {
            0 => String::new(),
            n => format!("thread_per_core = true\nworker_threads = {n}"),
        },
    );
    let config = Config::parse(&toml, std::path::Path::new("test.toml")).expect("config");
    let redirects = Arc::new(Redirects::default());
    let flows = Lines::default();
    let clock = dns_attrib::ManualClock::new();
    let gateway = Gateway::start_with_clock(
        config,
        redirects.clone(),
        FlowLog::to_writer(Box::new(flows.clone())),
        clock.clone(),
    )
    .await
    .expect("gateway starts");
    Env {
        gateway,
        clock,
        redirects,
        origins,
        origin_ca: ca,
        flows,
        dns_asked,
        _dir: dir,
    }
}

pub fn policy(json: &str) -> Policy {
    Policy::from_json(json).expect(json)
}

impl Env {
    /// Registers sandbox `id` on `addr` with `policy`.
    pub fn sandbox(&self, id: &str, addr: &str, policy: Policy) {
        self.gateway
            .registry()
            .put(SandboxId::new(id), vec![addr.parse().expect("ip")], policy)
            .expect("put");
    }

    /// Resolves `name` from `src` through the gateway's DNS listener.
    pub async fn resolve(&self, src: &str, name: &str) -> Message {
        let s = UdpSocket::bind((src.parse::<IpAddr>().expect("ip"), 0))
            .await
            .expect("bind");
        let mut q = Message::new(7, MessageType::Query, OpCode::Query);
        q.add_query(Query::query(
            Name::from_ascii(name).expect("name"),
            RecordType::A,
        ));
        s.send_to(&q.to_vec().expect("encode"), self.gateway.bound().dns)
            .await
            .expect("send");
        let mut buf = vec![0u8; 4096];
        let (n, _) = tokio::time::timeout(Duration::from_secs(3), s.recv_from(&mut buf))
            .await
            .expect("answer")
            .expect("recv");
        Message::from_vec(&buf[..n]).expect("parses")
    }

    /// A TCP connection from `src` "to" `dst`, as the redirect would deliver it.
    pub async fn connect(&self, src: &str, dst: SocketAddr) -> TcpStream {
        let sock = TcpSocket::new_v4().expect("socket");
        sock.bind((src.parse::<IpAddr>().expect("ip"), 0).into())
            .expect("bind");
        let local = sock.local_addr().expect("local");
        self.redirects.0.lock().expect("lock").insert(local, dst);
        let s = sock
            .connect(self.gateway.bound().transparent)
            .await
            .expect("connect");
        s.set_nodelay(true).expect("nodelay");
        s
    }

    /// A client TLS config trusting both the gateway CA and the origin CA.
    pub fn client_tls(&self, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(self.gateway.ca().cert_der().clone())
            .expect("gateway CA");
        for c in CertificateDer::pem_slice_iter(self.origin_ca.cert_pem.as_bytes()) {
            roots.add(c.expect("pem")).expect("origin CA");
        }
        let mut c = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(c)
    }

    /// TLS from `src` to `dst` with `sni`: the stream and whether the gateway
    /// (rather than the origin) presented the certificate.
    pub async fn tls(
        &self,
        src: &str,
        dst: SocketAddr,
        sni: &str,
        alpn: &[&[u8]],
    ) -> std::io::Result<(tokio_rustls::client::TlsStream<TcpStream>, bool)> {
        let tcp = self.connect(src, dst).await;
        let name = ServerName::try_from(sni.to_owned()).expect("server name");
        let tls = tokio_rustls::TlsConnector::from(self.client_tls(alpn))
            .connect(name, tcp)
            .await?;
        let leaf = tls.get_ref().1.peer_certificates().expect("certificates")[0].clone();
        let minted = issued_by_gateway(&leaf);
        Ok((tls, minted))
    }

    /// The flow log once it holds `n` lines (a flow's line is written when it ends).
    pub async fn flow_lines(&self, n: usize) -> Vec<serde_json::Value> {
        for _ in 0..100 {
            let lines = self.flows.records();
            if lines.len() >= n {
                return lines;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!(
            "the flow log has {} lines, not {n}: {:?}",
            self.flows.records().len(),
            self.flows.records()
        );
    }
}

/// Whether `leaf` was issued by the gateway's CA (its issuer name is in the DER).
fn issued_by_gateway(leaf: &CertificateDer<'_>) -> bool {
    let needle = b"egress-gateway interception CA";
    leaf.as_ref().windows(needle.len()).any(|w| w == needle)
}

/// POSTs `body` over HTTP/1.1 and returns status and response body.
pub async fn http_post<S>(
    io: S,
    host: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, String), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (status, body) = http_post_bytes(io, host, path, "application/octet-stream", body).await?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// [`http_post`] of a `content_type` body, with the response body as bytes.
pub async fn http_post_bytes<S>(
    io: S,
    host: &str,
    path: &str,
    content_type: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let req = hyper::Request::builder()
        .method("POST")
        .uri(path)
        .header("host", host)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let resp = s.send_request(req).await.map_err(|e| e.to_string())?;
    status_and_body(resp).await
}

/// Sends one HTTP request over `io` (HTTP/2 when negotiated) and returns status and body.
pub async fn http_get<S>(io: S, h2: bool, host: &str, path: &str) -> Result<(u16, String), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (status, body) = http_get_bytes(io, h2, host, path).await?;
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// [`http_get`] with the response body as bytes.
pub async fn http_get_bytes<S>(
    io: S,
    h2: bool,
    host: &str,
    path: &str,
) -> Result<(u16, Vec<u8>), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let req = hyper::Request::builder()
        .uri(if h2 {
            format!("https://{host}{path}")
        } else {
            path.to_owned()
        })
        .header("host", host)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let resp = if h2 {
        let (mut s, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        s.send_request(req).await.map_err(|e| e.to_string())?
    } else {
        let (mut s, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        s.send_request(req).await.map_err(|e| e.to_string())?
    };
    status_and_body(resp).await
}

async fn status_and_body(
    resp: hyper::Response<hyper::body::Incoming>,
) -> Result<(u16, Vec<u8>), String> {
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok((status, body.to_vec()))
}

/// An HTTP/2 client connection over `io`, driven by a task of its own.
pub async fn h2_client<S>(io: S) -> hyper::client::conn::http2::SendRequest<Full<Bytes>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (s, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(io))
        .await
        .expect("http/2");
    tokio::spawn(conn);
    s
}

/// The gateway with sandbox A allowed to `names` (each resolved through
/// the gateway, so attributed), intercepted.
pub async fn intercepting(names: &[&str]) -> Env {
    let e = env(Options::default()).await;
    e.sandbox("a", SANDBOX_A, intercepting_policy(names));
    for name in names {
        e.resolve(SANDBOX_A, &format!("{name}.")).await;
    }
    e
}

/// [`intercepting`]'s policy: `names` allowed, and the resolver.
pub fn intercepting_policy(names: &[&str]) -> Policy {
    let mut allow: Vec<serde_json::Value> = names
        .iter()
        .map(|n| serde_json::json!({"domain": n}))
        .collect();
    allow.push(serde_json::json!({"ip": "8.8.8.8"}));
    let doc = serde_json::json!({"allow": allow, "tls_interception": "on"});
    policy(&doc.to_string())
}

/// An HTTP/2 client connection from sandbox A to `dst`, its TLS
/// terminated by the gateway for `name`.
pub async fn intercepted_h2(
    e: &Env,
    dst: SocketAddr,
    name: &str,
) -> hyper::client::conn::http2::SendRequest<Full<Bytes>> {
    let (tls, minted) = e
        .tls(SANDBOX_A, dst, name, &[b"h2"])
        .await
        .expect("handshake");
    assert!(minted, "intercepted");
    h2_client(tls).await
}

/// One bodyless request on an HTTP/2 client connection: the response's
/// head and body.
pub async fn h2_send(
    s: &hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    method: http::Method,
    uri: &str,
) -> (http::response::Parts, String) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(uri)
        .body(Full::new(Bytes::new()))
        .expect("request");
    let resp = s.clone().send_request(req).await.expect("response");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    (parts, String::from_utf8_lossy(&body).into_owned())
}

/// GETs `path` from `host` on an open HTTP/1.1 connection, once it is
/// ready for another request; the status and the body.
pub async fn get_on(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    host: &str,
    path: &str,
) -> (u16, String) {
    sender.ready().await.expect("ready");
    let req = hyper::Request::builder()
        .uri(path)
        .header("host", host)
        .body(Full::default())
        .expect("request");
    let resp = sender.send_request(req).await.expect("response");
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Sandbox A's TLS to the HTTP/1.1-only origin as `h1.example.test`, its
/// TLS terminated by the gateway.
pub async fn h1_tls(e: &Env) -> tokio_rustls::client::TlsStream<TcpStream> {
    let (tls, minted) = e
        .tls(
            SANDBOX_A,
            e.origins.h1_only,
            "h1.example.test",
            &[b"http/1.1"],
        )
        .await
        .expect("handshake");
    assert!(minted, "intercepted");
    tls
}

/// [`h1_tls`] with a chunked upload begun (the head sent, no chunk yet):
/// a request in flight for as long as the test sends chunks.
pub async fn h1_upload(e: &Env) -> tokio_rustls::client::TlsStream<TcpStream> {
    let mut tls = h1_tls(e).await;
    tls.write_all(
        b"POST /up HTTP/1.1\r\nHost: h1.example.test\r\ntransfer-encoding: chunked\r\n\r\n",
    )
    .await
    .expect("head");
    tls
}

/// An HTTP/1.1 client connection from sandbox A to the HTTP/1.1-only
/// origin, its TLS terminated by the gateway.
pub async fn h1_client(e: &Env) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let tls = h1_tls(e).await;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("http/1.1");
    tokio::spawn(conn);
    sender
}

/// Whether an [`h1_client`]'s connection is seen closed within `within`:
/// its task notices the gateway's close when it next runs, which on a
/// loaded machine may be a moment after the close.
pub async fn h1_closed_within(
    h1: &hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    within: Duration,
) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while !h1.is_closed() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

/// Whether the gateway closed `s` without a byte (reset or close).
pub async fn closed_without_data(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 16];
    matches!(
        tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

/// The gateway's `/metrics` text.
pub async fn scrape(e: &Env) -> String {
    let mut s = tokio::net::TcpStream::connect(e.gateway.bound().admin)
        .await
        .expect("admin");
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")
        .await
        .expect("write");
    let mut text = String::new();
    s.read_to_string(&mut text).await.expect("read");
    text
}

/// The value of the series whose line starts with `series ` in `/metrics`.
pub async fn value(e: &Env, series: &str) -> u64 {
    let text = scrape(e).await;
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .unwrap_or_else(|| panic!("no series {series} in:\n{text}"))
        .trim()
        .parse()
        .expect("a count")
}
