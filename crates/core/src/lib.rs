//! The admission core of slackgate: pure, deterministic, and free of I/O.
//!
//! Every function here takes the current time (`now`, milliseconds on one monotonic clock) as an
//! argument; nothing reads a clock, spawns a task or touches a socket. The live gateway and the
//! simulator drive the *same* [`Gate`], so a policy measured in virtual time behaves the same
//! live. The shape follows quinn-proto: inputs go in (`offer`, `on_complete`, `cancel`, `tick`),
//! actions come out (`Decision`s and [`Event`]s to perform).

#![forbid(unsafe_code)]

pub mod config;
pub mod estimator;
pub mod gate;
pub mod ledger;
pub mod reason;
pub mod tokens;

#[cfg(test)]
mod test_rng;

pub use config::{
    ClassConfig, ConfigError, FailMode, GateConfig, OverflowMode, PoolConfig, PriorConfig,
    RetryConfig,
};
pub use estimator::{ErrorSummary, ErrorTracker, Estimate, Estimator, EstimatorSnapshot, Sharing};
pub use gate::ops::{DrainClass, DrainPool, DrainStatus};
pub use gate::reconfigure::ReconfigureReport;
pub use gate::{
    ClassSnapshot, Completed, Completion, Decision, EndpointView, Event, Gate, GateSnapshot, JobId,
    LaneId, PoolId, PoolSnapshot, Request, TenantStats, TENANTS_SHOWN,
};
pub use ledger::{HoldRecord, HoldState};
pub use reason::{Action, Reason};

/// Milliseconds on the caller's monotonic clock. The core never reads a clock itself.
pub type Millis = u64;
