//! The processes: gateways, dispatchers, and their CPU time (and
//! PostgreSQL's) from /proc.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A child process, killed (by its PID) when dropped.
pub(crate) struct Proc(pub(crate) Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A gateway process; its admin API on `admin`.
pub(crate) struct Gw {
    pub(crate) proc: Proc,
    pub(crate) admin: SocketAddr,
    cfg: PathBuf,
}

impl Gw {
    pub(crate) async fn start(bin: &Path, state: &Path) -> Result<Self, String> {
        let admin: SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?;
        let cfg = state.with_extension("toml");
        std::fs::write(&cfg, format!(
            "state_dir = \"{}\"\n[listen]\ntransparent = \"127.0.0.1:0\"\ndns = \"127.0.0.1:0\"\ndns_alt = \"127.0.0.1:0\"\nadmin = \"{admin}\"\n[log]\nflow_log = \"off\"\n[limits]\nworker_threads = 1\n",
            state.display())).map_err(|e| e.to_string())?;
        let proc = spawn(bin, &cfg)?;
        let gw = Self { proc, admin, cfg };
        gw.ready().await?;
        Ok(gw)
    }

    /// SIGKILL, then the same configuration again: its epoch and when it was ready.
    pub(crate) async fn restart(&mut self, bin: &Path) -> Result<(String, Instant), String> {
        let _ = self.proc.0.kill();
        let _ = self.proc.0.wait();
        self.proc = spawn(bin, &self.cfg)?;
        let epoch = self.ready().await?;
        Ok((epoch, Instant::now()))
    }

    /// Waits for `GET /readyz` (≤ 120 s); the epoch it reports.
    async fn ready(&self) -> Result<String, String> {
        let url = format!("http://{}", self.admin);
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            if let Ok((s, Value::String(t))) = egress_controller::gateway_client::call(
                &url,
                "",
                http::Method::GET,
                "/readyz",
                None,
            )
            .await
            {
                if s.is_success() {
                    let epoch = t.split_whitespace().find_map(|w| w.strip_prefix("epoch="));
                    return Ok(epoch.unwrap_or_default().to_owned());
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Err(format!("the gateway {} did not become ready", self.admin))
    }
}

fn spawn(bin: &Path, cfg: &Path) -> Result<Proc, String> {
    Command::new(bin)
        .args(["run", "--config"])
        .arg(cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map(Proc)
        .map_err(|e| format!("{}: {e}", bin.display()))
}

/// What starting a dispatcher process takes.
pub(crate) struct DispatcherEnv {
    bin: PathBuf,
    tenants: PathBuf,
    url: String,
    logs: PathBuf,
    /// The PostgreSQL postmaster's PID (from the cluster's data directory), if known.
    postmaster: Option<u32>,
}

impl DispatcherEnv {
    pub(crate) fn new(bin: &Path, dir: &Path, url: &str) -> Result<Self, String> {
        let tenants = dir.join("tenants.json");
        std::fs::write(
            &tenants,
            format!(
                r#"{{"tokens": {{"{}": {{"tenant": "t1", "federated": true, "admin": true}}}}}}"#,
                crate::TOKEN
            ),
        )
        .map_err(|e| e.to_string())?;
        let postmaster = std::env::var("EGRESS_PG_DIR").ok().and_then(|d| {
            let pid = std::fs::read_to_string(Path::new(&d).join("data/postmaster.pid")).ok()?;
            pid.lines().next()?.trim().parse().ok()
        });
        Ok(Self {
            bin: bin.to_owned(),
            tenants,
            url: url.to_owned(),
            logs: dir.to_owned(),
            postmaster,
        })
    }
}

/// Running dispatcher processes.
pub(crate) struct Dispatchers(Vec<Proc>);

impl Dispatchers {
    pub(crate) fn start(env: &DispatcherEnv, n: usize) -> Result<Self, String> {
        let mut procs = Vec::new();
        for i in 0..n {
            let log = std::fs::File::options()
                .create(true)
                .append(true)
                .open(env.logs.join(format!("dispatcher{i}.log")))
                .map_err(|e| e.to_string())?;
            let child = Command::new(&env.bin)
                .args(["dispatcher", "--tenants"])
                .arg(&env.tenants)
                .args([
                    "--lease-ttl",
                    "3s",
                    "--resync-interval",
                    "1s",
                    "--metrics-listen",
                    "127.0.0.1:0",
                ])
                .env("DATABASE_URL", &env.url)
                .env("RUST_LOG", "info")
                .env_remove("SPACE_EGRESS_PROFILES")
                .env_remove("SPACE_TLS_INTERCEPTION_EXEMPTIONS")
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .map_err(|e| format!("{}: {e}", env.bin.display()))?;
            procs.push(Proc(child));
        }
        Ok(Self(procs))
    }

    /// SIGTERM each (they give their leases up), then waits (≤ 10 s each).
    pub(crate) async fn stop(mut self) {
        for p in &self.0 {
            let _ = Command::new("kill")
                .args(["-TERM", &p.0.id().to_string()])
                .status();
        }
        for p in &mut self.0 {
            for _ in 0..200 {
                if p.0.try_wait().ok().flatten().is_some() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    fn pids(&self) -> Vec<u32> {
        self.0.iter().map(|p| p.0.id()).collect()
    }
}

/// CPU seconds spent by PostgreSQL, the dispatchers, the gateways, this process.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Cpu {
    postgres: f64,
    dispatchers: f64,
    gateways: f64,
    this: f64,
}

impl Cpu {
    pub(crate) fn sample(ds: &Dispatchers, gws: &[Gw], env: &DispatcherEnv) -> Self {
        let postgres = env.postmaster.map_or(0.0, |pm| {
            // Backends that ended count in the postmaster's children's time.
            let ended = cpu_fields(pm, 13, 14);
            let mut pids = children(pm);
            pids.push(pm);
            ended + pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>()
        });
        Self {
            postgres,
            dispatchers: ds.pids().iter().map(|p| cpu_seconds(*p)).sum(),
            gateways: gws.iter().map(|g| cpu_seconds(g.proc.0.id())).sum(),
            this: cpu_seconds(std::process::id()),
        }
    }

    pub(crate) fn minus(self, before: &Self) -> Self {
        Self {
            postgres: self.postgres - before.postgres,
            dispatchers: self.dispatchers - before.dispatchers,
            gateways: self.gateways - before.gateways,
            this: self.this - before.this,
        }
    }

    /// Cores' worth each used over `wall` seconds.
    pub(crate) fn shares(&self, wall: f64) -> Value {
        let r = |v: f64| (v / wall * 100.0).round() / 100.0;
        json!({"postgres": r(self.postgres), "dispatchers": r(self.dispatchers),
            "gateways": r(self.gateways), "api_and_bench": r(self.this)})
    }
}

/// utime + stime of a process (its threads included), in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    cpu_fields(pid, 11, 12)
}

/// Two clock-tick fields of /proc/PID/stat (counted after the command), in seconds.
fn cpu_fields(pid: u32, a: usize, b: usize) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some(after) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
        return 0.0;
    };
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime, stime are fields 14, 15 of the line (11, 12 after the
    // command); cutime, cstime 16, 17.
    (ticks(a) + ticks(b)) / 100.0
}

/// The processes whose parent is `parent`.
fn children(parent: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    let after = &s[s.rfind(')')? + 2..];
                    after.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(parent)
        })
        .collect()
}
