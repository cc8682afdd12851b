//! One connection, from accept to the flow log, as a sequence of stages:
//!
//! ```text
//! identify ─▶ classify (peek) ─▶ decide ─▶ deny │ splice │ http (intercept / plain, per request)
//! ```
//! Each stage returns a typed value or a [`Refusal`]; a refusal ends the
//! flow denied (fail closed). The flow's log line is built from the stage
//! values as they arrive ([`Record`]), and written once when the flow ends.

mod budget;
mod classify;
mod identify;
mod record;
mod refusal;
mod still;

use std::sync::Arc;

use egress_policy::{Intercepted, Protocol, Verdict};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

pub(crate) use identify::Accepted;
pub(crate) use record::Record;
pub use refusal::not_judged_by_policy;
pub(crate) use refusal::Refusal;

use crate::decide::{decide, Claims, Decided};
use crate::intercept::{http_flow, Framing};
use crate::state::Dataplane;
use crate::upstream::Upstreams;

/// Handles one accepted connection from `peer`.
pub(crate) async fn handle(
    dp: Arc<Dataplane>,
    up: Arc<Upstreams>,
    mut stream: TcpStream,
    peer: std::net::SocketAddr,
) {
    // Small writes (TLS records, HTTP heads) leave at once: Nagle against
    // the client's delayed ACKs would stall every response.
    let _ = stream.set_nodelay(true);
    let mut rec = Record::start(&dp, peer);
    let accepted = match identify::identify(&dp, &stream, peer) {
        Ok(a) => a,
        Err(refusal) => return rec.refused(&mut stream, refusal).await,
    };
    rec.accepted(&accepted);
    let (classified, peeked, accepted) = match peek(&dp, &mut stream, &accepted, peer).await {
        Ok(c) => c,
        Err(refusal) => return rec.refused(&mut stream, refusal).await,
    };
    let claims = classified.claims(accepted.dst);
    let decided = decide(
        &dp.cache,
        &accepted.sandbox.id,
        &accepted.sandbox.policy,
        &claims,
        &dp.doh_names,
    );
    rec.decided(&claims, &decided, &accepted.sandbox);
    match decided.verdict {
        Verdict::Deny(_) => {
            propose(&dp, &accepted, &claims, &decided);
            deny(&mut stream, &claims, &decided.verdict, &accepted).await;
        }
        Verdict::Intercept(_, why) => {
            let framing = Framing::Tls(claims.sni.cloned());
            let doh = why == Intercepted::ReservedResolver;
            let target = accepted.target();
            let out = http_flow(&dp, &up, target, framing, stream, peeked, doh).await;
            rec.served(out);
        }
        Verdict::Allow(_) if claims.protocol == Protocol::Http => {
            let target = accepted.target();
            let out = http_flow(&dp, &up, target, Framing::Plain, stream, peeked, false).await;
            rec.served(out);
        }
        Verdict::Allow(_) | Verdict::Splice(..) => {
            let names = (&decided.lookup, claims.sni);
            let meter = match budget::admit(&dp, &accepted.sandbox, names, peeked.len()) {
                Ok(meter) => meter,
                Err(detail) => {
                    crate::io::reset(&stream);
                    return rec.budget_refused(detail);
                }
            };
            let still = still::StillAllowed::new(&claims, &decided, &accepted.sandbox.policy);
            rec.spliced(splice(&dp, (stream, peeked, peer.ip()), (&accepted, &still), meter).await);
        }
    }
    rec.finish();
}

/// The flow's first bytes, classified, and its registration as it is once
/// they are read ([`identify::still`]).
async fn peek(
    dp: &Dataplane,
    stream: &mut TcpStream,
    accepted: &Accepted,
    peer: std::net::SocketAddr,
) -> Result<(crate::peek::Classified, Vec<u8>, Accepted), Refusal> {
    let config = dp.config();
    let (classified, bytes) = classify::classify(dp, &config, stream).await?;
    Ok((classified, bytes, identify::still(dp, accepted, peer)?))
}

/// Hands a denied flow to the sandbox's proposals.
fn propose(dp: &Dataplane, accepted: &Accepted, claims: &Claims<'_>, decided: &Decided) {
    let seen = crate::proposed::Seen {
        dst: accepted.dst,
        sni: claims.sni,
        host: claims.host,
        attributed: &decided.lookup.names(),
        reason: decided.verdict.code(),
    };
    let sb = &accepted.sandbox;
    dp.proposed
        .record((&sb.id, || dp.registry.is_current(sb)), seen, None);
}

/// An allowed flow the gateway does not read, admitted by the budget
/// stage: the splice, under the budget's meter. The flow's record stays
/// with the caller: moved in by value, it kept a slot of its own in this
/// future (and the task) for the flow's life.
/// The flow runs while its source address belongs to its sandbox, and its
/// sandbox's policy lets it ([`still`]).
async fn splice(
    dp: &Dataplane,
    (stream, peeked, src): (TcpStream, Vec<u8>, std::net::IpAddr),
    (accepted, still): (&Accepted, &still::StillAllowed<'_>),
    meter: Option<crate::budget::Meter>,
) -> Result<crate::spliced::Spliced, String> {
    use crate::fault::Fault;
    let config = dp.config();
    let route = dp.proxies.route(accepted.sandbox.upstream_proxy.as_ref());
    let to = (accepted.dst, &route);
    let stop = || {
        if dp.drain_over.load(std::sync::atomic::Ordering::Acquire) {
            return Some(Fault::DRAIN_DEADLINE);
        }
        match dp.registry.lookup(src) {
            Some(now) if now.id == accepted.sandbox.id && now.serial == accepted.sandbox.serial => {
                (!still.under(&now.policy, &dp.doh_names)).then_some(Fault::POLICY_WITHDRAWN)
            }
            _ => Some(Fault::SANDBOX_REMOVED),
        }
    };
    let hello = still.hello();
    crate::splice::splice_to(dp, stream, to, (peeked, hello), (&config, meter), stop).await
}

/// A denied flow: `403` with the reason where the protocol allows an answer
/// (plain HTTP), a reset otherwise.
async fn deny(stream: &mut TcpStream, claims: &Claims<'_>, verdict: &Verdict, accepted: &Accepted) {
    if claims.protocol == Protocol::Http {
        let denial = crate::reply::Denial {
            status: http::StatusCode::FORBIDDEN,
            code: verdict.code(),
            rule: verdict.deny_rule(),
            detail: verdict.describe(&accepted.sandbox.policy),
        };
        let _ = stream.write_all(&denial.closing()).await;
        let _ = stream.shutdown().await;
    } else {
        crate::io::reset(stream);
    }
}
