use std::os::unix::fs::MetadataExt;

use super::*;

fn vm(id: &str, port: u16) -> Vm {
    let policy = MachineEgress::from_json(&format!(
        r#"{{"mode": "allowlist", "rules": [{{"cidr": "10.0.0.0/8", "proto": "tcp", "port": {port}}}]}}"#
    ))
    .expect("policy");
    Vm {
        id: id.into(),
        addresses: vec![format!("100.64.0.{port}").parse().expect("ip")],
        link: None,
        cgroup: None,
        egress: Some(policy.clone()),
        effective: policy,
    }
}

fn two_vms() -> State {
    let mut s = State::empty();
    s.vms.insert("a".into(), vm("a", 1).into());
    s.vms.insert("b".into(), vm("b", 2).into());
    s
}

/// A claim every VM's addresses pass.
fn any(_: &str, _: &[std::net::IpAddr]) -> Result<(), String> {
    Ok(())
}

fn inode(path: &Path) -> u64 {
    std::fs::metadata(path).expect("metadata").ino()
}

#[test]
fn a_change_writes_only_the_files_of_what_it_changed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::new(dir.path());
    let empty = State::empty();
    let first = two_vms();
    store
        .save(&empty, &first, &["a".into(), "b".into()])
        .expect("save");
    assert_eq!(store.load(dir.path()).expect("load"), Some(first.clone()));
    let b = dir.path().join(DIR).join("vm-b.json");
    let (b_before, default_before) = (inode(&b), inode(&dir.path().join(DIR).join(DEFAULT_FILE)));

    // One VM's policy: its file is replaced, the other's and the default's are not.
    let mut next = first.clone();
    next.vms.insert("a".into(), vm("a", 9).into());
    store.save(&first, &next, &["a".into()]).expect("save");
    assert_eq!(inode(&b), b_before, "another VM's file was rewritten");
    assert_eq!(
        inode(&dir.path().join(DIR).join(DEFAULT_FILE)),
        default_before
    );
    assert_eq!(store.load(dir.path()).expect("load"), Some(next.clone()));

    // A removed VM's file goes; a new default is written.
    let mut last = next.clone();
    last.vms.remove("a");
    last.default = MachineEgress::from_json(r#"{"mode": "open"}"#).expect("open");
    store.save(&next, &last, &["a".into()]).expect("save");
    assert!(!dir.path().join(DIR).join("vm-a.json").exists());
    assert_eq!(store.load(dir.path()).expect("load"), Some(last));
}

/// A change of two VMs whose second file cannot be written (its
/// temporary file's place taken: a full disk would do the same) leaves the
/// first file as it was, not rewritten and put back, and no temporary file
/// behind: a putting back that failed too would have left the refused
/// change on disk for the next start.
#[test]
fn a_file_that_cannot_be_written_leaves_every_file_as_it_was() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::new(dir.path());
    let first = two_vms();
    store
        .save(&State::empty(), &first, &["a".into(), "b".into()])
        .expect("save");
    let a = dir.path().join(DIR).join("vm-a.json");
    let a_before = (inode(&a), std::fs::read(&a).expect("read"));
    std::fs::create_dir_all(dir.path().join(DIR).join(".vm-b.json.tmp").join("x"))
        .expect("in the way");
    let mut next = first.clone();
    next.vms.insert("a".into(), vm("a", 8).into());
    next.vms.insert("b".into(), vm("b", 9).into());
    let e = store
        .save(&first, &next, &["a".into(), "b".into()])
        .expect_err("not written");
    assert!(e.to_string().contains("vm-b.json"), "{e}");
    assert_eq!((inode(&a), std::fs::read(&a).expect("read")), a_before);
    assert!(!dir.path().join(DIR).join(".vm-a.json.tmp").exists());
    std::fs::remove_dir_all(dir.path().join(DIR).join(".vm-b.json.tmp")).expect("cleared");
    assert_eq!(store.load(dir.path()).expect("load"), Some(first));
}

#[test]
fn the_earlier_single_file_is_moved_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = two_vms();
    let legacy = dir.path().join(LEGACY_FILE);
    std::fs::write(&legacy, serde_json::to_vec(&state).expect("json")).expect("write");
    let store = Store::new(dir.path());
    assert_eq!(store.load(dir.path()).expect("load"), Some(state.clone()));
    assert!(!legacy.exists(), "machines.json stays after the move");
    assert!(dir.path().join(DIR).join("vm-a.json").exists());
    assert!(!dir.path().join(NEW_DIR).exists());
    // And read as the new layout from then on.
    assert_eq!(store.load(dir.path()).expect("load"), Some(state));
}

#[test]
fn nothing_yet_is_none_and_a_file_with_another_vm_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::new(dir.path());
    assert_eq!(store.load(dir.path()).expect("load"), None);
    store
        .save(&State::empty(), &two_vms(), &["a".into(), "b".into()])
        .expect("save");
    // A file renamed by hand: its name and the VM it holds disagree.
    let folder = dir.path().join(DIR);
    std::fs::rename(folder.join("vm-a.json"), folder.join("vm-c.json")).expect("rename");
    let err = store.load(dir.path()).expect_err("refused");
    let text = err.to_string();
    assert!(
        text.contains("vm-c.json") && text.contains("\"a\""),
        "{text}"
    );
    // A torn file is refused and named too.
    std::fs::write(folder.join("vm-c.json"), b"{\"id\": ").expect("write");
    let text = store.load(dir.path()).expect_err("refused").to_string();
    assert!(
        text.contains("vm-c.json") && text.contains("corrupt"),
        "{text}"
    );
    // Read at the start, it changed no rule: none was put back.
    assert!(
        text.starts_with("reading the machine egress state: ") && !text.contains("put back"),
        "{text}"
    );
}

/// A VM file is checked as its registration was: a link that is no
/// interface name (a quote in it would be nft script text), a cgroup path
/// that is not one, a repeated address: each refused, the file named.
#[test]
fn a_vm_file_is_checked_as_its_registration_was() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::new(dir.path());
    store
        .save(&State::empty(), &two_vms(), &["a".into(), "b".into()])
        .expect("save");
    assert!(store.load(dir.path()).is_ok());
    let file = dir.path().join(DIR).join("vm-a.json");
    let good: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&file).expect("read")).expect("json");
    for (field, value, says) in [
        (
            "link",
            serde_json::json!("tap0\" }; flush ruleset; #"),
            "link",
        ),
        ("cgroup", serde_json::json!("../escape"), "cgroup"),
        (
            "addresses",
            serde_json::json!(["100.64.0.1", "100.64.0.1"]),
            "twice",
        ),
    ] {
        let mut bad = good.clone();
        bad[field] = value;
        std::fs::write(&file, serde_json::to_vec(&bad).expect("json")).expect("write");
        let text = store.load(dir.path()).expect_err(field).to_string();
        assert!(
            text.contains("vm-a.json") && text.contains(says),
            "{field}: {text}"
        );
    }
}

/// A successor's check reads the state as start does and checks each VM
/// against the configured matching, as start does, moving nothing: a VM
/// matched by its addresses refuses a configuration that matches by
/// cgroup, naming its file. A VM file gone between the listing and its
/// read (removed meanwhile by the running gateway) is no error.
#[test]
fn a_check_reads_the_state_and_its_matching_and_moves_nothing() {
    use crate::config::{MachineEgressConfig, MachineMatch};
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::new(dir.path());
    store
        .save(&State::empty(), &two_vms(), &["a".into(), "b".into()])
        .expect("save");
    let mut config = MachineEgressConfig::default();
    assert_eq!(
        crate::check_state(&config, dir.path(), any).expect("reads"),
        2
    );
    config.matching = MachineMatch::Cgroup;
    let text = crate::check_state(&config, dir.path(), any)
        .expect_err("matched by addresses")
        .to_string();
    assert!(
        text.contains("vm-a.json") || text.contains("vm-b.json"),
        "{text}"
    );
    // Each VM's addresses are claimed as the start claims them.
    let config = MachineEgressConfig::default();
    let held = |vm: &str, addresses: &[std::net::IpAddr]| {
        let clash =
            vm == "b" && addresses == ["100.64.0.2".parse::<std::net::IpAddr>().expect("ip")];
        if clash {
            Err("100.64.0.2 is sandbox sb's".to_owned())
        } else {
            Ok(())
        }
    };
    let text = crate::check_state(&config, dir.path(), held)
        .expect_err("a VM's address held by a sandbox")
        .to_string();
    assert!(text.contains("100.64.0.2 is sandbox sb's"), "{text}");
    let gone = dir.path().join(DIR).join("vm-gone.json");
    assert!(matches!(read_listed::<Vm>(&gone), Ok(None)));
    // The earlier layout is read where it is, not moved.
    let legacy = tempfile::tempdir().expect("tempdir");
    let state = serde_json::to_vec(&two_vms()).expect("json");
    std::fs::write(legacy.path().join(LEGACY_FILE), state).expect("legacy");
    let config = MachineEgressConfig::default();
    assert_eq!(
        crate::check_state(&config, legacy.path(), any).expect("reads"),
        2
    );
    assert!(legacy.path().join(LEGACY_FILE).exists());
    assert!(!legacy.path().join(DIR).exists());
    // Its VMs are checked as the files they would be moved to are.
    let mut bad: serde_json::Value = serde_json::to_value(two_vms()).expect("json");
    bad["vms"]["a"]["link"] = serde_json::json!("tap0\" }; flush ruleset; #");
    let bad = serde_json::to_vec(&bad).expect("json");
    std::fs::write(legacy.path().join(LEGACY_FILE), bad).expect("legacy");
    let text = crate::check_state(&config, legacy.path(), any)
        .expect_err("a link that is no interface name")
        .to_string();
    assert!(
        text.contains(LEGACY_FILE) && text.contains("link"),
        "{text}"
    );
}
