//! Time as the gateway reads it. The core takes `now` as an argument; everything that gives
//! it one reads this [`Clock`], built on tokio's clock, so a test on tokio's paused time
//! (`#[tokio::test(start_paused = true)]`) moves the gate's time with `tokio::time::advance`.

use slackgate_core::Millis;
use tokio::time::Instant;

/// Milliseconds since the Unix epoch (the log's `ts_ms`); 0 if the clock is before 1970.
pub fn epoch_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The core's clock: epoch milliseconds that only ever move forward.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    start: Instant,
    start_epoch_ms: Millis,
}

impl Clock {
    /// A clock starting now.
    pub fn new() -> Clock {
        Clock {
            start: Instant::now(),
            start_epoch_ms: epoch_ms(),
        }
    }

    /// Epoch milliseconds, advanced by the monotonic clock since start: it never runs
    /// backwards (NTP steps do not move it), and it stays comparable with times persisted by
    /// an earlier run, which the ledger's hold TTLs need after a restart.
    pub fn now_ms(&self) -> Millis {
        self.start_epoch_ms
            .saturating_add(self.start.elapsed().as_millis() as Millis)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}
