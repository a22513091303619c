//! The server's own queue as a signal: the gateway side of `[pools.server_metrics]`.
//!
//! One task owns the scrapers (see [`crate::ops::scrape`]): at start, and after every applied
//! reload, it stops the old set and starts one scraper per endpoint of every pool that asks
//! for its server's metrics, through that pool's client and with its credentials. Each good
//! reading goes to the core (`Gate::set_server_reading`), valid for the pool's `stale_ms`;
//! a failed scrape leaves the last reading to go stale on its own, so one lost scrape does not
//! blind the gate, and a dead metrics endpoint returns it to its own view within `stale_ms`.
//! Every scrape is counted in `slackgate_server_metrics_scrapes_total` by outcome.

use crate::engine::state::Shared;
use crate::ops::scrape::{
    ScrapeCallback, ScrapeError, ScrapeJob, ScrapeTarget, Scrapers, ServerReading,
};
use http::HeaderMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often the task looks for a reload.
const RELOAD_CHECK: Duration = Duration::from_millis(250);

/// Apply one scrape's outcome: a good reading goes to the core, valid for `valid_ms`.
pub fn server_reading(
    shared: &Shared,
    target: &ScrapeTarget,
    result: Result<ServerReading, ScrapeError>,
    valid_ms: u64,
) {
    let outcome = match &result {
        Ok(_) => "ok",
        Err(e) => e.reason.as_str(),
    };
    shared
        .metrics
        .scrape(&target.pool, &target.endpoint, outcome);
    let Ok(r) = result else { return };
    shared.with_core(|st, now, _| {
        let Some(pool) = st.gate.pool_id(&target.pool) else {
            return;
        };
        if let Some(endpoint) = st.gate.endpoint_id(pool, &target.endpoint) {
            st.gate
                .set_server_reading(now, pool, endpoint, Some((r.running, r.waiting)), valid_ms);
        }
    });
}

/// The scrapers of the configuration in force.
fn start(shared: &Arc<Shared>) -> Vec<Scrapers> {
    let mut out = Vec::new();
    for pool in shared.control.pools() {
        let Some(metrics) = &pool.server_metrics else {
            continue;
        };
        let jobs = match ScrapeJob::for_pool(&pool) {
            Ok(jobs) => jobs,
            Err(e) => {
                // Validated with the config; a job that still cannot be built is reported.
                tracing::warn!("not reading the server's metrics: {e}");
                continue;
            }
        };
        let transport = shared.transports.for_pool(&pool.name);
        let mut auth = HeaderMap::new();
        transport.auth.apply(&mut auth, None);
        let jobs = jobs
            .into_iter()
            .map(|j| j.with_headers(auth.clone()))
            .collect();
        let valid_ms = metrics.stale_ms;
        let weak: Weak<Shared> = Arc::downgrade(shared);
        let on_result: ScrapeCallback = Arc::new(move |target, result| {
            if let Some(s) = weak.upgrade() {
                server_reading(&s, &target, result, valid_ms);
            }
        });
        out.push(Scrapers::start(&transport.client, jobs, on_result));
    }
    out
}

/// Run the scrapers, restarting them after each applied reload; aborted at shutdown (the
/// scrapers stop when dropped).
pub(crate) async fn run(shared: Arc<Shared>) {
    let mut generation = shared.control.generation();
    let mut scrapers = start(&shared);
    let mut tick = tokio::time::interval(RELOAD_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = shared.control.generation();
        if now == generation {
            continue;
        }
        generation = now;
        for s in scrapers.drain(..) {
            s.stop().await;
        }
        scrapers = start(&shared);
    }
}
