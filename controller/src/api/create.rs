//! Sandbox creates: `POST /v1/sandboxes` (native) and `POST /sandboxes`
//! (E2B). Each body is first translated into one [`CreateRequest`]; from
//! there one path runs for both ([`Api::create_sandbox`]): the warm-pool
//! header and the profile selection are admitted, the idempotency
//! fingerprint is taken, a claim from the template's warm pool is tried
//! ([`super::pool`]), and otherwise a new sandbox is inserted. The
//! [`Dialect`] decides only what differs on the wire: the template's field
//! name in errors, the reply's shape and status, and where a new sandbox's
//! policy is composed (native: queued, by the dispatcher; E2B: here, so
//! the reply names a sandbox that has its policy).

use egress_policy::{select, Policy};
use http::{HeaderMap, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{db, error, json_reply, policy_field, pool, typed, Api, Reply};
use crate::config::Tenant;
use crate::ops::{self, create_payload};
use crate::state::OperationKind;
use crate::store::{self, NewOperation, NewSandbox};
use crate::{e2b, ids};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    template: String,
    #[serde(default)]
    policy: Option<Value>,
    #[serde(default)]
    worker: Option<String>,
}

/// A create after translation: what a native and an E2B body both become.
struct CreateRequest {
    template: String,
    /// The tenant policy; `None` inherits the template's.
    policy: Option<Policy>,
    worker: Option<String>,
    /// What the idempotency fingerprint covers of the body (the selection
    /// and the pool are added): the native body's fields, `{"e2b": body}`.
    print: Value,
    dialect: Dialect,
}

/// Which API a create came through: what its answers look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dialect {
    /// `POST /v1/sandboxes`: queued; `202 {"sandbox", "operation"}`.
    Native,
    /// `POST /sandboxes`: composed in the request; `201 {"sandboxID",
    /// "templateID"}` (and `"operation"` for a warm-pool claim).
    E2b,
}

impl Dialect {
    /// The body field naming the template, as errors name it.
    fn template_field(self) -> &'static str {
        match self {
            Self::Native => "template",
            Self::E2b => "templateID",
        }
    }

    /// The answer to a create that produced `sandbox` (and queued `operation`).
    fn created(self, template: &str, sandbox: &str, operation: Option<&str>) -> Reply {
        match self {
            Self::Native => json_reply(
                StatusCode::ACCEPTED,
                &json!({"sandbox": sandbox, "operation": operation}),
            ),
            Self::E2b => {
                let mut doc = json!({"sandboxID": sandbox, "templateID": template});
                if let Some(op) = operation {
                    doc["operation"] = json!(op);
                }
                json_reply(StatusCode::CREATED, &doc)
            }
        }
    }
}

impl Api {
    /// Admits the profile selection of a create (`X-Space-Egress-Profiles`).
    fn admit(&self, caller: &Tenant, headers: &HeaderMap) -> Result<Vec<String>, Reply> {
        let mut values = headers.get_all(egress_policy::PROFILES_HEADER).iter();
        let first = values.next();
        let header = match (first, values.next()) {
            (None, _) => None,
            (Some(v), None) => Some(
                v.to_str()
                    .map_err(|_| selection_error("malformed", "not ASCII"))?,
            ),
            (Some(_), Some(_)) => {
                return Err(selection_error("malformed", "the header appears twice"))
            }
        };
        match select(&self.deployment.profiles, header, caller.federated) {
            Ok(s) => {
                self.metrics.admitted(&s.admissions);
                Ok(s.profiles.iter().map(ToString::to_string).collect())
            }
            Err(e) => {
                self.metrics.admitted(&e.admissions);
                Err(selection_error(e.kind.as_str(), &e.to_string()))
            }
        }
    }

    /// What every create (native or E2B) reads first: whether it names
    /// the warm pool of `template`, and the admitted profile selection.
    fn admit_create(
        &self,
        caller: &Tenant,
        headers: &HeaderMap,
        template: &str,
    ) -> Result<(bool, Vec<String>), Reply> {
        let pooled = pool::named(headers, template)?;
        let names = self.admit(caller, headers)?;
        Ok((pooled, names))
    }

    /// `POST /v1/sandboxes`: the body as a [`CreateRequest`].
    pub(super) async fn create(
        &self,
        caller: &Tenant,
        headers: &HeaderMap,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let req: CreateBody = typed(body?)?;
        let policy = req
            .policy
            .as_ref()
            .map(|p| policy_field(p, "policy"))
            .transpose()?;
        // A worker named must be one: otherwise the create is queued, its
        // operation retried for minutes, and the sandbox fails.
        if let Some(worker) = &req.worker {
            let known = store::worker(&self.pool, worker).await.map_err(db)?;
            if known.is_none() {
                return Err(error(
                    StatusCode::BAD_REQUEST,
                    &format!("worker: {worker:?} is not registered"),
                ));
            }
        }
        let print = json!({"template": req.template, "policy": req.policy, "worker": req.worker});
        let create = CreateRequest {
            template: req.template,
            policy,
            worker: req.worker,
            print,
            dialect: Dialect::Native,
        };
        self.create_sandbox(caller, headers, &create).await
    }

    /// `POST /sandboxes`: an E2B body, translated exactly (`400` with the
    /// reason when no exact translation exists) into a [`CreateRequest`].
    pub(super) async fn e2b_create(
        &self,
        caller: &Tenant,
        headers: &HeaderMap,
        body: Result<Value, Reply>,
    ) -> Result<Reply, Reply> {
        let raw = body?;
        let parsed = e2b::parse(raw.to_string().as_bytes())
            .map_err(|e| error(StatusCode::BAD_REQUEST, &e.to_string()))?;
        // A create that says nothing of the network gets the template's
        // policy, as a native create without one does.
        let silent = parsed.allow_internet_access.is_none() && parsed.network.is_none();
        let policy = match silent {
            true => None,
            false => e2b::translate(&parsed)
                .map_err(|e| error(StatusCode::BAD_REQUEST, &e.to_string()))
                .and_then(|p| super::not_too_large(p, "network"))
                .map(Some)?,
        };
        let create = CreateRequest {
            template: parsed.template_id,
            policy,
            worker: None,
            print: json!({ "e2b": raw }),
            dialect: Dialect::E2b,
        };
        self.create_sandbox(caller, headers, &create).await
    }

    /// Every create after translation: admission, the fingerprint, a
    /// warm-pool claim when the create names the pool (and it is not
    /// empty), else a new sandbox.
    async fn create_sandbox(
        &self,
        caller: &Tenant,
        headers: &HeaderMap,
        req: &CreateRequest,
    ) -> Result<Reply, Reply> {
        let (pooled, names) = self.admit_create(caller, headers, &req.template)?;
        let key = idempotency_key(headers)?;
        let fingerprint = create_fingerprint(&req.print, &names, pooled);
        let payload = create_payload(req.policy.as_ref(), req.worker.as_deref());
        if pooled {
            let claim = pool::ClaimRequest {
                claim: store::pool::Claim {
                    template: &req.template,
                    tenant: &caller.tenant,
                    egress_profiles: &names,
                    inherits_template: req.policy.is_none(),
                    worker: req.worker.as_deref(),
                },
                payload: &payload,
                key,
                fingerprint: &fingerprint,
                native: req.dialect == Dialect::Native,
            };
            if let Some((sandbox, operation)) = self.claim(caller, &claim).await? {
                return Ok(req
                    .dialect
                    .created(&req.template, &sandbox, operation.as_deref()));
            }
        }
        let new = NewSandbox {
            id: &ids::new("sb"),
            tenant: &caller.tenant,
            template: &req.template,
            egress_profiles: &names,
            inherits_template: req.policy.is_none(),
        };
        match req.dialect {
            Dialect::Native => {
                let op = NewOperation {
                    id: &ids::new("op"),
                    tenant: &caller.tenant,
                    kind: OperationKind::Create,
                    sandbox: new.id,
                    payload: &payload,
                    idempotency_key: key,
                    fingerprint: Some(&fingerprint),
                };
                self.enqueue(caller, &new, &op).await
            }
            Dialect::E2b => {
                let keyed = (key, fingerprint.as_str());
                self.compose_now(caller, &new, &payload, keyed).await
            }
        }
    }

    /// Inserts a sandbox and its operation, or replays the operation an
    /// idempotency key already names (same fingerprint) or refuses (409).
    pub(super) async fn enqueue(
        &self,
        caller: &Tenant,
        new: &NewSandbox<'_>,
        op: &NewOperation<'_>,
    ) -> Result<Reply, Reply> {
        for _ in 0..2 {
            let mut tx = self.pool.begin().await.map_err(db)?;
            // A retry waits for the create it retries, and then replays it.
            store::lock_tenant(&mut tx, &caller.tenant)
                .await
                .map_err(db)?;
            let native = Dialect::Native;
            if let Some(replay) =
                replayed_op(&mut tx, &caller.tenant, op, (new.template, native)).await?
            {
                return replay;
            }
            registered(&mut tx, new.template, Dialect::Native.template_field()).await?;
            within_quota(&mut tx, caller).await?;
            store::insert_sandbox(&mut tx, new).await.map_err(db)?;
            match store::insert_operation(&mut tx, op).await {
                Ok(()) => {}
                // A concurrent create with the same key won: replay it.
                Err(sqlx::Error::Database(e)) if e.is_unique_violation() => continue,
                Err(e) => return Err(db(e)),
            }
            tx.commit().await.map_err(db)?;
            return Ok(Dialect::Native.created(new.template, new.id, Some(op.id)));
        }
        Err(error(
            StatusCode::CONFLICT,
            "Idempotency-Key is being used concurrently; retry",
        ))
    }

    /// Inserts a sandbox and composes its policy in the same transaction
    /// (the queued create's code, run now): `201` once it has its policy;
    /// `503` when a retry may succeed, `400` when none will. With an
    /// `Idempotency-Key` (`keyed`: it and the request's fingerprint), a
    /// finished operation records it in the same transaction: a retry gets
    /// the original sandbox, another request under the key `409`.
    async fn compose_now(
        &self,
        caller: &Tenant,
        new: &NewSandbox<'_>,
        payload: &Value,
        (key, fingerprint): (Option<&str>, &str),
    ) -> Result<Reply, Reply> {
        let op = NewOperation {
            id: &ids::new("op"),
            tenant: &caller.tenant,
            kind: OperationKind::Create,
            sandbox: new.id,
            payload,
            idempotency_key: key,
            fingerprint: Some(fingerprint),
        };
        for _ in 0..2 {
            let mut tx = self.pool.begin().await.map_err(db)?;
            // A retry waits for the create it retries, and then replays it.
            store::lock_tenant(&mut tx, &caller.tenant)
                .await
                .map_err(db)?;
            let e2b = (new.template, Dialect::E2b);
            if let Some(replay) = replayed_op(&mut tx, &caller.tenant, &op, e2b).await? {
                return replay;
            }
            registered(&mut tx, new.template, Dialect::E2b.template_field()).await?;
            within_quota(&mut tx, caller).await?;
            store::insert_sandbox(&mut tx, new).await.map_err(db)?;
            if let Err(f) =
                ops::create(&mut tx, &self.deployment, &self.metrics, new.id, payload).await
            {
                let status = if f.retryable {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::BAD_REQUEST
                };
                return Err(error(status, &f.message));
            }
            if key.is_some() {
                match store::insert_finished_operation(&mut tx, &op).await {
                    Ok(()) => {}
                    // A concurrent create with the same key won: replay it.
                    Err(sqlx::Error::Database(e)) if e.is_unique_violation() => continue,
                    Err(e) => return Err(db(e)),
                }
            }
            tx.commit().await.map_err(db)?;
            return Ok(Dialect::E2b.created(new.template, new.id, None));
        }
        Err(error(
            StatusCode::CONFLICT,
            "Idempotency-Key is being used concurrently; retry",
        ))
    }
}

/// What an idempotency key `op` carries already names: the original
/// operation (same fingerprint) or `409`; `None` for a key not used yet (or
/// none).
pub(super) async fn replayed_op(
    conn: &mut sqlx::PgConnection,
    tenant: &str,
    op: &NewOperation<'_>,
    (template, dialect): (&str, Dialect),
) -> Result<Option<Result<Reply, Reply>>, Reply> {
    let Some(key) = op.idempotency_key else {
        return Ok(None);
    };
    let Some(store::Keyed {
        operation,
        sandbox,
        fingerprint: print,
        kind,
    }) = store::by_key(conn, tenant, key).await.map_err(db)?
    else {
        return Ok(None);
    };
    Ok(Some(if print.as_deref() == op.fingerprint {
        // An E2B create composed in its request answered without one.
        let shown = dialect == Dialect::Native || kind == OperationKind::Claim.as_str();
        let operation = shown.then_some(operation.as_str());
        Ok(dialect.created(template, &sandbox, operation))
    } else {
        Err(error(
            StatusCode::CONFLICT,
            "Idempotency-Key was used for a different request",
        ))
    }))
}

/// `429` when the caller's tenant already holds its `max_sandboxes`
/// (counted under a lock on the tenant, to the transaction's end).
pub(super) async fn within_quota(
    tx: &mut sqlx::PgConnection,
    caller: &Tenant,
) -> Result<(), Reply> {
    let held = store::held_by_tenant(tx, &caller.tenant)
        .await
        .map_err(db)?;
    if held >= i64::from(caller.max_sandboxes) {
        return Err(error(
            StatusCode::TOO_MANY_REQUESTS,
            &format!(
                "tenant {:?} holds {held} sandboxes, its max_sandboxes ({}): destroy one first",
                caller.tenant, caller.max_sandboxes
            ),
        ));
    }
    Ok(())
}

/// `400` naming `field` unless `template` is registered.
async fn registered(tx: &mut sqlx::PgConnection, template: &str, field: &str) -> Result<(), Reply> {
    if store::template_policy(tx, template)
        .await
        .map_err(db)?
        .is_none()
    {
        return Err(error(
            StatusCode::BAD_REQUEST,
            &format!("{field}: {template:?} is not registered"),
        ));
    }
    Ok(())
}

/// A create's idempotency fingerprint: the body's `print`, a nonempty
/// selection (an empty one keeps the fingerprint a create without profiles
/// had) and whether it names the warm pool.
fn create_fingerprint(print: &Value, names: &[String], pooled: bool) -> String {
    let mut print = print.clone();
    if !names.is_empty() {
        print["egress_profiles"] = json!(names);
    }
    if pooled {
        print["warm_pool"] = json!(true);
    }
    ids::fingerprint(print.to_string().as_bytes())
}

/// Longest `Idempotency-Key` taken.
const MAX_KEY: usize = 255;

/// The create's `Idempotency-Key`, if any: `400` for one that is not
/// printable ASCII, longer than [`MAX_KEY`], or sent twice. Read as no key, a
/// retry of it would create another sandbox; a proxy reading the other of
/// two could see another key than this one.
pub(super) fn idempotency_key(headers: &HeaderMap) -> Result<Option<&str>, Reply> {
    let mut values = headers.get_all("idempotency-key").iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return match headers.contains_key("idempotency-key") {
            true => Err(selection_error("repeated", "Idempotency-Key appears twice")),
            false => Ok(None),
        };
    };
    let key = value
        .to_str()
        .ok()
        .filter(|k| {
            !k.is_empty()
                && k.len() <= MAX_KEY
                && k.bytes().all(|b| b == b' ' || b.is_ascii_graphic())
        })
        .ok_or_else(|| {
            let why = format!("Idempotency-Key must be 1 to {MAX_KEY} printable ASCII characters");
            selection_error("malformed", &why)
        })?;
    Ok(Some(key))
}

fn selection_error(reason: &str, message: &str) -> Reply {
    json_reply(
        StatusCode::BAD_REQUEST,
        &json!({"error": message, "reason": reason}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn answer(reply: Reply) -> (StatusCode, Value) {
        let status = reply.status();
        let bytes = reply.into_body().collect().await.expect("body").to_bytes();
        (status, serde_json::from_slice(&bytes).expect("json"))
    }

    #[tokio::test]
    async fn each_dialect_answers_in_its_own_shape() {
        let cases = [
            (
                Dialect::Native,
                Some("op-1"),
                StatusCode::ACCEPTED,
                json!({"sandbox": "sb-1", "operation": "op-1"}),
            ),
            (
                Dialect::E2b,
                None,
                StatusCode::CREATED,
                json!({"sandboxID": "sb-1", "templateID": "base"}),
            ),
            (
                Dialect::E2b,
                Some("op-1"),
                StatusCode::CREATED,
                json!({"sandboxID": "sb-1", "templateID": "base", "operation": "op-1"}),
            ),
        ];
        for (dialect, operation, status, doc) in cases {
            let got = answer(dialect.created("base", "sb-1", operation)).await;
            assert_eq!(got, (status, doc), "{dialect:?} {operation:?}");
        }
        assert_eq!(Dialect::Native.template_field(), "template");
        assert_eq!(Dialect::E2b.template_field(), "templateID");
    }

    /// An `Idempotency-Key` is taken whole or refused: never read as none.
    #[tokio::test]
    async fn an_idempotency_key_that_does_not_read_one_way_is_refused() {
        let headers = |values: &[&[u8]]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(
                    "idempotency-key",
                    http::HeaderValue::from_bytes(v).expect("value"),
                );
            }
            h
        };
        assert_eq!(idempotency_key(&headers(&[])).ok(), Some(None));
        let one = headers(&[b"k-1"]);
        assert_eq!(idempotency_key(&one).ok(), Some(Some("k-1")));
        let long = vec![b'k'; MAX_KEY + 1];
        for (values, reason) in [
            (vec![&b"k-1"[..], b"k-2"], "repeated"),
            (vec!["kl\u{e9}".as_bytes()], "malformed"),
            (vec![&b"a\tkey"[..]], "malformed"),
            (vec![&long[..]], "malformed"),
        ] {
            let refused = idempotency_key(&headers(&values)).expect_err("refused");
            let (status, doc) = answer(refused).await;
            assert_eq!(
                (status, doc["reason"].clone()),
                (StatusCode::BAD_REQUEST, json!(reason))
            );
        }
    }

    #[test]
    fn the_fingerprint_covers_the_selection_and_the_pool_only_when_named() {
        let print = json!({"template": "base", "policy": null, "worker": null});
        let plain = ids::fingerprint(print.to_string().as_bytes());
        assert_eq!(create_fingerprint(&print, &[], false), plain);
        let names = ["sensor".to_owned()];
        let with_names = create_fingerprint(&print, &names, false);
        let pooled = create_fingerprint(&print, &[], true);
        assert_ne!(with_names, plain);
        assert_ne!(pooled, plain);
        assert_ne!(pooled, with_names);
        let e2b = json!({"e2b": {"templateID": "base"}});
        assert_ne!(create_fingerprint(&e2b, &[], true), pooled);
    }
}
