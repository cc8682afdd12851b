//! `SPACE_TLS_INTERCEPTION_EXEMPTIONS`: deployment-configured TLS interception
//! exemptions (spec/tls-interception-exemptions.txt).
//!
//! ```json
//! [{"domain":"relay.example.test"},{"wildcard_domain":"*.relay.example.test"}]
//! ```
//!
//! Unset disables. An empty array, malformed JSON, an invalid domain and any
//! non-hostname destination (IP, CIDR) fail startup. There is no built-in list.

use serde::Serialize;

use crate::dest::ExemptionDestination;
use crate::json::{self, JsonError};

/// The environment variable this module reads.
pub const EXEMPTIONS_ENV: &str = "SPACE_TLS_INTERCEPTION_EXEMPTIONS";

/// The configured exemptions: never empty when present.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct DeploymentExemptions(Vec<ExemptionDestination>);

/// Why `SPACE_TLS_INTERCEPTION_EXEMPTIONS` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExemptionsError {
    #[error("{EXEMPTIONS_ENV}: not valid JSON: {0}")]
    Syntax(JsonError),
    #[error("{EXEMPTIONS_ENV}: {0}")]
    Invalid(JsonError),
    #[error("{EXEMPTIONS_ENV}: empty list: unset the variable to disable exemptions")]
    Empty,
}

impl DeploymentExemptions {
    /// Parses the variable's value; `None` (unset) means disabled.
    pub fn from_env_value(value: Option<&str>) -> Result<Option<Self>, ExemptionsError> {
        let Some(text) = value else { return Ok(None) };
        let list: Vec<ExemptionDestination> = json::parse(text).map_err(|e| {
            if e.syntax {
                ExemptionsError::Syntax(e)
            } else {
                ExemptionsError::Invalid(e)
            }
        })?;
        if list.is_empty() {
            return Err(ExemptionsError::Empty);
        }
        Ok(Some(Self(list)))
    }

    pub fn iter(&self) -> impl Iterator<Item = &ExemptionDestination> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> ExemptionsError {
        DeploymentExemptions::from_env_value(Some(text)).expect_err(text)
    }

    #[test]
    fn unset_disables_and_valid_list_parses() {
        assert_eq!(DeploymentExemptions::from_env_value(None), Ok(None));
        let list = DeploymentExemptions::from_env_value(Some(
            r#"[{"domain":"Relay.example.test."},{"wildcard_domain":"*.relay.example.test"}]"#,
        ))
        .expect("valid")
        .expect("enabled");
        let shown: Vec<String> = list.iter().map(|d| d.get().to_string()).collect();
        assert_eq!(
            shown,
            [
                "domain relay.example.test",
                "wildcard_domain *.relay.example.test"
            ]
        );
    }

    #[test]
    fn refusals() {
        assert_eq!(err("[]"), ExemptionsError::Empty);
        assert!(matches!(err(""), ExemptionsError::Syntax(_)));
        assert!(matches!(
            err("[{\"domain\":\"a.test\"}"),
            ExemptionsError::Syntax(_)
        ));
        assert!(matches!(err("{}"), ExemptionsError::Invalid(_)));

        let cases = [
            (
                r#"[{"domain":"bad..test"}]"#,
                "[0]",
                "invalid domain \"bad..test\"",
            ),
            (
                r#"[{"domain":"a.test"},{"ip":"203.0.113.7"}]"#,
                "[1]",
                "ip destinations are not accepted here: expected one of domain, wildcard_domain",
            ),
            (
                r#"[{"cidr":"203.0.113.0/24"}]"#,
                "[0]",
                "cidr destinations are not accepted here",
            ),
            (r#"[{"domain":"203.0.113.7"}]"#, "[0]", "IP literal"),
            (
                r#"[{"wildcard_domain":"relay.*.test"}]"#,
                "[0]",
                "invalid wildcard_domain",
            ),
            (
                r#"[{"domain":"a.test","note":"x"}]"#,
                "[0]",
                "unsupported selector \"note\"",
            ),
        ];
        for (text, path, needle) in cases {
            let ExemptionsError::Invalid(e) = err(text) else {
                panic!("{text}: expected Invalid");
            };
            assert_eq!(e.path, path, "{text}");
            let shown = ExemptionsError::Invalid(e).to_string();
            assert!(shown.starts_with(EXEMPTIONS_ENV), "{shown}");
            assert!(shown.contains(needle), "{shown} lacks {needle:?}");
        }
    }
}
