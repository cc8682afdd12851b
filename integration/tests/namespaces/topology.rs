//! Four network namespaces: a gateway, two sandboxes and a fake internet,
//! joined by veth pairs on 100.64.0.0/10. The gateway namespace applies the
//! `egress-gateway redirect` rules on both sandbox interfaces and drops
//! forwarding; no namespace has a route to the host network. Everything is
//! removed on drop, also when a test fails.
//!
//! [`Topology::with_vm`] adds a fifth namespace standing in for the QEMU
//! process of a user-mode VM (machine egress): its traffic is forwarded by
//! the gateway namespace's kernel — and only its traffic, from its veth —
//! under the VM's nftables table.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

static NEXT: AtomicUsize = AtomicUsize::new(0);

pub const SB1_IP: &str = "100.64.1.2";
/// sb1's IPv6 address (the sandboxes are dual stack).
pub const SB1_IP6: &str = "2001:db8:1::2";
/// sb2's IPv6 address.
pub const SB2_IP6: &str = "2001:db8:2::2";
pub const SB2_IP: &str = "100.64.2.2";
/// The VM stand-in's address (machine egress).
pub const VM_IP: &str = "100.64.4.2";

/// Whether namespace tests can run here; with `EGRESS_E2E_REQUIRED=1`
/// (set by CI) a missing prerequisite is a failure, not a skip.
pub fn available() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0"));
    let nft = Command::new("nft")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let ip = Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    let curl = Command::new("curl")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let ok = root && nft && ip && curl;
    if !ok {
        let why = format!("namespace tests need root, nft, ip and curl (root={root} nft={nft} ip={ip} curl={curl})");
        egress_testkit::skip("the namespace suite", why);
    }
    ok
}

pub struct Topology {
    pub gw: String,
    pub sb1: String,
    pub sb2: String,
    pub inet: String,
    /// The namespace standing in for a VM's QEMU process, when asked for.
    pub vm: Option<String>,
    pub dir: tempfile::TempDir,
    /// Environment variables the next `start_gateway` gives the gateway.
    pub gateway_env: Vec<(String, String)>,
    /// Capabilities the gateway gets beyond the unit's bounding set
    /// ([`service_caps`]), for what a test itself arranges (`sys_admin`).
    pub extra_caps: Vec<&'static str>,
    /// Sandbox namespaces added by [`Topology::add_sandbox`].
    pub extra: Vec<String>,
    gateway: Option<Child>,
    /// A gateway that handed over to `gateway` and is draining.
    predecessor: Option<Child>,
    internet: Option<Child>,
}

/// Spawns `cmd` (its stdout read here, its stderr the test's) and waits for
/// the line `ready` it prints once listening.
pub fn spawn_ready(cmd: &mut Command, what: &str) -> Child {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("ready line");
    assert_eq!(line.trim(), "ready", "{what} did not start");
    child
}

/// Runs a command and insists it succeeds.
pub fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `setpriv` with the bounding set of `egress-gateway.service`'s
/// `CapabilityBoundingSet=`, for a gateway to run with the capabilities
/// the packaged unit gives it and no others (root keeps exactly those
/// across the exec): every namespace test is a check of that set. `extra`
/// are added (without `CAP_`, lower case).
pub fn service_caps(extra: &[&str]) -> Vec<String> {
    let unit =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/systemd/egress-gateway.service");
    let text = std::fs::read_to_string(&unit).expect("the gateway's unit");
    let caps: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .flat_map(str::split_whitespace)
        .map(|c| format!("+{}", c.trim_start_matches("CAP_").to_ascii_lowercase()))
        .chain(extra.iter().map(|c| format!("+{c}")))
        .collect();
    assert!(
        !caps.is_empty(),
        "{}: no CapabilityBoundingSet=",
        unit.display()
    );
    vec![
        "setpriv".into(),
        format!("--bounding-set=-all,{}", caps.join(",")),
        "--".into(),
    ]
}

/// Waits up to 20 s for `check`, failing with `what`.
pub fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn bin(name: &str) -> PathBuf {
    // Test binaries live in target/<profile>/deps; the workspace binaries one level up.
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace --bins` first (cargo test --workspace does)",
        path.display()
    );
    path
}

impl Topology {
    pub fn new() -> Self {
        Self::build(false)
    }

    /// With a namespace standing in for a VM's QEMU process at [`VM_IP`],
    /// reached through the veth `vm1`; the gateway namespace forwards what
    /// comes from it (and replies to it), nothing else.
    pub fn with_vm() -> Self {
        Self::build(true)
    }

    fn build(with_vm: bool) -> Self {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}-{n}", std::process::id());
        let dir = tempfile::tempdir().expect("temp dir");
        let mut t = Self {
            gw: format!("egw-gw-{tag}"),
            sb1: format!("egw-sb1-{tag}"),
            sb2: format!("egw-sb2-{tag}"),
            inet: format!("egw-net-{tag}"),
            vm: with_vm.then(|| format!("egw-vm-{tag}")),
            dir,
            gateway_env: Vec::new(),
            extra_caps: Vec::new(),
            extra: Vec::new(),
            gateway: None,
            predecessor: None,
            internet: None,
        };
        for ns in [&t.gw, &t.sb1, &t.sb2, &t.inet]
            .into_iter()
            .chain(t.vm.as_ref())
        {
            run("ip", &["netns", "add", ns]);
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
            // Dual stack with static addresses only: no router
            // advertisements, no autoconfigured addresses.
            for key in [
                "net.ipv6.conf.all.accept_ra=0",
                "net.ipv6.conf.default.accept_ra=0",
                "net.ipv6.conf.all.autoconf=0",
                "net.ipv6.conf.default.autoconf=0",
            ] {
                run("ip", &["netns", "exec", ns, "sysctl", "-qw", key]);
            }
        }
        // Veth pairs made inside the gateway namespace: nothing touches the host's.
        let link = |peer_ns: &str, gw_if: &str, gw_ip: &str, peer_ip: &str| {
            run(
                "ip",
                &[
                    "-n", &t.gw, "link", "add", gw_if, "type", "veth", "peer", "name", "eth0",
                    "netns", peer_ns,
                ],
            );
            run("ip", &["-n", &t.gw, "addr", "add", gw_ip, "dev", gw_if]);
            run("ip", &["-n", &t.gw, "link", "set", gw_if, "up"]);
            run(
                "ip",
                &["-n", peer_ns, "addr", "add", peer_ip, "dev", "eth0"],
            );
            run("ip", &["-n", peer_ns, "link", "set", "eth0", "up"]);
        };
        link(&t.sb1, "sb1", "100.64.1.1/30", "100.64.1.2/30");
        link(&t.sb2, "sb2", "100.64.2.1/30", "100.64.2.2/30");
        link(&t.inet, "inet0", "100.64.3.1/30", "100.64.3.2/30");
        // IPv6 on the same links, documentation prefixes only; `nodad`: usable at once.
        for (peer_ns, gw_if, n) in [
            (&t.sb1, "sb1", 1),
            (&t.sb2, "sb2", 2),
            (&t.inet, "inet0", 3),
        ] {
            let (gw_ip, peer_ip) = (format!("2001:db8:{n}::1/64"), format!("2001:db8:{n}::2/64"));
            run(
                "ip",
                &["-n", &t.gw, "addr", "add", &gw_ip, "dev", gw_if, "nodad"],
            );
            run(
                "ip",
                &[
                    "-n", peer_ns, "addr", "add", &peer_ip, "dev", "eth0", "nodad",
                ],
            );
        }
        for (ns, n) in [(&t.sb1, 1), (&t.sb2, 2)] {
            let via = format!("2001:db8:{n}::1");
            run(
                "ip",
                &["-n", ns, "-6", "route", "add", "default", "via", &via],
            );
        }
        run(
            "ip",
            &[
                "-n",
                &t.gw,
                "-6",
                "route",
                "add",
                "2001:db8:f::/48",
                "via",
                "2001:db8:3::2",
            ],
        );
        run(
            "ip",
            &[
                "-n",
                &t.inet,
                "-6",
                "route",
                "add",
                "2001:db8::/32",
                "via",
                "2001:db8:3::1",
            ],
        );
        for a in egress_integration::addresses6() {
            run(
                "ip",
                &[
                    "-n",
                    &t.inet,
                    "addr",
                    "add",
                    &format!("{a}/128"),
                    "dev",
                    "lo",
                    "nodad",
                ],
            );
        }
        run(
            "ip",
            &["-n", &t.sb1, "route", "add", "default", "via", "100.64.1.1"],
        );
        run(
            "ip",
            &["-n", &t.sb2, "route", "add", "default", "via", "100.64.2.1"],
        );
        if let Some(vm) = &t.vm {
            link(vm, "vm1", "100.64.4.1/30", "100.64.4.2/30");
            run(
                "ip",
                &["-n", vm, "route", "add", "default", "via", "100.64.4.1"],
            );
        }
        for net in ["203.0.113.0/24", "198.51.100.0/24"] {
            run(
                "ip",
                &["-n", &t.gw, "route", "add", net, "via", "100.64.3.2"],
            );
        }
        run(
            "ip",
            &[
                "-n",
                &t.inet,
                "route",
                "add",
                "100.64.0.0/10",
                "via",
                "100.64.3.1",
            ],
        );
        for a in egress_integration::addresses() {
            run(
                "ip",
                &[
                    "-n",
                    &t.inet,
                    "addr",
                    "add",
                    &format!("{a}/32"),
                    "dev",
                    "lo",
                ],
            );
        }
        // Sandbox traffic is never forwarded: every byte crosses the gateway
        // process. Only the VM stand-in's traffic (and replies to it) is, and
        // only after its machine egress table judged it.
        let forward = if t.vm.is_some() { 1 } else { 0 };
        run(
            "ip",
            &[
                "netns",
                "exec",
                &t.gw,
                "sysctl",
                "-qw",
                "net.ipv6.conf.all.forwarding=0",
            ],
        );
        run(
            "ip",
            &[
                "netns",
                "exec",
                &t.gw,
                "sysctl",
                "-qw",
                &format!("net.ipv4.ip_forward={forward}"),
            ],
        );
        let vm_rules = if t.vm.is_some() {
            "  iifname \"vm1\" oifname \"inet0\" accept\n  iifname \"inet0\" oifname \"vm1\" ct state established,related accept\n"
        } else {
            ""
        };
        let mut nft = Command::new("ip")
            .args(["netns", "exec", &t.gw, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .expect("nft");
        std::io::Write::write_all(
            nft.stdin.as_mut().expect("stdin"),
            format!("table inet egw_forward {{\n chain forward {{\n  type filter hook forward priority 0; policy drop;\n{vm_rules} }}\n}}\n").as_bytes(),
        )
        .expect("write");
        assert!(nft.wait().expect("nft").success());
        for ns in [&t.sb1, &t.sb2] {
            let etc = PathBuf::from("/etc/netns").join(ns);
            std::fs::create_dir_all(&etc).expect("/etc/netns");
            std::fs::write(
                etc.join("resolv.conf"),
                "nameserver 8.8.8.8\noptions timeout:2 attempts:1\n",
            )
            .expect("resolv.conf");
        }
        t.start_internet();
        for iface in ["sb1", "sb2"] {
            let out = t.exec(
                &t.gw,
                bin("egress-gateway").to_str().expect("utf-8"),
                &["redirect", "--sandbox-iface", iface, "--apply"],
            );
            assert!(
                out.status.success(),
                "redirect: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        t.write_config();
        t.start_gateway();
        t
    }

    /// Another sandbox namespace, `egw-<name>-…`, joined to the gateway
    /// namespace by the veth `gw_if` on `100.64.<n>.0/30` (the sandbox at
    /// `.2`, its default route via `.1`); no redirect rules for it. Removed
    /// with the topology.
    pub fn add_sandbox(&mut self, name: &str, gw_if: &str, n: u8) -> String {
        let ns = self.gw.replacen("egw-gw-", &format!("egw-{name}-"), 1);
        run("ip", &["netns", "add", &ns]);
        self.extra.push(ns.clone());
        run("ip", &["-n", &ns, "link", "set", "lo", "up"]);
        let (gw_ip, sb_ip, via) = (
            format!("100.64.{n}.1/30"),
            format!("100.64.{n}.2/30"),
            format!("100.64.{n}.1"),
        );
        run(
            "ip",
            &[
                "-n", &self.gw, "link", "add", gw_if, "type", "veth", "peer", "name", "eth0",
                "netns", &ns,
            ],
        );
        run("ip", &["-n", &self.gw, "addr", "add", &gw_ip, "dev", gw_if]);
        run("ip", &["-n", &self.gw, "link", "set", gw_if, "up"]);
        run("ip", &["-n", &ns, "addr", "add", &sb_ip, "dev", "eth0"]);
        run("ip", &["-n", &ns, "link", "set", "eth0", "up"]);
        run("ip", &["-n", &ns, "route", "add", "default", "via", &via]);
        let etc = PathBuf::from("/etc/netns").join(&ns);
        std::fs::create_dir_all(&etc).expect("/etc/netns");
        std::fs::write(
            etc.join("resolv.conf"),
            "nameserver 8.8.8.8\noptions timeout:2 attempts:1\n",
        )
        .expect("resolv.conf");
        ns
    }

    /// `egress-gateway ARGS` run in the gateway namespace; insists it succeeds.
    pub fn gateway_cli(&self, args: &[&str]) -> String {
        let out = self.exec(
            &self.gw,
            bin("egress-gateway").to_str().expect("utf-8"),
            args,
        );
        assert!(
            out.status.success(),
            "egress-gateway {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    fn start_internet(&mut self) {
        let ca = self.path("inet-ca");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.inet])
            .arg(env!("CARGO_BIN_EXE_fake-internet"))
            .arg("--ca-dir")
            .arg(&ca);
        self.internet = Some(spawn_ready(&mut cmd, "the fake internet"));
    }

    /// Rewrites the gateway's configuration with `limits` as its `[limits]`
    /// section; the next `start_gateway` runs with it.
    pub fn set_limits(&self, limits: &str) {
        self.write_config_with(limits, "");
    }

    /// Rewrites the gateway's configuration with `policy` as its `[policy]`
    /// section (e.g. `opaque_streams = "deny"`); the next `start_gateway`
    /// runs with it.
    pub fn set_policy_config(&self, policy: &str) {
        self.write_config_with("", policy);
    }

    /// Rewrites the gateway's configuration with `section` appended (e.g. an
    /// `[upstream_proxy]` section); the next `start_gateway` runs with it.
    pub fn set_extra_config(&self, section: &str) {
        self.write_config_full("", "", section);
    }

    fn write_config(&self) {
        self.write_config_with("", "");
    }

    fn write_config_with(&self, limits: &str, policy: &str) {
        self.write_config_full(limits, policy, "");
    }

    fn write_config_full(&self, limits: &str, policy: &str, extra: &str) {
        let cfg = format!(
            r#"
            state_dir = "{state}"
            [listen]
            transparent = "[::]:15001"
            [dns]
            upstreams = ["{dns}:53"]
            min_ttl = "1s"
            [tls]
            extra_upstream_roots = ["{roots}"]
            [timeouts]
            peek = "2s"
            drain = "10s"
            [log]
            flow_log = "{flows}"
            [credentials]
            files_under = ["{dir}"]
            [limits]
            {limits}
            [policy]
            {policy}
            {extra}
            "#,
            state = self.path("gw-state").display(),
            dns = egress_integration::DNS_IP,
            roots = self.path("inet-ca/ca.crt").display(),
            flows = self.path("flows.jsonl").display(),
            dir = self.path("").display(),
        );
        std::fs::write(self.path("gateway.toml"), cfg).expect("config");
    }

    /// The gateway started in its namespace, its log in `gateway.log`.
    fn spawn_gateway(&self) -> Child {
        Command::new("ip")
            .args(["netns", "exec", &self.gw])
            .args(service_caps(&self.extra_caps))
            .arg(bin("egress-gateway"))
            .args(["run", "--config"])
            .arg(self.path("gateway.toml"))
            .envs(self.gateway_env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.path("gateway.log")).expect("log"))
            .spawn()
            .expect("gateway")
    }

    /// Starts the gateway, which must refuse to start: its log, once it
    /// exited with a failure (within 20 s).
    pub fn start_gateway_refused(&mut self) -> String {
        let status = wait_exit(self.spawn_gateway(), Duration::from_secs(20));
        let log = std::fs::read_to_string(self.path("gateway.log")).unwrap_or_default();
        assert!(!status.success(), "started: {log}");
        log
    }

    /// Starts the gateway in its namespace and waits for `/readyz`.
    pub fn start_gateway(&mut self) {
        let child = self.spawn_gateway();
        self.gateway = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if self.admin("GET", "/readyz", None).0 == 200 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "gateway not ready: {}",
                std::fs::read_to_string(self.path("gateway.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts a successor with `run --take-over --config CONFIG` (same
    /// state_dir and [listen] as the running gateway's), its log in `log`,
    /// and waits until it serves. The predecessor drains its open flows and
    /// exits by itself: [`Topology::wait_predecessor`].
    pub fn take_over_gateway(&mut self, config: &Path, log: &str) {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.gw])
            .args(service_caps(&self.extra_caps))
            .arg(bin("egress-gateway"))
            .args(["run", "--take-over", "--config"])
            .arg(config)
            .envs(self.gateway_env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.path(log)).expect("log"))
            .spawn()
            .expect("successor");
        self.predecessor = self.gateway.replace(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let said = std::fs::read_to_string(self.path(log)).unwrap_or_default();
            if said.contains("took over") && self.admin("GET", "/readyz", None).0 == 200 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the successor did not take over: {said}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The predecessor's exit status, once it has drained (within `within`).
    pub fn wait_predecessor(&mut self, within: Duration) -> std::process::ExitStatus {
        let child = self.predecessor.take().expect("a predecessor");
        wait_exit(child, within)
    }

    /// The gateway process's exit status, once it has exited by itself
    /// (within `within`): after it handed over to a successor it started.
    pub fn wait_gateway_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let child = self.gateway.take().expect("a running gateway");
        wait_exit(child, within)
    }
}

/// A child's exit status within `within`; killed (and the test failed) past it.
fn wait_exit(mut child: Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().expect("status") {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the process did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Topology {
    /// Sends SIGTERM and waits for the exit status.
    pub fn stop_gateway(&mut self) -> std::process::ExitStatus {
        let mut child = self.gateway.take().expect("a running gateway");
        // `ip netns exec` execs the gateway, so this PID is the gateway's.
        run("kill", &["-TERM", &child.id().to_string()]);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(s) = child.try_wait().expect("status") {
                return s;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the gateway did not stop within 20 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The gateway process's PID (`ip netns exec` execs it).
    pub fn gateway_pid(&self) -> u32 {
        self.gateway.as_ref().expect("a running gateway").id()
    }

    /// Kills the gateway with SIGKILL: no drain, no last write.
    pub fn kill_gateway(&mut self) {
        let mut child = self.gateway.take().expect("a running gateway");
        run("kill", &["-KILL", &child.id().to_string()]);
        let _ = child.wait();
    }

    pub fn exec(&self, ns: &str, program: &str, args: &[&str]) -> Output {
        Command::new("ip")
            .args(["netns", "exec", ns, program])
            .args(args)
            .output()
            .expect("ip netns exec")
    }

    /// The link-local address of `dev` in namespace `ns`, once it is no
    /// longer tentative (up to 10 s).
    pub fn link_local(&self, ns: &str, dev: &str) -> String {
        let show = ["-6", "-o", "addr", "show", "dev", dev, "scope", "link"];
        let mut text = String::new();
        for _ in 0..100 {
            text = String::from_utf8_lossy(&self.exec(ns, "ip", &show).stdout).into_owned();
            let addr = text
                .split_whitespace()
                .skip_while(|w| *w != "inet6")
                .nth(1)
                .and_then(|a| a.split('/').next());
            if let (false, Some(addr)) = (text.contains("tentative"), addr) {
                return addr.to_owned();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("no link-local address on {ns}'s {dev}: {text}");
    }

    /// Has the gateway namespace take router advertisements, default
    /// routes included, on `iface` (`accept_ra=2`: even where it forwards).
    pub fn take_router_advertisements(&self, iface: &str) {
        for key in [
            format!("net.ipv6.conf.{iface}.accept_ra=2"),
            format!("net.ipv6.conf.{iface}.accept_ra_defrtr=1"),
        ] {
            assert!(self
                .exec(&self.gw, "sysctl", &["-qw", &key])
                .status
                .success());
        }
    }

    /// Sends a router advertisement (router lifetime 1800 s) to all nodes
    /// on `dev` of namespace `ns`, three times 200 ms apart (python3: the
    /// image has no tool that sends one).
    pub fn advertise_router(&self, ns: &str, dev: &str) {
        let advertise = format!(
            r#"
import socket, struct, time
s = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 255)
i = socket.if_nametoindex("{dev}")
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, i)
for _ in range(3):
    s.sendto(struct.pack("!BBHBBHII", 134, 0, 0, 64, 0, 1800, 0, 0), ("ff02::1", 0, 0, i))
    time.sleep(0.2)
"#
        );
        let sent = self.exec(ns, "python3", &["-c", &advertise]);
        assert!(
            sent.status.success(),
            "{}",
            String::from_utf8_lossy(&sent.stderr)
        );
    }

    /// The packets counted by the first rule of the gateway namespace's
    /// `inet` table `table` whose listing holds `needle`.
    pub fn rule_count(&self, table: &str, needle: &str) -> u64 {
        let out = self.exec(&self.gw, "nft", &["list", "table", "inet", table]);
        let rules = String::from_utf8_lossy(&out.stdout);
        rules
            .lines()
            .find(|l| l.contains(needle))
            .and_then(|l| l.split("counter packets ").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no counted rule with {needle:?} in:\n{rules}"))
    }

    /// An admin API call from inside the gateway namespace: status and body.
    pub fn admin(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        self.http_in_gw(method, &format!("http://127.0.0.1:15000{path}"), &[], body)
    }

    /// An HTTP call with curl from inside the gateway namespace (`headers`
    /// as `name: value`): status and body.
    pub fn http_in_gw(
        &self,
        method: &str,
        url: &str,
        headers: &[&str],
        body: Option<&str>,
    ) -> (u16, String) {
        let mut args = vec![
            "-s",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            "-X",
            method,
            "--max-time",
            "5",
        ];
        for h in headers {
            args.extend(["-H", h]);
        }
        if let Some(b) = body {
            args.extend(["-H", "content-type: application/json", "--data-binary", b]);
        }
        args.push(url);
        let out = self.exec(&self.gw, "curl", &args);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }

    /// Pushes `policy` for the sandbox at `addr` under `id`; a sandbox
    /// namespace's IPv6 address comes with its IPv4 one (they are dual stack).
    pub fn push(&self, id: &str, addr: &str, policy: &str) {
        match addr {
            SB1_IP => self.push_addrs(id, &[addr, SB1_IP6], policy),
            SB2_IP => self.push_addrs(id, &[addr, SB2_IP6], policy),
            _ => self.push_addrs(id, &[addr], policy),
        }
    }

    /// Pushes `policy` for the sandbox with all of `addrs` under `id`.
    pub fn push_addrs(&self, id: &str, addrs: &[&str], policy: &str) {
        let list: Vec<String> = addrs.iter().map(|a| format!("\"{a}\"")).collect();
        let doc = format!(
            r#"{{"addresses": [{}], "policy": {policy}}}"#,
            list.join(", ")
        );
        let (status, body) = self.admin("PUT", &format!("/v1/sandboxes/{id}"), Some(&doc));
        assert_eq!(status, 200, "push {id}: {body}");
    }

    /// `curl` from a sandbox: (exit code, body). `ca` is `gateway`, `origin` or `both`.
    pub fn curl(&self, ns: &str, ca: &str, url: &str, extra: &[&str]) -> (i32, String) {
        let bundle = self.ca(ca);
        let mut args = vec![
            "-sS",
            "--max-time",
            "8",
            "--cacert",
            bundle.to_str().expect("utf-8"),
        ];
        args.extend_from_slice(extra);
        args.push(url);
        let out = self.exec(ns, "curl", &args);
        let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        (out.status.code().unwrap_or(-1), text)
    }

    /// A CA file: the gateway's, the fake internet's, or both.
    pub fn ca(&self, which: &str) -> PathBuf {
        let gw = self.path("gw-state/ca/ca.crt");
        let origin = self.path("inet-ca/ca.crt");
        match which {
            "gateway" => gw,
            "origin" => origin,
            _ => {
                let both = self.path("both.pem");
                let text = std::fs::read_to_string(&gw).expect("gateway CA")
                    + &std::fs::read_to_string(&origin).expect("origin CA");
                std::fs::write(&both, text).expect("bundle");
                both
            }
        }
    }

    /// Resolves `name` in a sandbox with dig (through 8.8.8.8, i.e. the gateway).
    pub fn dig(&self, ns: &str, name: &str, tcp: bool) -> String {
        self.dig_at(ns, "8.8.8.8", name, tcp)
    }

    /// `dig +short` for `name`, asked of the resolver at `server`.
    pub fn dig_at(&self, ns: &str, server: &str, name: &str, tcp: bool) -> String {
        let at = format!("@{server}");
        let mut args = vec!["+short", "+time=3", "+tries=1", &at, name];
        if tcp {
            args.push("+tcp");
        }
        let out = self.exec(ns, "dig", &args);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The flow log's lines once `ready` holds for them, or after 10 s
    /// (a flow's line is written just after it ends, by the log's own
    /// thread, so a test that has just seen its client finish must wait).
    pub fn flows_when(
        &self,
        ready: impl Fn(&[serde_json::Value]) -> bool,
    ) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let flows = self.flows();
            if ready(&flows) || Instant::now() > deadline {
                return flows;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Requests the origin for api.example.test has received (it counts
    /// them as they arrive), read from the fake internet directly.
    pub fn reached(&self) -> u64 {
        let (_, body) = self.http_in_gw("GET", "http://203.0.113.10/_counts", &[], None);
        serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|c| c["api.example.test"].as_u64())
            .unwrap_or(0)
    }

    /// The flow log's lines so far.
    pub fn flows(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.path("flows.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for child in [
            self.gateway.take(),
            self.predecessor.take(),
            self.internet.take(),
        ]
        .into_iter()
        .flatten()
        {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        for ns in [&self.gw, &self.sb1, &self.sb2, &self.inet]
            .into_iter()
            .chain(self.vm.as_ref())
            .chain(&self.extra)
        {
            // Whatever else still runs in the namespace, by PID.
            if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
            let _ = std::fs::remove_dir_all(PathBuf::from("/etc/netns").join(ns));
        }
    }
}
