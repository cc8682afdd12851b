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
