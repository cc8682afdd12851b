//! `egress-pushload`: the gateway's control API at fleet scale, against the
//! release binary as a process (its real fsyncs, its real memory). For each
//! registered-sandbox count it measures the streamed resync (time, peak
//! RSS), single pushes (p50/p99, pushes/s) with 1 and 16 concurrent pushers,
//! the explain route's latency (the decision path, sharing the registry)
//! idle and during the push storm, restart-to-ready, and RSS per sandbox.
//! Each sandbox has one address and a 21-rule policy. Bounded in count and
//! time; loopback only.
//!
//! `cargo build --release -p egress-gateway -p egress-benches &&
//!  target/release/egress-pushload --gateway target/release/egress-gateway`

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// The gateway binary (the release build).
    #[arg(long)]
    gateway: PathBuf,
    /// Registered-sandbox counts to measure at.
    #[arg(long, value_delimiter = ',', default_value = "10,1000,10000,20000")]
    sizes: Vec<usize>,
    /// Pushes per measurement.
    #[arg(long, default_value_t = 2_000)]
    pushes: usize,
    /// Where state directories go (a real disk: fsync costs are the point).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

/// A 21-rule policy for sandbox `i`.
fn policy(i: usize, v: usize) -> serde_json::Value {
    let mut allow: Vec<serde_json::Value> = (0..18)
        .map(|k| json!({"domain": format!("svc{k}.tenant{i}.example.test")}))
        .collect();
    allow.push(json!({"cidr": "203.0.113.0/24"}));
    allow.push(json!({"ip": "8.8.8.8"}));
    json!({"default": "deny", "tls_interception": "on", "allow": allow,
           "deny": [{"domain": format!("v{v}.blocked.example.test")}]})
}

fn address(i: usize) -> String {
    format!("100.{}.{}.{}", 64 + i / 65_536, (i / 256) % 256, i % 256)
}

/// One keep-alive HTTP/1.1 connection to the admin API.
struct Conn(hyper::client::conn::http1::SendRequest<Full<Bytes>>);

impl Conn {
    async fn open(addr: SocketAddr) -> Result<Self, String> {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        Ok(Self(sender))
    }

    async fn send(
        &mut self,
        method: &str,
        path: &str,
        ctype: &str,
        body: String,
    ) -> Result<u16, String> {
        self.0.ready().await.map_err(|e| e.to_string())?;
        let req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "127.0.0.1")
            .header("content-type", ctype)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let resp = self.0.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        resp.into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        Ok(status)
    }
}

struct Gw {
    child: Child,
    admin: SocketAddr,
}

fn kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

async fn start(bin: &Path, state: &Path) -> Result<(Gw, Duration), String> {
    let admin: SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?;
    let cfg = state.with_extension("toml");
    std::fs::write(&cfg, format!(
        "state_dir = \"{}\"\n[listen]\ntransparent = \"127.0.0.1:0\"\ndns = \"127.0.0.1:0\"\ndns_alt = \"127.0.0.1:0\"\nadmin = \"{admin}\"\n[log]\nflow_log = \"off\"\n[limits]\nworker_threads = 2\n",
        state.display())).map_err(|e| e.to_string())?;
    let started = Instant::now();
    let child = Command::new(bin)
        .args(["run", "--config"])
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    loop {
        if let Ok(mut c) = Conn::open(admin).await {
            if c.send("GET", "/readyz", "text/plain", String::new()).await == Ok(200) {
                return Ok((Gw { child, admin }, started.elapsed()));
            }
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err("the gateway did not become ready".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

/// `count` pushes over `pushers` connections to the `size` registered sandboxes; latencies in ms.
async fn storm(
    admin: SocketAddr,
    size: usize,
    count: usize,
    pushers: usize,
    round: usize,
) -> Result<(Vec<f64>, f64), String> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..pushers {
        tasks.push(tokio::spawn(async move {
            let mut c = Conn::open(admin).await?;
            let mut lat = Vec::new();
            for k in (p..count).step_by(pushers) {
                let i = (k * 7919) % size;
                let body =
                    json!({"addresses": [address(i)], "policy": policy(i, round * count + k)})
                        .to_string();
                let t = Instant::now();
                let status = c
                    .send(
                        "PUT",
                        &format!("/v1/sandboxes/sb-{i}"),
                        "application/json",
                        body,
                    )
                    .await?;
                if status != 200 {
                    return Err(format!("push: {status}"));
                }
                lat.push(t.elapsed().as_secs_f64() * 1000.0);
            }
            Ok::<_, String>(lat)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.map_err(|e| e.to_string())??);
    }
    Ok((all, count as f64 / started.elapsed().as_secs_f64()))
}

/// Explain latencies (ms) while `busy` runs.
async fn explains(admin: SocketAddr, size: usize, n: usize) -> Result<Vec<f64>, String> {
    let mut c = Conn::open(admin).await?;
    let mut lat = Vec::new();
    for k in 0..n {
        let i = (k * 31) % size;
        let body = json!({"sandbox": format!("sb-{i}"), "dst": "203.0.113.7:443", "tls": true, "sni": format!("svc3.tenant{i}.example.test")}).to_string();
        let t = Instant::now();
        c.send("POST", "/v1/explain", "application/json", body)
            .await?;
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(lat)
}

async fn measure(args: &Args, size: usize) -> Result<serde_json::Value, String> {
    let state = args
        .dir
        .join(format!("egress-pushload-{}-{size}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    let (gw, _) = start(&args.gateway, &state).await?;
    let pid = gw.child.id();
    let base_rss = kb(pid, "VmRSS:");
    let mut ndjson = String::new();
    for i in 0..size {
        ndjson.push_str(
            &json!({"id": format!("sb-{i}"), "addresses": [address(i)], "policy": policy(i, 0)})
                .to_string(),
        );
        ndjson.push('\n');
    }
    let t = Instant::now();
    let status = Conn::open(gw.admin)
        .await?
        .send("PUT", "/v1/sandboxes", "application/x-ndjson", ndjson)
        .await?;
    let resync_s = t.elapsed().as_secs_f64();
    if status != 200 {
        return Err(format!("resync: {status}"));
    }
    let rss_kb = kb(pid, "VmRSS:");
    let peak_kb = kb(pid, "VmHWM:");
    let mut idle = explains(gw.admin, size, 500).await?;
    let mut out = json!({"sandboxes": size, "resync_s": resync_s, "rss_mib": rss_kb as f64 / 1024.0, "peak_rss_mib": peak_kb as f64 / 1024.0,
        "rss_per_sandbox_kib": (rss_kb.saturating_sub(base_rss)) as f64 / size.max(1) as f64,
        "explain_idle_ms": {"p50": pct(&mut idle, 0.5), "p99": pct(&mut idle, 0.99)}});
    for (round, pushers) in [1usize, 16].into_iter().enumerate() {
        let admin = gw.admin;
        let busy = tokio::spawn(async move { explains(admin, size, 500).await });
        let (mut lat, rate) = storm(gw.admin, size, args.pushes, pushers, round + 1).await?;
        let mut during = busy.await.map_err(|e| e.to_string())??;
        out[format!("pushers_{pushers}")] = json!({"p50_ms": pct(&mut lat, 0.5), "p99_ms": pct(&mut lat, 0.99), "pushes_per_s": rate,
            "explain_during_ms": {"p50": pct(&mut during, 0.5), "p99": pct(&mut during, 0.99)}});
    }
    let mut gw = gw;
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = gw.child.wait();
    let (mut again, ready) = start(&args.gateway, &state).await?;
    out["restart_to_ready_s"] = json!(ready.as_secs_f64());
    let _ = again.child.kill();
    let _ = again.child.wait();
    let _ = std::fs::remove_dir_all(&state);
    let _ = std::fs::remove_file(state.with_extension("toml"));
    Ok(out)
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let args = Arc::new(Args::parse());
    for &size in &args.sizes {
        let row = tokio::time::timeout(Duration::from_secs(600), measure(&args, size))
            .await
            .map_err(|_| format!("{size}: over 10 minutes"))??;
        println!("{row}");
    }
    Ok(())
}
