//! The egress controller: the API service and the dispatcher
//! (cluster-controller) of the sandbox egress specs, on PostgreSQL.
//!
//! - [`api`]: creates (native, queued; E2B-style, composed in the API),
//!   network policy replacement, lifecycle, forks, operations, admin routes.
//! - [`dispatcher`]: every replica executes queued operations and pushes
//!   each change to the worker's gateway, the workers split among them by
//!   [`shard`] leases.
//! - [`compose`]: a sandbox's effective policy and where each rule came from;
//!   the rules themselves live in `egress-policy`.
//! - [`shadow_report`]: a template rollout's shadow reports merged.
//! - [`console`]: the operator console's static assets (docs/console.md).
//! - [`pool`]: warm pools refilled in the background (claims: `api`).
//! - [`store`]: the schema (versioned migrations) and every statement.

pub mod api;
pub mod approvals;
pub mod compose;
pub mod config;
pub mod console;
pub mod dispatcher;
pub mod e2b;
pub mod gateway_client;
pub mod ids;
pub mod metrics;
pub mod ops;
pub mod pool;
pub mod shadow_report;
pub mod shard;
pub mod state;
pub mod store;
