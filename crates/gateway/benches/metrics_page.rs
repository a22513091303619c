//! Render time of the `/metrics` page, for comparing two builds of the renderer
//! (`scripts/bench-metrics-page.sh` runs an old and a new build alternately).
//!
//! The state is the golden test's (`tests/metrics_fixture`): `small` is that page as it is (3
//! classes, 2 pools, 4 endpoints: 482 lines), `large` adds 40 classes (3,562
//! lines). Each render starts from its own copy of the gate's snapshot, made outside the
//! clock, as a scrape starts from the snapshot it just took. Prints one line per size:
//! `metrics_page <size> <µs per page, median of the batches> <lines>`.
//!
//! Run: `cargo bench -p slackgate-gateway --bench metrics_page` (batches from
//! `SLACKGATE_BENCH_BATCHES`, default 30).

#[path = "../tests/metrics_fixture/mod.rs"]
mod metrics_fixture;

use metrics_fixture::{fixture, page};
use std::time::{Duration, Instant};

/// Renders per batch are chosen so a batch takes about this long.
const BATCH: Duration = Duration::from_millis(100);

fn main() {
    let batches: usize = std::env::var("SLACKGATE_BENCH_BATCHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    for (size, extra) in [("small", 0), ("large", 40)] {
        let f = fixture(extra);
        let lines = page(&f, f.snap.clone()).lines().count();
        // Calibrate: how many renders fill a batch.
        let t = Instant::now();
        let mut n = 0u32;
        while t.elapsed() < BATCH {
            std::hint::black_box(page(&f, f.snap.clone()));
            n += 1;
        }
        let mut per_page: Vec<f64> = (0..batches)
            .map(|_| {
                let snaps: Vec<_> = (0..n).map(|_| f.snap.clone()).collect();
                let t = Instant::now();
                for s in snaps {
                    std::hint::black_box(page(&f, s));
                }
                t.elapsed().as_secs_f64() * 1e6 / f64::from(n)
            })
            .collect();
        per_page.sort_by(f64::total_cmp);
        let median = per_page[per_page.len() / 2];
        println!("metrics_page {size} {median:.2} {lines}");
    }
}
