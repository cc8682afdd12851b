use super::*;

fn policy(text: &str) -> MachineEgress {
    MachineEgress::from_json(text).expect("valid")
}

fn allow_api() -> MachineEgress {
    policy(r#"{"rules": [{"cidr": "10.0.0.0/8", "proto": "tcp", "port": 5151}]}"#)
}

fn other() -> MachineEgress {
    policy(r#"{"mode": "open"}"#)
}

fn own(p: MachineEgress) -> WorkerPolicy {
    WorkerPolicy {
        own: true,
        policy: p,
    }
}

fn default(p: MachineEgress) -> WorkerPolicy {
    WorkerPolicy {
        own: false,
        policy: p,
    }
}

/// Every sentence of the spec's reconciliation bullets, as (case, spec,
/// annotation, worker) → (action, annotation after).
#[test]
fn the_reconciliation_table() {
    let write = |p: MachineEgress| Action::Write(p);
    type Case = (
        &'static str,
        Option<MachineEgress>,
        bool,
        WorkerPolicy,
        Action,
        bool,
    );
    let cases: Vec<Case> = vec![
        (
            "running, field set, worker differs: write",
            Some(allow_api()),
            false,
            default(MachineEgress::loopback()),
            write(allow_api()),
            true,
        ),
        (
            "running, field set, worker has it already: no write (only when it differs)",
            Some(allow_api()),
            true,
            own(allow_api()),
            Action::Leave,
            true,
        ),
        (
            "field set, the default happens to equal it: still written, so the VM has it as its own",
            Some(allow_api()),
            false,
            default(allow_api()),
            write(allow_api()),
            true,
        ),
        (
            "field set, policy changed through the relay: the spec wins on the next reconcile",
            Some(allow_api()),
            true,
            own(other()),
            write(allow_api()),
            true,
        ),
        (
            "field set, a policy set directly on the worker before the field existed: the spec wins",
            Some(allow_api()),
            false,
            own(other()),
            write(allow_api()),
            true,
        ),
        (
            "field removed, the reconciler had set it: clear (back to the node default)",
            None,
            true,
            own(allow_api()),
            Action::Clear,
            false,
        ),
        (
            "field removed, managed, someone already cleared it: nothing to clear, annotation dropped",
            None,
            true,
            default(MachineEgress::loopback()),
            Action::Leave,
            false,
        ),
        (
            "never had the field, policy set directly on the worker: left alone",
            None,
            false,
            own(other()),
            Action::Leave,
            false,
        ),
        (
            "never had the field, policy set through the relay: left alone",
            None,
            false,
            own(allow_api()),
            Action::Leave,
            false,
        ),
        (
            "never had the field, following the default: left alone",
            None,
            false,
            default(MachineEgress::loopback()),
            Action::Leave,
            false,
        ),
    ];
    for (case, spec, managed, worker, action, managed_after) in cases {
        let d = decide(spec.as_ref(), managed, &worker);
        assert_eq!(d.action, action, "{case}");
        assert_eq!(d.managed, managed_after, "{case}");
    }
}

#[test]
fn a_write_converges_then_leaves() {
    // Applying the decision's write makes the next decision a no-op.
    let spec = allow_api();
    let first = decide(Some(&spec), false, &default(MachineEgress::loopback()));
    let Action::Write(written) = first.action else {
        panic!("expected a write");
    };
    let second = decide(Some(&spec), first.managed, &own(written));
    assert_eq!(second.action, Action::Leave);
}

#[test]
fn the_policy_rides_in_the_create_request() {
    let spec = allow_api();
    let (body, managed) = create_body(&["100.64.3.2".into()], Some(&spec));
    assert_eq!(body["addresses"][0], "100.64.3.2");
    assert_eq!(body["egress"], spec.to_value());
    assert!(managed, "the reconciler set it");
    let (body, managed) = create_body(&["100.64.3.2".into()], None);
    assert!(body.get("egress").is_none(), "no field: the node default");
    assert!(!managed);
}
