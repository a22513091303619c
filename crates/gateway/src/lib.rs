//! The live slackgate gateway: an OpenAI-compatible HTTP proxy that asks the pure admission
//! core (`slackgate-core`) about every request before it is queued, and performs what the
//! core decides: forward, reject with 429 and an honest Retry-After, or drop.
//!
//! The crate is layered; a module imports only from the layers listed before it
//! (`scripts/check-structure.py` fails CI on an import that points up). Bottom to top:
//!
//! - [`support`]: the clock and keyed tenant ids.
//! - [`wire`]: what crosses the wire: header rules, upstream URLs, what a request asks for,
//!   every response body the gate writes.
//! - [`config`]: the TOML file.
//! - [`ledger_store`]: where the token ledger is kept (memory, SQLite, Redis).
//! - [`upstream`]: the client side: transports, TLS, auth, provider throttles, error causes.
//! - [`observe`]: the decision log and the Prometheus metrics.
//! - [`http`]: the server side of a connection: limits, timeouts, the write-stall guard.
//! - [`engine`]: the core behind its lock, the job guard, slot signals, endpoint health, the
//!   replica's role.
//! - [`pipeline`]: the request path, one chat completion (or reservation) in named phases.
//! - [`cluster`]: replicas sharing one gate; wraps the pipeline as a handler it is given.
//! - [`ops`]: operator controls and reloads, the admin API, stats, server scrapes.
//! - [`server`]: wires them together: listeners, tasks, lifecycle.
//!
//! docs/architecture.md walks one request through them.

#![forbid(unsafe_code)]

pub mod cluster;
pub mod config;
pub mod engine;
pub mod http;
pub mod ledger_store;
pub mod observe;
pub mod ops;
pub mod pipeline;
pub mod server;
pub mod support;
pub mod upstream;
pub mod wire;

pub use config::Config;
pub use observe::telemetry::DecisionLog;
pub use server::{run, run_with, Gateway, GatewayOptions};
