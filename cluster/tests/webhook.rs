//! The admission webhook: `review` on AdmissionReviews as the API server
//! sends them, with the same verdict as `egress_policy::machine::check`, and
//! the TLS server end to end (HTTP/1.1 and HTTP/2) with a throwaway CA.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use egress_cluster::resource::MANAGED_ANNOTATION;
use egress_cluster::webhook::{self, review, ReviewError, RECONCILER_USER};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};

const UID: &str = "705ab4f5-6393-11e8-b7cc-42010a800002";

/// An AdmissionReview as the API server sends it for a Machine; `egress`
/// `None` leaves the field out.
fn machine_review(operation: &str, egress: Option<Value>) -> Value {
    let mut network = json!({ "mode": "user" });
    if let Some(e) = egress {
        network["egress"] = e;
    }
    let object = json!({
        "apiVersion": "kairon.zyvor.dev/v1beta1",
        "kind": "Machine",
        "metadata": {
            "name": "web",
            "namespace": "prod",
            "uid": "8a1c2e0e-58b7-4b6c-9d0b-1a4c2f3e5d6a",
            "generation": 1,
            "creationTimestamp": "2025-06-01T10:00:00Z",
            "labels": { "app": "web" },
        },
        "spec": { "network": network, "cpus": 2 },
    });
    let (old, options) = match operation {
        "CREATE" => (Value::Null, "CreateOptions"),
        "DELETE" => (object.clone(), "DeleteOptions"),
        _ => (object.clone(), "UpdateOptions"),
    };
    let object = if operation == "DELETE" {
        Value::Null
    } else {
        object
    };
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": UID,
            "kind": { "group": "kairon.zyvor.dev", "version": "v1beta1", "kind": "Machine" },
            "resource": { "group": "kairon.zyvor.dev", "version": "v1beta1", "resource": "machines" },
            "requestKind": { "group": "kairon.zyvor.dev", "version": "v1beta1", "kind": "Machine" },
            "requestResource": { "group": "kairon.zyvor.dev", "version": "v1beta1", "resource": "machines" },
            "name": "web",
            "namespace": "prod",
            "operation": operation,
            "userInfo": {
                "username": "kubernetes-admin",
                "groups": ["kubeadm:cluster-admins", "system:authenticated"],
            },
            "object": object,
            "oldObject": old,
            "dryRun": false,
            "options": { "kind": options, "apiVersion": "meta.k8s.io/v1" },
        },
    })
}

/// The response of `review`, after the checks every response passes.
fn respond(doc: &Value) -> Value {
    let out = review(doc.to_string().as_bytes(), RECONCILER_USER).expect("a review");
    assert_eq!(out["apiVersion"], "admission.k8s.io/v1", "{out}");
    assert_eq!(out["kind"], "AdmissionReview", "{out}");
    assert_eq!(out["response"]["uid"], UID, "{out}");
    assert!(out.get("request").is_none(), "{out}");
    out["response"].clone()
}

/// `review`'s verdict on a Machine CREATE with `egress`, checked against
/// `egress_policy::machine::check` on the same policy.
fn verdict(egress: &Value) -> Value {
    let response = respond(&machine_review("CREATE", Some(egress.clone())));
    let (valid, report) = egress_policy::machine::check(&egress.to_string());
    assert_eq!(response["allowed"], valid, "{response} vs {report}");
    if !valid {
        assert_eq!(response["status"]["code"], 400, "{response}");
        assert_eq!(response["status"]["status"], "Failure", "{response}");
        // Every problem check reports, named as the webhook names it.
        let message = response["status"]["message"].as_str().expect("message");
        let expected: Vec<String> = report["errors"]
            .as_array()
            .expect("errors")
            .iter()
            .map(|e| match e["rule"].as_u64() {
                Some(i) => format!(
                    "spec.network.egress.rules[{i}]: {}",
                    e["message"].as_str().expect("text")
                ),
                None => format!(
                    "spec.network.egress: {}",
                    e["message"].as_str().expect("text")
                ),
            })
            .collect();
        assert_eq!(message, expected.join("; "));
    }
    response
}

fn message(response: &Value) -> &str {
    response["status"]["message"].as_str().expect("a message")
}

#[test]
fn a_valid_policy_is_allowed() {
    let spec_example = json!({
        "mode": "allowlist",
        "rules": [
            { "cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151, "note": "Veyron API" },
            { "cidr": "91.189.88.0/21", "proto": "tcp", "port": 80 },
            { "cidr": "0.0.0.0/0", "proto": "udp", "port": 53 },
        ],
    });
    for egress in [
        spec_example,
        json!({ "mode": "loopback" }),
        json!({ "mode": "open" }),
        json!({ "mode": "audit", "rules": [{ "cidr": "1.2.3.4" }] }),
        json!({}),
    ] {
        let r = verdict(&egress);
        assert_eq!(r["allowed"], true, "{egress}: {r}");
    }
}

#[test]
fn an_absent_or_null_egress_is_allowed() {
    for doc in [
        machine_review("CREATE", None),
        machine_review("CREATE", Some(Value::Null)),
        machine_review("UPDATE", None),
    ] {
        assert_eq!(respond(&doc)["allowed"], true);
    }
    // No network at all, or no spec.
    let mut doc = machine_review("CREATE", None);
    doc["request"]["object"]["spec"] = json!({ "cpus": 2 });
    assert_eq!(respond(&doc)["allowed"], true);
    doc["request"]["object"]
        .as_object_mut()
        .expect("object")
        .remove("spec");
    assert_eq!(respond(&doc)["allowed"], true);
}

#[test]
fn host_bits_are_refused_naming_the_rule() {
    let r = verdict(&json!({ "rules": [
        { "cidr": "10.0.0.0/8" },
        { "cidr": "10.1.2.3/8", "proto": "tcp", "port": 443 },
    ]}));
    assert_eq!(r["allowed"], false);
    assert_eq!(
        message(&r),
        "spec.network.egress.rules[1]: cidr \"10.1.2.3/8\" has host bits set: did you mean \"10.0.0.0/8\"?"
    );
}

#[test]
fn rules_under_mode_open_are_refused() {
    let r = verdict(&json!({ "mode": "open", "rules": [{ "cidr": "10.0.0.0/8" }] }));
    assert_eq!(r["allowed"], false);
    assert!(
        message(&r).starts_with("spec.network.egress: mode open: everything leaves"),
        "{r}"
    );
}

#[test]
fn more_than_256_rules_are_refused() {
    let rules: Vec<Value> = (0..257)
        .map(|i| json!({ "cidr": format!("10.0.{}.{}", i / 256, i % 256) }))
        .collect();
    let r = verdict(&json!({ "rules": rules }));
    assert_eq!(r["allowed"], false);
    assert!(
        message(&r).starts_with("spec.network.egress: 257 rules: at most 256 are allowed"),
        "{r}"
    );
    // 256 are fine.
    let rules: Vec<Value> = (0..256)
        .map(|i| json!({ "cidr": format!("10.0.0.{i}") }))
        .collect();
    assert_eq!(verdict(&json!({ "rules": rules }))["allowed"], true);
}

#[test]
fn five_entries_on_one_network_are_refused() {
    let rules: Vec<Value> = [80, 443, 8080, 8443, 9000]
        .iter()
        .map(|p| json!({ "cidr": "192.0.2.0/24", "proto": "tcp", "port": p }))
        .collect();
    let r = verdict(&json!({ "rules": rules }));
    assert_eq!(r["allowed"], false);
    assert!(
        message(&r).starts_with(
            "spec.network.egress.rules[0]: network 192.0.2.0/24 carries 5 distinct entries"
        ),
        "{r}"
    );
    // Four are the limit.
    let rules: Vec<Value> = [80, 443, 8080, 8443]
        .iter()
        .map(|p| json!({ "cidr": "192.0.2.0/24", "proto": "tcp", "port": p }))
        .collect();
    assert_eq!(verdict(&json!({ "rules": rules }))["allowed"], true);
}

#[test]
fn every_problem_is_reported() {
    let r = verdict(&json!({ "mode": "sometimes", "extra": 1, "rules": [
        { "cidr": "10.1.2.3/8" },
        { "cidr": "::1" },
        { "cidr": "1.2.3.4", "port": 80 },
        "not a rule",
    ]}));
    assert_eq!(r["allowed"], false);
    let parts: Vec<&str> = message(&r).split("; ").collect();
    assert!(parts.len() >= 6, "{parts:?}");
    assert!(parts[0].starts_with("spec.network.egress: "), "{parts:?}");
    for i in 0..4 {
        let at = format!("spec.network.egress.rules[{i}]: ");
        assert!(
            parts.iter().any(|p| p.starts_with(&at)),
            "{at} in {parts:?}"
        );
    }
    // Not an object at all.
    let r = verdict(&json!("allowlist"));
    assert!(message(&r).starts_with("spec.network.egress: policy must be a JSON object"));
}

/// The reconciler's user may change the egress-managed annotation and
/// nothing else: not the policy (valid or not), the labels, another
/// annotation, nor create a Machine. Anyone else's valid change passes.
#[test]
fn the_reconciler_may_change_only_its_annotation() {
    let by_reconciler = |mut doc: Value| {
        doc["request"]["userInfo"] = json!({
            "username": RECONCILER_USER,
            "groups": ["system:serviceaccounts", "system:authenticated"],
        });
        respond(&doc)
    };
    let open = json!({ "mode": "open" });
    let mut marked = machine_review("UPDATE", Some(open.clone()));
    marked["request"]["object"]["metadata"]["annotations"] = json!({ MANAGED_ANNOTATION: "true" });
    let r = by_reconciler(marked.clone());
    assert_eq!(r["allowed"], true, "the annotation alone: {r}");

    let mut widened = marked.clone();
    widened["request"]["oldObject"]["spec"]["network"]["egress"] = json!({ "mode": "loopback" });
    let r = by_reconciler(widened.clone());
    assert_eq!(r["allowed"], false, "the policy changed: {r}");
    assert_eq!(r["status"]["code"], 403, "{r}");
    let said = r["status"]["message"].as_str().expect("a message");
    assert!(
        said.contains(RECONCILER_USER) && said.contains("spec"),
        "{said}"
    );
    // The same change by anyone else is the policy check's alone.
    assert_eq!(respond(&widened)["allowed"], true);

    let mut relabelled = marked.clone();
    relabelled["request"]["object"]["metadata"]["labels"]["kairon.zyvor.dev/node"] =
        json!("node-b");
    let r = by_reconciler(relabelled);
    assert_eq!(r["allowed"], false, "a label: {r}");
    let mut annotated = marked;
    annotated["request"]["object"]["metadata"]["annotations"]["other"] = json!("x");
    let r = by_reconciler(annotated);
    assert_eq!(r["allowed"], false, "another annotation: {r}");
    let r = by_reconciler(machine_review("CREATE", Some(open)));
    assert_eq!(r["allowed"], false, "a create: {r}");
    // The reconciler's account deployed in another namespace (without
    // --reconciler-user) is bound the same; another account is not.
    let by = |user: &str, mut doc: Value| {
        doc["request"]["userInfo"] = json!({ "username": user });
        respond(&doc)
    };
    let elsewhere = "system:serviceaccount:egress:egress-cluster-reconciler";
    let r = by(elsewhere, widened.clone());
    assert_eq!(r["status"]["code"], 403, "{r}");
    let said = r["status"]["message"].as_str().expect("a message");
    assert!(said.starts_with(elsewhere), "{said}");
    for other in [
        "system:serviceaccount:kairon-system:egress-cluster-reconciler-2",
        "egress-cluster-reconciler",
        "system:serviceaccount:egress-cluster-reconciler",
    ] {
        assert_eq!(by(other, widened.clone())["allowed"], true, "{other}");
    }
}

#[test]
fn updates_are_checked_deletes_and_other_kinds_are_not() {
    let bad = json!({ "mode": "open", "rules": [{ "cidr": "10.0.0.0/8" }] });
    let mut doc = machine_review("UPDATE", Some(bad.clone()));
    doc["request"]["oldObject"]["spec"]["network"]["egress"] = json!({ "mode": "loopback" });
    let r = respond(&doc);
    assert_eq!(r["allowed"], false, "a policy changed to a bad one: {r}");
    // An update that leaves a stored bad policy as it is (one stored before
    // the check was stricter) is not refused: it would block the deletion
    // (a finalizer removed) for good.
    let r = respond(&machine_review("UPDATE", Some(bad.clone())));
    assert_eq!(r["allowed"], true, "the policy unchanged: {r}");
    let mut deleting = machine_review("UPDATE", Some(bad.clone()));
    for side in ["object", "oldObject"] {
        deleting["request"][side]["metadata"]["deletionTimestamp"] = json!("2025-06-02T10:00:00Z");
    }
    deleting["request"]["oldObject"]["metadata"]["finalizers"] = json!(["kairon.zyvor.dev/vm"]);
    let r = respond(&deleting);
    assert_eq!(
        r["allowed"], true,
        "a finalizer removed, the policy unchanged: {r}"
    );
    // A Machine being deleted is no way around the check.
    doc["request"]["object"]["metadata"]["deletionTimestamp"] = json!("2025-06-02T10:00:00Z");
    doc["request"]["oldObject"]["metadata"]["deletionTimestamp"] = json!("2025-06-02T10:00:00Z");
    let r = respond(&doc);
    assert_eq!(
        r["allowed"], false,
        "a bad policy set on a Machine being deleted: {r}"
    );
    // DELETE: nothing is stored, nothing to check (the old object is bad).
    let r = respond(&machine_review("DELETE", Some(bad.clone())));
    assert_eq!(r["allowed"], true, "{r}");
    // CONNECT.
    let mut doc = machine_review("CREATE", Some(bad.clone()));
    doc["request"]["operation"] = json!("CONNECT");
    assert_eq!(respond(&doc)["allowed"], true);
    // Another kind with the same field, or a Machine of another group.
    let mut doc = machine_review("CREATE", Some(bad.clone()));
    doc["request"]["kind"] = json!({ "group": "", "version": "v1", "kind": "Pod" });
    assert_eq!(respond(&doc)["allowed"], true);
    let mut doc = machine_review("CREATE", Some(bad));
    doc["request"]["kind"]["group"] = json!("example.com");
    assert_eq!(respond(&doc)["allowed"], true);
}

#[test]
fn malformed_reviews_are_errors() {
    let not_json = review(b"{\"apiVersion\": ", RECONCILER_USER);
    assert!(
        matches!(not_json, Err(ReviewError::Json(_))),
        "{not_json:?}"
    );
    for bad in [&b""[..], b"\xff\xfe", b"[]", b"null", b"42", b"{}"] {
        assert!(
            review(bad, RECONCILER_USER).is_err(),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
    let good = machine_review("CREATE", None);
    let mutate = |f: &dyn Fn(&mut Value)| {
        let mut doc = good.clone();
        f(&mut doc);
        review(doc.to_string().as_bytes(), RECONCILER_USER)
    };
    type Mutation<'a> = (&'a str, &'a dyn Fn(&mut Value));
    let cases: [Mutation<'_>; 8] = [
        ("no request", &|d| {
            d.as_object_mut().expect("obj").remove("request");
        }),
        ("null request", &|d| d["request"] = Value::Null),
        ("no uid", &|d| {
            d["request"].as_object_mut().expect("obj").remove("uid");
        }),
        ("empty uid", &|d| d["request"]["uid"] = json!("")),
        ("wrong kind", &|d| d["kind"] = json!("ConversionReview")),
        ("v1beta1", &|d| {
            d["apiVersion"] = json!("admission.k8s.io/v1beta1")
        }),
        ("bad operation", &|d| {
            d["request"]["operation"] = json!("PATCH")
        }),
        ("create without object", &|d| {
            d["request"]["object"] = Value::Null
        }),
    ];
    for (what, f) in cases {
        let r = mutate(f);
        assert!(matches!(r, Err(ReviewError::NotReview(_))), "{what}: {r:?}");
    }
    // A body of many small objects and arrays (a parse would build some
    // 100 MB from 1 MiB) is refused before it is parsed, naming the bounds.
    let mut wide = good.clone();
    let many = format!("[{}{{\"\":0}}]", "{\"\":0},".repeat(100_000));
    wide["request"]["object"]["spec"]["network"]["egress"] = json!("placeholder");
    let text = wide.to_string().replace("\"placeholder\"", &many);
    assert!(text.len() < webhook::MAX_BODY, "{} bytes", text.len());
    let refused = review(text.as_bytes(), RECONCILER_USER);
    let Err(ReviewError::NotReview(why)) = &refused else {
        panic!("parsed: {refused:?}");
    };
    assert!(
        why.starts_with("the body holds 1000")
            && why.contains("JSON objects and arrays")
            && why.ends_with("(16384 and 131072)"),
        "{why}"
    );
    // Commas in strings and escaped quotes are not counted.
    let strings = mutate(&|d| {
        d["request"]["object"]["metadata"]["labels"]["x"] = json!(",[{\",".repeat(40_000))
    });
    assert!(strings.is_ok(), "{strings:?}");
    // And nothing panics on deep or odd input.
    let deep = "[".repeat(100_000);
    assert!(review(deep.as_bytes(), RECONCILER_USER).is_err());
    assert!(mutate(&|d| d["request"]["object"]["spec"] = json!("x")).is_ok());
}

// === the TLS server ===

/// A throwaway CA and a server certificate for localhost and 127.0.0.1, in
/// PEM files; the CA certificate to trust.
struct Certs {
    dir: tempfile::TempDir,
    ca: CertificateDer<'static>,
}

fn certs() -> Certs {
    let ca_key = KeyPair::generate().expect("ca key");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca_params.self_signed(&ca_key).expect("ca cert");
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().expect("server key");
    let params = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
        .expect("server params");
    let cert = params.signed_by(&key, &issuer).expect("server cert");
    let dir = tempfile::tempdir().expect("dir");
    std::fs::write(dir.path().join("tls.crt"), cert.pem()).expect("write cert");
    std::fs::write(dir.path().join("tls.key"), key.serialize_pem()).expect("write key");
    Certs {
        dir,
        ca: ca_cert.der().clone(),
    }
}

/// The webhook's TLS configuration from `certs`' files.
fn server_tls(certs: &Certs) -> Arc<rustls::ServerConfig> {
    webhook::tls_config(
        certs.dir.path().join("tls.crt"),
        certs.dir.path().join("tls.key"),
    )
    .expect("tls config")
}

/// A listener on a loopback port, and its address.
async fn bound() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    (listener, addr)
}

async fn start_webhook(certs: &Certs) -> SocketAddr {
    let (listener, addr) = bound().await;
    tokio::spawn(webhook::serve(
        listener,
        server_tls(certs),
        RECONCILER_USER.into(),
    ));
    addr
}

/// One request over TLS, HTTP/2 when `h2`; the status, the ALPN protocol
/// and the body.
async fn https(
    addr: SocketAddr,
    ca: &CertificateDer<'static>,
    h2: bool,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> (u16, String) {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).expect("trust the CA");
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![if h2 {
        b"h2".to_vec()
    } else {
        b"http/1.1".to_vec()
    }];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let exchange = async {
        let tcp = TcpStream::connect(addr).await.expect("connect");
        let name = ServerName::try_from("localhost").expect("name");
        let tls = connector.connect(name, tcp).await.expect("TLS handshake");
        let alpn = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
        assert_eq!(
            alpn.as_deref(),
            Some(if h2 { &b"h2"[..] } else { &b"http/1.1"[..] })
        );
        let req = http::Request::builder()
            .method(method)
            .uri(format!("https://localhost:{}{path}", addr.port()))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        let resp = if h2 {
            let (mut sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                    .await
                    .expect("h2 handshake");
            tokio::spawn(conn);
            sender.send_request(req).await.expect("h2 response")
        } else {
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
                .await
                .expect("handshake");
            tokio::spawn(conn);
            sender.send_request(req).await.expect("response")
        };
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    };
    tokio::time::timeout(Duration::from_secs(20), exchange)
        .await
        .expect("an answer in time")
}

fn parse(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body:?}"))
}

#[tokio::test]
async fn the_tls_server_answers_reviews_over_http1_and_http2() {
    let certs = certs();
    let addr = start_webhook(&certs).await;
    let good = machine_review(
        "CREATE",
        Some(json!({ "rules": [{ "cidr": "10.0.0.0/8" }] })),
    );
    let bad = machine_review(
        "CREATE",
        Some(json!({ "rules": [{ "cidr": "10.0.0.1/8" }] })),
    );
    for h2 in [false, true] {
        let (status, body) = https(
            addr,
            &certs.ca,
            h2,
            "POST",
            "/validate",
            good.to_string().into(),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let doc = parse(&body);
        assert_eq!(doc["response"]["allowed"], true, "{doc}");
        assert_eq!(doc["response"]["uid"], UID);
        assert_eq!(doc["apiVersion"], "admission.k8s.io/v1");

        let (status, body) = https(addr, &certs.ca, h2, "POST", "/", bad.to_string().into()).await;
        assert_eq!(status, 200, "{body}");
        let doc = parse(&body);
        assert_eq!(doc["response"]["allowed"], false, "{doc}");
        assert!(
            doc["response"]["status"]["message"]
                .as_str()
                .expect("message")
                .starts_with("spec.network.egress.rules[0]: cidr \"10.0.0.1/8\" has host bits set"),
            "{doc}"
        );

        // Malformed: 400 with an error.
        for body in [&b"not json"[..], b"{\"kind\": \"AdmissionReview\"}"] {
            let (status, reply) =
                https(addr, &certs.ca, h2, "POST", "/validate", body.to_vec()).await;
            assert_eq!(status, 400, "{reply}");
            assert!(parse(&reply)["error"].is_string(), "{reply}");
        }
        // Wrong path, wrong method.
        let (status, reply) = https(
            addr,
            &certs.ca,
            h2,
            "POST",
            "/mutate",
            good.to_string().into(),
        )
        .await;
        assert_eq!(status, 404, "{reply}");
        assert!(parse(&reply)["error"].is_string());
        let (status, _) = https(addr, &certs.ca, h2, "GET", "/validate", Vec::new()).await;
        assert_eq!(status, 405);
    }
}

/// A renewed certificate (cert-manager rewrites the files) is served from
/// the next handshake on, without a restart; files that do not make a key
/// keep the one in service. The first certificate was served until a
/// restart before, and expired under a running webhook.
#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart() {
    let first = certs();
    let addr = start_webhook(&first).await;
    let review = machine_review("CREATE", None).to_string().into_bytes();
    assert_eq!(
        https(addr, &first.ca, false, "POST", "/validate", review.clone())
            .await
            .0,
        200
    );
    // A garbled write first: still served with the first certificate.
    let (cert, key) = (
        first.dir.path().join("tls.crt"),
        first.dir.path().join("tls.key"),
    );
    std::fs::write(&cert, "not a certificate").expect("garble");
    assert_eq!(
        https(addr, &first.ca, false, "POST", "/validate", review.clone())
            .await
            .0,
        200
    );
    // Then the renewal: another CA's certificate and its key.
    let renewed = certs();
    std::fs::copy(renewed.dir.path().join("tls.crt"), &cert).expect("cert");
    std::fs::copy(renewed.dir.path().join("tls.key"), &key).expect("key");
    let later = std::time::SystemTime::now() + Duration::from_secs(5);
    for path in [&cert, &key] {
        let f = std::fs::File::options()
            .write(true)
            .open(path)
            .expect("open");
        f.set_modified(later).expect("mtime");
    }
    let (status, _) = https(addr, &renewed.ca, true, "POST", "/validate", review).await;
    assert_eq!(status, 200, "the renewed certificate is served");
}

#[tokio::test]
async fn the_tls_server_caps_bodies_and_survives_garbage() {
    let certs = certs();
    let addr = start_webhook(&certs).await;
    // Over 1 MiB: 413.
    let (status, reply) = https(
        addr,
        &certs.ca,
        false,
        "POST",
        "/validate",
        vec![b' '; webhook::MAX_BODY + 1],
    )
    .await;
    assert_eq!(status, 413, "{reply}");
    // Plain text on the TLS port, and a client that connects and leaves:
    // the server carries on.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let _ = s.write_all(b"POST /validate HTTP/1.1\r\n\r\n").await;
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
        drop(TcpStream::connect(addr).await.expect("connect"));
    }
    let good = machine_review("CREATE", None);
    let (status, _) = https(
        addr,
        &certs.ca,
        true,
        "POST",
        "/validate",
        good.to_string().into(),
    )
    .await;
    assert_eq!(status, 200);
}

#[test]
fn tls_config_errors_name_the_file() {
    let certs = certs();
    let dir = certs.dir.path();
    let missing = dir.join("missing.crt");
    let e = webhook::tls_config(&missing, dir.join("tls.key")).expect_err("missing cert");
    assert!(
        e.to_string().contains(&missing.display().to_string()),
        "{e}"
    );
    let garbage = dir.join("garbage.key");
    std::fs::write(&garbage, "not a key").expect("write");
    let e = webhook::tls_config(dir.join("tls.crt"), &garbage).expect_err("garbage key");
    assert!(
        e.to_string().contains(&garbage.display().to_string()),
        "{e}"
    );
    let e = webhook::tls_config(&garbage, dir.join("tls.key")).expect_err("no cert");
    assert!(
        e.to_string().contains(&garbage.display().to_string()),
        "{e}"
    );
    // A key that is not the certificate's.
    let other = dir.join("other.key");
    std::fs::write(&other, KeyPair::generate().expect("key").serialize_pem()).expect("write");
    let e = webhook::tls_config(dir.join("tls.crt"), &other).expect_err("mismatched key");
    assert!(e.to_string().contains(&other.display().to_string()), "{e}");
}

/// A TLS connection to the webhook that sent a review's head, declaring a
/// body it never sends.
async fn stalled(
    addr: SocketAddr,
    ca: &CertificateDer<'static>,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    stalled_with(addr, ca, 100).await
}

/// [`stalled`], declaring a body of `length` bytes.
async fn stalled_with(
    addr: SocketAddr,
    ca: &CertificateDer<'static>,
    length: usize,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    use tokio::io::AsyncWriteExt;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).expect("trust the CA");
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = ServerName::try_from("localhost").expect("name");
    let mut tls = connector.connect(name, tcp).await.expect("TLS handshake");
    let head = format!("POST /validate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n");
    tls.write_all(head.as_bytes()).await.expect("head");
    tls.flush().await.expect("flush");
    tls
}

#[tokio::test]
async fn reviews_behind_stalled_bodies_are_answered_within_the_wait() {
    // Sixteen reviews whose bodies never come hold every slot for the body
    // wait (1 s) only. Another review, queued behind them, gets a slot and
    // its answer within its own wait (2 s): before, they held the slots for
    // 10 s, and it was refused 503 (with no wait at all, it queued for good).
    let certs = certs();
    let addr = start_webhook(&certs).await;
    let mut held = Vec::new();
    for _ in 0..webhook::MAX_REVIEWS {
        held.push(stalled(addr, &certs.ca).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let review = machine_review("CREATE", None).to_string().into_bytes();
    let answered = tokio::time::timeout(
        Duration::from_secs(5),
        https(addr, &certs.ca, true, "POST", "/validate", review),
    )
    .await;
    let (status, body) = answered.expect("answered within 5 s");
    assert_eq!(status, 200, "{body}");
    drop(held);
}

/// Stopped (SIGTERM), the webhook takes no connection, answers the review
/// whose body was still arriving, and only then returns.
#[tokio::test]
async fn a_stopping_webhook_answers_the_review_in_flight_first() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let certs = certs();
    let (listener, addr) = bound().await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stopped = async {
        let _ = stopped.await;
    };
    let server = tokio::spawn(webhook::serve_until(
        listener,
        server_tls(&certs),
        RECONCILER_USER.into(),
        stopped,
    ));
    let review = machine_review("CREATE", None).to_string();
    let mut tls = stalled_with(addr, &certs.ca, review.len()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.send(()).expect("stop");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!server.is_finished(), "returned with a review in flight");
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "a connection taken after the stop"
    );
    tls.write_all(review.as_bytes()).await.expect("body");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&answer).contains("\"uid\"") {
            let n = tls.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed: {}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&buf[..n]);
        }
    });
    read.await.expect("answered in time");
    let text = String::from_utf8_lossy(&answer).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 200"), "{text}");
    assert!(text.contains("connection: close"), "told to close: {text}");
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("returns once answered")
        .expect("server");
}
