//! The server side of a connection: connection limits and timeouts, the write-stall guard.

pub mod accept;
pub mod body;
pub mod connlimit;
pub mod stall;
