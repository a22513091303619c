//! A one-line progress bar on a terminal's stderr while a drill runs; nothing otherwise (CI).

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Counters the clients bump.
#[derive(Debug, Default)]
pub struct Counters {
    sent: AtomicU64,
    answered: AtomicU64,
    /// The most a client woke after the moment it was due to send (microseconds).
    late_us: AtomicU64,
}

impl Counters {
    /// A client sent its first offer.
    pub fn sent(&self) {
        self.sent.fetch_add(1, Ordering::Relaxed);
    }

    /// A client has its final answer.
    pub fn answered(&self) {
        self.answered.fetch_add(1, Ordering::Relaxed);
    }

    /// A client woke `by` after the moment it was due to send (a starved machine's mark:
    /// the drill's timers, the stub's and the gate's all fire late alike).
    pub fn late(&self, by: Duration) {
        let us = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
        self.late_us.fetch_max(us, Ordering::Relaxed);
    }

    /// The most any client woke late, in real milliseconds.
    pub fn latest_ms(&self) -> f64 {
        self.late_us.load(Ordering::Relaxed) as f64 / 1000.0
    }

    /// (sent, answered).
    pub fn get(&self) -> (u64, u64) {
        (
            self.sent.load(Ordering::Relaxed),
            self.answered.load(Ordering::Relaxed),
        )
    }
}

/// Whether a bar should be drawn: stderr is a terminal and `CI` is not set.
pub fn wanted() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("CI").is_none()
}

/// Draw the bar every 200 ms until the task is aborted.
pub fn spawn(label: String, total: u64, c: Arc<Counters>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let start = std::time::Instant::now();
        loop {
            let (sent, answered) = c.get();
            let width = 30u64;
            let filled = (answered * width)
                .checked_div(total)
                .unwrap_or(0)
                .min(width);
            let bar: String = (0..width)
                .map(|i| if i < filled { '#' } else { '.' })
                .collect();
            {
                let mut err = std::io::stderr().lock();
                let _ = write!(
                    err,
                    "\r{label:<9} [{bar}] {answered}/{total} answered, {sent} sent, {:.1} s ",
                    start.elapsed().as_secs_f64()
                );
                let _ = err.flush();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

/// Erase the bar's line.
pub fn clear() {
    let mut err = std::io::stderr().lock();
    let _ = write!(err, "\r{:<90}\r", "");
    let _ = err.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_send_is_kept() {
        let c = Counters::default();
        assert_eq!(c.latest_ms(), 0.0);
        c.late(Duration::from_micros(5_500));
        c.late(Duration::from_millis(2));
        assert_eq!(c.latest_ms(), 5.5);
    }
}
