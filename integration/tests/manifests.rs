//! `deploy/kubernetes`, checked against the types and binaries it names:
//!
//! - every file is in `kustomization.yaml` and every listed file exists
//!   (and `kubectl kustomize` builds it, where kubectl is installed);
//! - every document reads into its `k8s-openapi` type (or, for the
//!   cert-manager and Prometheus Operator kinds, a small schema of the keys
//!   used here) and loses no key on the way back: a lost key is an unknown
//!   field, reported with its path;
//! - each container's command is the binary its image names, its
//!   subcommand and flags are in that binary's `--help`, its environment
//!   variables are read by it, its image tag is the binary's version;
//! - each probe's port is the one the binary listens on (from its flags, or
//!   the gateway's `gateway.toml` in the ConfigMap), on every address, and
//!   its path is served: the gateway is started with the ConfigMap's
//!   configuration (listeners moved to loopback, files to a temp dir) and
//!   asked; the controller cannot start without PostgreSQL, so its paths
//!   are checked against its router's source;
//! - the reconciler's RBAC is exactly `egress_cluster::reconcile::KUBE_ACCESS`;
//! - the objects name each other correctly (Services, mounts, the
//!   webhook's certificate, the PodMonitor's token, the reconciler's worker);
//! - the CRD and the alert rules are the committed ones.
//!
//! The binaries are the workspace's, in `target/<profile>`:
//! `cargo test --workspace --all-targets` builds every binary before it runs
//! any test; alone, run `cargo build --workspace --bins` first.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, PodSpec, Probe};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn kube_dir() -> PathBuf {
    root().join("deploy/kubernetes")
}

/// Fails with every problem found, one per line.
fn assert_none(problems: &[String]) {
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

// === documents ===

/// One YAML document of one file.
struct Doc {
    file: String,
    value: Value,
}

impl Doc {
    fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or("")
    }
    fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or("")
    }
    fn namespace(&self) -> &str {
        self.value["metadata"]["namespace"].as_str().unwrap_or("")
    }
    fn at(&self) -> String {
        format!("{}: {} {}", self.file, self.kind(), self.name())
    }
    fn typed<T: DeserializeOwned>(&self) -> T {
        serde_json::from_value(self.value.clone()).unwrap_or_else(|e| panic!("{}: {e}", self.at()))
    }
}

fn read_docs(path: &Path) -> Vec<Doc> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = path.file_name().map(|f| f.to_string_lossy().into_owned());
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .filter(|v| !v.is_null())
        .map(|value| Doc {
            file: file.clone().unwrap_or_default(),
            value,
        })
        .collect()
}

/// The resource files: every `.yaml` but the kustomization.
fn resource_files() -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(kube_dir())
        .expect("deploy/kubernetes")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|f| f.ends_with(".yaml") && f != "kustomization.yaml")
        .collect();
    files.sort();
    files
}

fn docs() -> Vec<Doc> {
    resource_files()
        .iter()
        .flat_map(|f| read_docs(&kube_dir().join(f)))
        .collect()
}

fn find<'a>(docs: &'a [Doc], kind: &str, name: &str) -> Option<&'a Doc> {
    docs.iter().find(|d| d.kind() == kind && d.name() == name)
}

// === the kustomization ===

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Kustomization {
    #[allow(dead_code)]
    api_version: String,
    #[allow(dead_code)]
    kind: String,
    resources: Vec<String>,
}

#[test]
fn every_file_is_in_the_kustomization() {
    let text = std::fs::read_to_string(kube_dir().join("kustomization.yaml")).expect("read");
    let k: Kustomization = serde_yaml::from_str(&text).expect("kustomization.yaml");
    let listed: BTreeSet<&str> = k.resources.iter().map(String::as_str).collect();
    let files = resource_files();
    let mut problems = Vec::new();
    for f in &files {
        if !listed.contains(f.as_str()) {
            problems.push(format!("{f} is not listed in kustomization.yaml"));
        }
    }
    for l in &listed {
        if !kube_dir().join(l).is_file() {
            problems.push(format!(
                "kustomization.yaml lists {l}, which does not exist"
            ));
        }
    }
    assert_eq!(listed.len(), k.resources.len(), "a resource listed twice");
    assert_none(&problems);
    kustomize_builds(docs().len());
}

/// `kubectl kustomize` (offline) builds the same number of objects.
fn kustomize_builds(expected: usize) {
    let out = match Command::new("kubectl")
        .arg("kustomize")
        .arg(kube_dir())
        .output()
    {
        Ok(out) => out,
        Err(e) => return egress_testkit::skip("kubectl kustomize", e),
    };
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl kustomize: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let built = serde_yaml::Deserializer::from_str(&text).count();
    assert_eq!(built, expected, "kubectl kustomize built {built} objects");
}

// === unknown fields ===

/// Reads `value` into `T` and back: every key of `value` must survive.
fn round_trip<T: DeserializeOwned + Serialize>(value: &Value) -> Result<(), String> {
    let typed: T = serde_path_to_error::deserialize(value.clone())
        .map_err(|e| format!("{}: {}", e.path(), e.inner()))?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    let mut lost = Vec::new();
    lost_keys(value, &back, "", &mut lost);
    if lost.is_empty() {
        Ok(())
    } else {
        Err(lost.join(", "))
    }
}

fn lost_keys(orig: &Value, back: &Value, path: &str, out: &mut Vec<String>) {
    match (orig, back) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let here = format!("{path}.{k}");
                match b.get(k) {
                    None => out.push(format!("unknown field {here}")),
                    Some(w) => lost_keys(v, w, &here, out),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (v, w)) in a.iter().zip(b).enumerate() {
                lost_keys(v, w, &format!("{path}[{i}]"), out);
            }
        }
        (a, b) if a == b => {}
        (a, b) => out.push(format!("{path}: {a} reads back as {b}")),
    }
}

/// The type each `apiVersion`/`kind` is read into.
fn check_type(doc: &Value) -> Result<(), String> {
    use k8s_openapi::api::{admissionregistration::v1 as adm, apps::v1 as apps};
    use k8s_openapi::api::{core::v1 as core, policy::v1 as policy, rbac::v1 as rbac};
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as ext;
    let api = doc["apiVersion"].as_str().unwrap_or("");
    match (api, doc["kind"].as_str().unwrap_or("")) {
        ("v1", "Namespace") => round_trip::<core::Namespace>(doc),
        ("v1", "ConfigMap") => round_trip::<core::ConfigMap>(doc),
        ("v1", "Secret") => round_trip::<core::Secret>(doc),
        ("v1", "Service") => round_trip::<core::Service>(doc),
        ("v1", "ServiceAccount") => round_trip::<core::ServiceAccount>(doc),
        ("apps/v1", "DaemonSet") => round_trip::<apps::DaemonSet>(doc),
        ("apps/v1", "Deployment") => round_trip::<apps::Deployment>(doc),
        ("policy/v1", "PodDisruptionBudget") => round_trip::<policy::PodDisruptionBudget>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRole") => round_trip::<rbac::ClusterRole>(doc),
        ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding") => {
            round_trip::<rbac::ClusterRoleBinding>(doc)
        }
        ("rbac.authorization.k8s.io/v1", "Role") => round_trip::<rbac::Role>(doc),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => round_trip::<rbac::RoleBinding>(doc),
        ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration") => {
            round_trip::<adm::ValidatingWebhookConfiguration>(doc)
        }
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition") => {
            round_trip::<ext::CustomResourceDefinition>(doc)
        }
        ("monitoring.coreos.com/v1", "PodMonitor") => round_trip::<Crd<PodMonitorSpec>>(doc),
        ("monitoring.coreos.com/v1", "PrometheusRule") => round_trip::<Crd<RuleSpec>>(doc),
        ("cert-manager.io/v1", "Certificate") => round_trip::<Crd<CertificateSpec>>(doc),
        ("cert-manager.io/v1", "Issuer") => round_trip::<Crd<IssuerSpec>>(doc),
        (api, kind) => Err(format!("no schema for {api} {kind}: add one to this test")),
    }
}

#[test]
fn every_document_reads_into_its_type_with_no_unknown_field() {
    let mut all = docs();
    // The webhook without cert-manager, beside the kustomization.
    all.extend(read_docs(&root().join("deploy/machine-webhook.yaml")));
    let problems: Vec<String> = all
        .iter()
        .filter_map(|d| {
            check_type(&d.value)
                .err()
                .map(|e| format!("{}: {e}", d.at()))
        })
        .collect();
    assert!(all.len() > 20, "{} documents", all.len());
    assert_none(&problems);
}

// --- the schemas of the custom kinds: the keys used here, nothing else ---

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Crd<S> {
    api_version: String,
    kind: String,
    metadata: ObjectMeta,
    spec: S,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodMonitorSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    job_label: Option<String>,
    selector: k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
    pod_metrics_endpoints: Vec<PodMetricsEndpoint>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PodMetricsEndpoint {
    port: String,
    path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interval: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    authorization: Option<Authorization>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Authorization {
    #[serde(rename = "type")]
    kind: Bearer,
    credentials: k8s_openapi::api::core::v1::SecretKeySelector,
}

#[derive(Deserialize, Serialize)]
enum Bearer {
    Bearer,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RuleSpec {
    groups: Vec<RuleGroup>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RuleGroup {
    name: String,
    rules: Vec<Rule>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Rule {
    alert: String,
    expr: String,
    #[serde(default, rename = "for", skip_serializing_if = "Option::is_none")]
    for_: Option<String>,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct CertificateSpec {
    secret_name: String,
    #[serde(default, rename = "isCA", skip_serializing_if = "Option::is_none")]
    is_ca: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    common_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dns_names: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    duration: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    renew_before: Option<String>,
    private_key: PrivateKey,
    issuer_ref: IssuerRef,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct PrivateKey {
    algorithm: KeyAlgorithm,
    size: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rotation_policy: Option<RotationPolicy>,
}

#[derive(Deserialize, Serialize)]
enum KeyAlgorithm {
    #[serde(rename = "ECDSA")]
    Ecdsa,
    #[serde(rename = "RSA")]
    Rsa,
    Ed25519,
}

#[derive(Deserialize, Serialize)]
enum RotationPolicy {
    Never,
    Always,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct IssuerRef {
    name: String,
    kind: IssuerKind,
}

#[derive(Deserialize, Serialize)]
enum IssuerKind {
    Issuer,
    ClusterIssuer,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct IssuerSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    self_signed: Option<Empty>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ca: Option<CaIssuer>,
}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct CaIssuer {
    secret_name: String,
}

// === workloads and their containers ===

/// A Deployment's or DaemonSet's pod template.
struct Workload<'a> {
    doc: &'a Doc,
    pod: PodSpec,
    labels: BTreeMap<String, String>,
}

impl Workload<'_> {
    fn containers(&self) -> impl Iterator<Item = &Container> {
        let init = self.pod.init_containers.iter().flatten();
        init.chain(self.pod.containers.iter())
    }
    fn at(&self, c: &Container) -> String {
        format!("{} container {}", self.doc.at(), c.name)
    }
}

fn workloads(docs: &[Doc]) -> Vec<Workload<'_>> {
    docs.iter()
        .filter(|d| matches!(d.kind(), "Deployment" | "DaemonSet"))
        .map(|doc| {
            let template = &doc.value["spec"]["template"];
            Workload {
                doc,
                pod: serde_json::from_value(template["spec"].clone()).expect("pod spec"),
                labels: serde_json::from_value(template["metadata"]["labels"].clone())
                    .unwrap_or_default(),
            }
        })
        .collect()
}

/// The binary a container runs and its subcommand.
fn program(c: &Container) -> (String, String) {
    let path = c.command.as_ref().and_then(|c| c.first());
    let name = match path {
        Some(p) => p.rsplit('/').next().unwrap_or(p).to_owned(),
        None => image_name(c).0,
    };
    let sub = c.args.iter().flatten().next().cloned().unwrap_or_default();
    (name, sub)
}

/// `registry/path/NAME:TAG` → (NAME, TAG).
fn image_name(c: &Container) -> (String, String) {
    let image = c.image.as_deref().unwrap_or("");
    let last = image.rsplit('/').next().unwrap_or(image);
    let (name, tag) = last.split_once(':').unwrap_or((last, ""));
    (name.to_owned(), tag.to_owned())
}

fn args(c: &Container) -> &[String] {
    c.args.as_deref().unwrap_or(&[])
}

/// The value of `--flag V` or `--flag=V`.
fn flag<'a>(c: &'a Container, name: &str) -> Option<&'a str> {
    let a = args(c);
    a.iter().enumerate().find_map(|(i, arg)| {
        if arg == name {
            a.get(i + 1).map(String::as_str)
        } else {
            arg.strip_prefix(name)?.strip_prefix('=')
        }
    })
}

// === the binaries ===

/// A workspace binary, built beside this test's executable's folder.
fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built, and the manifests run it: `cargo build --workspace --bins` \
         (`cargo test --workspace --all-targets` builds every binary before any test runs)",
        path.display()
    );
    path
}

/// Runs a binary; its stdout, or why it failed.
fn run(name: &str, args: &[&str], env: &[(String, String)]) -> Result<String, String> {
    let out = Command::new(bin(name))
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .map_err(|e| format!("{name}: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        Err(format!("`{name} {}` failed: {err}{stdout}", args.join(" ")))
    }
}

/// Help texts by (binary, subcommand).
type Helps = HashMap<(String, String), Result<String, String>>;

/// `NAME SUB --help`, once per binary and subcommand.
fn help(name: &str, sub: &str) -> Result<String, String> {
    static CACHE: Mutex<Option<Helps>> = Mutex::new(None);
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let key = (name.to_owned(), sub.to_owned());
    cache
        .get_or_insert_with(HashMap::new)
        .entry(key)
        .or_insert_with(|| run(name, &[sub, "--help"], &[]))
        .clone()
}

/// The long flags a help text lists.
fn help_flags(help: &str) -> BTreeSet<String> {
    help.split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == ']')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| {
            let end = w[2..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .map_or(w.len(), |i| i + 2);
            w[..end].to_owned()
        })
        .collect()
}

/// Variables a binary reads that its `--help` does not list as `[env: …]`,
/// each with the source line that reads it.
const READ_ENV: &[(&str, &str, &str, &str)] = &[
    (
        "egress-gateway",
        "RUST_LOG",
        "gateway/src/cli/run.rs",
        "EnvFilter::try_from_default_env",
    ),
    (
        "egress-gateway",
        "MIMALLOC_ALLOW_THP",
        "gateway/src/main.rs",
        "mimalloc::MiMalloc",
    ),
    (
        "egress-gateway",
        "MIMALLOC_PURGE_DELAY",
        "gateway/src/main.rs",
        "mimalloc::MiMalloc",
    ),
    (
        "egress-controller",
        "RUST_LOG",
        "controller/src/main.rs",
        "EnvFilter::try_from_default_env",
    ),
    (
        "egress-controller",
        "SPACE_EGRESS_PROFILES",
        "controller/src/config.rs",
        "std::env::var(PROFILES_ENV)",
    ),
    (
        "egress-controller",
        "SPACE_TLS_INTERCEPTION_EXEMPTIONS",
        "controller/src/config.rs",
        "std::env::var(EXEMPTIONS_ENV)",
    ),
    (
        "egress-cluster",
        "RUST_LOG",
        "cluster/src/main.rs",
        "EnvFilter::try_from_default_env",
    ),
];

#[test]
fn the_env_table_matches_the_sources() {
    let mut problems = Vec::new();
    for (_, var, file, needle) in READ_ENV {
        let text = std::fs::read_to_string(root().join(file)).expect("source");
        if !text.contains(needle) {
            problems.push(format!(
                "{file} no longer has {needle:?}: is {var} still read?"
            ));
        }
    }
    let profiles = std::fs::read_to_string(root().join("policy/src/profiles.rs")).expect("read");
    assert!(profiles.contains(r#"PROFILES_ENV: &str = "SPACE_EGRESS_PROFILES""#));
    let exemptions =
        std::fs::read_to_string(root().join("policy/src/exemptions.rs")).expect("read");
    assert!(exemptions.contains(r#"EXEMPTIONS_ENV: &str = "SPACE_TLS_INTERCEPTION_EXEMPTIONS""#));
    assert_none(&problems);
}

/// The container's command, subcommand, flags, variables and image tag.
fn check_container(w: &Workload<'_>, c: &Container, out: &mut Vec<String>) {
    let at = w.at(c);
    let (name, sub) = program(c);
    let (image, tag) = image_name(c);
    if image != name {
        return out.push(format!("{at}: runs {name} from the image {image}"));
    }
    let cmd = c.command.clone().unwrap_or_default();
    if cmd != [format!("/usr/bin/{name}")] {
        out.push(format!(
            "{at}: command {cmd:?}, expected [\"/usr/bin/{name}\"]"
        ));
    }
    let version = run(&name, &["--version"], &[]).unwrap_or_else(|e| e);
    if version.trim() != format!("{name} {tag}") {
        out.push(format!("{at}: image tag {tag}, binary {}", version.trim()));
    }
    let help = match help(&name, &sub) {
        Ok(h) => h,
        Err(e) => return out.push(format!("{at}: {e}")),
    };
    let known = help_flags(&help);
    for a in args(c).iter().filter(|a| a.starts_with("--")) {
        let f = a.split('=').next().unwrap_or(a);
        if !known.contains(f) {
            out.push(format!(
                "{at}: {f} is not a flag of `{name} {sub}` (it has {known:?})"
            ));
        }
    }
    for var in c.env.iter().flatten().map(|e| e.name.as_str()) {
        // `[env: NAME=…]`, or `[env: NAME]` with hidden values.
        let listed = ["=", "]"]
            .iter()
            .any(|end| help.contains(&format!("[env: {var}{end}")));
        let read = READ_ENV.iter().any(|(b, v, ..)| *b == name && *v == var);
        let expanded = args(c).iter().any(|a| a.contains(&format!("$({var})")));
        if !(listed || read || expanded) {
            out.push(format!(
                "{at}: {var} is set but `{name} {sub}` does not read it"
            ));
        }
    }
    for reference in args(c).iter().flat_map(|a| var_refs(a)) {
        if !c.env.iter().flatten().any(|e| e.name == reference) {
            out.push(format!("{at}: $({reference}) is not in its env"));
        }
    }
}

/// The `$(NAME)`s Kubernetes expands in an argument.
fn var_refs(arg: &str) -> Vec<String> {
    arg.split("$(")
        .skip(1)
        .filter_map(|s| s.split_once(')').map(|(v, _)| v.to_owned()))
        .collect()
}

#[test]
fn every_container_runs_its_binary_with_flags_it_has() {
    let mut all = docs();
    all.extend(read_docs(&root().join("deploy/machine-webhook.yaml")));
    let mut problems = Vec::new();
    let mut seen = 0;
    for w in workloads(&all) {
        for c in w.containers() {
            check_container(&w, c, &mut problems);
            seen += 1;
        }
    }
    assert!(seen >= 7, "{seen} containers");
    assert_none(&problems);
}

// === files the containers read ===

/// Where a mounted file comes from: (`ConfigMap` or `Secret`, its name, key).
fn mount_source(
    pod: &PodSpec,
    c: &Container,
    path: &str,
) -> Option<(&'static str, String, String)> {
    let m = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| match &m.sub_path {
            Some(_) => m.mount_path == path,
            None => path
                .strip_prefix(m.mount_path.trim_end_matches('/'))
                .is_some_and(|rest| rest.starts_with('/') && !rest[1..].contains('/')),
        })?;
    let file = match &m.sub_path {
        Some(sub) => sub.clone(),
        None => path.rsplit('/').next().unwrap_or(path).to_owned(),
    };
    let volume = pod.volumes.iter().flatten().find(|v| v.name == m.name)?;
    let (kind, name, items) = if let Some(cm) = &volume.config_map {
        ("ConfigMap", cm.name.clone(), cm.items.clone())
    } else {
        let s = volume.secret.as_ref()?;
        ("Secret", s.secret_name.clone()?, s.items.clone())
    };
    let key = match items {
        Some(items) => items.into_iter().find(|i| i.path == file)?.key,
        None => file,
    };
    Some((kind, name, key))
}

/// The content of a ConfigMap's or Secret's key; for a Secret cert-manager
/// issues, a marker.
fn content(docs: &[Doc], kind: &str, name: &str, key: &str) -> Option<String> {
    if let Some(d) = find(docs, kind, name) {
        let field = if kind == "ConfigMap" {
            "data"
        } else {
            "stringData"
        };
        return d.value[field][key].as_str().map(str::to_owned);
    }
    let issued = docs
        .iter()
        .any(|d| d.kind() == "Certificate" && d.value["spec"]["secretName"] == name);
    (kind == "Secret" && issued && ["tls.crt", "tls.key", "ca.crt"].contains(&key))
        .then(|| "(issued by cert-manager)".to_owned())
}

/// The content of the file at `path` in the container, or why there is none.
fn mounted(docs: &[Doc], w: &Workload<'_>, c: &Container, path: &str) -> Result<String, String> {
    let (kind, name, key) = mount_source(&w.pod, c, path)
        .ok_or_else(|| format!("{}: nothing is mounted at {path}", w.at(c)))?;
    content(docs, kind, &name, &key).ok_or_else(|| {
        format!(
            "{}: {path} is {kind} {name} key {key}, which does not exist",
            w.at(c)
        )
    })
}

/// Flags that name a file the program reads.
const FILE_FLAGS: &[&str] = &[
    "--config",
    "--tenants",
    "--cert",
    "--key",
    "--worker-token-file",
    "--tokens-file",
];

/// The files gateway.toml names.
const GATEWAY_FILES: &[(&str, &str)] = &[
    ("tls", "ca_cert"),
    ("tls", "ca_key"),
    ("admin", "token_file"),
    ("admin", "metrics_token_file"),
];

#[test]
fn every_file_a_container_reads_is_mounted() {
    let docs = docs();
    let mut problems = Vec::new();
    for w in workloads(&docs) {
        for c in w.containers() {
            for f in FILE_FLAGS {
                if let Some(path) = flag(c, f) {
                    if let Err(e) = mounted(&docs, &w, c, path) {
                        problems.push(e);
                    }
                }
            }
            // `redirect` reads only the listen ports from the file.
            let Ok(config) = gateway_config(&docs, &w, c) else {
                continue;
            };
            if program(c).1 != "run" {
                continue;
            }
            for (table, key) in GATEWAY_FILES {
                if let Some(path) = config
                    .get(*table)
                    .and_then(|t| t.get(*key))
                    .and_then(|v| v.as_str())
                {
                    if let Err(e) = mounted(&docs, &w, c, path) {
                        problems.push(format!("{table}.{key}: {e}"));
                    }
                }
            }
        }
    }
    assert_none(&problems);
}

/// The gateway.toml a gateway container is given with `--config`.
fn gateway_config(docs: &[Doc], w: &Workload<'_>, c: &Container) -> Result<toml::Table, String> {
    if program(c).0 != "egress-gateway" {
        return Err(format!("{} is not a gateway", w.at(c)));
    }
    let path = flag(c, "--config").ok_or_else(|| format!("{}: no --config", w.at(c)))?;
    let text = mounted(docs, w, c, path)?;
    toml::from_str(&text).map_err(|e| format!("{}: {path}: {e}", w.at(c)))
}

fn toml_addr(config: &toml::Table, table: &str, key: &str) -> Option<SocketAddr> {
    config.get(table)?.get(key)?.as_str()?.parse().ok()
}

// === probes ===

/// The address the listener a container's probes target is bound to.
fn probed_listener(docs: &[Doc], w: &Workload<'_>, c: &Container) -> Result<SocketAddr, String> {
    let (name, sub) = program(c);
    let from_flag = |f: &str| -> Result<SocketAddr, String> {
        let value = match flag(c, f) {
            Some(v) => v.to_owned(),
            None => default_of(&name, &sub, f).ok_or_else(|| format!("{f}: no value"))?,
        };
        value.parse().map_err(|e| format!("{f} {value}: {e}"))
    };
    match (name.as_str(), sub.as_str()) {
        ("egress-gateway", "run") => {
            let config = gateway_config(docs, w, c)?;
            // gateway/src/config.rs's default.
            Ok(toml_addr(&config, "listen", "admin").unwrap_or(([127, 0, 0, 1], 15000).into()))
        }
        ("egress-controller", "api") | ("egress-cluster", "webhook") => from_flag("--listen"),
        ("egress-controller", "dispatcher") => from_flag("--metrics-listen"),
        _ => Err(format!(
            "no listener known for `{name} {sub}`: add it to this test"
        )),
    }
}

/// A flag's `[default: …]` in the help.
fn default_of(name: &str, sub: &str, f: &str) -> Option<String> {
    let help = help(name, sub).ok()?;
    let line = help.lines().find(|l| l.trim_start().starts_with(f))?;
    let rest = line.split("[default: ").nth(1)?;
    rest.split(']').next().map(str::to_owned)
}

fn probe_port(c: &Container, port: &IntOrString) -> Option<i32> {
    match port {
        IntOrString::Int(n) => Some(*n),
        IntOrString::String(s) => c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(s))
            .map(|p| p.container_port),
    }
}

fn probes(c: &Container) -> Vec<(&'static str, &Probe)> {
    [
        ("readinessProbe", &c.readiness_probe),
        ("livenessProbe", &c.liveness_probe),
        ("startupProbe", &c.startup_probe),
    ]
    .into_iter()
    .filter_map(|(k, p)| p.as_ref().map(|p| (k, p)))
    .collect()
}

/// Paths served by binaries this test cannot start (the controller needs
/// PostgreSQL), with the router line that serves each.
const ROUTES: &[(&str, &str, &str, &str, &str)] = &[
    (
        "egress-controller",
        "api",
        "/healthz",
        "controller/src/api.rs",
        r#"("GET", ["healthz"]) => "healthz""#,
    ),
    (
        "egress-controller",
        "api",
        "/metrics",
        "controller/src/api.rs",
        r#"("GET", ["metrics"]) => "metrics""#,
    ),
    (
        "egress-controller",
        "dispatcher",
        "/healthz",
        "controller/src/api.rs",
        r#""/healthz" => json_reply(StatusCode::OK"#,
    ),
    (
        "egress-controller",
        "dispatcher",
        "/metrics",
        "controller/src/api.rs",
        r#""/metrics" => text(metrics.encode())"#,
    ),
    (
        "egress-cluster",
        "webhook",
        "/validate",
        "cluster/src/webhook.rs",
        r#""/validate" | "/""#,
    ),
];

fn served_per_source(name: &str, sub: &str, path: &str) -> Result<(), String> {
    let (.., file, needle) = ROUTES
        .iter()
        .find(|(b, s, p, ..)| *b == name && *s == sub && *p == path)
        .ok_or_else(|| format!("`{name} {sub}` does not serve {path}"))?;
    let text = std::fs::read_to_string(root().join(file)).map_err(|e| e.to_string())?;
    if text.contains(needle) {
        Ok(())
    } else {
        Err(format!(
            "{file} no longer has {needle:?}: does `{name} {sub}` serve {path}?"
        ))
    }
}

/// An HTTP request to send to the running gateway: (where it comes from, path, headers).
type Ask = (String, String, Vec<(String, String)>);

/// Port and address checks; HTTP paths of the gateway go to `ask`, the rest
/// are checked against [`ROUTES`].
fn check_probes(
    docs: &[Doc],
    w: &Workload<'_>,
    c: &Container,
    ask: &mut Vec<Ask>,
    out: &mut Vec<String>,
) {
    for (kind, p) in probes(c) {
        let at = format!("{} {kind}", w.at(c));
        let (port, path, headers) = match (&p.http_get, &p.tcp_socket) {
            (Some(h), _) => (
                &h.port,
                h.path.clone(),
                h.http_headers.clone().unwrap_or_default(),
            ),
            (_, Some(t)) => (&t.port, None, Vec::new()),
            _ => {
                out.push(format!("{at}: neither httpGet nor tcpSocket"));
                continue;
            }
        };
        let listener = match probed_listener(docs, w, c) {
            Ok(l) => l,
            Err(e) => {
                out.push(format!("{at}: {e}"));
                continue;
            }
        };
        match probe_port(c, port) {
            Some(n) if i64::from(n) == i64::from(listener.port()) => {}
            n => out.push(format!(
                "{at}: port {port:?} ({n:?}) but it listens on {listener}"
            )),
        }
        if !listener.ip().is_unspecified() {
            out.push(format!(
                "{at}: the kubelet probes the pod's address, the listener is on {listener}"
            ));
        }
        let Some(path) = path else { continue };
        let (name, sub) = program(c);
        if name == "egress-gateway" {
            let headers = headers.into_iter().map(|h| (h.name, h.value)).collect();
            ask.push((at, path, headers));
        } else if let Err(e) = served_per_source(&name, &sub, &path) {
            out.push(format!("{at}: {e}"));
        }
    }
}

#[test]
fn probes_target_the_listener_and_paths_the_binaries_serve() {
    let docs = docs();
    let mut problems = Vec::new();
    let mut ask = Vec::new();
    let mut gateway = None;
    for w in workloads(&docs) {
        for c in &w.pod.containers {
            check_probes(&docs, &w, c, &mut ask, &mut problems);
            if let Ok(config) = gateway_config(&docs, &w, c) {
                gateway = Some(config);
            }
        }
    }
    let gateway = start_gateway(&gateway.expect("a gateway container"));
    // The PodMonitor presents the metrics token: what it reads is served
    // with it (and only /metrics, the gateway's own tests check).
    let scrape_token = if gateway_admin(&docs, &workloads(&docs)).2.is_some() {
        METRICS_TOKEN
    } else {
        gateway.token.as_str()
    };
    ask.extend(pod_monitor_asks(&docs, scrape_token));
    assert!(ask.len() >= 3, "{ask:?}");
    for (at, path, headers) in &ask {
        match get(gateway.admin, path, headers) {
            Ok(status) if (200..400).contains(&status) => {}
            Ok(status) => problems.push(format!("{at}: the gateway answers {path} with {status}")),
            Err(e) => problems.push(format!("{at}: GET {path}: {e}")),
        }
    }
    assert_none(&problems);
}

/// The gateway PodMonitor's scrapes, with the token the test gave the gateway.
fn pod_monitor_asks(docs: &[Doc], token: &str) -> Vec<Ask> {
    let mut asks = Vec::new();
    for d in docs.iter().filter(|d| d.kind() == "PodMonitor") {
        let monitor: Crd<PodMonitorSpec> = d.typed();
        let labels = monitor
            .spec
            .selector
            .match_labels
            .clone()
            .unwrap_or_default();
        if labels.get("app.kubernetes.io/name").map(String::as_str) != Some("egress-gateway") {
            continue;
        }
        for e in &monitor.spec.pod_metrics_endpoints {
            let headers = e
                .authorization
                .iter()
                .map(|_| ("Authorization".to_owned(), format!("Bearer {token}")))
                .collect();
            asks.push((d.at(), e.path.clone(), headers));
        }
    }
    asks
}

// === the gateway, started with the ConfigMap's configuration ===

struct Running {
    child: Child,
    admin: SocketAddr,
    token: String,
    _dir: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `config` with every listener on loopback (port 0), its files in a temp
/// dir (a CA from `ca init`, a token), no DNS upstream and no flow log;
/// every other key as in the ConfigMap.
fn local_config(config: &toml::Table, dir: &Path) -> (toml::Table, String) {
    let mut c = config.clone();
    let path = |p: PathBuf| toml::Value::String(p.to_string_lossy().into_owned());
    let table = |c: &mut toml::Table, name: &str| -> toml::Table {
        c.get(name)
            .and_then(|t| t.as_table())
            .cloned()
            .unwrap_or_default()
    };
    c.insert("state_dir".into(), path(dir.join("state")));
    let mut listen = table(&mut c, "listen");
    for key in ["transparent", "dns", "dns_alt", "admin"] {
        listen.insert(key.into(), toml::Value::String("127.0.0.1:0".into()));
    }
    c.insert("listen".into(), listen.into());
    let mut tls = table(&mut c, "tls");
    if tls.contains_key("ca_cert") {
        tls.insert("ca_cert".into(), path(dir.join("ca/ca.crt")));
        tls.insert("ca_key".into(), path(dir.join("ca/ca.key")));
    }
    c.insert("tls".into(), tls.into());
    let token = "manifests-test-token-0123456789".to_owned();
    let mut admin = table(&mut c, "admin");
    if admin.contains_key("token_file") {
        admin.insert("token_file".into(), path(dir.join("token")));
    }
    if admin.contains_key("metrics_token_file") {
        admin.insert("metrics_token_file".into(), path(dir.join("metrics-token")));
    }
    c.insert("admin".into(), admin.into());
    let mut dns = table(&mut c, "dns");
    dns.insert("upstreams".into(), toml::Value::Array(Vec::new()));
    c.insert("dns".into(), dns.into());
    let mut log = table(&mut c, "log");
    log.insert("flow_log".into(), toml::Value::String("off".into()));
    c.insert("log".into(), log.into());
    // The fence keeper would write this machine's nftables.
    c.remove("redirect");
    (c, token)
}

/// The token the test gives the gateway as `admin.metrics_token_file`.
const METRICS_TOKEN: &str = "manifests-test-metrics-0123456789";

fn start_gateway(config: &toml::Table) -> Running {
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = dir.path().join("ca");
    run(
        "egress-gateway",
        &["ca", "init", "--dir", &ca.to_string_lossy()],
        &[],
    )
    .expect("ca init");
    let (local, token) = local_config(config, dir.path());
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, &token).expect("token");
    std::fs::write(dir.path().join("metrics-token"), METRICS_TOKEN).expect("metrics token");
    let file = dir.path().join("gateway.toml");
    std::fs::write(&file, toml::to_string(&local).expect("toml")).expect("write");
    let mut child = Command::new(bin("egress-gateway"))
        .args(["run", "--config", &file.to_string_lossy()])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the gateway");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(30)) {
        if let Some(rest) = line.split("admin on http://").nth(1) {
            let admin = rest
                .split('/')
                .next()
                .and_then(|a| a.parse().ok())
                .expect("admin address");
            return Running {
                child,
                admin,
                token,
                _dir: dir,
            };
        }
        seen.push(line);
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!(
        "the gateway did not start with the ConfigMap's gateway.toml:\n{}",
        seen.join("\n")
    );
}

/// The status of `GET path`, as the kubelet (or Prometheus) would ask.
fn get(addr: SocketAddr, path: &str, headers: &[(String, String)]) -> Result<u16, String> {
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).map_err(|e| e.to_string())?;
    let reply = String::from_utf8_lossy(&reply);
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("not an HTTP reply: {reply:?}"))
}

// === RBAC ===

type Access = BTreeSet<(String, String, String)>;

/// What the bindings in `docs` grant a service account, and any rule this
/// test cannot reduce to (group, resource, verb).
fn grants(docs: &[Doc], sa: &str, ns: &str, out: &mut Vec<String>) -> Access {
    use k8s_openapi::api::rbac::v1::{PolicyRule, RoleRef, Subject};
    let mut access = Access::new();
    for b in docs
        .iter()
        .filter(|d| matches!(d.kind(), "ClusterRoleBinding" | "RoleBinding"))
    {
        let subjects: Vec<Subject> =
            serde_json::from_value(b.value["subjects"].clone()).unwrap_or_default();
        let bound = subjects.iter().any(|s| {
            s.kind == "ServiceAccount" && s.name == sa && s.namespace.as_deref() == Some(ns)
        });
        if !bound {
            continue;
        }
        if b.kind() == "RoleBinding" {
            out.push(format!(
                "{}: the reconciler watches every namespace: bind a ClusterRole cluster-wide",
                b.at()
            ));
        }
        let role: RoleRef = serde_json::from_value(b.value["roleRef"].clone()).expect("roleRef");
        let Some(r) = find(docs, &role.kind, &role.name) else {
            out.push(format!("{}: no {} {}", b.at(), role.kind, role.name));
            continue;
        };
        let rules: Vec<PolicyRule> =
            serde_json::from_value(r.value["rules"].clone()).unwrap_or_default();
        for rule in rules {
            if rule.resource_names.is_some() || rule.non_resource_urls.is_some() {
                out.push(format!("{}: resourceNames or nonResourceURLs", r.at()));
            }
            for g in rule.api_groups.iter().flatten() {
                for res in rule.resources.iter().flatten() {
                    for v in &rule.verbs {
                        access.insert((g.clone(), res.clone(), v.clone()));
                    }
                }
            }
        }
    }
    access
}

#[test]
fn the_reconciler_may_do_exactly_what_it_calls() {
    let docs = docs();
    let used: Access = egress_cluster::reconcile::KUBE_ACCESS
        .iter()
        .flat_map(|(g, r, verbs)| {
            verbs
                .iter()
                .map(move |v| ((*g).into(), (*r).into(), (*v).into()))
        })
        .collect();
    let ws = workloads(&docs);
    let is_reconciler = |w: &Workload<'_>| w.containers().any(|c| program(c).1 == "reconcile");
    let reconciler = ws
        .iter()
        .find(|w| is_reconciler(w))
        .expect("the reconciler DaemonSet");
    let sa = reconciler
        .pod
        .service_account_name
        .clone()
        .expect("serviceAccountName");
    let ns = reconciler.doc.namespace();
    let mut problems = Vec::new();
    if find(&docs, "ServiceAccount", &sa).is_none() {
        problems.push(format!("no ServiceAccount {sa}"));
    }
    // The webhook lets this user change the egress-managed annotation only.
    let user = format!("system:serviceaccount:{ns}:{sa}");
    if user != egress_cluster::webhook::RECONCILER_USER {
        problems.push(format!(
            "the reconciler runs as {user}, the webhook's --reconciler-user default is {}",
            egress_cluster::webhook::RECONCILER_USER
        ));
    }
    let granted = grants(&docs, &sa, ns, &mut problems);
    for extra in granted.difference(&used) {
        problems.push(format!("granted but not called (KUBE_ACCESS): {extra:?}"));
    }
    for missing in used.difference(&granted) {
        problems.push(format!("called (KUBE_ACCESS) but not granted: {missing:?}"));
    }
    // Nothing else holds a token for the API.
    for w in ws.iter().filter(|w| !is_reconciler(w)) {
        if w.pod.automount_service_account_token != Some(false) {
            problems.push(format!(
                "{}: automountServiceAccountToken is not false",
                w.doc.at()
            ));
        }
    }
    assert_none(&problems);
}

// === how the objects name each other ===

fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn selected<'a, 'b>(
    ws: &'a [Workload<'b>],
    ns: &str,
    selector: &BTreeMap<String, String>,
) -> Vec<&'a Workload<'b>> {
    ws.iter()
        .filter(|w| w.doc.namespace() == ns && selects(selector, &w.labels))
        .collect()
}

fn has_port(ws: &[&Workload<'_>], port: &IntOrString) -> bool {
    ws.iter()
        .flat_map(|w| &w.pod.containers)
        .any(|c| match port {
            IntOrString::String(name) => c
                .ports
                .iter()
                .flatten()
                .any(|p| p.name.as_ref() == Some(name)),
            IntOrString::Int(n) => c.ports.iter().flatten().any(|p| p.container_port == *n),
        })
}

/// Each Service selects pods that have its target ports.
fn check_services(docs: &[Doc], ws: &[Workload<'_>], out: &mut Vec<String>) {
    use k8s_openapi::api::core::v1::Service;
    for d in docs.iter().filter(|d| d.kind() == "Service") {
        let spec = d.typed::<Service>().spec.unwrap_or_default();
        let pods = selected(ws, d.namespace(), &spec.selector.unwrap_or_default());
        if pods.is_empty() {
            out.push(format!("{}: selects no pods", d.at()));
        }
        for p in spec.ports.iter().flatten() {
            let target = p.target_port.clone().unwrap_or(IntOrString::Int(p.port));
            if !has_port(&pods, &target) {
                out.push(format!(
                    "{}: no selected pod has the port {target:?}",
                    d.at()
                ));
            }
        }
    }
}

/// The webhook's Service, path, certificate and CA injection.
fn check_webhook(docs: &[Doc], ws: &[Workload<'_>], out: &mut Vec<String>) {
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration as Vwc;
    for d in docs
        .iter()
        .filter(|d| d.kind() == "ValidatingWebhookConfiguration")
    {
        let vwc: Vwc = d.typed();
        let inject = d.value["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].as_str();
        let Some((cert_ns, cert_name)) = inject.and_then(|a| a.split_once('/')) else {
            out.push(format!(
                "{}: no cert-manager.io/inject-ca-from <namespace>/<Certificate>",
                d.at()
            ));
            continue;
        };
        let cert = docs.iter().find(|c| {
            c.kind() == "Certificate" && c.name() == cert_name && c.namespace() == cert_ns
        });
        let Some(cert) = cert else {
            out.push(format!(
                "{}: inject-ca-from names no Certificate {cert_ns}/{cert_name}",
                d.at()
            ));
            continue;
        };
        let cert: Crd<CertificateSpec> = cert.typed();
        for hook in vwc.webhooks.iter().flatten() {
            let Some(svc) = &hook.client_config.service else {
                out.push(format!("{}: {} has no service", d.at(), hook.name));
                continue;
            };
            let host = format!("{}.{}.svc", svc.name, svc.namespace);
            if !cert.spec.dns_names.iter().flatten().any(|n| *n == host) {
                out.push(format!(
                    "{}: the Certificate {cert_name} does not name {host}",
                    d.at()
                ));
            }
            let Some(s) =
                find(docs, "Service", &svc.name).filter(|s| s.namespace() == svc.namespace)
            else {
                out.push(format!("{}: no Service {host}", d.at()));
                continue;
            };
            let port = svc.port.unwrap_or(443);
            if !s.value["spec"]["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p["port"] == port)
            {
                out.push(format!("{}: the Service {host} has no port {port}", d.at()));
            }
            let selector =
                serde_json::from_value(s.value["spec"]["selector"].clone()).unwrap_or_default();
            for w in selected(ws, &svc.namespace, &selector) {
                let mounts = w
                    .pod
                    .volumes
                    .iter()
                    .flatten()
                    .filter_map(|v| v.secret.as_ref()?.secret_name.as_ref());
                if !mounts.clone().any(|m| *m == cert.spec.secret_name) {
                    out.push(format!(
                        "{}: does not mount {}, the Certificate's Secret",
                        w.doc.at(),
                        cert.spec.secret_name
                    ));
                }
                for c in &w.pod.containers {
                    let (name, sub) = program(c);
                    if let Err(e) =
                        served_per_source(&name, &sub, svc.path.as_deref().unwrap_or("/"))
                    {
                        out.push(format!("{}: {e}", d.at()));
                    }
                }
            }
        }
    }
}

/// Certificates name existing issuers; a CA issuer's Secret is a CA certificate's.
fn check_issuers(docs: &[Doc], out: &mut Vec<String>) {
    for d in docs.iter().filter(|d| d.kind() == "Certificate") {
        let cert: Crd<CertificateSpec> = d.typed();
        let kind = match cert.spec.issuer_ref.kind {
            IssuerKind::Issuer => "Issuer",
            IssuerKind::ClusterIssuer => "ClusterIssuer",
        };
        let Some(issuer) = find(docs, kind, &cert.spec.issuer_ref.name) else {
            out.push(format!(
                "{}: no {kind} {}",
                d.at(),
                cert.spec.issuer_ref.name
            ));
            continue;
        };
        let issuer: Crd<IssuerSpec> = issuer.typed();
        if let Some(ca) = issuer.spec.ca {
            let signed = docs.iter().filter(|c| c.kind() == "Certificate").any(|c| {
                c.value["spec"]["secretName"] == ca.secret_name.as_str()
                    && c.value["spec"]["isCA"] == true
            });
            if !signed {
                out.push(format!(
                    "{}: its issuer's Secret {} is no CA Certificate's",
                    d.at(),
                    ca.secret_name
                ));
            }
        }
    }
}

/// The PodMonitors select pods with their ports and job label; the gateway's
/// presents the token the gateway requires.
fn check_pod_monitors(
    docs: &[Doc],
    ws: &[Workload<'_>],
    gateway_token: Option<(&'static str, String, String)>,
    out: &mut Vec<String>,
) {
    for d in docs.iter().filter(|d| d.kind() == "PodMonitor") {
        let m: Crd<PodMonitorSpec> = d.typed();
        let pods = selected(
            ws,
            d.namespace(),
            &m.spec.selector.match_labels.clone().unwrap_or_default(),
        );
        if pods.is_empty() {
            out.push(format!("{}: selects no pods", d.at()));
        }
        if let Some(job) = &m.spec.job_label {
            if pods.iter().any(|w| !w.labels.contains_key(job)) {
                out.push(format!("{}: a selected pod has no label {job}", d.at()));
            }
        }
        for e in &m.spec.pod_metrics_endpoints {
            if !has_port(&pods, &IntOrString::String(e.port.clone())) {
                out.push(format!("{}: no selected pod has a port {}", d.at(), e.port));
            }
            if let Some(a) = &e.authorization {
                let presented = (
                    "Secret",
                    a.credentials.name.clone(),
                    a.credentials.key.clone(),
                );
                if gateway_token.as_ref() != Some(&presented) {
                    out.push(format!(
                        "{}: presents {presented:?}, the gateway reads {gateway_token:?}",
                        d.at()
                    ));
                }
            }
        }
    }
}

/// A mount source: its kind, name and key.
type Source = (&'static str, String, String);

/// The gateway's admin token file, as a mount source, its admin address,
/// and its metrics token file as a mount source.
fn gateway_admin(
    docs: &[Doc],
    ws: &[Workload<'_>],
) -> (Option<Source>, SocketAddr, Option<Source>) {
    for w in ws {
        for c in &w.pod.containers {
            let Ok(config) = gateway_config(docs, w, c) else {
                continue;
            };
            let source = |key: &str| {
                config
                    .get("admin")
                    .and_then(|a| a.get(key))
                    .and_then(|t| t.as_str())
                    .and_then(|f| mount_source(&w.pod, c, f))
            };
            let admin =
                toml_addr(&config, "listen", "admin").unwrap_or(([127, 0, 0, 1], 15000).into());
            return (source("token_file"), admin, source("metrics_token_file"));
        }
    }
    panic!("no gateway container");
}

/// The reconciler talks to the gateway's admin port with the gateway's token.
fn check_reconciler(docs: &[Doc], ws: &[Workload<'_>], out: &mut Vec<String>) {
    let (token, admin, _) = gateway_admin(docs, ws);
    for w in ws {
        for c in w
            .pod
            .containers
            .iter()
            .filter(|c| program(c).1 == "reconcile")
        {
            let worker = flag(c, "--worker").unwrap_or("127.0.0.1:15000");
            if worker.rsplit(':').next() != Some(admin.port().to_string().as_str()) {
                out.push(format!(
                    "{}: --worker {worker}, the gateway's admin is on {admin}",
                    w.at(c)
                ));
            }
            let source = flag(c, "--worker-token-file").and_then(|f| mount_source(&w.pod, c, f));
            if source != token {
                out.push(format!(
                    "{}: reads the token {source:?}, the gateway {token:?}",
                    w.at(c)
                ));
            }
        }
    }
}

/// Every ConfigMap or Secret key an `env` names exists (or is optional).
fn check_env_refs(docs: &[Doc], ws: &[Workload<'_>], out: &mut Vec<String>) {
    for w in ws {
        for c in w.containers() {
            for e in c.env.iter().flatten() {
                let Some(from) = &e.value_from else { continue };
                let refs = [
                    from.config_map_key_ref
                        .as_ref()
                        .map(|r| ("ConfigMap", &r.name, &r.key, r.optional)),
                    from.secret_key_ref
                        .as_ref()
                        .map(|r| ("Secret", &r.name, &r.key, r.optional)),
                ];
                for (kind, name, key, optional) in refs.into_iter().flatten() {
                    if optional != Some(true) && content(docs, kind, name, key).is_none() {
                        out.push(format!(
                            "{}: {}: no {kind} {name} key {key}",
                            w.at(c),
                            e.name
                        ));
                    }
                }
            }
        }
    }
}

#[test]
fn the_objects_name_each_other() {
    let docs = docs();
    let ws = workloads(&docs);
    let mut problems = Vec::new();
    check_services(&docs, &ws, &mut problems);
    check_webhook(&docs, &ws, &mut problems);
    check_issuers(&docs, &mut problems);
    // The PodMonitor presents the metrics token where the gateway has one.
    let (admin_token, _, metrics_token) = gateway_admin(&docs, &ws);
    check_pod_monitors(&docs, &ws, metrics_token.or(admin_token), &mut problems);
    check_reconciler(&docs, &ws, &mut problems);
    check_env_refs(&docs, &ws, &mut problems);
    assert_none(&problems);
}

// === copies of committed files ===

#[test]
fn the_crd_and_alert_rules_are_the_committed_ones() {
    let copy = std::fs::read_to_string(kube_dir().join("machine-crd.yaml")).expect("read");
    let generated = std::fs::read_to_string(root().join("deploy/machine-crd.yaml")).expect("read");
    assert!(
        copy == generated,
        "deploy/kubernetes/machine-crd.yaml differs from deploy/machine-crd.yaml (generated: \
         cluster/tests/crd.rs): cp deploy/machine-crd.yaml deploy/kubernetes/"
    );
    let rules_file = root().join("deploy/prometheus/egress-gateway.rules.yml");
    let rules: Value =
        serde_yaml::from_str(&std::fs::read_to_string(rules_file).expect("read")).expect("yaml");
    let docs = docs();
    let rule = docs
        .iter()
        .find(|d| d.kind() == "PrometheusRule")
        .expect("a PrometheusRule");
    assert!(
        rule.value["spec"]["groups"] == rules["groups"],
        "{}: spec.groups differ from deploy/prometheus/egress-gateway.rules.yml's groups",
        rule.at()
    );
}

/// The standalone webhook (no cert-manager) stays the same webhook.
#[test]
fn the_standalone_webhook_is_the_same_webhook() {
    let standalone = read_docs(&root().join("deploy/machine-webhook.yaml"));
    let docs = docs();
    for kind in ["ValidatingWebhookConfiguration", "Deployment", "Service"] {
        let a = standalone.iter().find(|d| d.kind() == kind).expect(kind);
        let b = find(&docs, kind, a.name()).unwrap_or_else(|| panic!("no {kind} {}", a.name()));
        let (mut a, b) = (a.value.clone(), &b.value);
        match kind {
            "ValidatingWebhookConfiguration" => {
                for hook in a["webhooks"].as_array_mut().into_iter().flatten() {
                    hook["clientConfig"]
                        .as_object_mut()
                        .map(|c| c.remove("caBundle"));
                }
                assert_eq!(a["webhooks"], b["webhooks"], "the webhooks differ");
            }
            "Deployment" => {
                let args =
                    |v: &Value| v["spec"]["template"]["spec"]["containers"][0]["args"].clone();
                assert_eq!(args(&a), args(b), "the webhook's args differ");
                // Its key is mounted as strictly (0440, the fsGroup's).
                for field in ["securityContext", "volumes"] {
                    let pod = |v: &Value| v["spec"]["template"]["spec"][field].clone();
                    assert_eq!(pod(&a), pod(b), "the webhook pod's {field} differ");
                }
            }
            _ => assert_eq!(a["spec"], b["spec"], "the webhook's Service differs"),
        }
    }
}

// === what the containers are given ===

/// A container's environment, as Kubernetes would set it from literal
/// values and ConfigMap keys (Secrets and fields are left out).
fn resolved_env(docs: &[Doc], c: &Container) -> Vec<(String, String)> {
    c.env
        .iter()
        .flatten()
        .filter_map(|e| {
            let value = match (&e.value, &e.value_from) {
                (Some(v), _) => Some(v.clone()),
                (None, Some(f)) => {
                    let r = f.config_map_key_ref.as_ref()?;
                    content(docs, "ConfigMap", &r.name, &r.key)
                }
                _ => None,
            }?;
            Some((e.name.clone(), value))
        })
        .collect()
}

#[test]
fn the_profile_variables_pass_the_check() {
    let docs = docs();
    let mut checked = 0;
    for w in workloads(&docs) {
        for c in w
            .pod
            .containers
            .iter()
            .filter(|c| program(c).0 == "egress-controller")
        {
            let env: Vec<(String, String)> = resolved_env(&docs, c)
                .into_iter()
                .filter(|(k, _)| k.starts_with("SPACE_"))
                .collect();
            let out = run("egress-gateway", &["policy", "check-config"], &env)
                .unwrap_or_else(|e| panic!("{}: {env:?}: {e}", w.at(c)));
            assert!(out.contains(r#""status":"ok""#), "{out}");
            checked += 1;
        }
    }
    assert_eq!(checked, 2, "the api and the dispatcher");
}

#[test]
fn the_redirect_init_container_sends_to_the_gateway_ports() {
    let docs = docs();
    let dir = tempfile::tempdir().expect("temp dir");
    let mut checked = 0;
    for w in workloads(&docs) {
        let Some(gw) = w.pod.containers.iter().find(|c| program(c).1 == "run") else {
            continue;
        };
        let config = gateway_config(&docs, &w, gw).expect("gateway.toml");
        for c in w
            .pod
            .init_containers
            .iter()
            .flatten()
            .filter(|c| program(c).1 == "redirect" && flag(c, "--sandbox-iface").is_some())
        {
            let env = resolved_env(&docs, c);
            let path = flag(c, "--config").expect("--config");
            let file = dir.path().join("gateway.toml");
            std::fs::write(&file, mounted(&docs, &w, c, path).expect("mounted")).expect("write");
            // As the container runs it, printing instead of applying.
            let argv: Vec<String> = args(c)
                .iter()
                .filter(|a| *a != "--apply")
                .map(|a| {
                    env.iter()
                        .fold(a.clone(), |a, (k, v)| a.replace(&format!("$({k})"), v))
                })
                .map(|a| {
                    if a == path {
                        file.to_string_lossy().into_owned()
                    } else {
                        a
                    }
                })
                .collect();
            let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
            let rules =
                run("egress-gateway", &argv, &[]).unwrap_or_else(|e| panic!("{}: {e}", w.at(c)));
            for (key, names) in [
                ("transparent", &["transparent"][..]),
                ("dns", &["dns-udp", "dns-tcp"]),
                ("dns_alt", &["dns-alt-udp", "dns-alt-tcp"]),
            ] {
                let port = toml_addr(&config, "listen", key)
                    .expect("listen address")
                    .port();
                assert!(
                    rules.contains(&format!("redirect to :{port}")),
                    "{}: no redirect to :{port}:\n{rules}",
                    w.at(c)
                );
                for name in names {
                    let declared = gw
                        .ports
                        .iter()
                        .flatten()
                        .find(|p| p.name.as_deref() == Some(name));
                    assert_eq!(
                        declared.map(|p| p.container_port),
                        Some(i32::from(port)),
                        "{}: port {name}",
                        w.at(gw)
                    );
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 1, "one redirect init container");
}

/// The gateway's pod fences its sandbox interface before it attaches the
/// redirect (an attach into a fence made later would be dropped: the fence
/// starts with nothing attached), and the running gateway's fence keeper
/// watches the same interface.
#[test]
fn the_sandbox_interface_is_fenced_before_its_redirect() {
    let docs = docs();
    let ws = workloads(&docs);
    let w = ws
        .iter()
        .find(|w| w.pod.containers.iter().any(|c| program(c).1 == "run"))
        .expect("the gateway's workload");
    let inits: Vec<&Container> = w.pod.init_containers.iter().flatten().collect();
    let at = |want: &str| {
        inits
            .iter()
            .position(|c| program(c).1 == "redirect" && args(c).iter().any(|a| a == want))
            .unwrap_or_else(|| panic!("no redirect init container with {want}"))
    };
    let (fence, redirect) = (at("--fence"), at("--sandbox-iface"));
    assert!(fence < redirect, "the fence runs after the redirect");
    let iface = resolved_env(&docs, inits[redirect])
        .into_iter()
        .find(|(k, _)| k == "SANDBOX_IFACE")
        .map(|(_, v)| v)
        .expect("SANDBOX_IFACE");
    let gw = w
        .pod
        .containers
        .iter()
        .find(|c| program(c).1 == "run")
        .expect("gateway");
    let config = gateway_config(&docs, w, gw).expect("gateway.toml");
    let patterns: Vec<&str> = config
        .get("redirect")
        .and_then(|r| r.get("fence"))
        .and_then(|f| f.as_array())
        .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    let covers = |p: &str| match p.strip_suffix('*') {
        Some(prefix) => iface.starts_with(prefix),
        None => p == iface,
    };
    assert!(
        patterns.iter().any(|p| covers(p)),
        "redirect.fence {patterns:?} does not cover {iface}"
    );
    // What the fence container installs, printed.
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("gateway.toml");
    let path = flag(inits[fence], "--config").expect("--config");
    std::fs::write(
        &file,
        mounted(&docs, w, inits[fence], path).expect("mounted"),
    )
    .expect("write");
    let rules = run(
        "egress-gateway",
        &["redirect", "--fence", "--config", &file.to_string_lossy()],
        &[],
    )
    .expect("redirect --fence");
    assert!(
        rules.contains(&format!("iifname \"{iface}\" iifname != @attached")),
        "{rules}"
    );
}
