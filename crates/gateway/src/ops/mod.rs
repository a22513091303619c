//! Operations: controls and reloads, the admin API and its live page, stats, and the tasks that read the
//! model servers (queue signal, context window).

pub mod admin;
pub mod control;
pub mod live;
pub mod scrape;
pub mod server_limits;
pub mod server_signal;
pub mod stats;
