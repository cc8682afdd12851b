//! The per-request stages: authority → judge → rules → credentials →
//! budget; a request let through goes on to the forward stage
//! (`forward.rs`). What the flow log keeps of each stage goes into the
//! request's own [`RequestRecord`], never into a slot the connection's other
//! requests share.

use std::sync::Arc;

use dns_attrib::Lookup;
use egress_policy::http::MAX_METHOD_LEN;
use egress_policy::{Denied, Hostname, Protocol, RequestCode, RequestDenial, RuleRef, Verdict};
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;

use super::charge::{entries_of, StreamCharge};
use super::serve::ClientBody;
use super::Conn;
use crate::authority::{self, Authority, AuthorityError, Target};
use crate::credentials;
use crate::decide::{
    decide, folded_twin, judge_methods, method_overrides, path_override, request_names, Claims,
    MAX_OVERRIDES,
};
use crate::metrics::CodeLabels;
use crate::pool::Body;
use crate::registry::Sandbox;
use crate::reply::{text, Denial};
use crate::shadow::Judged;

/// What one request leaves in its flow's log, filled in by its stages.
#[derive(Debug, Default)]
pub(super) struct RequestRecord {
    /// The authority it was judged on (kept only with a flow log).
    pub(super) host: Option<String>,
    /// Why it was answered `400`, if it was.
    pub(super) refused: Option<String>,
    /// Refused by policy, a credential or a budget.
    pub(super) denied: bool,
    /// That refusal as the flow log shows it (only with a flow log).
    pub(super) denied_shown: Option<String>,
    /// What an audited rule would have refused, as the flow log shows it.
    pub(super) would_deny: Option<String>,
}

/// A request's record in the making: folded into its connection's tally
/// when the request ends, answered or abandoned by its client.
struct Recording<'c> {
    conn: &'c Conn,
    record: RequestRecord,
}

impl Drop for Recording<'_> {
    fn drop(&mut self) {
        let record = std::mem::take(&mut self.record);
        self.conn.tally().add(record);
    }
}

/// Why a request's authority is refused.
enum Refused {
    BadRequest(String),
    Misdirected,
}

/// The flow policy's answer to a request.
enum Judgement {
    /// Let through, with what the shadow compares against.
    Allowed(Judged),
    Denied(Denial),
    /// An authority the flow's TLS server name did not name (`421`).
    Misdirected,
}

/// The per-request stage that refused a request: the policy's rules, or a
/// host-bound credential (which a shadow policy shares, so never a
/// difference between the two).
enum Stage {
    Rules(Denial),
    Credentials(Denial),
}

impl Stage {
    fn into_denial(self) -> Denial {
        match self {
            Self::Rules(d) | Self::Credentials(d) => d,
        }
    }
}

/// A refused request's answer, for the shadow's comparison.
fn deny_of(d: &Denial) -> Judged {
    Judged {
        verdict: "deny",
        reason: d.code,
    }
}

/// What the rules and credentials stages read of a request.
struct Asked<'a> {
    /// The registration it is judged under.
    sandbox: &'a Sandbox,
    /// Its name (an IP-literal authority names none).
    host: Option<&'a Hostname>,
    /// The attribution the flow policy judged it on.
    lookup: &'a Lookup,
    method: &'a str,
    /// The methods its method-override headers name: frameworks that honour
    /// them (Rails, Symfony, Google's APIs) act on one, so each is judged too.
    overrides: &'a [String],
    /// The request target (path and query).
    target: &'a str,
}

impl Conn {
    /// One request, through the stages; its record is kept however it ends.
    pub(super) async fn handle(&self, req: Request<ClientBody>) -> Response<Body> {
        let mut recording = Recording {
            conn: self,
            record: RequestRecord::default(),
        };
        // An answer to HEAD, a refusal too, goes without its body: hyper's
        // HTTP/2 server would send one, which an HTTP/2 client may take for
        // a protocol error.
        let head = req.method() == http::Method::HEAD;
        let resp = self.answer(req, &mut recording.record).await;
        if head {
            return emptied(resp);
        }
        resp
    }

    /// One request: its authority, its verdict, the per-request stages,
    /// then upgrade or forward.
    async fn answer(
        &self,
        mut req: Request<ClientBody>,
        rec: &mut RequestRecord,
    ) -> Response<Body> {
        // Judged under the sandbox's registration as it is now (a DoH query
        // too: its address may be a sandbox's registered since).
        let Some(sandbox) = self.sandbox_now() else {
            return refused_after_body(req, self.unregistered(rec)).await;
        };
        if self.doh {
            return self.doh_answer(req).await;
        }
        let sb = &*sandbox;
        if req.version() == http::Version::HTTP_2 {
            super::forward::join_cookies(req.headers_mut());
        }
        let authority = match self.authority(&req, rec) {
            Ok(a) => a,
            Err(Refused::BadRequest(why)) => return refuse(&req, why, rec),
            Err(Refused::Misdirected) => return misdirected(),
        };
        let read = match read_headers(&req, sb.policy.has_request_rules()) {
            Ok(read) => read,
            Err(why) => return refuse(&req, why, rec),
        };
        let overrides = &read[..];
        let host = authority.name();
        let (lookup, judged) = self.judge(sb, host, rec);
        let allowed = match judged {
            Judgement::Allowed(allowed) => allowed,
            Judgement::Misdirected => return misdirected(),
            Judgement::Denied(denial) => {
                let active = deny_of(&denial);
                self.shadow_request(sb, (&req, overrides), host, &lookup, active);
                return refused_after_body(req, denial).await;
            }
        };
        let asked = (&mut req, overrides);
        let charge = match self.checked(sb, asked, (host, &lookup, allowed), rec) {
            Ok(charge) => charge,
            Err(denial) => return refused_after_body(req, denial).await,
        };
        self.opening(sb, &req, (host, &lookup), overrides);
        let carried = carried_of(&mut req);
        let resp = self.forwarded(sb, req, host, &authority, charge).await;
        // An answer to HEAD is emptied in `handle`, whatever its status.
        match carried {
            Some((carried, method)) => self.unreflected(sb, resp, (&carried, &method), rec),
            None if bodiless(false, resp.status()) => emptied(resp),
            None => resp,
        }
    }

    /// A DoH request, admitted as DNS from the sandbox's own address.
    async fn doh_answer(&self, req: Request<ClientBody>) -> Response<Body> {
        match &self.dp.resolver {
            Some(proxy) => {
                let draining = || self.draining();
                crate::doh::answer(proxy, (self.src, self.dst), req, draining).await
            }
            None => text(StatusCode::SERVICE_UNAVAILABLE, "no DNS proxy\n"),
        }
    }

    /// A request let through, forwarded: to the name the origin's
    /// certificate must carry (none: its address), the way out the
    /// registration names now (direct or a proxy); with a meter, both its
    /// bodies charged through it.
    async fn forwarded(
        &self,
        sb: &Sandbox,
        mut req: Request<ClientBody>,
        host: Option<&Hostname>,
        authority: &Authority,
        charge: Option<Arc<StreamCharge>>,
    ) -> Response<Body> {
        let verify_as = self.sni.as_ref().or(host);
        let route = self.dp.proxies.route(sb.upstream_proxy.as_ref());
        if let Some(charge) = &charge {
            req.body_mut().charge_to(charge.clone());
        }
        let resp = self
            .pass(req, (verify_as, &route), &authority.value())
            .await;
        match charge {
            Some(charge) => resp.map(|body| charge.response(body)),
            None => resp,
        }
    }

    /// The stages after the flow policy let a request through: its rules
    /// and credentials (compared with the shadow's answer), then its budget
    /// (with an HTTP/2 request's meter, if its policy has budgets).
    fn checked(
        &self,
        sb: &Sandbox,
        (req, overrides): (&mut Request<ClientBody>, &[String]),
        (host, lookup, allowed): (Option<&Hostname>, &Lookup, Judged),
        rec: &mut RequestRecord,
    ) -> Result<Option<Arc<StreamCharge>>, Denial> {
        let checked = self.per_request(sb, (req, overrides), host, lookup, rec);
        if sb.shadow.is_some() {
            let active = match &checked {
                Err(Stage::Rules(d)) => deny_of(d),
                // A credential's refusal is not the policy's: the candidate
                // shares the credentials, and would refuse it too.
                Ok(()) | Err(Stage::Credentials(_)) => allowed,
            };
            self.shadow_request(sb, (req, overrides), host, lookup, active);
        }
        checked.map_err(Stage::into_denial)?;
        let h2 = req.version() == http::Version::HTTP_2;
        self.within_budget(sb, (host, lookup), h2, rec)
    }

    /// The authority stage: the one authority every claim of the request
    /// agrees on, or why it is refused (`400`; `421` for an address under a
    /// TLS server name).
    fn authority(
        &self,
        req: &Request<ClientBody>,
        rec: &mut RequestRecord,
    ) -> Result<Authority, Refused> {
        let claims = authority::judge(
            req.uri().authority().map(http::uri::Authority::as_str),
            req.headers()
                .get_all(header::HOST)
                .iter()
                .map(HeaderValue::as_bytes),
        );
        let authority = match claims {
            Ok(Some(a)) => a,
            // Plain HTTP/1.0 without Host: judged on the address and attribution alone.
            Ok(None) if !self.tls && req.version() == http::Version::HTTP_10 => {
                Authority::of_ip(self.dst.ip())
            }
            Ok(None) => return Err(Refused::BadRequest(AuthorityError::Missing.to_string())),
            Err(e) => return Err(Refused::BadRequest(e.to_string())),
        };
        // Under a TLS server name, the request's authority is that name:
        // another (or an address) is another claim, and the origin was
        // verified for the server name only. Whatever the policy says now
        // (a push may have turned interception off since the hello).
        if self.sni.is_some() && authority.name() != self.sni.as_ref() {
            return Err(Refused::Misdirected);
        }
        if self.dp.flow_log.enabled() {
            rec.host = Some(match &authority.target {
                Target::Name(n) => n.to_string(),
                Target::Ip(ip) => ip.to_string(),
            });
        }
        Ok(authority)
    }

    /// Judges this request under the sandbox's shadow policy, if it has
    /// one, on the evidence the active policy judged it on.
    fn shadow_request(
        &self,
        sb: &Sandbox,
        (req, overrides): (&Request<ClientBody>, &[String]),
        host: Option<&Hostname>,
        lookup: &Lookup,
        active: crate::shadow::Judged,
    ) {
        let Some(shadow) = &sb.shadow else {
            return;
        };
        let attributed = lookup.names();
        let target = req
            .uri()
            .path_and_query()
            .map_or_else(|| req.uri().path(), |pq| pq.as_str());
        let request = crate::shadow::Request {
            claims: self.claims(host),
            tls: self.tls,
            attributed: &attributed,
            gap: lookup.gap(),
            method: req.method().as_str(),
            overrides,
            target,
        };
        let judge = crate::shadow::Judge {
            doh: &self.dp.doh_names,
            diffs: &self.dp.shadow_diffs,
        };
        crate::shadow::request(&judge, shadow, &request, active);
    }

    /// The claims of a request on this flow (`host`: its name, if any).
    pub(super) fn claims<'a>(&'a self, host: Option<&'a Hostname>) -> Claims<'a> {
        Claims {
            dst: self.dst,
            protocol: if self.tls {
                Protocol::Tls
            } else {
                Protocol::Http
            },
            sni: self.sni.as_ref(),
            host,
            // The flow is terminated: what a request is for is its own name.
            ech: false,
        }
    }

    /// The judge stage: decides this request under the flow policy (an
    /// IP-literal authority names no domain: `host` is `None`), giving the
    /// attribution it was judged on and the policy's answer.
    fn judge(
        &self,
        sb: &Sandbox,
        host: Option<&Hostname>,
        rec: &mut RequestRecord,
    ) -> (Lookup, Judgement) {
        let claims = self.claims(host);
        let decided = decide(
            &self.dp.cache,
            &sb.id,
            &sb.policy,
            &claims,
            &self.dp.doh_names,
        );
        let verdict = decided.verdict;
        let answer = match verdict {
            Verdict::Deny(Denied::Misdirected) => Judgement::Misdirected,
            Verdict::Deny(_) => {
                let seen = crate::proposed::Seen {
                    dst: self.dst,
                    sni: self.sni.as_ref(),
                    host,
                    attributed: &decided.lookup.names(),
                    reason: verdict.code(),
                };
                let live = || self.dp.registry.is_current(sb);
                self.dp.proposed.record((&sb.id, live), seen, None);
                self.note_denied(rec, verdict.code(), || {
                    let host = host.map_or_else(|| "-".to_owned(), ToString::to_string);
                    format!("{} (the request's host {host})", verdict.code())
                });
                Judgement::Denied(Denial {
                    status: StatusCode::FORBIDDEN,
                    code: verdict.code(),
                    rule: verdict.deny_rule(),
                    detail: verdict.describe(&sb.policy),
                })
            }
            Verdict::Allow(_) | Verdict::Splice(..) | Verdict::Intercept(..) => {
                Judgement::Allowed(crate::shadow::allowed(&verdict))
            }
        };
        (decided.lookup, answer)
    }

    /// The per-request rules and the credentials, for a request its flow's
    /// policy lets through: refused (saying by which stage), or let through
    /// with the credentials of its host in place of their placeholders.
    fn per_request(
        &self,
        sb: &Sandbox,
        (req, overrides): (&mut Request<ClientBody>, &[String]),
        host: Option<&Hostname>,
        lookup: &Lookup,
        rec: &mut RequestRecord,
    ) -> Result<(), Stage> {
        if !sb.policy.has_request_rules() {
            return Ok(());
        }
        let target = req
            .uri()
            .path_and_query()
            .map_or_else(|| req.uri().path(), |pq| pq.as_str())
            .to_owned();
        let method = req.method().clone();
        let asked = Asked {
            sandbox: sb,
            host,
            lookup,
            method: method.as_str(),
            overrides,
            target: &target,
        };
        self.request_rules(&asked, rec).map_err(Stage::Rules)?;
        self.inject_credentials(req, &asked, rec)
            .map_err(Stage::Credentials)
    }

    /// The rules stage: the sandbox's per-request rules on the request's
    /// method and target. What an audited rule would have refused is
    /// counted (and kept for the flow log); a refusal is proposed, counted
    /// and answered `403`.
    fn request_rules(&self, asked: &Asked<'_>, rec: &mut RequestRecord) -> Result<(), Denial> {
        let Asked {
            sandbox,
            host,
            lookup,
            method,
            overrides,
            target,
        } = *asked;
        let policy = &sandbox.policy;
        // The request's name counts alone where the origin's certificate
        // verifies it; plain HTTP's Host is a claim, so every name the
        // address may be is judged too.
        let attributed = lookup.names();
        let names = request_names(self.tls, host, &attributed);
        // Every method the request may be taken for is judged; a refusal of
        // any one refuses it, and names that method.
        let (judged, method) = judge_methods(policy, &names, (method, overrides), target);
        let show = |d: &RequestDenial| {
            let path = target.split('?').next().unwrap_or("");
            let path: String = path.chars().take(256).collect();
            let method: String = method.chars().take(MAX_METHOD_LEN).collect();
            format!("{} {}: {method} {path}", d.code.as_str(), d.rule.label())
        };
        if let Some(w) = &judged.would_deny {
            self.dp
                .metrics
                .requests_would_deny
                .get_or_create(&CodeLabels {
                    code: w.code.as_str(),
                })
                .inc();
            rec.would_deny.get_or_insert_with(|| show(w));
        }
        let Some(d) = &judged.deny else {
            return Ok(());
        };
        self.propose_request(sandbox, d, (host, &attributed[..]), (method, target));
        self.note_denied(rec, d.code.as_str(), || show(d));
        Err(Denial {
            status: StatusCode::FORBIDDEN,
            code: d.code.as_str(),
            rule: Some(d.rule.index()),
            detail: policy.describe_request(d),
        })
    }

    /// The credentials stage: the values of the host's credentials in place
    /// of their placeholders (counted), or the request refused for one.
    fn inject_credentials(
        &self,
        req: &mut Request<ClientBody>,
        asked: &Asked<'_>,
        rec: &mut RequestRecord,
    ) -> Result<(), Denial> {
        let credentials = &asked.sandbox.credentials;
        if credentials.is_empty() {
            return Ok(());
        }
        let attributed = asked.lookup.names();
        let may_be = request_names(self.tls, asked.host, &attributed);
        let names = match asked.host.filter(|_| self.tls) {
            Some(verified) => credentials::Names::Verified(verified),
            None => credentials::Names::Unverified(&may_be),
        };
        let applied = credentials::apply(
            credentials,
            &self.dp.secrets,
            names,
            asked.target,
            req.headers_mut(),
            self.dp.config().limits.max_request_head,
        )
        .map_err(|refused| self.credential_refused(credentials, refused, asked.method, rec))?;
        self.dp
            .metrics
            .credentials_injected
            .inc_by(applied.injected as u64);
        if let Some(carried) = applied.carried {
            credentials::Carried::request(req.headers_mut());
            req.extensions_mut().insert(carried);
        }
        Ok(())
    }

    /// The answer to a request that carried credential values, each value
    /// the origin sent back in place of its placeholder (counted); one in a
    /// coding the gateway cannot read for them is refused `502`.
    fn unreflected(
        &self,
        sb: &Sandbox,
        resp: Response<Body>,
        (carried, method): (&credentials::Carried, &http::Method),
        rec: &mut RequestRecord,
    ) -> Response<Body> {
        let (mut parts, body) = resp.into_parts();
        let found = &self.dp.metrics.credentials_reflected;
        found.inc_by(carried.headers(&mut parts.headers) as u64);
        found.inc_by(carried.reason(&mut parts.extensions) as u64);
        if bodiless(*method == http::Method::HEAD, parts.status) {
            // The scrubbing below would not see a body sent anyway.
            return emptied(Response::from_parts(parts, body));
        }
        // Read from the headers with the values out: the detail is shown.
        if let Some(coding) = credentials::Carried::encoded(&parts.headers) {
            let refused = credentials::Refused {
                why: credentials::Refusal::ResponseEncoded,
                index: carried.index,
            };
            let mut denial =
                self.credential_refused(&sb.credentials, refused, method.as_str(), rec);
            denial.detail = format!("{} ({coding:?})", denial.detail);
            return denial.response();
        }
        // The values and their placeholders differ in length.
        parts.headers.remove(header::CONTENT_LENGTH);
        Response::from_parts(parts, carried.body(body, found.clone()))
    }

    /// A request refused for a credential, counted: `403`, or `503` when
    /// its value cannot be read.
    fn credential_refused(
        &self,
        credentials: &[credentials::Credential],
        refused: credentials::Refused,
        method: &str,
        rec: &mut RequestRecord,
    ) -> Denial {
        let code = refused.why.code();
        let name = &credentials[refused.index].name;
        let rule = u32::try_from(refused.index).unwrap_or(u32::MAX);
        self.note_denied(rec, code, || {
            let method: String = method.chars().take(MAX_METHOD_LEN).collect();
            format!("{code} credentials[{rule}] {name:?}: {method}")
        });
        let detail = match refused.why {
            credentials::Refusal::HostMismatch => {
                format!("the placeholder of credential {name:?} is only for its hosts")
            }
            credentials::Refusal::Required => {
                format!("requests to these hosts must carry credential {name:?}'s placeholder")
            }
            credentials::Refusal::Unavailable => {
                format!("the value of credential {name:?} cannot be read by the gateway")
            }
            credentials::Refusal::TooLarge => {
                format!("with credential {name:?}'s value in, the request head would pass limits.max_request_head")
            }
            credentials::Refusal::ResponseEncoded => {
                format!("the origin's answer to a request carrying credential {name:?}'s value is in a coding the gateway cannot read for the value")
            }
        };
        let status = match refused.why {
            credentials::Refusal::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            credentials::Refusal::TooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            credentials::Refusal::ResponseEncoded => StatusCode::BAD_GATEWAY,
            _ => StatusCode::FORBIDDEN,
        };
        Denial {
            status,
            code,
            rule: Some(rule),
            detail,
        }
    }

    /// Hands a refused request to the sandbox's proposals, with the
    /// destination of the allow entry whose level refused it.
    fn propose_request(
        &self,
        sb: &Sandbox,
        d: &RequestDenial,
        (host, attributed): (Option<&Hostname>, &[Hostname]),
        (method, target): (&str, &str),
    ) {
        let (RequestCode::HttpNotAllowed, RuleRef::Allow(i)) = (d.code, d.rule) else {
            return;
        };
        let Ok(path) = egress_policy::http::normalize(target) else {
            return;
        };
        let level = usize::try_from(i)
            .ok()
            .and_then(|i| sb.policy.policy().allow.get(i))
            .map(|r| r.dest.clone());
        let seen = crate::proposed::Seen {
            dst: self.dst,
            sni: self.sni.as_ref(),
            host,
            attributed,
            reason: d.code.as_str(),
        };
        let request = egress_policy::proposals::DeniedRequest {
            method: method.to_owned(),
            path,
            level,
        };
        let live = || self.dp.registry.is_current(sb);
        self.dp.proposed.record((&sb.id, live), seen, Some(request));
    }

    /// The entries of `budgets` a request to `host` is charged to. The
    /// evidence: a terminated request's verified name, else the names
    /// attributed to the address; a plain-HTTP `Host` that is not
    /// attributed is a claim, which may add an entry, never take the
    /// request out of its evidence's (`Budgets::charged`).
    fn budget_entries<'b>(
        &self,
        budgets: &'b egress_policy::budget::Budgets,
        host: Option<&Hostname>,
        attributed: &[Hostname],
    ) -> Vec<(u32, &'b egress_policy::budget::Budget)> {
        let verified = host.filter(|_| self.tls);
        let evidence: Vec<&Hostname> = match verified {
            Some(v) => vec![v],
            None => attributed.iter().collect(),
        };
        let claims: Vec<&Hostname> = host
            .filter(|h| verified.is_none() && !attributed.contains(h))
            .into_iter()
            .collect();
        budgets.charged(&evidence, &claims)
    }

    /// The budget stage, after the policy let the request through: the
    /// bytes moved since the last request was judged charged to that
    /// request's entries (to this one's, if it is the first: `charge.rs`),
    /// then the request budget of each entry this one is charged to (one,
    /// or two: `Budgets::charged`); over any, `429` (`budget_exceeded`).
    /// Budgets never allow. An HTTP/2 request (`h2`) gets the meter its
    /// bodies are charged through.
    fn within_budget(
        &self,
        sb: &Sandbox,
        (host, lookup): (Option<&Hostname>, &Lookup),
        h2: bool,
        rec: &mut RequestRecord,
    ) -> Result<Option<Arc<StreamCharge>>, Denial> {
        let budgets = &sb.policy.policy().budgets;
        if budgets.is_empty() {
            return Ok(None);
        }
        let attributed = lookup.names();
        let entries = self.budget_entries(budgets, host, &attributed);
        let now = self.dp.cache.now();
        let destinations = entries.iter().map(|(_, b)| b.destination.clone());
        let (last, delta) = self.budget.hand_over(destinations.collect());
        // Every entry is charged its bytes, refused or not: a claim's entry
        // that is spent must not keep them from the evidence's.
        let own = match last {
            Some(last) => {
                for (_, budget) in entries_of(&last, budgets) {
                    self.dp.budgets.charge(&sb.id, budget, delta, now);
                }
                0
            }
            None => delta,
        };
        let mut over = None;
        for &(rule, budget) in &entries {
            if let Err(o) = self.dp.budgets.request(&sb.id, budget, own, now) {
                over = over.or(Some((rule, budget, o)));
            }
        }
        let Some((rule, budget, over)) = over else {
            let table = (self.dp.budgets.clone(), self.dp.cache.clone());
            return Ok(h2.then(|| self.budget.stream(table, sb.id.clone(), &entries)));
        };
        self.dp.metrics.budget_exceeded(over);
        let detail = format!(
            "budgets[{rule}] ({}): {}",
            budget.destination,
            crate::budget::describe(over, budget)
        );
        self.note_denied(rec, "budget_exceeded", || {
            format!("budget_exceeded {detail}")
        });
        Err(Denial {
            status: StatusCode::TOO_MANY_REQUESTS,
            code: "budget_exceeded",
            rule: Some(rule),
            detail,
        })
    }

    /// Charges the bytes moved after the last request to its entries (of
    /// the registration the connection has now, as far as they are still
    /// in it).
    pub(super) fn charge_rest(&self) {
        let sandbox = self.sandbox_now().unwrap_or_else(|| self.sandbox.clone());
        let budgets = &sandbox.policy.policy().budgets;
        if budgets.is_empty() {
            return;
        }
        let (Some(last), delta) = self.budget.rest() else {
            return;
        };
        let now = self.dp.cache.now();
        for (_, budget) in entries_of(&last, budgets) {
            self.dp.budgets.charge(&sandbox.id, budget, delta, now);
        }
    }

    /// A request whose flow's sandbox is gone (deleted, or its address taken
    /// away since the flow began): refused, counted, and the connection ends
    /// at this request's boundary ([`Conn::stopping`]).
    fn unregistered(&self, rec: &mut RequestRecord) -> Denial {
        let code = "unknown_sandbox";
        self.note_denied(rec, code, || {
            format!(
                "{code}: sandbox {} is no longer registered for {}",
                self.sandbox.id, self.src
            )
        });
        Denial {
            status: StatusCode::FORBIDDEN,
            code,
            rule: None,
            detail: format!(
                "sandbox {} is no longer registered for address {}",
                self.sandbox.id, self.src
            ),
        }
    }

    /// Counts a refused request, and keeps it for the flow log.
    fn note_denied(
        &self,
        rec: &mut RequestRecord,
        code: &'static str,
        show: impl FnOnce() -> String,
    ) {
        self.dp
            .metrics
            .requests_denied
            .get_or_create(&CodeLabels { code })
            .inc();
        rec.denied = true;
        if self.dp.flow_log.enabled() {
            rec.denied_shown.get_or_insert_with(show);
        }
    }
}

/// The credential values `req` carries, with its method, to be looked for in
/// its answer; only such a request has its method kept.
fn carried_of(req: &mut Request<ClientBody>) -> Option<(credentials::Carried, http::Method)> {
    let carried = req.extensions_mut().remove::<credentials::Carried>()?;
    Some((carried, req.method().clone()))
}

/// Answers `400` without forwarding anything; an HTTP/1 connection is
/// closed after it, since the client and the gateway no longer agree on
/// what the bytes mean.
fn refuse(req: &Request<ClientBody>, why: String, rec: &mut RequestRecord) -> Response<Body> {
    let mut resp = text(StatusCode::BAD_REQUEST, &format!("{why}\n"));
    if req.version() < http::Version::HTTP_2 {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    rec.refused = Some(why);
    resp
}

/// Answers a refused request once its body is read (up to 64 KiB, for at
/// most a second), so an HTTP/2 client gets the answer rather than a reset
/// stream; a larger or slower body is not waited for.
async fn refused_after_body(req: Request<ClientBody>, denial: Denial) -> Response<Body> {
    let body = http_body_util::Limited::new(req.into_body(), 64 * 1024);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(1), body.collect()).await;
    denial.response()
}

fn misdirected() -> Response<Body> {
    text(
        StatusCode::MISDIRECTED_REQUEST,
        "Host does not match the TLS server name\n",
    )
}

/// The methods a request's overrides name ([`read_overrides`]), or why
/// its headers refuse it (`400`) before it is judged: a name an origin
/// reads as another with `_` taken for `-`, a header naming another path
/// where per-request rules judge the target (`path_judged`), or more
/// methods named than are judged one by one.
fn read_headers(req: &Request<ClientBody>, path_judged: bool) -> Result<Vec<String>, String> {
    if let Some(name) = folded_twin(req.headers()) {
        return Err(format!(
            "header {name:?} reads as another with '_' taken for '-'"
        ));
    }
    if let Some(name) = path_judged.then(|| path_override(req.headers())).flatten() {
        return Err(format!(
            "header {name:?} names a path other than the request's"
        ));
    }
    let read = read_overrides(req);
    if read.len() > MAX_OVERRIDES {
        return Err(format!(
            "more than {MAX_OVERRIDES} methods named by method overrides"
        ));
    }
    Ok(read)
}

/// The methods a request's overrides name, read once for every request,
/// whatever judges them: the per-request rules, a shadow's, and those of a
/// push that adds rules while the request is in flight. The cap on them is
/// the same whatever the policy (a shadow put in place must not refuse
/// what was let through before).
fn read_overrides(req: &Request<ClientBody>) -> Vec<String> {
    let target = req.uri().path_and_query().map_or("", |pq| pq.as_str());
    method_overrides(req.method().as_str(), req.headers(), target)
}

/// Whether an answer has no body whatever the origin sends (RFC 9110
/// §6.4.1): to `HEAD`, informational, `204` or `304`.
fn bodiless(head: bool, status: StatusCode) -> bool {
    head || status.is_informational()
        || matches!(status, StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED)
}

/// The answer with its body dropped unread: an HTTP/2 origin may still send
/// DATA on a `204` or `304`, which hyper's HTTP/2 server would pass on and
/// no client reads as part of the answer.
fn emptied(resp: Response<Body>) -> Response<Body> {
    let (parts, body) = resp.into_parts();
    drop(body);
    let empty = http_body_util::Empty::new().map_err(|never| match never {});
    Response::from_parts(parts, empty.boxed())
}
