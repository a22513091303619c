//! The servers' context windows, asked of the servers: the gateway side of
//! `[pools.limits] discover`.
//!
//! One task asks every endpoint of every pool that discovers its limits (`discover = true`,
//! or unset with `[pools.server_metrics] kind = "llamacpp"` or `"vllm"`) what its context window
//! is (see [`crate::ops::scrape::limits`]) when the gateway starts, after every applied reload and
//! every `discover_interval_ms`, all endpoints of a pool at once, and gives the core the
//! smallest window its endpoints named (`Gate::set_discovered_context`): a request must fit
//! whichever server it is sent to. An endpoint that does not answer keeps the figure it gave
//! last (the reason goes to stderr when it changes); one that answers without a figure counts
//! for nothing. A pool none of whose endpoints named one, or whose `discover` was turned off,
//! keeps the configured window (or the default).

use crate::engine::state::Shared;
use crate::ops::scrape::limits::discover_context;
use futures_util::future::join_all;
use http::HeaderMap;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How often the task looks for a reload.
const RELOAD_CHECK: Duration = Duration::from_millis(250);

/// How long one question to one server may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// What the task remembers between rounds.
#[derive(Default)]
struct Known {
    /// (pool, endpoint url) -> the window it named last.
    said: HashMap<(String, String), u32>,
    /// (pool, endpoint url) -> the last failure reported (reported again only when it changes).
    failed: HashMap<(String, String), String>,
    /// pool -> when it was last asked.
    asked_at: HashMap<String, tokio::time::Instant>,
}

/// Run the discovery until the gateway shuts down (the task is aborted then).
pub(crate) async fn run(shared: Arc<Shared>) {
    let mut known = Known::default();
    let mut generation = None;
    let mut tick = tokio::time::interval(RELOAD_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now_gen = shared.control.generation();
        let reloaded = generation != Some(now_gen);
        generation = Some(now_gen);
        for pool in shared.control.pools() {
            if !pool.discovers_limits() {
                // Turned off (or never on): whatever a server said no longer holds.
                if reloaded {
                    known.said.retain(|(p, _), _| p != &pool.name);
                    shared.with_core(|st, _, _| st.gate.set_discovered_context(&pool.name, None));
                }
                continue;
            }
            let every = Duration::from_millis(pool.limits.discover_interval_ms);
            let due = known
                .asked_at
                .get(&pool.name)
                .is_none_or(|at| at.elapsed() >= every);
            if !(due || reloaded) {
                continue;
            }
            known
                .asked_at
                .insert(pool.name.clone(), tokio::time::Instant::now());
            ask_pool(&shared, &pool, &mut known).await;
        }
    }
}

/// Ask every endpoint of `pool` at once and hand the core the smallest window named.
async fn ask_pool(shared: &Shared, pool: &slackgate_core::config::PoolConfig, known: &mut Known) {
    let transport = shared.transports.for_pool(&pool.name);
    let mut auth = HeaderMap::new();
    transport.auth.apply(&mut auth, None);
    let endpoints = pool.endpoint_list();
    known
        .said
        .retain(|(p, url), _| p != &pool.name || endpoints.iter().any(|e| &e.url == url));
    let answers = join_all(
        endpoints
            .iter()
            .map(|e| discover_context(&transport.client, &e.url, &auth, ASK_TIMEOUT)),
    )
    .await;
    for (e, answer) in endpoints.iter().zip(answers) {
        let key = (pool.name.clone(), e.url.clone());
        match answer {
            Ok(Some(n)) => {
                known.failed.remove(&key);
                if known.said.insert(key, n) != Some(n) {
                    tracing::info!(
                        "pool {:?} endpoint {:?} serves a context window of {n} tokens",
                        pool.name,
                        e.name
                    );
                }
            }
            Ok(None) => {
                known.failed.remove(&key);
                known.said.remove(&key);
            }
            // Not answered now: keep what it said last (health ejects it if it is gone).
            Err(why) => {
                if known.failed.get(&key) != Some(&why) {
                    tracing::warn!(
                        "pool {:?} endpoint {:?}: cannot read its context window \
                         ({why}); keeping the last figure",
                        pool.name,
                        e.name
                    );
                    known.failed.insert(key, why);
                }
            }
        }
    }
    let smallest = known
        .said
        .iter()
        .filter(|((p, _), _)| p == &pool.name)
        .map(|(_, n)| *n)
        .min();
    shared.with_core(|st, _, _| st.gate.set_discovered_context(&pool.name, smallest));
}
