//! The policy's `dns` section applied to a query before it may leave:
//! which types may be asked, and — under `resolve: "policy"` — which names.
//!
//! Without a `dns` section every query is forwarded, as before the section
//! existed. With one, ANY is refused (RFC 8482: REFUSED rather than a
//! synthesised HINFO, so nothing is made up and a client that insists sees
//! why), a type outside `query_types` is refused, and under `resolve:
//! "policy"` a name the policy would never let a flow reach by name is
//! answered NXDOMAIN by the proxy itself: nothing about it goes upstream,
//! so no data encoded in it reaches the name's servers. A question name
//! that is not a hostname (`_svc._tcp.example.test`) cannot match a domain
//! rule, so under `resolve: "policy"` it is NXDOMAIN too (fail closed).

use egress_policy::dns::{Resolve, ANY};
use egress_policy::{CompiledPolicy, NameVerdict};
use hickory_proto::op::Query;

use crate::chain::hostname;

/// What becomes of a query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gate {
    Forward,
    /// REFUSED, with its reason: `query_any` or `query_type`.
    Refuse(&'static str),
    /// NXDOMAIN from the proxy, with its reason: a [`NameVerdict`] code or `not_hostname`.
    NxDomain(&'static str),
}

/// Judges `question` by `policy`'s `dns` section.
pub(crate) fn gate(policy: &CompiledPolicy, question: &Query) -> Gate {
    let Some(dns) = &policy.policy().dns else {
        return Gate::Forward;
    };
    let qtype = u16::from(question.query_type);
    if !dns.permits_type(qtype) {
        return Gate::Refuse(if qtype == ANY {
            "query_any"
        } else {
            "query_type"
        });
    }
    if dns.resolve == Resolve::Policy {
        let Some(name) = hostname(&question.name) else {
            return Gate::NxDomain("not_hostname");
        };
        match policy.judge_name(&name) {
            NameVerdict::Resolve => {}
            denied => return Gate::NxDomain(denied.code()),
        }
    }
    Gate::Forward
}
