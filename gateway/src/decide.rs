//! The one decision function. The dataplane (per flow), the intercept path
//! (per request), DNS admission, the admin explain route and the explain CLI
//! all judge here, so explain cannot disagree with enforcement.

use std::net::SocketAddr;

use dns_attrib::{AttributionCache, Lookup};
use egress_policy::SandboxId;
use egress_policy::{
    AttributionGap, CompiledPolicy, Flow, Hostname, Protocol, StreamProtocol, Verdict,
};

use crate::doh::DohNames;
use serde_json::{json, Value};

/// What a flow claims: where it goes, what it speaks, and the names it gives.
/// Names arrive validated (the peek and the authority check refuse any that
/// read two ways).
#[derive(Clone, Copy, Debug)]
pub struct Claims<'a> {
    pub dst: SocketAddr,
    pub protocol: Protocol,
    pub sni: Option<&'a Hostname>,
    pub host: Option<&'a Hostname>,
    /// The ClientHello carries `encrypted_client_hello`: `sni` is its outer name.
    pub ech: bool,
}

/// A flow judged against the live attribution.
#[derive(Debug)]
pub struct Decided {
    pub verdict: Verdict,
    /// The attribution it was judged on (names through [`Lookup::names`]).
    pub lookup: Lookup,
}

impl<'a> Claims<'a> {
    /// The claims of an explain question: TLS when it says so (with `ech`
    /// when its hello carries `encrypted_client_hello`), HTTP when it names
    /// a Host, unreadable opaque bytes otherwise.
    pub fn asked(
        dst: SocketAddr,
        tls: bool,
        ech: bool,
        sni: Option<&'a Hostname>,
        host: Option<&'a Hostname>,
    ) -> Self {
        let protocol = match (tls, host) {
            (true, _) => Protocol::Tls,
            (false, Some(_)) => Protocol::Http,
            (false, None) => Protocol::Opaque(None),
        };
        Self {
            dst,
            protocol,
            sni,
            host,
            ech: tls && ech,
        }
    }

    /// These claims, where they are not TLS, as HTTP whose `Host` names an
    /// address (`address_host`): HTTP with no name, as the peek reads such
    /// a request.
    pub fn with_address_host(mut self, address_host: bool) -> Self {
        if address_host && !matches!(self.protocol, Protocol::Tls) {
            self.protocol = Protocol::Http;
        }
        self
    }

    /// These claims, where they are an opaque stream, as one of `kind` (the
    /// protocol the peek would name; `None`: unreadable).
    pub fn with_stream(mut self, kind: Option<StreamProtocol>) -> Self {
        if let Protocol::Opaque(_) = self.protocol {
            self.protocol = Protocol::Opaque(kind);
        }
        self
    }
}

/// Judges `claims` under `policy`, on what sandbox `id`'s DNS through the
/// reserved resolvers attributes to the destination now.
pub fn decide(
    cache: &AttributionCache,
    id: &SandboxId,
    policy: &CompiledPolicy,
    claims: &Claims<'_>,
    doh: &DohNames,
) -> Decided {
    let lookup = cache.names_for(id, claims.dst.ip());
    let verdict = judge(policy, claims, &lookup.names(), lookup.gap(), doh);
    Decided { verdict, lookup }
}

/// An explain question's verdict, judged as the dataplane judges it: a TLS
/// flow on its ClientHello alone, with no `Host` (a deny, or a splice, is
/// then the whole answer: a spliced flow's requests are never seen), and
/// only a flow that will be terminated again with its request's `Host`.
pub fn judge_question(
    policy: &CompiledPolicy,
    claims: &Claims<'_>,
    attributed: &[Hostname],
    gap: AttributionGap,
    doh: &DohNames,
) -> Verdict {
    if claims.protocol == Protocol::Tls && claims.host.is_some() {
        let hello = Claims {
            host: None,
            ..*claims
        };
        let flow = judge(policy, &hello, attributed, gap, doh);
        if !matches!(flow, Verdict::Intercept(..)) {
            return flow;
        }
    }
    judge(policy, claims, attributed, gap, doh)
}

/// Judges `claims` on the attribution given (`gap`: why `attributed` is
/// empty); `doh` tells encrypted DNS from other TLS.
pub fn judge(
    policy: &CompiledPolicy,
    claims: &Claims<'_>,
    attributed: &[Hostname],
    gap: AttributionGap,
    doh: &DohNames,
) -> Verdict {
    let encrypted_dns = match claims.protocol {
        Protocol::Tls => doh.kind(claims.dst, claims.sni.or(claims.host), attributed),
        Protocol::Http | Protocol::Opaque(_) => DohNames::by_port(claims.dst),
        Protocol::Dns => None,
    };
    policy.decide(&Flow {
        dst: claims.dst,
        protocol: claims.protocol,
        sni: claims.sni,
        host: claims.host,
        attributed,
        attribution_gap: gap,
        encrypted_dns,
        ech: claims.ech,
    })
}

/// The explain answer, the same for the API and the CLI: the verdict, its
/// code, the readable reason naming the rule, and the names judged on.
pub fn explained(verdict: &Verdict, policy: &CompiledPolicy, attributed: &[Hostname]) -> Value {
    json!({
        "verdict": verdict.name(),
        "reason": verdict.code(),
        "detail": verdict.describe(policy),
        "attributed": attributed.iter().map(ToString::to_string).collect::<Vec<_>>(),
    })
}

/// The names a request is judged by per-request rules on: its own name
/// alone where the origin's certificate verifies it (terminated TLS), and
/// every name the address may be where it is only a claim (plain HTTP) or
/// absent (an address for authority).
pub fn request_names<'a>(
    tls: bool,
    host: Option<&'a Hostname>,
    attributed: &'a [Hostname],
) -> Vec<&'a Hostname> {
    let mut names: Vec<&Hostname> = host.into_iter().collect();
    if !tls || host.is_none() {
        names.extend(attributed.iter().filter(|n| Some(*n) != host));
    }
    names
}

/// The headers some frameworks take a request's method from instead of its
/// request line. Names, not strings: a lookup by a string parses it first.
static METHOD_OVERRIDES: [http::HeaderName; 3] = [
    http::HeaderName::from_static("x-http-method-override"),
    http::HeaderName::from_static("x-http-method"),
    http::HeaderName::from_static("x-method-override"),
];

/// Names the gateway reads, rewrites or strips, which an origin that takes
/// `_` for `-` in a header name could read another header as: `Host`, the
/// framing and connection-specific headers, the method overrides.
const JUDGED_NAMES: [&str; 13] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// A header name as an origin that takes `_` for `-` reads it (Puma, CGI
/// and FastCGI bridges, which name headers `HTTP_X_Y`); borrowed when it
/// has no `_`. Header names are lower-case already.
pub(crate) fn folded(name: &str) -> std::borrow::Cow<'_, str> {
    match name.contains('_') {
        true => std::borrow::Cow::Owned(name.replace('_', "-")),
        false => std::borrow::Cow::Borrowed(name),
    }
}

/// A header name of the request with `_` in it that such an origin reads
/// as a name the gateway judges ([`JUDGED_NAMES`]) or as another header
/// the request carries: `X-HTTP-Method_Override: DELETE` is a `DELETE` to
/// Rails on Puma, which the gateway would judge as the request's own
/// method. The name, to refuse the request with; `None` for the usual
/// request, whose names have no `_`.
pub fn folded_twin(headers: &http::HeaderMap) -> Option<&str> {
    let names = || headers.keys().map(http::HeaderName::as_str);
    if !names().any(|n| n.contains('_')) {
        return None;
    }
    // Each name folded once (an HTTP/2 request may carry thousands), and
    // how many read alike.
    let read: Vec<(&str, std::borrow::Cow<'_, str>)> = names().map(|n| (n, folded(n))).collect();
    let mut alike: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (_, f) in &read {
        *alike.entry(f.as_ref()).or_default() += 1;
    }
    let twin = |f: &str| alike.get(f).is_some_and(|&n| n > 1) || JUDGED_NAMES.contains(&f);
    read.iter()
        .find(|(n, f)| n.contains('_') && twin(f))
        .map(|(n, _)| *n)
}

/// Headers that have an origin route a request by another path than its
/// target's (IIS URL Rewrite, Zend Framework 1 and Symfony's legacy
/// request reading honour them).
const PATH_OVERRIDES: [&str; 2] = ["x-original-url", "x-rewrite-url"];

/// A header of the request naming a path other than its target's (as
/// written, or read with `_` for `-`): where per-request rules judge the
/// target, such a request is refused rather than judged on a path its
/// origin may not act on. `None` for the usual request.
pub fn path_override(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .keys()
        .map(http::HeaderName::as_str)
        .find(|n| n.starts_with('x') && PATH_OVERRIDES.contains(&folded(n).as_ref()))
}

/// Most methods a request's overrides may name besides its own; a request
/// naming more is refused (`400`) rather than judged once for each.
pub const MAX_OVERRIDES: usize = 16;

/// Every method a request's overrides name, as sent: its override headers'
/// values and its query's `_method` parameters (Laravel, Symfony and
/// Express's method-override read them), decoded, without what is not a
/// visible ASCII character at either end (a reader trims blanks, and a
/// byte that is not UTF-8 may be one to it: Node reads `\xA0` as a
/// no-break space). A query key is read as PHP reads it
/// ([`is_method_key`]), so `.method`, ` _method` and `_method%00x` count
/// too. A value with a comma names its whole and each of its
/// comma-separated items: Express's and Koa's method-override take the
/// first item of `DELETE, GET`, another reader the whole. Read lazily: a
/// value of many items is never held as many strings.
pub fn override_values<'a>(
    headers: &'a http::HeaderMap,
    target: &'a str,
) -> impl Iterator<Item = std::borrow::Cow<'a, str>> + 'a {
    let from_headers = METHOD_OVERRIDES
        .iter()
        .flat_map(|name| headers.get_all(name))
        .map(|v| String::from_utf8_lossy(v.as_bytes()));
    let query = target.split_once('?').map_or("", |(_, q)| q);
    let from_query = form_urlencoded::parse(query.as_bytes())
        .filter(|(k, _)| is_method_key(k))
        .map(|(_, v)| v);
    from_headers
        .chain(from_query)
        .flat_map(|value| Readings { value, at: None })
}

/// An override value's readings ([`override_values`]): the whole, then,
/// if it has a comma, each item that is not empty.
struct Readings<'a> {
    value: std::borrow::Cow<'a, str>,
    /// Where the next item starts; `None` before the whole.
    at: Option<usize>,
}

impl<'a> Iterator for Readings<'a> {
    type Item = std::borrow::Cow<'a, str>;

    fn next(&mut self) -> Option<Self::Item> {
        use std::borrow::Cow;
        loop {
            let text: &str = &self.value;
            let (start, end, whole) = match self.at {
                None => (0, text.len(), true),
                Some(at) if at > text.len() => return None,
                Some(at) => (
                    at,
                    text[at..].find(',').map_or(text.len(), |e| at + e),
                    false,
                ),
            };
            self.at = Some(match whole {
                true if text.contains(',') => 0,
                true => usize::MAX,
                false => end + 1,
            });
            let piece = &text[start..end];
            let visible = |c: char| !c.is_ascii_graphic();
            let lead = piece.len() - piece.trim_start_matches(visible).len();
            let kept = piece.trim_matches(visible).len();
            if kept == 0 && !whole {
                continue;
            }
            let (from, to) = (start + lead, start + lead + kept);
            return Some(match &self.value {
                Cow::Borrowed(b) => Cow::Borrowed(&b[from..to]),
                Cow::Owned(o) => Cow::Owned(o[from..to].to_owned()),
            });
        }
    }
}

/// Whether a query key is `_method` as PHP's `$_GET` reads it (up to its
/// first NUL, leading blanks dropped, `.` and blanks taken for `_`), or an
/// override header's name, as ASP.NET reads it.
fn is_method_key(key: &str) -> bool {
    // ASP.NET reads an override header's name in the query string too,
    // case ignored (`?X-HTTP-Method-Override=DELETE`).
    if METHOD_OVERRIDES
        .iter()
        .any(|h| key.eq_ignore_ascii_case(h.as_str()))
    {
        return true;
    }
    let key = key.split('\0').next().unwrap_or("");
    let key = key.trim_start_matches(' ');
    key.len() == "_method".len()
        && key
            .bytes()
            .zip("_method".bytes())
            .all(|(k, m)| k == m || (m == b'_' && matches!(k, b'.' | b' ')))
}

/// The methods a request may be taken for besides its own `method`
/// ([`override_values`]), each once (case ignored). At most
/// [`MAX_OVERRIDES`] + 1 are collected: one more than the cap says the
/// request names too many.
pub fn method_overrides(method: &str, headers: &http::HeaderMap, target: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for m in override_values(headers, target) {
        let seen = m.eq_ignore_ascii_case(method) || out.iter().any(|o| o.eq_ignore_ascii_case(&m));
        if !seen {
            out.push(m.into_owned());
            if out.len() > MAX_OVERRIDES {
                break;
            }
        }
    }
    out
}

/// Judges a request under `policy` for its `method` and each method its
/// `overrides` name: a refusal of any one refuses it. The judgement, and
/// the method it names (the refused one, else the request's own).
pub fn judge_methods<'m>(
    policy: &CompiledPolicy,
    names: &[&Hostname],
    (method, overrides): (&'m str, &'m [String]),
    target: &str,
) -> (egress_policy::RequestJudgement, &'m str) {
    let mut judged = policy.judge_request(names, method, target);
    let mut named = method;
    for other in overrides {
        if judged.deny.is_some() {
            break;
        }
        let o = policy.judge_request(names, other, target);
        if o.deny.is_some() {
            (judged, named) = (o, other.as_str());
        }
    }
    (judged, named)
}

/// The explain answer for one request on a flow that is let through:
/// `allow` or `deny` with the code, the rule's index and text, and what an
/// audited rule would have refused.
pub fn explained_request(
    policy: &CompiledPolicy,
    tls: bool,
    host: Option<&Hostname>,
    attributed: &[Hostname],
    method: &str,
    target: &str,
) -> Value {
    let names = request_names(tls, host, attributed);
    // An explain question has no headers: the path's `_method` is all.
    let overrides = method_overrides(method, &http::HeaderMap::new(), target);
    let (judged, refused) = judge_methods(policy, &names, (method, &overrides), target);
    let show = |d: &egress_policy::RequestDenial| {
        json!({
            "reason": d.code.as_str(),
            "rule": d.rule.index(),
            "detail": policy.describe_request(d),
        })
    };
    let mut v = match &judged.deny {
        Some(d) => {
            let mut v = show(d);
            v["verdict"] = json!("deny");
            v
        }
        None => json!({"verdict": "allow"}),
    };
    v["method"] = json!(method);
    v["path"] = json!(target);
    if refused != method {
        // The method an override named, which the refusal is for.
        v["override"] = json!(refused);
    }
    if let Some(w) = &judged.would_deny {
        v["would_deny"] = show(w);
    }
    v
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use egress_policy::{AttributionGap, CompiledPolicy, Hostname, PlatformDenies, Policy};

    use super::{
        explained_request, judge, judge_methods, judge_question, method_overrides, Claims,
    };
    use crate::doh::DohNames;

    /// Explain judges a TLS question with a `Host` as the dataplane does:
    /// the flow on its ClientHello first, the `Host` only on a flow that
    /// will be terminated.
    #[test]
    fn a_tls_questions_host_counts_only_once_the_flow_is_terminated() {
        let host = Hostname::parse("api.test").expect("name");
        let claims = Claims::asked(
            "203.0.113.7:443".parse().expect("dst"),
            true,
            false,
            None,
            Some(&host),
        );
        let codes = |doc: &str| {
            let policy = CompiledPolicy::new(
                Policy::from_json(doc).expect(doc),
                Arc::new(PlatformDenies::builtin()),
            );
            let gap = AttributionGap::NoDnsSeen;
            let doh = DohNames::empty();
            let asked = judge_question(&policy, &claims, &[], gap, &doh);
            let whole = judge(&policy, &claims, &[], gap, &doh);
            (asked.code().to_owned(), whole.code().to_owned())
        };
        // Allowed by name, no DNS seen: a hello without an SNI is refused
        // before any request could name the host.
        let (asked, whole) =
            codes(r#"{"allow": [{"domain": "api.test"}], "tls_interception": "on"}"#);
        assert_eq!(
            (asked.as_str(), whole.as_str()),
            ("no_dns_seen", "needs_verification")
        );
        // Interception off: the flow is spliced, its Host never read.
        let (asked, whole) = codes(r#"{"default": "allow", "deny": [{"domain": "api.test"}]}"#);
        assert_eq!(
            (asked.as_str(), whole.as_str()),
            ("interception_off", "tenant_deny")
        );
        // Terminated: each request is judged with its Host.
        let (asked, _) = codes(
            r#"{"default": "allow", "deny": [{"domain": "api.test"}], "tls_interception": "on"}"#,
        );
        assert_eq!(asked, "tenant_deny");
    }

    /// Explain judges the methods a request's `_method` names, as the
    /// dataplane does; and the override values are read as the frameworks
    /// read them.
    #[test]
    fn explain_judges_a_paths_method_override() {
        let policy = CompiledPolicy::new(
            Policy::from_json(
                r#"{"allow": [{"domain": "api.test"}], "tls_interception": "on",
                    "deny": [{"domain": "api.test", "http": {"methods": ["DELETE"]}}]}"#,
            )
            .expect("policy"),
            Arc::new(PlatformDenies::builtin()),
        );
        let host = Hostname::parse("api.test").expect("name");
        let asked = |path: &str| {
            let v = explained_request(&policy, true, Some(&host), &[], "POST", path);
            (
                v["verdict"].as_str().unwrap_or("").to_owned(),
                v["override"].clone(),
            )
        };
        assert_eq!(asked("/x"), ("allow".to_owned(), serde_json::Value::Null));
        assert_eq!(
            asked("/x?_method=DELETE"),
            ("deny".to_owned(), serde_json::json!("DELETE"))
        );
        let headers = http::HeaderMap::new();
        for (target, found) in [
            ("/x?.method=delete", vec!["delete"]),
            ("/x?+_method=PUT&_method=put&x=1", vec!["PUT"]),
            ("/x?_method=POST", vec![]),
            // ASP.NET: the header's name as a query key, case ignored.
            ("/x?X-HTTP-Method-Override=DELETE", vec!["DELETE"]),
            (
                "/x?x-http-method=put&X-Method-Override=PATCH",
                vec!["put", "PATCH"],
            ),
            ("/x?method=DELETE&_methods=DELETE", vec![]),
            // PHP reads a key up to its NUL.
            ("/x?_method%00x=DELETE", vec!["DELETE"]),
            // Express reads the first item, another reader the whole.
            (
                "/x?_method=DELETE,%20GET",
                vec!["DELETE, GET", "DELETE", "GET"],
            ),
            // A byte that is not UTF-8 (Node's no-break space) at an end.
            ("/x?_method=DELETE%A0", vec!["DELETE"]),
            ("/x?_method=%0BDELETE%09,,", vec!["DELETE\t,,", "DELETE"]),
        ] {
            assert_eq!(
                method_overrides("POST", &headers, target),
                found,
                "{target}"
            );
        }
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "x-http-method-override",
            http::HeaderValue::from_static(" DELETE ,GET,, "),
        );
        assert_eq!(
            method_overrides("POST", &headers, "/x"),
            ["DELETE ,GET,,", "DELETE", "GET"]
        );
        let overrides = method_overrides("POST", &headers, "/x");
        let (judged, named) = judge_methods(&policy, &[&host], ("POST", &overrides), "/x");
        assert!(judged.deny.is_some(), "the DELETE in the list is refused");
        assert_eq!(named, "DELETE");
    }
}
