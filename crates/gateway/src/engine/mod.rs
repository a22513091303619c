//! The core behind its lock: waiting jobs, the job guard that settles each exactly once,
//! slot signals, endpoint health.

pub mod body;
pub mod controls;
pub mod health;
pub mod job;
pub mod ledger;
pub mod lines;
pub mod pump;
pub mod replica;
pub mod start;
pub mod state;
pub mod unqueued;
