//! Egress policy: destinations and their normal form, the tenant/effective
//! policy model, operator profiles (`SPACE_EGRESS_PROFILES`), deployment TLS
//! exemptions (`SPACE_TLS_INTERCEPTION_EXEMPTIONS`), profile selection
//! (`X-Space-Egress-Profiles`), composition, the compiled per-flow matcher,
//! and the machine (L4) egress policy of user-mode VMs ([`machine`]).
//!
//! Pure: no I/O, no async, no clock. The gateway and the controller both
//! build on it; everything that reads the network or the environment lives
//! in them and hands this crate strings and facts.

pub mod budget;
mod compose;
mod dest;
pub mod dns;
pub mod duration;
mod exemptions;
pub mod http;
mod json;
pub mod machine;
mod matcher;
mod name;
mod platform;
mod policy;
mod profiles;
pub mod proposals;
mod rule;
mod sandbox;
mod select;
mod stream;

pub use budget::{Budget, BudgetDestination, Budgets};
pub use compose::{compose, resolve_saved, Composed, MissingProfile, RESERVED_RESOLVERS};
pub use dest::{
    embedded_ipv4, Destination, DestinationError, ExemptionDestination, Kind, KindList,
    ProfileDestination,
};
pub use dns::{DnsBudget, DnsPolicy, QueryType, QueryTypes, Rate, Resolve};
pub use exemptions::{DeploymentExemptions, ExemptionsError, EXEMPTIONS_ENV};
pub use json::{parse as from_json, value as json_value, JsonError};
pub use matcher::{
    Allowed, AttributionGap, CompiledPolicy, Denied, EncryptedDns, Flow, Intercepted, NameVerdict,
    PlatformDenies, Protocol, RequestCode, RequestDenial, RequestJudgement, RuleRef, Spliced,
    Verdict,
};
pub use name::{server_name, Hostname, NameError, WildcardDomain};
pub use platform::{default_denies, DEFAULT_PLATFORM_DENY_CIDRS};
pub use policy::{DefaultAction, Policy, TlsInterception};
pub use profiles::{Profile, ProfileName, Profiles, ProfilesError, PROFILES_ENV};
pub use rule::Rule;
pub use sandbox::{SandboxId, SandboxIdError};
pub use select::{
    select, Admission, AdmissionReason, Outcome, Selection, SelectionError, SelectionErrorKind,
    PROFILES_HEADER, UNKNOWN_PROFILE_LABEL,
};
pub use stream::{OpaqueStreams, StreamProtocol, Streams};
