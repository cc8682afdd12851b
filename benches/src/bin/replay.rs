//! `egress-replay`: re-creates the flows of a flow log (the gateway's own
//! JSONL) from inside a sandbox, and reports throughput, latency, bytes and
//! every flow whose verdict now differs from the recorded one — so a policy
//! change can be tried against yesterday's traffic before it is pushed.
//!
//! Per flow: resolve the first attributed name through the system resolver
//! (in a sandbox namespace, 8.8.8.8, i.e. the gateway), connect to the
//! recorded destination, speak TLS with the recorded SNI (or plain HTTP with
//! the recorded Host), and ask for `/bytes/N` with the recorded download size.
//! The verdict seen from the sandbox: a refused or reset connection or a
//! `403` is `deny`; a certificate from the gateway's CA `intercept`; one from
//! the origin `splice`; plain bytes that got through `allow`.
//!
//! ```sh
//! ip netns exec SANDBOX egress-replay --log flows.jsonl --gateway-ca gw.crt --origin-ca origin.crt
//! ```
//!
//! With `--shadow CANDIDATE` it sends nothing: each recorded decision is
//! judged again under the candidate and the differences are reported in the
//! shape of the gateway's shadow report ([`shadow`]).

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

#[path = "replay/shadow.rs"]
mod shadow;

#[derive(Parser)]
#[command(about = "Replay a flow log from inside a sandbox and compare verdicts")]
struct Args {
    /// The flow log (JSON lines, as the gateway writes them).
    #[arg(long)]
    log: PathBuf,
    /// The gateway's interception CA certificate.
    #[arg(long, required_unless_present = "shadow")]
    gateway_ca: Option<PathBuf>,
    /// The CA the origins' certificates chain to.
    #[arg(long, required_unless_present = "shadow")]
    origin_ca: Option<PathBuf>,
    /// A candidate policy: judge every recorded decision again under it
    /// and report the differences, offline (no traffic is replayed).
    #[arg(long)]
    shadow: Option<PathBuf>,
    /// Flows in flight at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Replay at this multiple of the recorded pace (0: as fast as possible).
    #[arg(long, default_value_t = 0.0)]
    speed: f64,
    /// Replay at most this many flows.
    #[arg(long)]
    limit: Option<usize>,
    /// Give up on a flow after this many seconds.
    #[arg(long, default_value_t = 10)]
    timeout: u64,
    /// With `--shadow`: judge only this sandbox's lines (a worker's log
    /// holds every sandbox's; the gateway's report is one sandbox's).
    #[arg(long, requires = "shadow")]
    sandbox: Option<String>,
    /// Replay even outside a network namespace of its own: every recorded
    /// destination is connected to, from wherever this runs.
    #[arg(long)]
    allow_network: bool,
    /// No progress bar (for logs and CI).
    #[arg(long)]
    quiet: bool,
}

/// The fields of a flow-log line the replay uses.
#[derive(Debug, Deserialize)]
struct Recorded {
    #[serde(default)]
    ts: Option<String>,
    #[serde(default)]
    sandbox: Option<String>,
    /// `tls`, `http`, a stream's name, `opaque`; absent before a flow was
    /// classified (and in logs older than the field).
    #[serde(default)]
    protocol: Option<String>,
    dst: Option<SocketAddr>,
    sni: Option<String>,
    host: Option<String>,
    #[serde(default)]
    attributed: Vec<String>,
    /// Names the line left out of `attributed` (it lists 8).
    #[serde(default)]
    attributed_left_out: Option<usize>,
    verdict: String,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    bytes_down: u64,
    /// Seconds since the first flow, when `ts` is not used (generated samples).
    #[serde(default)]
    offset_s: Option<f64>,
}

struct Outcome {
    verdict: &'static str,
    bytes: u64,
    elapsed: Duration,
    detail: String,
}

struct Clients {
    tls: Arc<rustls::ClientConfig>,
    gateway_ca_der: Vec<CertificateDer<'static>>,
}

fn load(path: Option<&PathBuf>) -> Result<Vec<CertificateDer<'static>>, String> {
    let path = path.ok_or("--gateway-ca and --origin-ca are required to replay")?;
    CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn clients(args: &Args) -> Result<Clients, String> {
    let gateway = load(args.gateway_ca.as_ref())?;
    let origin = load(args.origin_ca.as_ref())?;
    let mut roots = rustls::RootCertStore::empty();
    for c in gateway.iter().chain(&origin) {
        roots.add(c.clone()).map_err(|e| e.to_string())?;
    }
    let mut tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Clients {
        tls: Arc::new(tls),
        gateway_ca_der: gateway,
    })
}

async fn replay_one(c: &Clients, r: &Recorded) -> Outcome {
    let started = Instant::now();
    let outcome = |verdict, bytes, detail: String| Outcome {
        verdict,
        bytes,
        elapsed: started.elapsed(),
        detail,
    };
    let Some(dst) = r.dst else {
        return outcome("deny", 0, "no destination recorded".into());
    };
    if let Some(name) = r.attributed.first() {
        // The sandbox's own lookup, through its resolver (the gateway).
        let _ = tokio::net::lookup_host((name.as_str(), dst.port())).await;
    }
    let tcp = match TcpStream::connect(dst).await {
        Ok(t) => t,
        Err(e) => return outcome("deny", 0, format!("connect: {e}")),
    };
    let _ = tcp.set_nodelay(true);
    let tls = r.sni.is_some() || dst.port() == 443;
    let host = r
        .sni
        .clone()
        .or_else(|| r.host.clone())
        .unwrap_or_else(|| dst.ip().to_string());
    let path = format!("/bytes/{}", r.bytes_down.min(8 << 20));
    if !tls {
        return match http_get(tcp, &host, &path).await {
            Ok((403, n)) => outcome("deny", n, "403".into()),
            Ok((_, n)) => outcome("allow", n, String::new()),
            Err(e) => outcome("deny", 0, e),
        };
    }
    let name = match ServerName::try_from(host.clone()) {
        Ok(n) => n,
        Err(e) => return outcome("deny", 0, format!("server name {host:?}: {e}")),
    };
    let stream = match tokio_rustls::TlsConnector::from(c.tls.clone())
        .connect(name, tcp)
        .await
    {
        Ok(s) => s,
        Err(e) => return outcome("deny", 0, format!("TLS: {e}")),
    };
    let minted = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|chain| chain.last())
        .is_some_and(|top| c.gateway_ca_der.iter().any(|ca| ca == top));
    let verdict = if minted { "intercept" } else { "splice" };
    match http_get(stream, &host, &path).await {
        Ok((403, n)) => outcome("deny", n, "403 after termination".into()),
        Ok((_, n)) => outcome(verdict, n, String::new()),
        // A non-HTTP service: the verdict is the handshake's.
        Err(e) => outcome(verdict, 0, e),
    }
}

/// One GET with `Connection: close`: the status and the bytes read.
async fn http_get<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    host: &str,
    path: &str,
) -> Result<(u16, u64), String> {
    let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut head = Vec::new();
    let mut total = 0u64;
    loop {
        let n = s.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if head.len() < 16 {
            head.extend_from_slice(&buf[..n.min(16)]);
        }
    }
    let status = std::str::from_utf8(head.get(9..12).unwrap_or_default())
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| "no HTTP status".to_owned())?;
    Ok((status, total))
}

/// A line longer than this is not a flow-log line (the gateway's are a few
/// KiB): skipped, not read whole.
const MAX_LINE: u64 = 64 * 1024;

/// The flow log's lines, at most `limit`. A line that does not read (cut
/// by a full disk, not UTF-8, too long) is skipped and named on stderr;
/// only a failing read stops it.
fn read_log(path: &PathBuf, limit: Option<usize>) -> Result<Vec<Recorded>, String> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut reader = std::io::BufReader::new(file);
    let mut flows = Vec::new();
    let (mut line, mut skipped) = (Vec::new(), 0usize);
    for number in 1.. {
        line.clear();
        let n = (&mut reader)
            .take(MAX_LINE)
            .read_until(b'\n', &mut line)
            .map_err(|e| format!("{}:{number}: {e}", path.display()))?;
        if n == 0 {
            break;
        }
        if !line.ends_with(b"\n") && n as u64 == MAX_LINE {
            // The rest of an overlong line.
            let mut rest = Vec::new();
            let _ = reader.read_until(b'\n', &mut rest);
        }
        if line.trim_ascii().is_empty() {
            continue;
        }
        match serde_json::from_slice::<Recorded>(&line) {
            Ok(r) => flows.push(r),
            Err(e) => {
                skipped += 1;
                eprintln!("egress-replay: {}:{number}: skipped: {e}", path.display());
            }
        }
        if limit.is_some_and(|l| flows.len() >= l) {
            break;
        }
    }
    if skipped > 0 {
        eprintln!("egress-replay: {skipped} line(s) skipped");
    }
    Ok(flows)
}

/// Whether this process runs in a named network namespace (`ip netns
/// exec`: one of `/run/netns`), or one other than PID 1's: a replay
/// connects to every recorded destination, which only a sandbox's
/// namespace keeps off the host's network.
fn in_own_netns() -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(mine) = std::fs::metadata("/proc/self/ns/net") else {
        return false;
    };
    let same = |m: &std::fs::Metadata| m.dev() == mine.dev() && m.ino() == mine.ino();
    let named = std::fs::read_dir("/run/netns").is_ok_and(|dir| {
        dir.flatten()
            .any(|e| std::fs::metadata(e.path()).is_ok_and(|m| same(&m)))
    });
    named || std::fs::metadata("/proc/1/ns/net").is_ok_and(|init| !same(&init))
}

/// `--shadow`: the recorded decisions judged under the candidate.
fn shadow_report(args: &Args, candidate: &std::path::Path) -> Result<serde_json::Value, String> {
    let policy = shadow::candidate(candidate)?;
    let flows = read_log(&args.log, args.limit)?;
    Ok(shadow::report(&policy, &flows, args.sandbox.as_deref()))
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(candidate) = &args.shadow {
        return print_shadow(&args, candidate);
    }
    if !args.allow_network && !in_own_netns() {
        eprintln!("egress-replay: not in a network namespace of its own: a replay connects to every recorded destination (run it with `ip netns exec SANDBOX`, or pass --allow-network)");
        return ExitCode::FAILURE;
    }
    let (c, flows) = match setup(&args) {
        Ok(setup) => setup,
        Err(e) => {
            eprintln!("egress-replay: {e}");
            return ExitCode::FAILURE;
        }
    };
    let total = flows.len();
    let bar = if args.quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(total as u64)
    };
    let started = Instant::now();
    let tasks = replay_all(&args, &c, flows, &bar, started).await;
    let tally = Tally::collect(tasks).await;
    bar.finish_and_clear();
    report(total, started.elapsed().as_secs_f64(), tally)
}

/// `--shadow`: prints the report, or why there is none.
fn print_shadow(args: &Args, candidate: &std::path::Path) -> ExitCode {
    match shadow_report(args, candidate) {
        Ok(report) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).unwrap_or_default()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("egress-replay: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The TLS clients, then the flows to replay.
fn setup(args: &Args) -> Result<(Arc<Clients>, Vec<Recorded>), String> {
    let c = Arc::new(clients(args)?);
    let flows = read_log(&args.log, args.limit)?;
    Ok((c, flows))
}

/// One replayed flow: its index in the log, the record, what happened.
type Replayed = (usize, Recorded, Outcome);

/// Starts every flow, `--concurrency` at a time, at the recorded pace
/// times `--speed` (if set), each bounded by `--timeout`.
async fn replay_all(
    args: &Args,
    c: &Arc<Clients>,
    flows: Vec<Recorded>,
    bar: &indicatif::ProgressBar,
    started: Instant,
) -> Vec<tokio::task::JoinHandle<Replayed>> {
    let gate = Arc::new(tokio::sync::Semaphore::new(args.concurrency.max(1)));
    let limit = Duration::from_secs(args.timeout);
    let mut tasks = Vec::with_capacity(flows.len());
    for (i, r) in flows.into_iter().enumerate() {
        if args.speed > 0.0 {
            if let Some(at) = r.offset_s.filter(|at| at.is_finite() && *at >= 0.0) {
                let due = Duration::try_from_secs_f64(at / args.speed).unwrap_or(Duration::MAX);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    tokio::time::sleep(wait).await;
                }
            }
        }
        let (c, gate, bar) = (c.clone(), gate.clone(), bar.clone());
        let permit = gate.acquire_owned().await;
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let o = match tokio::time::timeout(limit, replay_one(&c, &r)).await {
                Ok(o) => o,
                Err(_) => Outcome {
                    verdict: "timeout",
                    bytes: 0,
                    elapsed: limit,
                    detail: "timed out".into(),
                },
            };
            bar.inc(1);
            (i, r, o)
        }));
    }
    tasks
}

/// What the replayed flows add up to.
struct Tally {
    latency: Histogram<u64>,
    bytes: u64,
    mismatches: Vec<serde_json::Value>,
}

impl Tally {
    /// Waits for every flow, in log order.
    async fn collect(tasks: Vec<tokio::task::JoinHandle<Replayed>>) -> Self {
        // Microseconds, 1 µs to 1 h, 3 significant digits: constant, valid bounds.
        let mut latency =
            Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("valid constant bounds");
        let mut bytes = 0u64;
        let mut mismatches = Vec::new();
        for t in tasks {
            let Ok((i, r, o)) = t.await else { continue };
            let _ = latency.record(o.elapsed.as_micros() as u64);
            bytes += o.bytes;
            if o.verdict != r.verdict {
                mismatches.push(serde_json::json!({
                    "line": i + 1,
                    "dst": r.dst,
                    "sni": r.sni,
                    "host": r.host,
                    "recorded": r.verdict,
                    "replayed": o.verdict,
                    "detail": o.detail,
                    "ts": r.ts,
                }));
            }
        }
        Self {
            latency,
            bytes,
            mismatches,
        }
    }
}

/// Prints the report of `total` flows over `secs`: success if no verdict
/// differs, 2 if one does.
fn report(total: usize, secs: f64, tally: Tally) -> ExitCode {
    let Tally {
        latency,
        bytes,
        mismatches,
    } = tally;
    let report = serde_json::json!({
        "flows": total,
        "seconds": (secs * 1000.0).round() / 1000.0,
        "flows_per_second": if secs > 0.0 { (total as f64 / secs).round() } else { 0.0 },
        "latency_ms": {
            "p50": latency.value_at_quantile(0.5) as f64 / 1000.0,
            "p90": latency.value_at_quantile(0.9) as f64 / 1000.0,
            "p99": latency.value_at_quantile(0.99) as f64 / 1000.0,
            "max": latency.max() as f64 / 1000.0,
        },
        "bytes_down": bytes,
        "mismatches": mismatches.len(),
        "mismatched_flows": mismatches,
    });
    println!(
        "{}",
        serde_json::to_string_pretty(&report).unwrap_or_default()
    );
    if report["mismatches"] == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    }
}
