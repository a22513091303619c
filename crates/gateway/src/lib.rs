//! The live slackgate gateway: an OpenAI-compatible HTTP proxy that asks the pure admission
//! core (`slackgate-core`) about every request before it is queued, and performs what the
//! core decides: forward, reject with 429 and an honest Retry-After, or drop.
//!
//! Module map: [`config`] (the TOML file), [`request_info`] (what a request asks for),
//! [`state`] (the core behind a lock, waiting requests, one place where transitions are
//! logged), [`proxy`] (the request path), [`body`] (the body wrapper that releases a slot
//! exactly once), [`response`] (every response the gate writes), [`telemetry`] (decision
//! log), [`metrics`] (Prometheus), [`server`] (accept loop and lifecycle), [`stall`] (the
//! write-stall guard that disconnects clients that stop reading), [`connlimit`] (header and
//! idle timeouts, connection caps, overload), [`tenant`] (keyed tenant ids), [`scrape`] (reading
//! a model server's own queue from its Prometheus endpoint).

#![forbid(unsafe_code)]

pub mod admin;
pub mod admission_api;
pub mod body;
pub mod cluster;
pub mod config;
pub mod config_path;
pub mod connlimit;
pub mod control;
pub mod health;
pub mod ledger_store;
pub mod metrics;
pub mod proxy;
pub mod request_info;
pub mod response;
pub mod scrape;
pub mod server;
pub(crate) mod server_limits;
pub mod server_signal;
pub mod stall;
pub mod state;
pub mod stats;
pub mod telemetry;
pub mod tenant;
pub mod upstream;

pub use config::Config;
pub use server::{run, run_with, Gateway, GatewayOptions};
pub use telemetry::DecisionLog;
