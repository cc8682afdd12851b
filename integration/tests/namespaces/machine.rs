//! Machine egress end to end: a namespace stands in for a user-mode VM's
//! QEMU process; the gateway compiles the VM's policy into nftables in its
//! own namespace and the kernel forwards or refuses what the VM sends, TCP
//! and UDP, to the fake internet.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::topology::{self, Topology, SB1_IP, VM_IP};

const API_IP: &str = "203.0.113.10"; // api.example.test
const OTHER_IP: &str = "203.0.113.11"; // other.example.test
const DNS: &str = egress_integration::DNS_IP;

fn vm(t: &Topology) -> &str {
    t.vm.as_deref().expect("a topology with a VM")
}

/// An HTTP GET from the VM: true when the origin answered 200.
fn tcp_ok(t: &Topology, ip: &str) -> bool {
    let out = t.exec(
        vm(t),
        "curl",
        &[
            "-s",
            "-o",
            "/dev/null",
            "--connect-timeout",
            "1",
            "--max-time",
            "3",
            "-w",
            "%{http_code}",
            &format!("http://{ip}/"),
        ],
    );
    String::from_utf8_lossy(&out.stdout).trim() == "200"
}

/// A DNS query from the VM to the fake resolver, over UDP or TCP: true when
/// the answer came back.
fn dns_ok(t: &Topology, tcp: bool) -> bool {
    let mut args = vec!["+short", "+time=1", "+tries=1"];
    if tcp {
        args.push("+tcp");
    }
    let at = format!("@{DNS}");
    args.extend([at.as_str(), "api.example.test"]);
    let out = t.exec(vm(t), "dig", &args);
    String::from_utf8_lossy(&out.stdout).contains(API_IP)
}

/// The node's machine egress table as nft lists it.
fn node_table(t: &Topology) -> String {
    let out = t.exec(&t.gw, "nft", &["list", "table", "inet", "egress_machine"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Deletes the gateway's table of `family` (`inet`: the node table,
/// `netdev`: the links') behind its back (as another tool or a reboot of
/// the namespace's rules would).
fn delete_table(t: &Topology, family: &str) {
    behind_its_back(t, "delete", family);
}

/// `nft <verb> table <family> egress_machine` in the gateway's namespace.
fn behind_its_back(t: &Topology, verb: &str, family: &str) {
    let gw = t.gw.as_str();
    let args = [
        "netns",
        "exec",
        gw,
        "nft",
        verb,
        "table",
        family,
        "egress_machine",
    ];
    topology::run("ip", &args);
}

/// `nft <args>` in the gateway's namespace, behind its back.
fn nft_behind_its_back(t: &Topology, args: &[&str]) {
    let mut all = vec!["netns", "exec", t.gw.as_str(), "nft"];
    all.extend_from_slice(args);
    topology::run("ip", &all);
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

fn put_egress(t: &Topology, id: &str, policy: &str) -> Value {
    let (status, body) = t.admin("PUT", &format!("/v1/vms/{id}/network/egress"), Some(policy));
    assert_eq!(status, 200, "{body}");
    json(&body)
}

fn register(t: &Topology, id: &str, addr: &str, egress: Option<&str>) {
    let doc = match egress {
        Some(e) => format!(r#"{{"addresses": ["{addr}"], "egress": {e}}}"#),
        None => format!(r#"{{"addresses": ["{addr}"]}}"#),
    };
    let (status, body) = t.admin("PUT", &format!("/v1/vms/{id}"), Some(&doc));
    assert_eq!(status, 200, "{body}");
}

const ALLOW_DNS_AND_API: &str = r#"{"mode": "allowlist", "rules": [
    {"cidr": "203.0.113.53", "proto": "udp", "port": 53, "note": "fake resolver"},
    {"cidr": "203.0.113.10/32", "proto": "tcp", "port": 80}]}"#;

/// A connection the VM holds open across a policy change: `true` when the
/// origin's echo came back after the change, `false` when the flow was cut.
/// The VM opens it to `ip`:22 (a banner, then one echo), the policy becomes
/// `policy`, then the VM sends a line and waits 2 s for it to come back.
fn open_flow_survives(t: &Topology, ip: &str, policy: &str) -> bool {
    use std::io::{BufRead, BufReader, Write};
    let script = format!(
        "import socket, sys\n\
         s = socket.create_connection(('{ip}', 22), timeout=3)\n\
         assert s.recv(64).startswith(b'SSH-')\n\
         print('open', flush=True)\n\
         sys.stdin.readline()\n\
         s.settimeout(2)\n\
         s.sendall(b'ping')\n\
         try:\n    print('echoed' if s.recv(64) == b'ping' else 'other', flush=True)\n\
         except OSError:\n    print('cut', flush=True)\n"
    );
    let mut child = std::process::Command::new("ip")
        .args(["netns", "exec", vm(t), "python3", "-c", &script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3 in the VM");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("first line");
    assert_eq!(line.trim(), "open", "the flow did not open");
    put_egress(t, "vm1", policy);
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(b"go\n").expect("go");
    line.clear();
    out.read_line(&mut line).expect("second line");
    assert!(child.wait().expect("python3").success());
    match line.trim() {
        "echoed" => true,
        "cut" => false,
        other => panic!("the flow answered {other:?}"),
    }
}

/// An open flow keeps the verdict it was accepted under when the VM's
/// allowlist changes, and is cut when the VM goes to `loopback`.
#[test]
fn open_flows_outlive_a_narrower_allowlist_but_not_loopback() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    let ssh = format!(
        r#"{{"mode": "allowlist", "rules": [{{"cidr": "{API_IP}", "proto": "tcp", "port": 22}}]}}"#
    );
    register(&t, "vm1", VM_IP, Some(&ssh));
    assert!(
        open_flow_survives(&t, API_IP, ALLOW_DNS_AND_API),
        "an open flow outlives an allowlist without it"
    );
    put_egress(&t, "vm1", &ssh);
    assert!(
        !open_flow_survives(&t, API_IP, r#"{"mode": "loopback"}"#),
        "loopback cuts the open flow"
    );
    // Out of loopback again, the VM's open flows pass on their conntrack
    // entry once more (its address left the cut set).
    put_egress(&t, "vm1", &ssh);
    assert!(open_flow_survives(&t, API_IP, r#"{"mode": "open"}"#));
}

/// A DNS query over UDP from the VM to the fake resolver sent from source
/// port `port` (so a second query is the first's flow): whether the answer
/// came back.
fn dns_from_port(t: &Topology, port: u16) -> bool {
    let at = format!("@{DNS}");
    let from = format!("{VM_IP}#{port}");
    let args = [
        "+short",
        "+time=1",
        "+tries=1",
        "-b",
        &from,
        &at,
        "api.example.test",
    ];
    let out = t.exec(vm(t), "dig", &args);
    String::from_utf8_lossy(&out.stdout).contains(API_IP)
}

/// A VM removed leaves no open flow to the next VM given its address: its
/// conntrack entries go with it, and those its address opened while no
/// VM held it go when a VM is given it. A UDP flow is the easy one to
/// ride: the next VM sends from the same port to the same destination, and
/// the entry would pass it before any dispatch, whatever its own policy
/// says.
#[test]
fn a_removed_vms_open_flows_are_not_left_to_the_next_vm_at_its_address() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    register(&t, "vm1", VM_IP, Some(ALLOW_DNS_AND_API));
    assert!(dns_from_port(&t, 40053), "vm1 may ask the resolver");
    let (status, body) = t.admin("DELETE", "/v1/vms/vm1", None);
    assert_eq!(status, 200, "{body}");
    register(
        &t,
        "vm2",
        VM_IP,
        Some(r#"{"mode": "allowlist", "rules": []}"#),
    );
    assert!(!dns_from_port(&t, 40054), "vm2 may not, on a new flow");
    assert!(
        !dns_from_port(&t, 40053),
        "vm2 may not on vm1's flow either"
    );
    // Registered again without the address, a VM loses its flows from it.
    put_egress(&t, "vm2", ALLOW_DNS_AND_API);
    assert!(dns_from_port(&t, 40055), "vm2 may ask now");
    register(
        &t,
        "vm2",
        "100.64.4.3",
        Some(r#"{"mode": "allowlist", "rules": []}"#),
    );
    register(
        &t,
        "vm3",
        VM_IP,
        Some(r#"{"mode": "allowlist", "rules": []}"#),
    );
    assert!(!dns_from_port(&t, 40055), "vm3 may not on vm2's flow");
    // An address no VM holds is not judged (the topology forwards it):
    // the flows it opens then go when a VM is given it.
    let (status, body) = t.admin("DELETE", "/v1/vms/vm3", None);
    assert_eq!(status, 200, "{body}");
    assert!(dns_from_port(&t, 40056), "no VM's: not judged");
    register(
        &t,
        "vm4",
        VM_IP,
        Some(r#"{"mode": "allowlist", "rules": []}"#),
    );
    assert!(
        !dns_from_port(&t, 40056),
        "vm4 may not on the flow its address opened while no VM's"
    );
    let (_, text) = t.admin("GET", "/metrics", None);
    assert!(
        text.contains("egress_machine_conntrack_failures_total 0"),
        "{text}"
    );
}

/// A new flow to another VM's address is dropped whatever the sending
/// VM's policy lets out: the guard comes before the VM's own chain, whose
/// verdict would end the forward chain. The origin's address stands in for
/// a second VM's (registered as `vm2`, it is in `to4`).
#[test]
fn a_new_flow_to_another_vm_is_dropped_under_every_mode() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    register(&t, "vm1", VM_IP, Some(r#"{"mode": "open"}"#));
    assert!(tcp_ok(&t, API_IP), "open reaches the address");
    // Not under loopback, which would cut its own replies as well.
    register(&t, "vm2", API_IP, Some(r#"{"mode": "open"}"#));
    for policy in [
        r#"{"mode": "open"}"#.to_owned(),
        r#"{"mode": "audit"}"#.to_owned(),
        format!(
            r#"{{"mode": "allowlist", "rules": [{{"cidr": "{API_IP}/32", "proto": "tcp", "port": 80}}]}}"#
        ),
    ] {
        put_egress(&t, "vm1", &policy);
        assert!(!tcp_ok(&t, API_IP), "a new flow to vm2 under {policy}");
    }
    put_egress(&t, "vm1", r#"{"mode": "open"}"#);
    assert!(
        tcp_ok(&t, OTHER_IP),
        "open still reaches every other address"
    );
    // Its address no VM's again, the flow passes.
    let (status, body) = t.admin("DELETE", "/v1/vms/vm2", None);
    assert_eq!(status, 200, "{body}");
    put_egress(&t, "vm1", r#"{"mode": "open"}"#);
    assert!(
        tcp_ok(&t, API_IP),
        "open reaches the address once vm2 is gone"
    );
    // Re-registered without `egress` (as a VM manager does with new
    // addresses), a VM keeps its own policy; it followed the node default.
    put_egress(&t, "vm1", r#"{"mode": "loopback"}"#);
    register(&t, "vm1", VM_IP, None);
    let (_, body) = t.admin("GET", "/v1/vms/vm1", None);
    assert_eq!(json(&body)["follows_default"], false, "{body}");
    assert_eq!(json(&body)["effective"]["mode"], "loopback", "{body}");
    assert!(!tcp_ok(&t, OTHER_IP), "still under loopback");
}

/// The port the origin's UDP sink listens on, for [`error_reaches_the_vm`].
const SINK_PORT: u16 = 40999;

/// The VM opens a UDP flow to [`OTHER_IP`]; the fake internet's side
/// receives its datagram and answers with an ICMP port unreachable about
/// that flow, sent from its address `from`. True when the error reached the
/// VM's socket (its `recv` refused), false when it waited 3 s for nothing.
fn error_reaches_the_vm(t: &Topology, from: &str) -> bool {
    const SEND: &str = r#"
import socket, struct, sys
def checksum(b):
    n = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    n = (n >> 16) + (n & 0xffff)
    n += n >> 16
    return ~n & 0xffff
src, sink, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind((sink, port))
u.settimeout(5)
print("ready", flush=True)
data, (vm, vm_port) = u.recvfrom(64)
# What the VM sent, as its first bytes: the IP header and the UDP header.
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + 8 + len(data), 0, 0, 63, 17, 0,
                 socket.inet_aton(vm), socket.inet_aton(sink))
ip = ip[:10] + struct.pack("!H", checksum(ip)) + ip[12:]
inner = ip + struct.pack("!HHHH", vm_port, port, 8 + len(data), 0)
head = struct.pack("!BBHI", 3, 3, 0, 0)
msg = head[:2] + struct.pack("!H", checksum(head + inner)) + head[4:] + inner
r = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
r.bind((src, 0))
r.sendto(msg, (vm, 0))
"#;
    const WAIT: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], int(sys.argv[2])))
s.settimeout(3)
s.send(b"egress")
try:
    s.recv(64)
except ConnectionRefusedError:
    sys.exit(0)
except socket.timeout:
    sys.exit(1)
sys.exit(2)
"#;
    let port = SINK_PORT.to_string();
    let mut sender = topology::spawn_ready(
        std::process::Command::new("ip")
            .args(["netns", "exec", &t.inet, "python3", "-c", SEND])
            .args([from, OTHER_IP, &port]),
        "the origin's UDP sink",
    );
    let waited = t.exec(vm(t), "python3", &["-c", WAIT, OTHER_IP, &port]);
    let sent = sender.wait().expect("the sender");
    assert!(sent.success(), "the sender failed: {sent}");
    match waited.status.code() {
        Some(0) => true,
        Some(1) => false,
        _ => panic!("{}", String::from_utf8_lossy(&waited.stderr)),
    }
}

/// An ICMP error is `related` to the flow it names, whoever sends it: from
/// another VM's address it reached the VM on its flow to the internet
/// (here a port unreachable; a "fragmentation needed" would shrink the
/// flow's path MTU), though no flow between two VMs may open. The origin's
/// address stands in for the second VM's, as above; the control is the
/// same error from the flow's own destination, which passes.
#[test]
fn a_vm_sends_no_error_into_another_vms_flow() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    register(&t, "vm1", VM_IP, Some(r#"{"mode": "open"}"#));
    assert!(
        error_reaches_the_vm(&t, API_IP),
        "an error from an address no VM's passes"
    );
    register(&t, "vm2", API_IP, Some(r#"{"mode": "open"}"#));
    assert!(
        !error_reaches_the_vm(&t, API_IP),
        "an error from vm2 reached vm1 on its flow"
    );
    assert!(
        error_reaches_the_vm(&t, OTHER_IP),
        "the flow's own destination still reports its errors"
    );
}

#[test]
fn each_mode_governs_tcp_and_udp_in_the_kernel() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    // Unregistered, the stand-in is only forwarded by the test topology: the
    // gateway has no say yet.
    register(&t, "vm1", VM_IP, Some(ALLOW_DNS_AND_API));
    assert!(dns_ok(&t, false), "udp 53 to the resolver is allowed");
    assert!(!dns_ok(&t, true), "tcp 53 is not");
    assert!(tcp_ok(&t, API_IP), "tcp 80 to the API is allowed");
    assert!(!tcp_ok(&t, OTHER_IP), "another address is not");

    put_egress(&t, "vm1", r#"{"mode": "loopback"}"#);
    assert!(
        !dns_ok(&t, false) && !tcp_ok(&t, API_IP),
        "loopback: nothing leaves"
    );

    let view = put_egress(&t, "vm1", r#"{"mode": "open"}"#);
    assert_eq!(view["source"], "vm");
    assert!(
        dns_ok(&t, false) && dns_ok(&t, true) && tcp_ok(&t, OTHER_IP),
        "open: everything"
    );

    // A rule without a protocol (the `any` set) allows every protocol to
    // its address, and nothing else.
    let any = format!(r#"{{"mode": "allowlist", "rules": [{{"cidr": "{DNS}"}}]}}"#);
    put_egress(&t, "vm1", &any);
    assert!(dns_ok(&t, false) && dns_ok(&t, true), "any protocol to DNS");
    assert!(!tcp_ok(&t, API_IP), "nothing else");
    put_egress(&t, "vm1", r#"{"mode": "open"}"#);

    // The observed record kept what loopback and the allowlist refused.
    let (status, body) = t.admin("GET", "/v1/vms/vm1/network/egress/observed", None);
    assert_eq!(status, 200, "{body}");
    let observed = json(&body);
    let seen = |addr: &str, proto: &str, port: u64| {
        observed["observed"]
            .as_array()
            .expect("list")
            .iter()
            .any(|e| {
                e["address"] == addr
                    && e["proto"] == proto
                    && e["port"] == port
                    && e["count"].as_u64() > Some(0)
            })
    };
    assert!(seen(OTHER_IP, "tcp", 80), "{body}");
    assert!(seen(DNS, "tcp", 53), "{body}");
    assert!(seen(DNS, "udp", 53), "refused under loopback: {body}");

    // An address belongs to a sandbox or a VM, never both.
    let doc = format!(r#"{{"addresses": ["{VM_IP}"], "policy": {{"default": "deny"}}}}"#);
    let (status, body) = t.admin("PUT", "/v1/sandboxes/sb-x", Some(&doc));
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("belongs to VM vm1"), "{body}");
    t.push("sb1", SB1_IP, r#"{"default": "deny"}"#);
    let (status, body) = t.admin(
        "PUT",
        "/v1/vms/vm2",
        Some(&format!(r#"{{"addresses": ["{SB1_IP}"]}}"#)),
    );
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("already belongs to sandbox sb1"), "{body}");

    // Invalid policies: 400 with the checker's errors; unknown VM: 404.
    let (status, body) = t.admin(
        "PUT",
        "/v1/vms/vm1/network/egress",
        Some(r#"{"mode": "open", "rules": [{"cidr": "10.1.2.3/8"}]}"#),
    );
    assert_eq!(status, 400, "{body}");
    let errors = json(&body)["errors"].clone();
    assert!(errors.to_string().contains("10.0.0.0/8"), "{body}");
    assert_eq!(t.admin("GET", "/v1/vms/nope/network/egress", None).0, 404);

    // The metrics read the kernel's counters at the observer's next round
    // (machine_egress.observe_interval, 5 s by default).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, text) = t.admin("GET", "/metrics", None);
        let refused = text
            .lines()
            .find_map(|l| {
                l.strip_prefix(
                    "egress_machine_refused_packets_total{vm=\"vm1\",outcome=\"refused\"} ",
                )
            })
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if refused > 0 {
            assert!(
                text.contains("egress_machine_vms{mode=\"open\"} 1"),
                "{text}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "refused packets never counted:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // Removing the VM removes its chain, sets and counters.
    assert!(node_table(&t).contains("chain vm_vm1 {"));
    let (status, body) = t.admin("DELETE", "/v1/vms/vm1", None);
    assert_eq!(status, 200, "{body}");
    assert!(!node_table(&t).contains("_vm1"), "{}", node_table(&t));
}

#[test]
fn a_policy_change_under_traffic_leaves_no_window() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    register(&t, "vm1", VM_IP, Some(ALLOW_DNS_AND_API));
    // Two loops in the VM, for the whole run: UDP queries (allowed by every
    // policy below) and TCP connects to an address no policy allows.
    let script = format!(
        "end=$(($(date +%s) + 8)); ok=0; bad=0; leak=0; \
         while [ $(date +%s) -lt $end ]; do \
           if dig +short +time=1 +tries=1 @{DNS} api.example.test | grep -q {API_IP}; then ok=$((ok+1)); else bad=$((bad+1)); fi; \
           if curl -s -o /dev/null --connect-timeout 0.2 http://{OTHER_IP}/; then leak=$((leak+1)); fi; \
         done; echo $ok $bad $leak"
    );
    let ns = vm(&t).to_owned();
    let probe = std::thread::spawn(move || {
        std::process::Command::new("ip")
            .args(["netns", "exec", &ns, "sh", "-c", &script])
            .output()
            .expect("probe")
    });
    // Swap between two policies that both allow DNS and neither allows OTHER_IP.
    let other = r#"{"mode": "allowlist", "rules": [
        {"cidr": "203.0.113.0/26", "proto": "udp", "port": 53},
        {"cidr": "198.51.100.0/24", "proto": "tcp"}]}"#;
    let started = Instant::now();
    let mut swaps = 0;
    while started.elapsed() < Duration::from_secs(7) {
        put_egress(
            &t,
            "vm1",
            if swaps % 2 == 0 {
                other
            } else {
                ALLOW_DNS_AND_API
            },
        );
        swaps += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = probe.join().expect("probe thread");
    let text = String::from_utf8_lossy(&out.stdout);
    let figures: Vec<u64> = text
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let [ok, bad, leak] = figures[..] else {
        panic!("probe output {text:?}");
    };
    eprintln!("policy swaps {swaps}: DNS answered {ok}, unanswered {bad}; connects to a refused address that got through {leak}");
    assert!(swaps >= 10, "only {swaps} swaps");
    assert_eq!(leak, 0, "a refused destination was reachable during a swap");
    assert_eq!(bad, 0, "an allowed flow was refused during a swap");
    assert!(ok > 5, "{text}");
}

#[test]
fn audit_then_suggest_then_allowlist() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    // A sandbox on this worker resolves the API's name: the gateway's
    // attribution knows it, so the suggestion's note carries it.
    t.push(
        "sb1",
        SB1_IP,
        r#"{"default": "deny", "allow": [{"ip": "8.8.8.8"}, {"domain": "api.example.test"}]}"#,
    );
    assert!(t.dig(&t.sb1, "api.example.test", false).contains(API_IP));

    register(
        &t,
        "vm1",
        VM_IP,
        Some(
            r#"{"mode": "audit", "rules": [{"cidr": "203.0.113.53", "proto": "udp", "port": 53}]}"#,
        ),
    );
    assert!(tcp_ok(&t, API_IP), "audit allows everything");
    assert!(dns_ok(&t, false));
    let (_, body) = t.admin("GET", "/v1/vms/vm1/network/egress/observed", None);
    let observed = json(&body);
    assert_eq!(observed["recorded"], "would_refuse", "{body}");
    let entries = observed["observed"].as_array().expect("list").clone();
    let api = entries
        .iter()
        .find(|e| e["address"] == API_IP && e["port"] == 80)
        .unwrap_or_else(|| panic!("no entry for the API: {body}"));
    assert_eq!(api["names"][0], "api.example.test", "{body}");
    assert!(
        !entries
            .iter()
            .any(|e| e["address"] == DNS && e["proto"] == "udp"),
        "allowed by a rule, so not recorded: {body}"
    );

    let (status, body) = t.admin(
        "POST",
        "/v1/vms/vm1/network/egress/suggest?apply=true",
        None,
    );
    assert_eq!(status, 200, "{body}");
    let suggestion = json(&body);
    let rules = suggestion["policy"]["rules"]
        .as_array()
        .expect("rules")
        .clone();
    assert!(
        rules.iter().any(|r| r["cidr"] == "203.0.113.10/32"
            && r["proto"] == "tcp"
            && r["port"] == 80
            && r["note"]
                .as_str()
                .is_some_and(|n| n.contains("api.example.test"))),
        "{body}"
    );
    assert_eq!(
        rules[0]["cidr"], "203.0.113.53/32",
        "current rules come first: {body}"
    );
    let (_, now) = t.admin("GET", "/v1/vms/vm1/network/egress", None);
    assert_eq!(json(&now)["policy"], suggestion["policy"], "applied");

    // Enforce what was learnt: the flow that audit recorded is now allowed,
    // anything else refused.
    let mut enforced = suggestion["policy"].clone();
    enforced["mode"] = "allowlist".into();
    put_egress(&t, "vm1", &enforced.to_string());
    assert!(tcp_ok(&t, API_IP), "learnt and allowed");
    assert!(dns_ok(&t, false));
    assert!(!tcp_ok(&t, OTHER_IP), "never observed, refused");
}

#[test]
fn defaults_apply_running_and_restart() {
    if !topology::available() {
        return;
    }
    let mut t = Topology::with_vm();
    // No default set: loopback, nothing leaves.
    register(&t, "vm1", VM_IP, None);
    let (_, body) = t.admin("GET", "/v1/vms/vm1/network/egress", None);
    assert_eq!(json(&body)["source"], "default");
    assert_eq!(json(&body)["policy"]["mode"], "loopback");
    assert!(!tcp_ok(&t, API_IP));

    // A new default without apply_running: running VMs keep theirs.
    let (status, body) = t.admin(
        "PUT",
        "/v1/network/egress/defaults",
        Some(ALLOW_DNS_AND_API),
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        !tcp_ok(&t, API_IP),
        "vm1 started before the default changed"
    );
    // A VM registered afterwards takes it.
    let (status, body) = t.admin(
        "PUT",
        "/v1/vms/vm2",
        Some(r#"{"addresses": ["100.64.9.9"]}"#),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        json(&body)["effective"]["rules"].as_array().map(Vec::len),
        Some(2)
    );

    // With apply_running: vm1 follows at once.
    let (status, body) = t.admin(
        "PUT",
        "/v1/network/egress/defaults?apply_running=true",
        Some(ALLOW_DNS_AND_API),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["applied_to"], serde_json::json!(["vm1"]));
    assert!(tcp_ok(&t, API_IP) && !tcp_ok(&t, OTHER_IP));

    // Restart: the gateway's tables are gone (as after a reboot of the
    // namespace's rules); it re-installs them before it reports ready.
    assert!(t.stop_gateway().success());
    delete_table(&t, "inet");
    assert!(tcp_ok(&t, OTHER_IP), "no table: the test topology forwards");
    t.start_gateway();
    assert!(node_table(&t).contains("chain vm_vm1 {"));
    assert!(tcp_ok(&t, API_IP), "the restored policy allows the API");
    assert!(!tcp_ok(&t, OTHER_IP), "and nothing else");
    let (_, body) = t.admin("GET", "/v1/network/egress/defaults", None);
    assert_eq!(
        json(&body)["policy"]["rules"].as_array().map(Vec::len),
        Some(2)
    );
    let (_, body) = t.admin("GET", "/v1/vms/vm2", None);
    assert_eq!(json(&body)["follows_default"], true, "{body}");

    // The state directory lost while the VMs run: the start is refused,
    // and the table it would have replaced with an empty one still judges
    // vm1's traffic. With the state back, the gateway starts.
    assert!(t.stop_gateway().success());
    let (state, moved) = (t.path("gw-state/machines"), t.path("machines.moved"));
    std::fs::rename(&state, &moved).expect("state moved away");
    let log = t.start_gateway_refused();
    assert!(log.contains("holds VMs' chains (vm_vm1"), "{log}");
    assert!(!tcp_ok(&t, OTHER_IP), "the table is still in place");
    std::fs::rename(&moved, &state).expect("state back");
    t.start_gateway();
    assert!(tcp_ok(&t, API_IP) && !tcp_ok(&t, OTHER_IP));
    // Events are read in the gateway's own namespace: an nft that governs
    // another (here the VM stand-in's) stops the start, naming the key.
    assert!(t.stop_gateway().success());
    let elsewhere = format!(
        "[machine_egress]\nnft = [\"ip\", \"netns\", \"exec\", \"{}\", \"nft\"]\n",
        vm(&t)
    );
    t.set_extra_config(&elsewhere);
    // `ip netns exec` enters the namespace and mounts its /sys.
    t.extra_caps = vec!["sys_admin"];
    let log = t.start_gateway_refused();
    assert!(
        log.contains("machine_egress.observe: \"events\" reads the rules' events"),
        "{log}"
    );
    t.set_extra_config(&format!("{elsewhere}observe = \"sampled\"\n"));
    t.start_gateway();
}

/// A metric's value at the observer's next rounds: waits (bounded) until
/// it reaches `at_least`, and returns it.
fn metric_reaching(t: &Topology, series: &str, at_least: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (_, text) = t.admin("GET", "/metrics", None);
        let n = text
            .lines()
            .find_map(|l| l.strip_prefix(series)?.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if n >= at_least {
            return n;
        }
        assert!(
            Instant::now() < deadline,
            "{series} stayed at {n}, below {at_least}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// curl in the VM stand-in, sent from `source` to `url` (1 s to connect,
/// 3 s in all), writing only the status code.
fn curl_from(t: &Topology, source: &str, url: &str) -> std::process::Output {
    t.exec(
        vm(t),
        "curl",
        &[
            "-s",
            "-o",
            "/dev/null",
            "--interface",
            source,
            "--connect-timeout",
            "1",
            "--max-time",
            "3",
            "-w",
            "%{http_code}",
            url,
        ],
    )
}

/// An HTTP GET from the VM stand-in sent from `source`.
fn tcp_from(t: &Topology, source: &str, ip: &str) -> bool {
    let out = curl_from(t, source, &format!("http://{ip}/"));
    String::from_utf8_lossy(&out.stdout).trim() == "200"
}

/// Whether the gateway namespace's own end of the VM link (a port nothing
/// listens on) answers a connect sent from `source`: `Some(true)` when it
/// is refused (the SYN arrived and was reset), `Some(false)` when it times
/// out (dropped), `None` for anything else.
fn host_answers(t: &Topology, source: &str) -> Option<bool> {
    let out = curl_from(t, source, "http://100.64.4.1:9/");
    match out.status.code() {
        Some(7) => Some(true),
        Some(28) => Some(false),
        _ => None,
    }
}

const SPOOF: &str = "100.64.4.6";
const OTHER_VM: &str = "100.64.9.9";

/// Gives the VM stand-in's `eth0` the addresses [`SPOOF`] (one no VM
/// claims) and [`OTHER_VM`], and the gateway namespace a route back to each
/// through `vm1`: without the check, packets from them would get through.
fn spoofing_sources(t: &Topology) {
    for extra in [SPOOF, OTHER_VM] {
        topology::run(
            "ip",
            &[
                "-n",
                vm(t),
                "addr",
                "add",
                &format!("{extra}/32"),
                "dev",
                "eth0",
            ],
        );
        topology::run("ip", &["-n", &t.gw, "route", "add", extra, "dev", "vm1"]);
    }
}

/// The links' table (`netdev egress_machine`) as nft lists it; empty when
/// there is none.
fn links_table(t: &Topology) -> String {
    let out = t.exec(&t.gw, "nft", &["list", "table", "netdev", "egress_machine"]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A second address on the VM link — one no VM claims, then another VM's
/// — is dropped and counted in every mode, `open` included, while the
/// VM's own address is judged by its policy: with the check the kernel
/// allows by default (the link's own ingress hook on Linux 6.16 and later,
/// the prerouting hook before).
#[test]
fn spoofed_sources_on_a_vm_link_are_dropped_in_every_mode() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    spoofing_is_dropped_in_every_mode(&t);
}

/// The same on the prerouting hook (`machine_egress.link_check =
/// "prerouting"`, what `auto` picks on a kernel before 6.16): one lookup by
/// interface name in the node table, no links' table.
#[test]
fn spoofed_sources_are_dropped_on_the_prerouting_hook_too() {
    if !topology::available() {
        return;
    }
    let mut t = Topology::with_vm();
    t.stop_gateway();
    t.set_extra_config("[machine_egress]\nlink_check = \"prerouting\"\n");
    t.start_gateway();
    spoofing_is_dropped_in_every_mode(&t);
    let table = node_table(&t);
    assert!(table.contains("iifname vmap @links"), "{table}");
    assert!(links_table(&t).is_empty(), "{}", links_table(&t));
}

fn spoofing_is_dropped_in_every_mode(t: &Topology) {
    spoofing_sources(t);
    assert!(
        tcp_from(t, SPOOF, API_IP),
        "no VM registered: the topology forwards"
    );
    register(t, "vm2", OTHER_VM, Some(r#"{"mode": "open"}"#));
    assert!(
        tcp_from(t, OTHER_VM, API_IP),
        "vm2's address, vm1 not registered"
    );
    let doc =
        format!(r#"{{"addresses": ["{VM_IP}"], "link": "vm1", "egress": {{"mode": "open"}}}}"#);
    let (status, body) = t.admin("PUT", "/v1/vms/vm1", Some(&doc));
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["link"], "vm1", "{body}");
    for (mode, own) in [
        (r#"{"mode": "open"}"#, true),
        (r#"{"mode": "audit"}"#, true),
        (ALLOW_DNS_AND_API, true),
        (r#"{"mode": "loopback"}"#, false),
    ] {
        put_egress(t, "vm1", mode);
        assert_eq!(tcp_from(t, VM_IP, API_IP), own, "own address under {mode}");
        assert!(!tcp_from(t, SPOOF, API_IP), "unclaimed source under {mode}");
        assert!(
            !tcp_from(t, OTHER_VM, API_IP),
            "vm2's address on vm1's link under {mode}"
        );
        // To the host itself: the own address reaches it (a closed port
        // answers with a reset), a spoofed one is dropped before it does.
        assert_eq!(
            host_answers(t, VM_IP),
            Some(true),
            "own address under {mode}"
        );
        assert_eq!(
            host_answers(t, SPOOF),
            Some(false),
            "unclaimed source to the host under {mode}"
        );
    }
    // Every mode dropped and counted: at least one SYN per attempt.
    metric_reaching(t, "egress_machine_spoofed_packets_total{vm=\"vm1\"} ", 12);

    // The link belongs to one VM.
    let doc = r#"{"addresses": ["100.64.9.10"], "link": "vm1"}"#;
    let (status, body) = t.admin("PUT", "/v1/vms/vm3", Some(doc));
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("already belongs to VM vm1"), "{body}");
}

/// A router advertisement from a VM never makes it the node's router,
/// even on a link that would take one (`accept_ra`): it is dropped on the
/// link and counted as spoofed. Before the VM is registered, the same
/// advertisement gives the node a default route through it: the link check
/// is what stops it.
#[test]
fn a_vm_never_becomes_the_nodes_router() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    t.take_router_advertisements("vm1");
    t.link_local(vm(&t), "eth0");
    let routes = || {
        let out = t.exec(
            &t.gw,
            "ip",
            &["-6", "route", "show", "default", "dev", "vm1"],
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    t.advertise_router(vm(&t), "eth0");
    topology::eventually("no VM registered: the node takes the route", || {
        !routes().is_empty()
    });
    topology::run(
        "ip",
        &["-n", &t.gw, "-6", "route", "flush", "default", "dev", "vm1"],
    );
    assert_eq!(routes(), "");
    let doc =
        format!(r#"{{"addresses": ["{VM_IP}"], "link": "vm1", "egress": {{"mode": "open"}}}}"#);
    let (status, body) = t.admin("PUT", "/v1/vms/vm1", Some(&doc));
    assert_eq!(status, 200, "{body}");
    t.advertise_router(vm(&t), "eth0");
    metric_reaching(&t, "egress_machine_spoofed_packets_total{vm=\"vm1\"} ", 3);
    assert_eq!(
        routes(),
        "",
        "the VM's advertisement made it the node's router"
    );
}

/// On the ingress hook, a VM's link that is deleted and made again under
/// its name (a QEMU restart re-creates its tap) is checked from its first
/// packet: the kernel binds the chain by name. Moving the VM to another
/// link moves the check; unregistering it takes the chain away.
#[test]
fn a_link_made_again_is_checked_again() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    let doc =
        format!(r#"{{"addresses": ["{VM_IP}"], "link": "vm1", "egress": {{"mode": "open"}}}}"#);
    let (status, body) = t.admin("PUT", "/v1/vms/vm1", Some(&doc));
    assert_eq!(status, 200, "{body}");
    if !links_table(&t).contains("hook ingress device \"vm1\"") {
        egress_testkit::skip(
            "a_link_made_again_is_checked_again",
            "this kernel does not bind ingress chains by name (before 6.16): the prerouting check is in use",
        );
        return;
    }
    // The link goes, and comes back under the same name.
    topology::run("ip", &["-n", &t.gw, "link", "del", "vm1"]);
    for cmd in [
        vec![
            "-n",
            &t.gw,
            "link",
            "add",
            "vm1",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            vm(&t),
        ],
        vec!["-n", &t.gw, "addr", "add", "100.64.4.1/30", "dev", "vm1"],
        vec!["-n", &t.gw, "link", "set", "vm1", "up"],
        vec!["-n", vm(&t), "addr", "add", "100.64.4.2/30", "dev", "eth0"],
        vec!["-n", vm(&t), "link", "set", "eth0", "up"],
        vec!["-n", vm(&t), "route", "add", "default", "via", "100.64.4.1"],
    ] {
        topology::run("ip", &cmd);
    }
    spoofing_sources(&t);
    assert!(tcp_from(&t, VM_IP, API_IP), "own address on the new link");
    assert!(
        !tcp_from(&t, SPOOF, API_IP),
        "unclaimed source on the new link"
    );
    metric_reaching(&t, "egress_machine_spoofed_packets_total{vm=\"vm1\"} ", 1);
    // Another link: the check moves with the VM, and vm1 is free.
    let doc =
        format!(r#"{{"addresses": ["{VM_IP}"], "link": "vm9", "egress": {{"mode": "open"}}}}"#);
    let (status, body) = t.admin("PUT", "/v1/vms/vm1", Some(&doc));
    assert_eq!(status, 200, "{body}");
    let links = links_table(&t);
    assert!(links.contains("device \"vm9\""), "{links}");
    assert!(!links.contains("device \"vm1\""), "{links}");
    assert!(tcp_from(&t, SPOOF, API_IP), "vm1 carries no check now");
    let (status, body) = t.admin("DELETE", "/v1/vms/vm1", None);
    assert_eq!(status, 200, "{body}");
    assert!(!links_table(&t).contains("link_vm1"), "{}", links_table(&t));
}

/// The cgroup v2 hierarchy as nft sees it under /sys/fs/cgroup: `""` when
/// unified, `"unified"` on a hybrid host; `None` without one.
fn cgroup_prefix() -> Option<&'static str> {
    ["", "unified"].into_iter().find(|p| {
        std::path::Path::new("/sys/fs/cgroup")
            .join(p)
            .join("cgroup.controllers")
            .exists()
    })
}

/// A cgroup of its own, removed on drop (after its processes exited).
struct Cgroup {
    dir: std::path::PathBuf,
    parent: std::path::PathBuf,
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
        let _ = std::fs::remove_dir(&self.parent);
    }
}

/// A stand-in QEMU process: curl run in the gateway's namespace (the
/// "host" of this test) from inside `cgroup`; true when the origin answered.
fn curl_in(t: &Topology, cgroup: Option<&Cgroup>, ip: &str) -> bool {
    let join = cgroup.map_or(String::new(), |c| {
        format!("echo $$ > {}/cgroup.procs && ", c.dir.display())
    });
    let script = format!(
        "{join}exec curl -s -o /dev/null --connect-timeout 1 --max-time 3 -w '%{{http_code}}' http://{ip}/"
    );
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", t.gw))
        .args(["sh", "-c", &script])
        .output()
        .expect("nsenter");
    String::from_utf8_lossy(&out.stdout).trim() == "200"
}

/// QEMU in the host namespace: the VM is registered by its process's
/// cgroup and the rules judge what that process sends, on the output hook.
#[test]
fn the_cgroup_variant_governs_a_process_in_the_host_namespace() {
    if !topology::available() {
        return;
    }
    let Some(prefix) = cgroup_prefix() else {
        egress_testkit::skip("the cgroup variant", "no cgroup v2 hierarchy here");
        return;
    };
    let mut t = Topology::with_vm();
    // nft resolves cgroup paths under /sys/fs/cgroup, which `ip netns exec`
    // hides from the gateway: its nft runs in this test's mount namespace,
    // and the gateway reads the tree there too.
    let section = format!(
        "[machine_egress]\nmatch = \"cgroup\"\ncgroup_prefix = \"{prefix}\"\ncgroup_root = \"/proc/{pid}/root/sys/fs/cgroup\"\nnft = [\"nsenter\", \"--mount=/proc/{pid}/ns/mnt\", \"--net=/run/netns/{}\", \"nft\"]\n",
        t.gw,
        pid = std::process::id(),
    );
    t.set_extra_config(&section);
    // `nsenter` into this test's mount namespace needs these; the packaged
    // unit's gateway runs `nft` in its own namespaces and does not.
    t.extra_caps = vec!["sys_admin", "sys_chroot", "sys_ptrace"];
    assert!(t.stop_gateway().success());
    t.start_gateway();
    let parent = std::path::Path::new("/sys/fs/cgroup")
        .join(prefix)
        .join(format!("egress-test-{}-{}", std::process::id(), t.gw));
    let cg = Cgroup {
        dir: parent.join("vm-q.scope"),
        parent: parent.clone(),
    };
    std::fs::create_dir_all(&cg.dir).expect("cgroup");
    let rel = format!(
        "{}/vm-q.scope",
        parent.file_name().and_then(|n| n.to_str()).expect("name")
    );
    let doc = format!(r#"{{"cgroup": "{rel}", "egress": {ALLOW_DNS_AND_API}}}"#);
    let (status, body) = t.admin("PUT", "/v1/vms/q", Some(&doc));
    assert_eq!(status, 200, "{body}");
    assert_eq!(json(&body)["cgroup"], rel, "{body}");
    assert!(
        node_table(&t).contains("socket cgroupv2 level 2 vmap @cg2"),
        "{}",
        node_table(&t)
    );

    assert!(curl_in(&t, Some(&cg), API_IP), "allowlist: the API");
    assert!(!curl_in(&t, Some(&cg), OTHER_IP), "allowlist: nothing else");
    assert!(
        curl_in(&t, None, OTHER_IP),
        "a process outside the VM's cgroup is not judged"
    );
    put_egress(&t, "q", r#"{"mode": "loopback"}"#);
    assert!(!curl_in(&t, Some(&cg), API_IP), "loopback: nothing leaves");
    put_egress(&t, "q", r#"{"mode": "audit"}"#);
    assert!(curl_in(&t, Some(&cg), OTHER_IP), "audit: everything leaves");
    put_egress(&t, "q", r#"{"mode": "open"}"#);
    assert!(
        curl_in(&t, Some(&cg), OTHER_IP) && curl_in(&t, Some(&cg), API_IP),
        "open"
    );
    a_reply_on_a_flow_from_outside_is_judged(&t, &cg);

    let (_, body) = t.admin("GET", "/v1/vms/q/network/egress/observed", None);
    let entries = json(&body)["observed"].as_array().expect("list").clone();
    assert!(
        entries
            .iter()
            .any(|e| e["address"] == OTHER_IP && e["port"] == 80),
        "refused under the allowlist, recorded: {body}"
    );
    // An address registration or a link has no meaning here.
    let (status, body) = t.admin("PUT", "/v1/vms/r", Some(r#"{"addresses": ["100.64.9.9"]}"#));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("cgroup"), "{body}");
    let doc = r#"{"cgroup": "egress-test-none/vm-s.scope"}"#;
    let (status, body) = t.admin("PUT", "/v1/vms/s", Some(doc));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("not in the cgroup tree"), "{body}");
    // A VM in a cgroup nested in q's is judged by its own policy, not q's
    // (q is open; the inner VM under loopback).
    let inner = Cgroup {
        dir: cg.dir.join("inner"),
        parent: cg.dir.join("inner"),
    };
    std::fs::create_dir_all(&inner.dir).expect("inner cgroup");
    let doc = format!(r#"{{"cgroup": "{rel}/inner", "egress": {{"mode": "loopback"}}}}"#);
    let (status, body) = t.admin("PUT", "/v1/vms/r", Some(&doc));
    assert_eq!(status, 200, "{body}");
    assert!(
        !curl_in(&t, Some(&inner), API_IP),
        "the inner VM's loopback"
    );
    assert!(curl_in(&t, Some(&cg), API_IP), "q is still open");
    let (status, _) = t.admin("DELETE", "/v1/vms/r", None);
    assert_eq!(status, 200);
    drop(inner);
    an_emptied_output_chain_is_installed_again(&t, &cg);
    a_scope_made_again_is_judged(&mut t, &cg);
    let (status, body) = t.admin("DELETE", "/v1/vms/q", None);
    assert_eq!(status, 200, "{body}");
    assert!(!node_table(&t).contains("vm_q"), "{}", node_table(&t));
}

/// A flow opened from outside to a socket of VM q's process (a datagram
/// to a port it bound, as slirp does for the guest's UDP) is established
/// in the reply direction: what q sends back on it is judged by q's policy
/// like a flow q opened, not passed on conntrack. Under `open` the echo
/// comes back; under an allowlist that does not cover the sender, it does
/// not (the kernel's drop on the output hook is `EPERM` to the sender,
/// which the server shrugs off). Leaves q `open`.
fn a_reply_on_a_flow_from_outside_is_judged(t: &Topology, cg: &Cgroup) {
    use std::io::{BufRead, BufReader};
    let server = "import socket\n\
         s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
         s.bind(('100.64.3.1', 0))\n\
         print(s.getsockname()[1], flush=True)\n\
         s.settimeout(30)\n\
         while True:\n\
         \x20   data, peer = s.recvfrom(64)\n\
         \x20   try:\n\
         \x20       s.sendto(data, peer)\n\
         \x20   except PermissionError:\n\
         \x20       pass\n";
    let join = format!(
        "echo $$ > {}/cgroup.procs && exec python3 -c \"$1\"",
        cg.dir.display()
    );
    let mut child = std::process::Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", t.gw))
        .args(["sh", "-c", &join, "sh", server])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the echo server in q's cgroup");
    let mut port = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut port)
        .expect("its port");
    let port = port.trim().to_owned();
    // One datagram from OTHER_IP on the fake internet; true when it came back.
    let echoed = || {
        let probe = "import socket, sys\n\
             s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
             s.bind((sys.argv[1], 0))\n\
             s.settimeout(1.5)\n\
             s.sendto(b'ping', ('100.64.3.1', int(sys.argv[2])))\n\
             try:\n    print('echoed' if s.recv(64) == b'ping' else 'other')\n\
             except OSError:\n    print('none')\n";
        let out = t.exec(&t.inet, "python3", &["-c", probe, OTHER_IP, &port]);
        String::from_utf8_lossy(&out.stdout).trim() == "echoed"
    };
    let open = echoed();
    put_egress(t, "q", ALLOW_DNS_AND_API);
    let allowlist = echoed();
    put_egress(t, "q", r#"{"mode": "open"}"#);
    let _ = child.kill();
    let _ = child.wait();
    assert!(open, "open: the echo of a flow from outside comes back");
    assert!(
        !allowlist,
        "allowlist: q answered an address its rules do not cover on a flow opened from outside"
    );
}

/// The output chain emptied by another tool (`nft flush chain`): with the
/// cgroup match it is the chain that judges, so the observer installs the
/// table again, as it does for the forward chain with the address match.
/// Leaves q under loopback.
fn an_emptied_output_chain_is_installed_again(t: &Topology, cg: &Cgroup) {
    put_egress(t, "q", r#"{"mode": "loopback"}"#);
    nft_behind_its_back(t, &["flush", "chain", "inet", "egress_machine", "output"]);
    metric_reaching(t, "egress_machine_table_restored_total ", 1);
    assert!(!curl_in(t, Some(cg), API_IP), "loopback again");
}

/// A restarted QEMU's scope, made again under VM q's path, is another
/// cgroup (nft loaded the old one's inode): the gateway binds it again
/// within a few seconds, and starts with the scope gone.
fn a_scope_made_again_is_judged(t: &mut Topology, cg: &Cgroup) {
    put_egress(t, "q", r#"{"mode": "loopback"}"#);
    assert!(!curl_in(t, Some(cg), API_IP), "loopback");
    std::fs::remove_dir(&cg.dir).expect("the scope goes");
    std::fs::create_dir(&cg.dir).expect("the scope is made again");
    assert!(
        refused_within(t, cg, API_IP),
        "the scope made again passed unjudged"
    );
    assert!(t.stop_gateway().success());
    std::fs::remove_dir(&cg.dir).expect("the scope goes");
    t.start_gateway();
    let (status, body) = t.admin("GET", "/v1/vms/q", None);
    assert_eq!(status, 200, "q is kept while its scope is gone: {body}");
    std::fs::create_dir(&cg.dir).expect("the scope is made again");
    assert!(
        refused_within(t, cg, API_IP),
        "the scope made again after a start passed unjudged"
    );
}

/// Whether a connection from `cg` to `ip` is refused within about five
/// seconds (the observer binds a cgroup made again within one).
fn refused_within(t: &Topology, cg: &Cgroup, ip: &str) -> bool {
    (0..10).any(|_| {
        let refused = !curl_in(t, Some(cg), ip);
        if !refused {
            std::thread::sleep(std::time::Duration::from_millis(400));
        }
        refused
    })
}

/// One TCP connect from the VM that gives up after 0.3 s, before TCP's
/// first retransmission (1 s): exactly one SYN. True when it connected.
fn one_syn(t: &Topology, ip: &str) -> bool {
    let out = t.exec(
        vm(t),
        "curl",
        &[
            "-s",
            "-o",
            "/dev/null",
            "--connect-timeout",
            "0.3",
            "--max-time",
            "3",
            "-w",
            "%{http_code}",
            &format!("http://{ip}/"),
        ],
    );
    String::from_utf8_lossy(&out.stdout).trim() == "200"
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
}

/// The observed entry for `addr` tcp/80, if any.
fn entry(t: &Topology, id: &str, addr: &str) -> (Value, Option<Value>) {
    let (status, body) = t.admin(
        "GET",
        &format!("/v1/vms/{id}/network/egress/observed"),
        None,
    );
    assert_eq!(status, 200, "{body}");
    let doc = json(&body);
    let found = doc["observed"]
        .as_array()
        .expect("list")
        .iter()
        .find(|e| e["address"] == addr && e["proto"] == "tcp" && e["port"] == 80)
        .cloned();
    (doc, found)
}

/// Exact observation: every refused packet reaches the record as an event
/// on the log group, so N refused connects (one SYN each) count N, and
/// first and last seen are the first and the last packet's times — four
/// seconds and more apart here, which no read of a set at the end could
/// tell. Under audit, N connects that pass count N would-refuse.
#[test]
fn refused_packets_are_counted_exactly_with_their_times() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    register(&t, "vm1", VM_IP, Some(ALLOW_DNS_AND_API));
    const N: u64 = 7;
    let start = unix_now();
    assert!(!one_syn(&t, OTHER_IP), "refused");
    std::thread::sleep(Duration::from_millis(2_200));
    for _ in 0..N - 2 {
        assert!(!one_syn(&t, OTHER_IP), "refused");
    }
    std::thread::sleep(Duration::from_millis(2_200));
    assert!(!one_syn(&t, OTHER_IP), "refused");
    let end = unix_now();
    // The kernel sends events within 10 ms; allow the reader a moment.
    std::thread::sleep(Duration::from_millis(300));
    let (doc, found) = entry(&t, "vm1", OTHER_IP);
    let e = found.unwrap_or_else(|| panic!("no entry: {doc}"));
    assert_eq!(e["count"], N, "{doc}");
    let (first, last) = (
        e["first_seen"].as_u64().expect("first"),
        e["last_seen"].as_u64().expect("last"),
    );
    assert!(start <= first && last <= end, "{start}..{end}: {doc}");
    assert!(last - first >= 4, "the first and the last packet: {doc}");
    assert_eq!(doc["lost"], 0, "{doc}");

    // Audit: every connect passes, and its first packet is recorded.
    put_egress(
        &t,
        "vm1",
        r#"{"mode": "audit", "rules": [{"cidr": "203.0.113.53", "proto": "udp", "port": 53}]}"#,
    );
    for _ in 0..N {
        assert!(one_syn(&t, API_IP), "audit passes");
    }
    std::thread::sleep(Duration::from_millis(300));
    let (doc, found) = entry(&t, "vm1", API_IP);
    assert_eq!(doc["recorded"], "would_refuse", "{doc}");
    let e = found.unwrap_or_else(|| panic!("no entry: {doc}"));
    assert_eq!(
        e["count"], N,
        "one per connect, the rest established: {doc}"
    );
    // Nothing was lost on the way, for any cause.
    let (_, text) = t.admin("GET", "/metrics", None);
    for cause in ["rate", "overrun", "unreadable"] {
        let series = format!("egress_machine_observe_lost_total{{cause=\"{cause}\"}} 0");
        assert!(text.contains(&series), "{series}:\n{text}");
    }
}

/// Another tool removing the node table (`nft flush ruleset`, a firewall
/// reload) leaves the VMs unjudged for at most an observer round: the
/// table comes back with every VM in it, the refused destination is refused
/// again, and the restore is counted.
#[test]
fn a_node_table_removed_by_another_tool_is_installed_again() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    let doc =
        format!(r#"{{"addresses": ["{VM_IP}"], "link": "vm1", "egress": {ALLOW_DNS_AND_API}}}"#);
    let (status, body) = t.admin("PUT", "/v1/vms/vm1", Some(&doc));
    assert_eq!(status, 200, "{body}");
    assert!(tcp_ok(&t, API_IP), "allowed");
    assert!(!tcp_ok(&t, OTHER_IP), "refused");
    delete_table(&t, "inet");
    metric_reaching(&t, "egress_machine_table_restored_total ", 1);
    assert!(
        node_table(&t).contains("chain vm_vm1"),
        "{}",
        node_table(&t)
    );
    assert!(!tcp_ok(&t, OTHER_IP), "refused again");
    assert!(tcp_ok(&t, API_IP), "allowed again");
    // A table flushed, not deleted, keeps its counters and chains but not
    // its rules: installed again too.
    behind_its_back(&t, "flush", "inet");
    metric_reaching(&t, "egress_machine_table_restored_total ", 2);
    assert!(!tcp_ok(&t, OTHER_IP), "refused again after the flush");
    // The forward chain deleted: the kernel's dump of its rules is empty.
    nft_behind_its_back(
        &t,
        &["delete", "chain", "inet", "egress_machine", "forward"],
    );
    metric_reaching(&t, "egress_machine_table_restored_total ", 3);
    assert!(!tcp_ok(&t, OTHER_IP), "refused again after the chain went");
    // The links' table alone (the ingress check): installed again too.
    if !links_table(&t).is_empty() {
        delete_table(&t, "netdev");
        metric_reaching(&t, "egress_machine_table_restored_total ", 4);
        assert!(
            links_table(&t).contains("spoofed_vm1"),
            "{}",
            links_table(&t)
        );
        // Flushed, it keeps its chains and counters but not its rules:
        // every link's sources would pass unchecked.
        spoofing_sources(&t);
        assert!(!tcp_from(&t, SPOOF, API_IP), "a spoofed source dropped");
        behind_its_back(&t, "flush", "netdev");
        metric_reaching(&t, "egress_machine_table_restored_total ", 5);
        assert!(
            !tcp_from(&t, SPOOF, API_IP),
            "a spoofed source dropped again after the flush"
        );
        assert!(tcp_ok(&t, API_IP), "the VM's own address still allowed");
    }
}

/// One ICMP echo from namespace `ns` to `ip` over a raw socket (no `ping`
/// on the CI machines): true when the reply came within 1.5 s.
fn icmp_echo(t: &Topology, ns: &str, ip: &str) -> bool {
    const PROBE: &str = r#"
import select, socket, struct, sys
def csum(b):
    t = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    t = (t >> 16) + (t & 0xffff)
    return ~(t + (t >> 16)) & 0xffff
body = b'egress'
head = struct.pack('!BBHHH', 8, 0, 0, 0x4567, 1)
packet = struct.pack('!BBHHH', 8, 0, csum(head + body), 0x4567, 1) + body
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.sendto(packet, (sys.argv[1], 0))
while select.select([s], [], [], 1.5)[0]:
    data, peer = s.recvfrom(2048)
    if peer[0] == sys.argv[1] and data[20] == 0:
        sys.exit(0)
sys.exit(1)
"#;
    t.exec(ns, "python3", &["-c", PROBE, ip]).status.success()
}

/// With forwarding on in the gateway's namespace (machine egress needs it
/// for the VM), a sandbox's packets that are neither TCP nor UDP are not
/// forwarded past the gateway: the redirect sends TCP and DNS to the
/// gateway and drops other UDP, and its table drops whatever else would be
/// forwarded from the sandbox's interface. An ICMP echo reached the fake
/// internet before (an ICMP tunnel out).
#[test]
fn nothing_of_a_sandbox_is_forwarded_past_the_gateway() {
    if !topology::available() {
        return;
    }
    let t = Topology::with_vm();
    // The topology's own fence lets only the VM's traffic be forwarded; here
    // it lets sb1's to the fake internet through too (the documentation
    // range, inside these namespaces), so that only the gateway's redirect
    // table stands in the way.
    for rule in [
        "iifname \"sb1\" oifname \"inet0\" ip daddr 203.0.113.0/24 accept",
        "iifname \"inet0\" oifname \"sb1\" ct state established,related accept",
    ] {
        let add = format!("insert rule inet egw_forward forward {rule}");
        let out = t.exec(&t.gw, "nft", &[&add]);
        assert!(out.status.success(), "{out:?}");
    }
    assert!(
        icmp_echo(&t, &t.sb1, "100.64.1.1"),
        "the probe works: the gateway's own address answers"
    );
    assert!(
        !icmp_echo(&t, &t.sb1, OTHER_IP),
        "an ICMP echo from the sandbox was forwarded to the internet"
    );
}
