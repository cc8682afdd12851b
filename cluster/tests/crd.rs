//! `deploy/machine-crd.yaml` is what `egress-cluster crd` prints: generated
//! from the Rust type, never edited by hand. `EGRESS_WRITE_CRD=1 cargo test
//! -p egress-cluster --test crd` rewrites it after a change to the type.

use egress_cluster::resource::{crd_yaml, Machine};

#[test]
fn the_committed_crd_is_generated_from_the_type() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/machine-crd.yaml");
    let generated = crd_yaml().expect("serialises");
    if std::env::var_os("EGRESS_WRITE_CRD").is_some() {
        std::fs::write(path, &generated).expect("write");
    }
    let committed = std::fs::read_to_string(path).expect("deploy/machine-crd.yaml");
    assert_eq!(
        committed, generated,
        "deploy/machine-crd.yaml is stale: EGRESS_WRITE_CRD=1 cargo test -p egress-cluster --test crd"
    );
}

#[test]
fn the_crd_names_the_group_kind_and_egress_schema() {
    let crd: serde_json::Value =
        serde_yaml::from_str(&crd_yaml().expect("serialises")).expect("yaml");
    assert_eq!(crd["spec"]["group"], "kairon.zyvor.dev");
    assert_eq!(crd["spec"]["names"]["kind"], "Machine");
    let version = &crd["spec"]["versions"][0];
    assert_eq!(version["name"], "v1beta1");
    let egress = &version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["network"]["properties"]["egress"];
    let modes: Vec<&str> = egress["properties"]["mode"]["enum"]
        .as_array()
        .expect("enum")
        .iter()
        .filter_map(|m| m.as_str())
        .collect();
    assert_eq!(
        modes,
        ["loopback", "allowlist", "audit", "open"],
        "{egress}"
    );
    assert_eq!(egress["properties"]["rules"]["maxItems"], 256, "{egress}");
    // A Machine with the spec's example round-trips through the type.
    let m: Machine = serde_yaml::from_str(
        r#"
apiVersion: kairon.zyvor.dev/v1beta1
kind: Machine
metadata: {name: web, namespace: prod}
spec:
  network:
    mode: user
    egress:
      mode: allowlist
      rules:
      - {cidr: 10.0.0.0/8, proto: tcp, port: 5151, note: Veyron API}
      - {cidr: 91.189.88.0/21, proto: tcp, port: 80}
      - {cidr: 0.0.0.0/0, proto: udp, port: 53}
"#,
    )
    .expect("the spec's example");
    let policy = m.egress().expect("has the field").expect("valid");
    assert_eq!(policy.rules.len(), 3);
}

/// The policy checked is the one written: a field this build does not know
/// (one a newer CRD allows) refuses it rather than being dropped (which
/// checked `{cidr, proto: tcp}` for a rule narrowed to some ports, all of
/// TCP), and a mode it does not know refuses this Machine alone rather
/// than failing to read it (which stopped the node's whole watch).
#[test]
fn the_policy_checked_is_the_one_written() {
    let machine = |egress: &str| -> Machine {
        let doc = format!(
            r#"{{"apiVersion": "kairon.zyvor.dev/v1beta1", "kind": "Machine",
                "metadata": {{"name": "web", "namespace": "prod"}},
                "spec": {{"network": {{"egress": {egress}}}}}}}"#
        );
        serde_json::from_str(&doc).expect("read whatever the policy says")
    };
    let newer = machine(
        r#"{"mode": "allowlist", "rules": [{"cidr": "10.0.0.0/8", "proto": "tcp", "ports": "8000-8100"}]}"#,
    );
    let refused = newer.egress().expect("has the field");
    assert!(refused.is_err(), "{refused:?}");
    let unknown_mode = machine(r#"{"mode": "strict"}"#);
    let refused = unknown_mode.egress().expect("has the field");
    assert!(refused.is_err(), "{refused:?}");
    assert!(machine("null").egress().is_none(), "null is absent");
}
