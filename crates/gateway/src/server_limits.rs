//! The servers' context windows, asked of the servers: the gateway side of
//! `[pools.limits] discover`.
//!
//! One task asks every endpoint of every pool with `discover = true` what its context window
//! is (see [`crate::scrape::limits`]) when the gateway starts, after every applied reload and
//! every `discover_interval_ms`, and gives the core the smallest window its endpoints named
//! (`Gate::set_discovered_context`): a request must fit whichever server it is sent to. An
//! endpoint that does not answer keeps the figure it gave last; a pool none of whose
//! endpoints ever named one keeps the configured window (or the default).

use crate::scrape::limits::discover_context;
use crate::state::Shared;
use http::HeaderMap;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// How often the task looks for a reload.
const RELOAD_CHECK: Duration = Duration::from_millis(250);

/// How long one question to one server may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// Run the discovery until the gateway shuts down (the task is aborted then).
pub(crate) async fn run(shared: Arc<Shared>) {
    // (pool, endpoint url) -> the window it named last.
    let mut said: HashMap<(String, String), u32> = HashMap::new();
    let mut asked_at: HashMap<String, tokio::time::Instant> = HashMap::new();
    let mut generation = None;
    let mut tick = tokio::time::interval(RELOAD_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now_gen = shared.control.generation();
        let reloaded = generation != Some(now_gen);
        generation = Some(now_gen);
        for pool in shared.control.pools() {
            if !pool.limits.discover {
                continue;
            }
            let every = Duration::from_millis(pool.limits.discover_interval_ms);
            let due = asked_at
                .get(&pool.name)
                .is_none_or(|at| at.elapsed() >= every);
            if !(due || reloaded) {
                continue;
            }
            asked_at.insert(pool.name.clone(), tokio::time::Instant::now());
            let transport = shared.transports.for_pool(&pool.name);
            let mut auth = HeaderMap::new();
            transport.auth.apply(&mut auth, None);
            let endpoints = pool.endpoint_list();
            said.retain(|(p, url), _| p != &pool.name || endpoints.iter().any(|e| &e.url == url));
            for e in &endpoints {
                match discover_context(&transport.client, &e.url, &auth, ASK_TIMEOUT).await {
                    Ok(Some(n)) => {
                        let key = (pool.name.clone(), e.url.clone());
                        if said.insert(key, n) != Some(n) {
                            eprintln!(
                                "slackgate: pool {:?} endpoint {:?} serves a context window of \
                                 {n} tokens",
                                pool.name, e.name
                            );
                        }
                    }
                    Ok(None) => {
                        said.remove(&(pool.name.clone(), e.url.clone()));
                    }
                    // Unreachable now: keep what it said last (health ejects it if it is gone).
                    Err(_) => {}
                }
            }
            let smallest = said
                .iter()
                .filter(|((p, _), _)| p == &pool.name)
                .map(|(_, n)| *n)
                .min();
            shared.with_core(|st, _, _| st.gate.set_discovered_context(&pool.name, smallest));
        }
    }
}
