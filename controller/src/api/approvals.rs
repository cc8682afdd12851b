//! The API's proposal and approval routes: a sandbox's proposals, fetched
//! from its worker's gateway; approving one (a row in `approvals`, laid over
//! every sandbox its scope reaches, pushed like any policy change); listing
//! and revoking approvals. Everything is scoped by the caller's tenant: a
//! sandbox or approval of another tenant is `404`.

use egress_policy::Rule;
use http::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{db, error, json_reply, typed, visible, Api, Reply};
use crate::approvals::{self, NewApproval, Scope};
use crate::config::Tenant;
use crate::{gateway_client, ids, store};

/// `POST /v1/sandboxes/{id}/proposals/{pid}/approve`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ApproveBody {
    scope: Scope,
    /// RFC 3339; `null` or absent: until revoked. `Some(_)`: named (the
    /// outer option), a time or `null`.
    #[serde(default, deserialize_with = "named")]
    until: Option<Option<String>>,
}

/// A field given, `null` included: `Some` of what it holds.
fn named<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(d).map(Some)
}

/// The answer to an approval not recorded: `400` for one too large, `409`
/// for one that would lift an end in force unsaid.
fn not_approved(why: approvals::NotApproved) -> Reply {
    match why {
        approvals::NotApproved::TooLarge(why) => error(StatusCode::BAD_REQUEST, &why),
        approvals::NotApproved::EndsInForce { id, until } => error(
            StatusCode::CONFLICT,
            &format!(
                "approval {id} of this rule is in force until {until}: name \"until\" to change its end (null: none)"
            ),
        ),
    }
}

impl Api {
    /// `GET /v1/sandboxes/{id}/proposals`: the worker's answer, as it is.
    pub(super) async fn proposals(&self, caller: &Tenant, id: &str) -> Result<Reply, Reply> {
        let doc = self.fetch_proposals(caller, id).await?;
        Ok(json_reply(StatusCode::OK, &doc))
    }

    /// The sandbox's proposals from its worker's gateway.
    async fn fetch_proposals(&self, caller: &Tenant, id: &str) -> Result<Value, Reply> {
        let mut conn = self.pool.acquire().await.map_err(db)?;
        let row = visible(caller, store::sandbox(&mut conn, id).await.map_err(db)?, id)?;
        drop(conn);
        let no_proposals = || {
            error(
                StatusCode::NOT_FOUND,
                &format!("sandbox {id} is not on a gateway yet"),
            )
        };
        let worker = row.worker.ok_or_else(no_proposals)?;
        let w = store::worker(&self.pool, &worker)
            .await
            .map_err(db)?
            .ok_or_else(no_proposals)?;
        let path = format!("/v1/sandboxes/{id}/proposals");
        let answer = gateway_client::call(&w.admin_url, &w.token, Method::GET, &path, None).await;
        match answer {
            Ok((StatusCode::OK, doc)) => Ok(doc),
            Ok((StatusCode::NOT_FOUND, _)) => Err(no_proposals()),
            Ok((status, doc)) => Err(error(
                StatusCode::BAD_GATEWAY,
                &format!("worker {worker} answered {status}: {doc}"),
            )),
            Err(e) => Err(super::unanswered(caller, &format!("worker {worker}: {e}"))),
        }
    }

    /// `POST /v1/sandboxes/{id}/proposals/{pid}/approve`.
    pub(super) async fn approve(
        &self,
        caller: &Tenant,
        (id, pid): (&str, &str),
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let req: ApproveBody = typed(body?)?;
        if let Some(Some(until)) = &req.until {
            self.check_until(until).await?;
        }
        let doc = self.fetch_proposals(caller, id).await?;
        let proposal = doc["proposals"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["id"] == pid)
            .cloned()
            .ok_or_else(|| error(StatusCode::NOT_FOUND, &format!("no proposal {pid:?}")))?;
        let rule: Rule = serde_json::from_value(proposal["rule"].clone()).map_err(|e| {
            error(
                StatusCode::BAD_GATEWAY,
                &format!("the worker proposed an invalid rule: {e}"),
            )
        })?;
        approvable_for(req.scope, &rule).map_err(|why| error(StatusCode::BAD_REQUEST, &why))?;
        let mut tx = self.pool.begin().await.map_err(db)?;
        let row = visible(caller, store::sandbox(&mut tx, id).await.map_err(db)?, id)?;
        let target = match req.scope {
            Scope::Sandbox => row.id.clone(),
            Scope::Template => row.template.clone(),
            Scope::Tenant => row.tenant.clone(),
        };
        let approval_id = ids::new("ap");
        let new = NewApproval {
            id: &approval_id,
            tenant: &row.tenant,
            scope: req.scope,
            target: &target,
            rule: &rule,
            principal: &caller.principal(),
            until: req.until.as_ref().and_then(Option::as_deref),
            until_named: req.until.is_some(),
            evidence: &proposal,
        };
        let (approval, created) = approvals::approve(&mut tx, &new)
            .await
            .map_err(db)?
            .map_err(not_approved)?;
        tx.commit().await.map_err(db)?;
        let status = if created {
            StatusCode::CREATED
        } else {
            StatusCode::OK
        };
        Ok(json_reply(status, &approval.document()))
    }

    /// `400` unless `until` is an RFC 3339 time (a date, a time and an
    /// offset: not PostgreSQL's other readings, `infinity` or a time in the
    /// server's zone) in the future, by the database's clock, which
    /// expires approvals.
    async fn check_until(&self, until: &str) -> Result<(), Reply> {
        use time::format_description::well_known::Rfc3339;
        if time::OffsetDateTime::parse(until, &Rfc3339).is_err() {
            return Err(error(
                StatusCode::BAD_REQUEST,
                &format!("until: {until:?} is not an RFC 3339 time"),
            ));
        }
        match store::is_future(&self.pool, until).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(error(
                StatusCode::BAD_REQUEST,
                &format!("until: {until:?} is past"),
            )),
            // A data exception: a time PostgreSQL cannot store (an offset
            // past 15 hours, the year 0), the caller's to mend.
            Err(e) if store::is_data_exception(&e) => Err(error(
                StatusCode::BAD_REQUEST,
                &format!("until: {until:?} is not a time the store can hold: {e}"),
            )),
            Err(e) => Err(db(e)),
        }
    }

    /// `GET /v1/approvals`: the caller's tenant's (an admin's: every tenant's).
    pub(super) async fn approvals(&self, caller: &Tenant) -> Result<Reply, Reply> {
        let tenant = (!caller.admin).then_some(caller.tenant.as_str());
        let (list, truncated) = approvals::list(&self.pool, tenant).await.map_err(db)?;
        let docs: Vec<Value> = list.iter().map(approvals::Approval::document).collect();
        Ok(json_reply(
            StatusCode::OK,
            &json!({ "approvals": docs, "truncated": truncated }),
        ))
    }

    /// `DELETE /v1/approvals/{id}`: revoked, and its rule taken out.
    pub(super) async fn revoke(&self, caller: &Tenant, id: &str) -> Result<Reply, Reply> {
        let tenant = (!caller.admin).then_some(caller.tenant.as_str());
        let mut tx = self.pool.begin().await.map_err(db)?;
        let revoked = approvals::revoke(&mut tx, id, tenant).await.map_err(db)?;
        tx.commit().await.map_err(db)?;
        match revoked {
            Some(a) => Ok(json_reply(StatusCode::OK, &a.document())),
            None => Err(error(StatusCode::NOT_FOUND, &format!("no approval {id:?}"))),
        }
    }
}

/// Whether `rule` may be approved for `scope`: a rule qualified by `http`
/// or `streams` for its sandbox only. Laid over another sandbox that
/// reaches the destination by a wider entry (a wildcard, the default), it
/// would make a level of its own for the name and change which requests
/// that sandbox may make; the proposal says nothing about them.
fn approvable_for(scope: Scope, rule: &egress_policy::Rule) -> Result<(), String> {
    if scope == Scope::Sandbox || (rule.http.is_none() && rule.streams.is_none()) {
        return Ok(());
    }
    Err(format!(
        "scope: {:?} for a rule qualified by http or streams: it can be approved for its sandbox only (for a template or the tenant it would change which requests other sandboxes may make to a destination they reach by another entry)",
        scope.as_str()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_qualified_rule_is_approved_for_its_sandbox_only() {
        let rule = |json: &str| serde_json::from_str::<egress_policy::Rule>(json).expect(json);
        let open = rule(r#"{"domain": "api.test"}"#);
        let post =
            rule(r#"{"domain": "api.test", "http": {"methods": ["POST"], "paths": ["/v1/x"]}}"#);
        let ssh = rule(r#"{"ip": "203.0.113.7", "streams": ["ssh"]}"#);
        for scope in [Scope::Sandbox, Scope::Template, Scope::Tenant] {
            assert_eq!(approvable_for(scope, &open), Ok(()), "{scope:?}");
        }
        assert_eq!(approvable_for(Scope::Sandbox, &post), Ok(()));
        assert_eq!(approvable_for(Scope::Sandbox, &ssh), Ok(()));
        for scope in [Scope::Template, Scope::Tenant] {
            for r in [&post, &ssh] {
                let why = approvable_for(scope, r).expect_err("refused");
                assert!(
                    why.starts_with(&format!("scope: {:?}", scope.as_str())),
                    "{why}"
                );
            }
        }
    }
}
