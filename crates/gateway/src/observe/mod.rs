//! Observability: the JSON decision log and the Prometheus metrics page.

pub mod codes;
pub mod exposition;
pub mod frames;
pub mod gauges;
pub mod ledger_gauges;
pub mod log_writer;
pub mod metrics;
pub mod telemetry;
