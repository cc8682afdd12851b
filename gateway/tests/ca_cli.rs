//! `egress-gateway ca init`.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

fn ca_init(dir: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
        .args(["ca", "init", "--dir"])
        .arg(dir)
        .output()
        .expect("runs")
}

#[test]
fn ca_init_prints_the_certificate_path_and_never_overwrites() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let dir = tmp.path().join("ca");
    let out = ca_init(&dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8(out.stdout).expect("utf-8");
    let cert = dir.join("ca.crt");
    assert_eq!(printed.trim(), cert.to_str().expect("utf-8"));
    let pem = std::fs::read_to_string(&cert).expect("cert written");
    assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"));
    let key_mode = std::fs::metadata(dir.join("ca.key"))
        .expect("key")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(key_mode, 0o600);

    let again = ca_init(&dir);
    assert_eq!(again.status.code(), Some(1));
    let err = String::from_utf8(again.stderr).expect("utf-8");
    assert!(err.contains("refusing to overwrite"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&cert).expect("cert"),
        pem,
        "the first CA is intact"
    );
}

fn ca(args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_egress-gateway"))
        .arg("ca")
        .args(args)
        .output()
        .expect("runs")
}

fn os(s: &str) -> &std::ffi::OsStr {
    std::ffi::OsStr::new(s)
}

#[test]
fn ca_request_then_ca_sign_makes_a_worker_chain_under_the_fleet_root() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let root_dir = tmp.path().join("root");
    let worker = tmp.path().join("worker");
    let out = ca(&[os("init"), os("--root"), os("--dir"), root_dir.as_os_str()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = ca(&[
        os("request"),
        os("--dir"),
        worker.as_os_str(),
        os("--name"),
        os("worker-7"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let csr = worker.join("ca.csr");
    let printed = String::from_utf8(out.stdout).expect("utf-8");
    assert_eq!(printed.trim(), csr.to_str().expect("utf-8"));
    let key_mode = std::fs::metadata(worker.join("ca.key"))
        .expect("key")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(key_mode, 0o600);
    let request = std::fs::read_to_string(&csr).expect("csr");
    assert!(request.starts_with("-----BEGIN CERTIFICATE REQUEST-----"));

    let chain = worker.join("ca.crt");
    let sign = |csr: &std::path::Path, days: &str| {
        ca(&[
            os("sign"),
            os("--root-cert"),
            root_dir.join("ca.crt").as_os_str(),
            os("--root-key"),
            root_dir.join("ca.key").as_os_str(),
            os("--csr"),
            csr.as_os_str(),
            os("--out"),
            chain.as_os_str(),
            os("--days"),
            os(days),
        ])
    };
    let out = sign(&csr, "90");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8(out.stdout).expect("utf-8").trim(),
        chain.to_str().expect("utf-8")
    );
    let ca = egress_certs::CertificateAuthority::load(&egress_certs::CaPaths::in_dir(&worker))
        .expect("the worker's key and the signed chain load together");
    assert!(ca.subject().contains("worker-7"), "{}", ca.subject());
    let (_, cert) = x509_parser::parse_x509_certificate(ca.cert_der()).expect("x509");
    let bc = cert
        .basic_constraints()
        .expect("ok")
        .expect("present")
        .value;
    assert!(bc.ca);
    assert_eq!(bc.path_len_constraint, Some(0));
    let days =
        (cert.validity().not_after.timestamp() - cert.validity().not_before.timestamp()) / 86_400;
    assert_eq!(days, 90, "90 days and the hour of backdating");

    let again = sign(&csr, "90");
    assert_eq!(again.status.code(), Some(1));
    let err = String::from_utf8(again.stderr).expect("utf-8");
    assert!(err.contains("refusing to overwrite"), "{err}");

    // A request altered in transit: one base64 character of its body changed.
    std::fs::remove_file(&chain).expect("rm");
    let mut lines: Vec<String> = request.lines().map(str::to_owned).collect();
    let line = &mut lines[3];
    let flipped = if line.starts_with('A') { "B" } else { "A" };
    line.replace_range(0..1, flipped);
    let tampered = tmp.path().join("tampered.csr");
    std::fs::write(&tampered, lines.join("\n")).expect("write");
    let out = sign(&tampered, "90");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8(out.stderr).expect("utf-8");
    assert!(err.contains(tampered.to_str().expect("utf-8")), "{err}");
    assert!(!chain.exists(), "nothing written for a refused request");
}
