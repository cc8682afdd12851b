//! The tour's throwaway world: three network namespaces made for one run —
//! a sandbox, the gateway's worker, and a fake internet — joined by veth
//! pairs on 100.64.0.0/10, with the fake internet's origins and DNS server on
//! 203.0.113.0/24 and 198.51.100.0/24. No namespace has a route to the host's
//! network, and the worker namespace forwards nothing: every byte the
//! sandbox sends crosses the gateway process or is dropped.
//!
//! [`Teardown`] remembers everything made (processes by PID, namespaces,
//! files) and undoes it once, whether the tour ends, fails or is
//! interrupted.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The sandbox's address; the gateway knows it by this.
pub(crate) const SANDBOX_IP: &str = "100.64.1.2";
/// The worker's side of the sandbox's link: the interface the redirect
/// rules are installed for.
const SANDBOX_IFACE: &str = "sb0";
/// The gateway's admin listener (its default), inside the worker namespace.
pub(crate) const ADMIN: &str = "http://127.0.0.1:15000";

/// What a run made, undone once.
#[derive(Default)]
pub(crate) struct Teardown {
    made: Mutex<Made>,
}

#[derive(Default)]
struct Made {
    pids: Vec<u32>,
    namespaces: Vec<String>,
    paths: Vec<PathBuf>,
}

impl Teardown {
    /// Ends the processes (by PID), deletes the namespaces (and with them
    /// the redirect rules and veth pairs) and the run's files. Idempotent.
    pub(crate) fn run(&self) {
        let made = std::mem::take(&mut *self.made.lock().unwrap_or_else(|e| e.into_inner()));
        for pid in made.pids.iter().rev() {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .output();
        }
        for ns in made.namespaces.iter().rev() {
            let _ = Command::new("ip").args(["netns", "delete", ns]).output();
        }
        for path in made.paths.iter().rev() {
            let _ = std::fs::remove_dir_all(path);
        }
    }

    fn with(&self, f: impl FnOnce(&mut Made)) {
        f(&mut self.made.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// The three namespaces, the fake internet and the gateway, running.
pub(crate) struct Stage {
    pub(crate) sandbox: String,
    pub(crate) worker: String,
    pub(crate) dir: PathBuf,
    teardown: Arc<Teardown>,
}

impl Stage {
    /// Builds the world; on any failure what was made so far is left to
    /// `teardown` (the caller runs it).
    pub(crate) fn build(bins: &Bins, teardown: Arc<Teardown>) -> Result<Self, String> {
        let tag = std::process::id();
        let dir = std::env::temp_dir().join(format!("egress-demo-{tag}"));
        // A folder of this run's own, made now, readable by root alone: one
        // already there (anyone may create names in /tmp) could be another
        // user's, who could then swap the gateway's config under root.
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        teardown.with(|m| m.paths.push(dir.clone()));
        let stage = Self {
            sandbox: format!("egd-sandbox-{tag}"),
            worker: format!("egd-worker-{tag}"),
            dir,
            teardown,
        };
        let internet = format!("egd-internet-{tag}");
        for ns in [&stage.sandbox, &stage.worker, &internet] {
            stage.namespace(ns)?;
        }
        stage.links(&internet)?;
        stage.resolver()?;
        stage.start_internet(bins, &internet)?;
        let worker = stage.worker.as_str();
        let fwd = [
            "netns",
            "exec",
            worker,
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=0",
        ];
        sh("ip", &fwd)?;
        let gateway = bins.gateway.to_string_lossy();
        let redirect = ["redirect", "--sandbox-iface", SANDBOX_IFACE, "--apply"];
        stage.exec_ok(worker, &gateway, &redirect)?;
        stage.start_gateway(bins)?;
        Ok(stage)
    }

    fn namespace(&self, ns: &str) -> Result<(), String> {
        sh("ip", &["netns", "add", ns])?;
        self.teardown.with(|m| m.namespaces.push(ns.to_owned()));
        sh("ip", &["-n", ns, "link", "set", "lo", "up"])
    }

    /// The sandbox's resolver is 8.8.8.8, as in a sandbox image: its
    /// tools' lookups go to the gateway's DNS proxy (`ip netns exec` reads
    /// /etc/netns/<ns>/resolv.conf in place of /etc/resolv.conf).
    fn resolver(&self) -> Result<(), String> {
        let etc = Path::new("/etc/netns").join(&self.sandbox);
        self.teardown.with(|m| m.paths.push(etc.clone()));
        std::fs::create_dir_all(&etc)
            .and_then(|()| {
                std::fs::write(
                    etc.join("resolv.conf"),
                    "nameserver 8.8.8.8\noptions timeout:2 attempts:1\n",
                )
            })
            .map_err(|e| format!("{}: {e}", etc.display()))
    }

    /// sandbox ── sb0 (worker) ── inet0 (worker) ── internet; the worker
    /// routes only the two documentation ranges, towards the internet.
    fn links(&self, internet: &str) -> Result<(), String> {
        let (w, s) = (self.worker.as_str(), self.sandbox.as_str());
        for (peer, iface, mine, theirs) in [
            (s, SANDBOX_IFACE, "100.64.1.1/30", "100.64.1.2/30"),
            (internet, "inet0", "100.64.3.1/30", "100.64.3.2/30"),
        ] {
            let veth = [
                "-n", w, "link", "add", iface, "type", "veth", "peer", "name", "eth0",
            ];
            sh("ip", &[&veth[..], &["netns", peer]].concat())?;
            sh("ip", &["-n", w, "addr", "add", mine, "dev", iface])?;
            sh("ip", &["-n", w, "link", "set", iface, "up"])?;
            sh("ip", &["-n", peer, "addr", "add", theirs, "dev", "eth0"])?;
            sh("ip", &["-n", peer, "link", "set", "eth0", "up"])?;
        }
        sh(
            "ip",
            &["-n", s, "route", "add", "default", "via", "100.64.1.1"],
        )?;
        for net in ["203.0.113.0/24", "198.51.100.0/24"] {
            sh("ip", &["-n", w, "route", "add", net, "via", "100.64.3.2"])?;
        }
        sh(
            "ip",
            &[
                "-n",
                internet,
                "route",
                "add",
                "100.64.0.0/10",
                "via",
                "100.64.3.1",
            ],
        )?;
        for a in egress_integration::addresses() {
            let a = format!("{a}/32");
            sh("ip", &["-n", internet, "addr", "add", &a, "dev", "lo"])?;
        }
        Ok(())
    }

    fn start_internet(&self, bins: &Bins, internet: &str) -> Result<(), String> {
        let mut child = Command::new("ip")
            .args(["netns", "exec", internet])
            .arg(&bins.internet)
            .arg("--ca-dir")
            .arg(self.dir.join("internet-ca"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("{}: {e}", bins.internet.display()))?;
        self.teardown.with(|m| m.pids.push(child.id()));
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            let _ = BufReader::new(out).read_line(&mut line);
        }
        if line.trim() == "ready" {
            Ok(())
        } else {
            Err("the fake internet did not start".to_owned())
        }
    }

    /// The gateway on its defaults, but for what a throwaway world needs:
    /// its state and flow log in this run's folder, the fake internet's DNS
    /// server as its upstream and the fake internet's CA as an upstream root.
    fn start_gateway(&self, bins: &Bins) -> Result<(), String> {
        let config = self.dir.join("gateway.toml");
        let text = format!(
            "state_dir = \"{state}\"\n[dns]\nupstreams = [\"{dns}:53\"]\n[tls]\nextra_upstream_roots = [\"{roots}\"]\n[log]\nflow_log = \"{flows}\"\n[credentials]\nfiles_under = [\"{secrets}\"]\n",
            state = self.dir.join("gateway-state").display(),
            secrets = self.secrets_dir().display(),
            dns = egress_integration::DNS_IP,
            roots = self.dir.join("internet-ca/ca.crt").display(),
            flows = self.flow_log().display(),
        );
        std::fs::write(&config, text).map_err(|e| format!("{}: {e}", config.display()))?;
        let log = std::fs::File::create(self.dir.join("gateway.log")).map_err(|e| e.to_string())?;
        let child = Command::new("ip")
            .args(["netns", "exec", &self.worker])
            .arg(&bins.gateway)
            .args(["run", "--config"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("{}: {e}", bins.gateway.display()))?;
        self.teardown.with(|m| m.pids.push(child.id()));
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.admin("GET", "/readyz", None).0 == 200 {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(format!(
            "the gateway was not ready within 20 s; its log:\n{}",
            std::fs::read_to_string(self.dir.join("gateway.log")).unwrap_or_default()
        ))
    }

    pub(crate) fn flow_log(&self) -> PathBuf {
        self.dir.join("flows.jsonl")
    }

    /// The gateway's CA certificate, which sandboxes trust.
    pub(crate) fn gateway_ca(&self) -> PathBuf {
        self.dir.join("gateway-state/ca/ca.crt")
    }

    /// The fake internet's CA: what the origins' own certificates chain to.
    pub(crate) fn origin_ca(&self) -> PathBuf {
        self.dir.join("internet-ca/ca.crt")
    }

    /// `program args` in namespace `ns`.
    pub(crate) fn exec(&self, ns: &str, program: &str, args: &[&str]) -> Result<Output, String> {
        Command::new("ip")
            .args(["netns", "exec", ns, program])
            .args(args)
            .output()
            .map_err(|e| format!("{program}: {e}"))
    }

    fn exec_ok(&self, ns: &str, program: &str, args: &[&str]) -> Result<(), String> {
        checked(self.exec(ns, program, args)?, program, args)
    }

    /// A request to the gateway's admin API from the worker namespace:
    /// (status, body).
    pub(crate) fn admin(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let url = format!("{ADMIN}{path}");
        let mut args = vec![
            "-s",
            "-w",
            "\n%{http_code}",
            "-X",
            method,
            "--max-time",
            "5",
        ];
        if let Some(b) = body {
            args.extend(["-H", "content-type: application/json", "--data-binary", b]);
        }
        args.push(&url);
        let out = self
            .exec(&self.worker, "curl", &args)
            .map(|o| o.stdout)
            .unwrap_or_default();
        let text = String::from_utf8_lossy(&out).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }

    /// Writes `contents` to a file of this run (a credential's source).
    /// Where credential values are kept: the one directory the gateway may
    /// read them from (`credentials.files_under`).
    fn secrets_dir(&self) -> PathBuf {
        self.dir.join("secrets")
    }

    /// Writes a credential value into [`Stage::secrets_dir`].
    pub(crate) fn write_secret(&self, name: &str, contents: &str) -> Result<PathBuf, String> {
        let dir = self.secrets_dir();
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(name);
        std::fs::File::create(&path)
            .and_then(|mut f| f.write_all(contents.as_bytes()))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(path)
    }
}

/// The programs the tour runs: the gateway and the fake internet.
pub(crate) struct Bins {
    pub(crate) gateway: PathBuf,
    pub(crate) internet: PathBuf,
}

impl Bins {
    /// Beside this program (how cargo builds them), else on `PATH`.
    pub(crate) fn find() -> Result<Self, Vec<String>> {
        let here = std::env::current_exe().ok();
        let dir = here.as_deref().and_then(Path::parent);
        let find = |name: &str| {
            dir.map(|d| d.join(name))
                .filter(|p| p.is_file())
                .or_else(|| on_path(name))
                .ok_or_else(|| {
                    format!(
                        "{name} (build it: cargo build -p egress-gateway -p egress-integration)"
                    )
                })
        };
        match (find("egress-gateway"), find("fake-internet")) {
            (Ok(gateway), Ok(internet)) => Ok(Self { gateway, internet }),
            (g, i) => Err([g.err(), i.err()].into_iter().flatten().collect()),
        }
    }
}

/// `name` on `PATH`, if it is there.
pub(crate) fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// Runs a command and insists it succeeds.
fn sh(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    checked(out, program, args)
}

/// A command's failure, with what it said, as an error.
fn checked(out: Output, program: &str, args: &[&str]) -> Result<(), String> {
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}
