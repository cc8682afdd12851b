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
