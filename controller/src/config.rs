//! What both roles read at start: the operator profiles and the deployment
//! exemptions from the environment, and the tenants file. Invalid
//! configuration stops the process with an error naming the variable, the
//! profile and the field — before a dispatcher standby tries to lead.

use std::collections::HashMap;
use std::path::Path;

use egress_policy::{DeploymentExemptions, Profiles, EXEMPTIONS_ENV, PROFILES_ENV};
use serde::Deserialize;

/// The deployment's composition inputs.
#[derive(Clone, Debug, Default)]
pub struct Deployment {
    pub profiles: Profiles,
    /// `None`: exemptions disabled (variable unset).
    pub exemptions: Option<DeploymentExemptions>,
}

impl Deployment {
    /// From `SPACE_EGRESS_PROFILES` and `SPACE_TLS_INTERCEPTION_EXEMPTIONS`.
    pub fn from_env() -> Result<Self, String> {
        Self::from_values(
            std::env::var(PROFILES_ENV).ok().as_deref(),
            std::env::var(EXEMPTIONS_ENV).ok().as_deref(),
        )
    }

    /// From the two variables' values (`None`: unset).
    pub fn from_values(profiles: Option<&str>, exemptions: Option<&str>) -> Result<Self, String> {
        Ok(Self {
            profiles: Profiles::from_env_value(profiles).map_err(|e| e.to_string())?,
            exemptions: DeploymentExemptions::from_env_value(exemptions)
                .map_err(|e| e.to_string())?,
        })
    }
}

/// Who a bearer token is.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    pub tenant: String,
    /// Federated tenants may select profiles with `X-Space-Egress-Profiles`.
    #[serde(default)]
    pub federated: bool,
    /// Admins manage templates and workers and see every sandbox.
    #[serde(default)]
    pub admin: bool,
    /// Who holds the token (a person or a service), recorded with each
    /// approval; absent: `tenant:<tenant>`.
    #[serde(default)]
    pub principal: Option<String>,
    /// Sandboxes the tenant may hold at once (not destroyed or failed),
    /// counted over all its tokens; a create, fork or warm-pool claim past
    /// it is `429`. One tenant would otherwise take every worker's
    /// addresses.
    #[serde(default = "default_max_sandboxes")]
    pub max_sandboxes: u32,
}

/// A tenant's `max_sandboxes` when its token does not say.
pub const DEFAULT_MAX_SANDBOXES: u32 = 1_000;

fn default_max_sandboxes() -> u32 {
    DEFAULT_MAX_SANDBOXES
}

impl Tenant {
    /// The identity an approval records.
    pub fn principal(&self) -> String {
        self.principal
            .clone()
            .unwrap_or_else(|| format!("tenant:{}", self.tenant))
    }
}

/// The tokens file: `{"tokens": {"<token>": {"tenant", "federated", "admin", "principal", "max_sandboxes"}}}`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenants {
    tokens: HashMap<String, Tenant>,
}

/// A token as errors show it: its first four characters.
fn shown(token: &str) -> String {
    format!("{}…", token.chars().take(4).collect::<String>())
}

/// `path` with the token in it (`tokens.<token>.<field>`) shortened;
/// `message` says which field a path ends in when it is no field an entry
/// has (an unknown one).
fn redacted(path: &str, message: &str) -> String {
    let Some(rest) = path.strip_prefix("tokens.") else {
        return path.to_owned();
    };
    // A token may hold a dot: only a field the entries have (or an
    // unknown one the parser names in its message) is split off.
    const FIELDS: [&str; 5] = ["tenant", "federated", "admin", "principal", "max_sandboxes"];
    match rest.rsplit_once('.') {
        Some((token, field)) if FIELDS.contains(&field) || unknown(message) == Some(field) => {
            format!("tokens.{}.{field}", shown(token))
        }
        _ => format!("tokens.{}", shown(rest)),
    }
}

/// The field an "unknown field" message names.
fn unknown(message: &str) -> Option<&str> {
    message.strip_prefix("unknown field `")?.split('`').next()
}

/// A parser's message with a key it quotes (a token written twice) shortened.
fn redacted_message(message: &str) -> String {
    match message.strip_prefix("duplicate key `") {
        Some(rest) => format!("duplicate key `{}`", shown(rest.trim_end_matches('`'))),
        None => message.to_owned(),
    }
}

impl Tenants {
    pub fn load(path: &Path) -> Result<Self, String> {
        egress_api::file::warn_if_open("--tenants", path);
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--tenants {}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("--tenants {}: {e}", path.display()))
    }

    /// Reads the tokens file: a token written twice, or anything after the
    /// document, is refused; no error shows more of a token than its first
    /// four characters (the errors reach the logs).
    pub fn parse(text: &str) -> Result<Self, String> {
        let value = egress_policy::json_value(text).map_err(|e| {
            let path = redacted(&e.path, &e.message);
            format!("{path}: {}", redacted_message(&e.message))
        })?;
        let t: Self = serde_path_to_error::deserialize(value).map_err(|e| {
            let message = e.inner().to_string();
            let path = redacted(&e.path().to_string(), &message);
            format!("{path}: {}", redacted_message(&message))
        })?;
        if let Some(short) = t.tokens.keys().find(|k| k.len() < 16) {
            let shown: String = short.chars().take(4).collect();
            return Err(format!(
                "tokens.{shown}…: a token must be at least 16 characters"
            ));
        }
        // The warm pool's sandboxes belong to the tenant "": a token of that
        // tenant would see and act on every one of them.
        if let Some(token) = t
            .tokens
            .iter()
            .find_map(|(k, v)| v.tenant.trim().is_empty().then_some(k))
        {
            let shown: String = token.chars().take(4).collect();
            return Err(format!("tokens.{shown}….tenant: a tenant must be named"));
        }
        Ok(t)
    }

    /// The tenant a bearer token belongs to. Every token is compared, each
    /// in constant time (aws-lc's `CRYPTO_memcmp`), so how long the lookup
    /// takes says nothing of how much of a token was right.
    pub fn get(&self, token: &str) -> Option<&Tenant> {
        let same = |t: &String| {
            aws_lc_rs::constant_time::verify_slices_are_equal(t.as_bytes(), token.as_bytes())
                .is_ok()
        };
        self.tokens.iter().fold(
            None,
            |found, (t, tenant)| if same(t) { Some(tenant) } else { found },
        )
    }

    /// The `max_sandboxes` of `tenant`: the least any of its tokens gives;
    /// `None` when no token names it.
    pub fn max_sandboxes(&self, tenant: &str) -> Option<u32> {
        self.tokens
            .values()
            .filter(|t| t.tenant == tenant)
            .map(|t| t.max_sandboxes)
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_configuration_names_what_is_wrong() {
        let e = Deployment::from_values(Some(r#"{"Bad": {"allow": [{"ip": "1.2.3.4"}]}}"#), None)
            .expect_err("bad name");
        assert!(
            e.contains("SPACE_EGRESS_PROFILES") && e.contains("Bad"),
            "{e}"
        );
        let e = Deployment::from_values(Some(r#"{"s": {"allow": []}}"#), None).expect_err("empty");
        assert!(e.contains("\"s\"") || e.contains("s."), "{e}");
        let e = Deployment::from_values(None, Some("[]")).expect_err("empty list");
        assert!(e.contains("SPACE_TLS_INTERCEPTION_EXEMPTIONS"), "{e}");
        let e = Deployment::from_values(None, Some(r#"[{"cidr": "10.0.0.0/8"}]"#))
            .expect_err("not a hostname");
        assert!(e.contains("SPACE_TLS_INTERCEPTION_EXEMPTIONS"), "{e}");
        assert!(Deployment::from_values(None, None).is_ok());
        assert!(Deployment::from_values(Some("{}"), None).is_ok());
    }

    #[test]
    fn tenants_file() {
        let t = Tenants::parse(
            r#"{"tokens": {"0123456789abcdef": {"tenant": "t1", "federated": true}}}"#,
        )
        .expect("valid");
        assert_eq!(t.get("0123456789abcdef").map(|t| t.federated), Some(true));
        for near in [
            "0123456789abcdeF",
            "0123456789abcde",
            "0123456789abcdef0",
            "",
        ] {
            assert!(t.get(near).is_none(), "{near:?}");
        }
        let e = Tenants::parse(r#"{"tokens": {"short": {"tenant": "t"}}}"#).expect_err("short");
        assert!(e.contains("at least 16"), "{e}");
        let e = Tenants::parse(r#"{"tokens": {"0123456789abcdef": {"tenant": "t", "x": 1}}}"#)
            .expect_err("unknown field");
        assert!(e.contains("x"), "{e}");
        // Errors never show a token whole: a misspelt field, a token
        // twice, anything after the document.
        let secret = "s3cr3t-t0ken-0123456789";
        for (text, says) in [
            (
                format!(r#"{{"tokens": {{"{secret}": {{"tenant": "t", "admn": true}}}}}}"#),
                "tokens.s3cr….admn: unknown field `admn`",
            ),
            (
                format!(
                    r#"{{"tokens": {{"{secret}": {{"tenant": "a"}}, "{secret}": {{"tenant": "b", "admin": true}}}}}}"#
                ),
                "duplicate key `s3cr…`",
            ),
            (
                format!(r#"{{"tokens": {{"{secret}": {{"tenant": "t"}}}}}} {{"x": 1}}"#),
                "trailing characters",
            ),
            (
                r#"{"tokens": {"acme.liveprodkeyabc": "x"}}"#.to_owned(),
                "tokens.acme…: invalid type",
            ),
        ] {
            let e = Tenants::parse(&text).expect_err(says);
            assert!(e.contains(says), "{e}");
            assert!(!e.contains(secret) && !e.contains("liveprod"), "{e}");
        }
        let e = Tenants::parse(r#"{"tokens": {"0123456789abcdef": {"tenant": ""}}}"#)
            .expect_err("unnamed");
        assert!(
            e.contains("tokens.0123….tenant: a tenant must be named"),
            "{e}"
        );
    }
}
