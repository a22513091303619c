//! Observability: the JSON decision log and the Prometheus metrics.

pub mod codes;
pub mod metrics;
pub mod telemetry;
