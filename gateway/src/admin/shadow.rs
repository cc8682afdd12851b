//! The shadow routes of the control API (`/v1/sandboxes/{id}/shadow…`): put,
//! read and drop a sandbox's candidate policy, read what it would have
//! changed, and promote it. Changes go through the committer like pushes,
//! so they are journalled, ordered with the pushes, and survive a restart.

use std::sync::Arc;

use egress_policy::SandboxId;
use http::StatusCode;
use serde_json::json;

use super::{applied, refused, rejected, sandbox_json, Control};
use crate::commit::{Candidate, Change, NotApplied};
use crate::control_http::{error, json_reply, Reply};
use crate::persist::SandboxDoc;
use crate::shadow::ShadowDoc;

pub(crate) use egress_api::gateway::PutShadow;

fn no_sandbox(id: &str) -> Reply {
    error(StatusCode::NOT_FOUND, &format!("no sandbox {id:?}"), None)
}

fn no_shadow(id: &str) -> Reply {
    error(
        StatusCode::NOT_FOUND,
        &format!("sandbox {id:?} has no shadow policy"),
        None,
    )
}

/// `PUT …/shadow`: the candidate, validated like a push's policy (it was
/// parsed as one), compiled here as a push's policy is (concurrently, not
/// on the commit thread), journalled.
pub(crate) async fn put(ctl: &Control, id: &str, doc: PutShadow) -> Reply {
    let sid = SandboxId::new(id);
    let Some(sandbox) = ctl.dp.registry.get(&sid) else {
        return no_sandbox(id);
    };
    let shadow = ShadowDoc {
        policy: doc.policy,
        since: crate::shadow::now(),
        policy_changed: None,
    };
    let credentials = sandbox.credentials.clone();
    let compile = move |r: &crate::registry::Registry| r.compile_shadow(shadow, &credentials);
    let shadow = match super::compiled(ctl, compile).await {
        Ok(shadow) => shadow,
        Err(reply) => return rejected(ctl, reply),
    };
    let candidate = Candidate {
        shadow: Arc::new(shadow),
        credentials: sandbox.credentials.clone(),
    };
    match ctl
        .committer
        .submit(Change::Shadow(sid.clone(), Some(Box::new(candidate))))
        .await
    {
        Ok(_) => {
            applied(ctl);
            get(ctl, id)
        }
        Err(NotApplied::Missing) => no_sandbox(id),
        Err(why) => refused(ctl, why, "policy"),
    }
}

/// `GET …/shadow`.
pub(crate) fn get(ctl: &Control, id: &str) -> Reply {
    let Some(s) = ctl.dp.registry.get(&SandboxId::new(id)) else {
        return no_sandbox(id);
    };
    match &s.shadow {
        Some(shadow) => json_reply(StatusCode::OK, &shadow.json(id)),
        None => no_shadow(id),
    }
}

/// `DELETE …/shadow`.
pub(crate) async fn delete(ctl: &Control, id: &str) -> Reply {
    let sid = SandboxId::new(id);
    match ctl.dp.registry.get(&sid) {
        None => return no_sandbox(id),
        Some(s) if s.shadow.is_none() => return no_shadow(id),
        Some(_) => {}
    }
    match ctl.committer.submit(Change::Shadow(sid, None)).await {
        Ok(_) => {
            applied(ctl);
            json_reply(StatusCode::OK, &json!({ "sandbox": id, "shadow": null }))
        }
        Err(NotApplied::Missing) => no_sandbox(id),
        Err(why) => refused(ctl, why, "id"),
    }
}

/// `GET …/shadow/report`.
pub(crate) fn report(ctl: &Control, id: &str) -> Reply {
    let Some(s) = ctl.dp.registry.get(&SandboxId::new(id)) else {
        return no_sandbox(id);
    };
    match &s.shadow {
        Some(shadow) => json_reply(StatusCode::OK, &shadow.report_json(id)),
        None => no_shadow(id),
    }
}

/// `POST …/shadow/promote`: the candidate becomes the policy in one
/// journalled put (addresses and credentials as they are), the shadow goes.
pub(crate) async fn promote(ctl: &Control, id: &str) -> Reply {
    let sid = SandboxId::new(id);
    if ctl.dp.registry.get(&sid).is_none() {
        return no_sandbox(id);
    }
    match ctl.committer.submit(Change::Promote(sid.clone())).await {
        Ok(_) => {
            applied(ctl);
            match ctl.dp.registry.get(&sid) {
                Some(s) => json_reply(StatusCode::OK, &sandbox_json(&SandboxDoc::from(&*s))),
                None => no_sandbox(id),
            }
        }
        Err(NotApplied::Missing) => rejected(ctl, no_shadow(id)),
        Err(why) => refused(ctl, why, "id"),
    }
}
