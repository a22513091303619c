//! Shared state of a running gate: the admission core behind one mutex, the waiting requests,
//! and the telemetry every transition produces.
//!
//! The core is pure; this module performs what it decides. Every core transition happens in
//! [`Shared::with_core`], which then drains the core's events (dispatch this job, tell that one
//! it was dropped) and, after the lock is released, writes one log line per transition and
//! updates metrics from those same lines, so the log and `/metrics` cannot disagree.

use crate::config::{Config, ServerConfig};
use crate::ledger_store::{LedgerStore, MemoryStore};
use crate::observe::metrics::Metrics;
use crate::observe::telemetry::{DecisionLog, LogLine};
use crate::support::clock::{epoch_ms, Clock};
use crate::upstream::{EnvLookup, Transports, UpstreamBase};
use crate::wire::response::{AdmissionBody, RetryAdvice};
use slackgate_core::{
    Action, Completed, Completion, Decision, Event, Gate, JobId, Millis, PoolId, Reason, Request,
};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// A slot, as [`Signal::Go`] gives it.
#[derive(Debug)]
pub struct Go {
    /// Pool whose slot it holds.
    pub pool: PoolId,
    /// That pool's name.
    pub pool_name: String,
    /// The endpoint of the pool it goes to (see the core's `Gate::endpoints`).
    pub endpoint: usize,
    /// That endpoint's name.
    pub endpoint_name: String,
    /// That endpoint's base URL (resolved under the lock: a reload cannot move it).
    pub upstream: UpstreamBase,
    /// Time it waited in the queue.
    pub queue_wait_ms: u64,
    /// Fires if the gate cancels the job while it runs (a drain with `cancel`, the end of
    /// the shutdown grace period), with the reason.
    pub abort: oneshot::Receiver<Reason>,
}

/// What a queued request is told when the gate has made up its mind about it.
#[derive(Debug)]
pub enum Signal {
    /// A slot is yours: send the request upstream.
    Go(Go),
    /// It will not be sent: its deadline became unmeetable, its class was drained, it was
    /// displaced, or the gate is shutting down (the reason says which). The advice is the
    /// core's when it gave one (a `displaced` drop: when a retry could be admitted); `None`
    /// leaves the gateway's default for the reason.
    Dropped(Reason, AdmissionBody, Option<RetryAdvice>),
}

/// Per-job facts the core does not keep but the log needs.
#[derive(Clone, Debug, Default)]
pub struct JobMeta {
    /// Canonical class name.
    pub class: String,
    /// Raw label sent.
    pub label: Option<String>,
    /// Hashed tenant.
    pub tenant: Option<String>,
    /// Idempotency key.
    pub idempotency_key: Option<String>,
    /// Attempt number.
    pub attempt: Option<u32>,
    /// Request path.
    pub path: String,
    /// Arrival, epoch ms.
    pub arrived_epoch_ms: u64,
    /// Tokens reserved: prompt estimate + expected output.
    pub tokens_held: u64,
    /// Pool name.
    pub pool: String,
    /// The endpoint it was dispatched to (set at dispatch).
    pub endpoint: Option<String>,
}

pub(crate) struct Waiting {
    pub(crate) meta: JobMeta,
    pub(crate) tx: Option<oneshot::Sender<Signal>>,
    /// A reservation-API hold: no HTTP request waits on it; the worker calls the model itself
    /// and settles with commit/cancel (or the hold expires).
    reservation: bool,
    /// Once dispatched: cancels the running request (see [`Signal::Go`]).
    pub(crate) abort: Option<oneshot::Sender<Reason>>,
}

/// The core and the requests waiting on it.
pub struct CoreState {
    /// The admission core.
    pub gate: Gate,
    pub(crate) waiting: HashMap<JobId, Waiting>,
    /// Base URL of each endpoint of each pool, by pool id and endpoint id (both stable
    /// across reloads; see the core's `reconfigure`).
    pub(crate) upstreams: Vec<Vec<Option<UpstreamBase>>>,
    /// Sequence number of the last log line; every line gets the next one under this lock,
    /// so `seq` is the order in which the core decided.
    seq: u64,
}

impl CoreState {
    /// Number `lines` in order, continuing the sequence.
    pub(crate) fn number(&mut self, lines: &mut [LogLine]) {
        let amplification = self.gate.ledger_stats().amplification;
        for line in lines {
            self.seq += 1;
            line.seq = self.seq;
            // Where tokens are settled, the ledger-wide amplification after the settlement.
            if matches!(line.action, "complete" | "cancel" | "drop") {
                line.amplification = amplification;
            }
        }
    }
}

/// Everything request handlers share.
pub struct Shared {
    pub(crate) core: Mutex<CoreState>,
    /// The core's clock.
    pub clock: Clock,
    /// Counters and histograms.
    pub metrics: Metrics,
    /// Decision log.
    pub log: DecisionLog,
    /// Each pool's upstream client and credentials (rebuilt on reload).
    pub transports: Transports,
    /// Server settings (fixed for the life of the process: a reload reports changes here as
    /// needing a restart).
    pub server: ServerConfig,
    /// Where ledger records are persisted.
    pub store: Arc<dyn LedgerStore>,
    /// Operator controls, reloads and shutdown (changed by the ops layer's `control`).
    pub control: crate::engine::controls::Control,
    /// Hashes API keys and `X-Tenant` values into tenant ids.
    pub tenants: crate::support::tenant::TenantHasher,
    /// The proxy listener's open connections and their limits.
    pub conns: Arc<crate::http::connlimit::ConnTracker>,
    /// The admin listener's open connections and their limits.
    pub admin_conns: Arc<crate::http::connlimit::ConnTracker>,
    /// Endpoint failures and probe schedules (see [`crate::engine::health`]).
    pub health: crate::engine::health::Health,
    /// This replica's membership of a cluster (`[cluster]`; `None`: a gate alone).
    pub cluster: Option<Arc<crate::engine::replica::Cluster>>,
}

/// How a request ended, for the log and the estimator.
#[derive(Clone, Copy, Debug, Default)]
pub struct Outcome {
    /// Upstream response completed normally.
    pub ok: bool,
    /// HTTP status from upstream (0: none).
    pub status: u16,
    /// Reason code for the log line.
    pub reason: Option<Reason>,
    /// Prompt tokens reported by the upstream.
    pub prompt_tokens: Option<u32>,
    /// Completion tokens reported (or counted).
    pub completion_tokens: Option<u32>,
}

/// The answer to an admission request.
pub enum Admission {
    /// Rejected: answer now.
    Rejected(Decision, Box<AdmissionBody>),
    /// Queued: wait for the signal; the guard releases the job if the request goes away.
    Queued {
        /// The decision (for response headers).
        decision: Decision,
        /// Fires on dispatch or drop.
        signal: oneshot::Receiver<Signal>,
        /// Ends the job exactly once.
        guard: JobGuard,
        /// The ledger write that carried the job's hold, when the store numbers writes: the
        /// flush before dispatch answers for it ([`Shared::durable_for`]).
        hold_write: Option<crate::ledger_store::WriteSeq>,
    },
}

impl Shared {
    /// Build the shared state for a validated configuration.
    pub fn new(cfg: &Config, log: DecisionLog) -> Result<Shared, String> {
        Shared::with_store(cfg, log, Arc::new(MemoryStore::new()))
    }

    /// Build the shared state over a ledger store, restoring the ledger from it: holds still
    /// inside their TTL keep counting, holds past it expire (tokens wasted), done keys still
    /// answer duplicates.
    pub fn with_store(
        cfg: &Config,
        log: DecisionLog,
        store: Arc<dyn LedgerStore>,
    ) -> Result<Shared, String> {
        Shared::with_store_env(cfg, log, store, crate::upstream::process_env())
    }

    /// Like [`Shared::with_store`], looking up `pools[].auth.api_key_env` in `env`.
    pub fn with_store_env(
        cfg: &Config,
        log: DecisionLog,
        store: Arc<dyn LedgerStore>,
        env: EnvLookup,
    ) -> Result<Shared, String> {
        let transports = Transports::build(
            &cfg.gate.pools,
            Duration::from_millis(cfg.server.upstream_idle_timeout_ms),
            env,
        )?;
        let mut gate = Gate::new(cfg.gate.clone()).map_err(|e| e.to_string())?;
        let clock = Clock::new();
        let records = match store.load() {
            Ok(r) => r,
            // A replica may start while Redis is out of reach: it decides by its classes' fail
            // modes until Redis answers, and the ledger is loaded when it takes the lease.
            Err(e) if cfg.cluster.is_some() => {
                eprintln!(
                    "slackgate: cluster: cannot load the shared ledger yet ({e}); starting \
                     without it (it is loaded when this replica takes the lease)"
                );
                Vec::new()
            }
            Err(e) => return Err(format!("cannot load the ledger: {e}")),
        };
        // Generated keys carry the start time, so they never collide with an earlier run's.
        gate.set_key_run_tag(&format!("{:x}", clock.now_ms()));
        gate.restore_ledger(records, clock.now_ms());
        let restored = gate.take_ledger_records();
        // In a cluster the leader owns the shared ledger: what a replica's restore changed
        // (the leader's live holds expired in its stale view) must not reach the store.
        if cfg.cluster.is_none() {
            store.write(restored);
        }
        for (i, p) in cfg.gate.pools.iter().enumerate() {
            let endpoints = p.endpoint_list();
            if endpoints.is_empty() {
                return Err(format!("pools[{i}].upstream: missing"));
            }
            for (j, e) in endpoints.iter().enumerate() {
                let at = if p.endpoints.is_empty() {
                    format!("pools[{i}].upstream")
                } else {
                    format!("pools[{i}].endpoints[{j}].url")
                };
                crate::upstream::parse_base(&e.url).map_err(|err| format!("{at}: {err}"))?;
            }
        }
        let upstreams = crate::engine::controls::pool_upstreams(&gate);
        let tenant_key = match &cfg.server.tenant_hash_key {
            Some(hex) => crate::support::tenant::parse_key(hex)
                .map_err(|e| format!("server.tenant_hash_key: {e}"))?,
            None => store.tenant_hash_key().map_err(|e| {
                if cfg.cluster.is_some() {
                    format!(
                        "cannot read the cluster's tenant hash key from Redis: {e} (set \
                         server.tenant_hash_key on every replica to start without Redis)"
                    )
                } else {
                    format!("cannot read the tenant hash key: {e}")
                }
            })?,
        };
        Ok(Shared {
            core: Mutex::new(CoreState {
                gate,
                waiting: HashMap::new(),
                upstreams,
                seq: 0,
            }),
            clock,
            metrics: Metrics::default(),
            log,
            transports,
            server: cfg.server.clone(),
            store,
            control: crate::engine::controls::Control::new(cfg),
            tenants: crate::support::tenant::TenantHasher::new(tenant_key),
            conns: crate::http::connlimit::ConnTracker::new(crate::http::connlimit::Limits {
                header_read_timeout: Duration::from_millis(cfg.server.header_read_timeout_ms),
                idle_timeout: Duration::from_millis(cfg.server.idle_timeout_ms),
                max_connections: cfg.server.max_connections,
                max_connections_per_addr: cfg.server.max_connections_per_addr,
            }),
            admin_conns: crate::http::connlimit::ConnTracker::new(crate::http::connlimit::Limits {
                header_read_timeout: Duration::from_millis(cfg.server.header_read_timeout_ms),
                idle_timeout: Duration::from_millis(cfg.server.idle_timeout_ms),
                max_connections: cfg.admin.max_connections,
                max_connections_per_addr: cfg.admin.max_connections_per_addr,
            }),
            health: crate::engine::health::Health::default(),
            cluster: None,
        })
    }

    /// Run `f` on the core at the current time, then perform every event it produced.
    pub fn with_core<R>(
        &self,
        f: impl FnOnce(&mut CoreState, Millis, &mut Vec<LogLine>) -> R,
    ) -> R {
        self.with_core_written(f).0
    }

    /// [`Shared::with_core`], also returning the number of the ledger write it made (the
    /// records the core produced in this call, a new hold among them), if the store numbers
    /// writes and there were records.
    pub fn with_core_written<R>(
        &self,
        f: impl FnOnce(&mut CoreState, Millis, &mut Vec<LogLine>) -> R,
    ) -> (R, Option<crate::ledger_store::WriteSeq>) {
        let mut lines = Vec::new();
        let mut written = None;
        let r = {
            // The core never panics on input; a poisoned lock would only follow a bug in this
            // file, and the state is still consistent between calls, so keep going.
            let mut st = self.core.lock().unwrap_or_else(|p| p.into_inner());
            let now = self.clock.now_ms();
            let r = f(&mut st, now, &mut lines);
            pump(&mut st, now, &mut lines);
            // In a cluster, every decision line says whether the leader made it or a replica
            // that could reach none (its class failing open).
            if let Some(c) = &self.cluster {
                let mode = c.local_mode();
                for line in lines
                    .iter_mut()
                    .filter(|l| matches!(l.action, "admit" | "reject" | "shadow_reject"))
                {
                    line.cluster = Some(mode);
                }
            }
            st.number(&mut lines);
            let mut records = st.gate.take_ledger_records();
            // In a cluster only the leader writes the shared ledger as a whole; another
            // replica writes only the holds it placed itself (its fail-open decisions). The
            // rest of what its core changes (a TTL expiry in its stale copy, say) is its own
            // view, and must not overwrite the leader's truth.
            if let Some(c) = &self.cluster {
                if !c.leads() {
                    records.retain(|r| r.owner.as_deref() == Some(c.owner.as_str()));
                }
            }
            // Queued to the store's single writer while still under the lock, so records reach
            // it in the order the core produced them (the store also keeps the highest version).
            if !records.is_empty() {
                written = self.store.write_numbered(records);
            }
            r
        };
        for line in &lines {
            self.metrics.observe(line);
            self.log.log(line);
        }
        (r, written)
    }

    /// Wait until every ledger record written so far is durable (group commit: concurrent
    /// callers share one transaction). Runs the blocking flush off the async workers.
    pub async fn durable(&self) -> Result<(), String> {
        Arc::clone(&self.store)
            .flush_async()
            .await
            .map_err(|e| e.to_string())
    }

    /// Wait, as [`Shared::durable`] does, for everything written so far, but answer for the
    /// ledger write numbered `write` (a request's hold): an error if that write's batch was
    /// given up or the wait timed out, whatever other writes met. `None` (a store that does
    /// not number writes, or no write): as `durable`.
    pub async fn durable_for(
        &self,
        write: Option<crate::ledger_store::WriteSeq>,
    ) -> Result<(), String> {
        Arc::clone(&self.store)
            .flush_write_async(write)
            .await
            .map_err(|e| e.to_string())
    }

    /// The ceiling of every Retry-After (`retry.max_retry_after_ms`) in force.
    pub fn retry_ceiling_ms(&self) -> u64 {
        let st = self.core.lock().unwrap_or_else(|p| p.into_inner());
        st.gate.config().retry.max_retry_after_ms
    }

    /// Place a reservation-API hold (seed 001): the same decision and the same ledger as the
    /// proxy, but no request waits on it. Returns the decision, the ledger's held count and
    /// the number of the ledger write that carries the hold (see [`Shared::durable_for`]).
    pub fn reserve(
        &self,
        label: Option<&str>,
        mut req: Request,
        mut meta: JobMeta,
    ) -> (Decision, u64, Option<crate::ledger_store::WriteSeq>) {
        let ((d, held), write) = self.with_core_written(|st, now, lines| {
            let d = decide(st, now, label, &mut req, &mut meta);
            lines.push(decision_line(&d, &meta));
            if d.admitted() {
                st.waiting.insert(
                    d.job_id,
                    Waiting {
                        meta,
                        tx: None,
                        reservation: true,
                        abort: None,
                    },
                );
            }
            (d, st.gate.ledger_stats().held)
        });
        (d, held, write)
    }

    /// Settle a key as done (`spent`) or cancelled (`wasted`) through the reservation API.
    pub fn settle_key(
        &self,
        key: &str,
        commit: bool,
        tokens: u64,
    ) -> Result<slackgate_core::HoldRecord, slackgate_core::ledger::SettleError> {
        self.settle_key_because(key, commit, tokens, None)
    }

    /// [`Shared::settle_key`], logging the cancel under `reason` (a hold the shared ledger
    /// refused is a `reject_duplicate`, not a client's cancel).
    pub fn settle_key_because(
        &self,
        key: &str,
        commit: bool,
        tokens: u64,
        reason: Option<Reason>,
    ) -> Result<slackgate_core::HoldRecord, slackgate_core::ledger::SettleError> {
        self.with_core(|st, now, lines| {
            let job = st.gate.job_for_key(key);
            let r = if commit {
                st.gate.commit_key(now, key, tokens)
            } else {
                st.gate.cancel_key(now, key, tokens)
            };
            // Only a job the settlement really ended loses its waiter (a refused settlement,
            // such as a proxied request's key, leaves the request running).
            let ended = job.filter(|id| st.gate.job_for_key(key) != Some(*id));
            if let Some(w) = ended.and_then(|id| st.waiting.remove(&id).map(|w| (id, w))) {
                let (id, w) = w;
                let hold = match &r {
                    Ok(h) => Some(h),
                    Err(slackgate_core::ledger::SettleError::HoldExpired(h)) => Some(&**h),
                    Err(_) => None,
                };
                let action = if commit {
                    Action::Complete
                } else {
                    Action::Cancel
                };
                let reason = match hold.map(|h| h.state) {
                    Some(slackgate_core::HoldState::Expired) => Reason::HoldExpired,
                    _ if commit => Reason::Completed,
                    _ => reason.unwrap_or(Reason::ClientCancelled),
                };
                let mut line = base_line(id, &w.meta, action, reason);
                line.tokens_held = Some(w.meta.tokens_held);
                line.tokens_spent = hold.map(|h| h.tokens_spent);
                line.tokens_wasted = hold.map(|h| h.tokens_wasted);
                lines.push(line);
            }
            r
        })
    }

    /// Expire due holds now (the reservation API's `/expire`): (released, tokens wasted).
    pub fn expire_now(&self) -> (u64, u64) {
        self.with_core(|st, now, _| {
            let before = st.gate.ledger_stats();
            st.gate.tick(now);
            let after = st.gate.ledger_stats();
            (
                after.expired.saturating_sub(before.expired),
                after.tokens_wasted.saturating_sub(before.tokens_wasted),
            )
        })
    }

    /// Lanes in the core's table, live and retired (reloads reuse freed ones).
    pub fn lane_count(&self) -> usize {
        self.with_core(|st, _, _| st.gate.lane_count())
    }

    /// Ledger totals and the projected wait a default request would see, for `/stats`.
    pub fn ledger_view(
        &self,
    ) -> (
        slackgate_core::ledger::LedgerStats,
        slackgate_core::GateSnapshot,
    ) {
        self.with_core(|st, now, _| (st.gate.ledger_stats(), st.gate.snapshot(now)))
    }

    /// Tokens held under a key (for a commit that names no spend).
    pub fn held_tokens(&self, key: &str) -> Option<u64> {
        self.with_core(|st, _, _| st.gate.ledger().get(key).map(|r| r.tokens_held))
    }

    /// Tokens spent by a key's settled hold (for a replayed commit).
    pub fn settled_tokens(&self, key: &str) -> Option<u64> {
        self.with_core(|st, _, _| st.gate.ledger().get(key).map(|r| r.tokens_spent))
    }

    /// The configured hold TTL.
    pub fn hold_ttl_ms(&self) -> u64 {
        self.with_core(|st, _, _| st.gate.ledger().config().hold_ttl_ms)
    }

    /// The fail mode of the class a request labelled `label` belongs to (the default class's
    /// for no label; `open` when nothing matches: the core then refuses it itself).
    pub fn fail_mode(&self, label: Option<&str>) -> slackgate_core::FailMode {
        self.with_core(|st, _, _| st.gate.fail_mode(st.gate.classify(label)))
    }

    /// The fail mode of a decided request's class.
    pub fn fail_mode_of(&self, lane: Option<slackgate_core::LaneId>) -> slackgate_core::FailMode {
        self.with_core(|st, _, _| st.gate.fail_mode(lane))
    }

    /// `closed` if any class fails closed (the reservation API's requests).
    pub fn strictest_fail_mode(&self) -> slackgate_core::FailMode {
        self.with_core(|st, _, _| st.gate.strictest_fail_mode())
    }

    /// Log and count a request refused because the cluster's shared state is out of reach
    /// and its class fails closed (it never reached the core).
    pub fn log_cluster_refusal(&self, path: &str, label: Option<String>) {
        let class = self.with_core(|st, _, _| {
            st.gate
                .classify(label.as_deref())
                .map(|l| st.gate.class_name(l).to_string())
        });
        let mut lines = vec![LogLine {
            class,
            ts_ms: epoch_ms(),
            action: Action::Reject.as_str(),
            reason: Reason::ClusterUnavailable.as_str(),
            status: Some(503),
            path: Some(path.to_string()),
            class_label: label,
            cluster: Some("degraded"),
            ..LogLine::default()
        }];
        self.emit(&mut lines);
    }

    /// Write lines about no queued job (bad input, operator and cluster events): numbered
    /// under the core lock, like every other line, so `seq` is one total order; then logged
    /// and counted.
    pub(crate) fn emit(&self, lines: &mut [LogLine]) {
        self.core
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .number(lines);
        for line in lines.iter() {
            self.metrics.observe(line);
            self.log.log(line);
        }
    }

    /// Cluster mode: this replica has just taken the gate's lease. Load every record the
    /// shared store holds and take the ledger over (see the core's `Gate::adopt_ledger`).
    /// Blocking (the store's `load`): called on the lease thread. Returns the records loaded.
    pub fn adopt_shared_ledger(
        &self,
        alive: &std::collections::HashSet<String>,
        store_lost_data: bool,
    ) -> Result<usize, String> {
        // What this replica wrote while it could not reach the store goes first (bounded by
        // the store's timeout; what does not make it is merged from memory by the core).
        let _ = self.store.flush();
        let records = self.store.load().map_err(|e| e.to_string())?;
        let n = records.len();
        // Written as leader: the lease is this replica's from here (the lease thread makes it
        // lead right after), so the records the takeover changes go to the store.
        let out = self.with_core(|st, now, _| {
            st.gate.adopt_ledger(records, now, alive, store_lost_data);
            st.gate.take_ledger_records()
        });
        if !out.is_empty() {
            self.store.write(out);
        }
        Ok(n)
    }

    /// Cluster mode, after Redis lost its data: write back every record of this replica's
    /// ledger that it placed itself. Returns how many.
    pub fn republish_own_records(&self) -> usize {
        let Some(c) = &self.cluster else {
            return 0;
        };
        let me = c.owner.as_str();
        let records: Vec<slackgate_core::HoldRecord> = self.with_core(|st, _, _| {
            st.gate
                .ledger()
                .records()
                .filter(|r| r.owner.as_deref() == Some(me))
                .cloned()
                .collect()
        });
        let n = records.len();
        if n > 0 {
            self.store.write(records);
        }
        n
    }

    /// After a flush: whether the shared ledger refused the hold of `job` (its client's
    /// idempotency key is held or done there by another hold). Returns the key if so.
    pub fn hold_refused(&self, job: JobId) -> Option<String> {
        // Only a shared store refuses; a gate alone skips the lookups.
        self.cluster.as_ref()?;
        let key = self.with_core(|st, _, _| st.waiting.get(&job)?.meta.idempotency_key.clone())?;
        self.hold_refused_key(&key).then_some(key)
    }

    /// [`Shared::hold_refused`] by key (the reservation API's holds).
    pub fn hold_refused_key(&self, key: &str) -> bool {
        if self.cluster.is_none() {
            return false;
        }
        let created = self.with_core(|st, _, _| st.gate.ledger().get(key).map(|r| r.created_at_ms));
        created.is_some_and(|c| self.store.hold_refused(key, c))
    }

    /// Cluster mode, on the leader: expire the proxied holds of replicas no longer in
    /// `alive` (their requests died with them). Returns how many.
    pub fn expire_orphans(&self, alive: &std::collections::HashSet<String>) -> usize {
        self.with_core(|st, now, _| st.gate.expire_orphans(now, alive))
    }

    /// Split every pool's slots `parts` ways on this replica (cluster mode; 1 on the leader).
    pub fn set_share(&self, parts: u32) {
        self.with_core(|st, _, _| st.gate.set_capacity_share(parts));
    }

    /// Record a ledger store failure (the request proceeds: fail open, counted in metrics).
    pub fn note_store_error(&self, e: &str) {
        self.metrics.decision("none", "error", "ledger_store_error");
        let _ = e;
    }

    /// Decide on a request with the client's class label (resolved against the live class
    /// table). Rejections are logged here; admitted jobs are queued.
    pub fn admit_labeled(
        self: &Arc<Self>,
        label: Option<&str>,
        mut req: Request,
        mut meta: JobMeta,
    ) -> Admission {
        let (mut admission, written) = self.with_core_written(|st, now, lines| {
            let d = decide(st, now, label, &mut req, &mut meta);
            // Only a capacity rejection names somewhere else to go: another pool would refuse
            // a switched-off class, a duplicate key or a spent grant just the same.
            let hint = d
                .class
                .filter(|_| d.reason.is_capacity())
                .and_then(|c| st.gate.retry_hint(c))
                .map(str::to_string);
            let body = admission_body(&d, &meta, hint);
            lines.push(decision_line(&d, &meta));
            if !d.admitted() {
                return Admission::Rejected(d, Box::new(body));
            }
            let (tx, rx) = oneshot::channel();
            st.waiting.insert(
                d.job_id,
                Waiting {
                    meta: meta.clone(),
                    tx: Some(tx),
                    reservation: false,
                    abort: None,
                },
            );
            Admission::Queued {
                guard: JobGuard {
                    shared: Arc::clone(self),
                    id: d.job_id,
                    done: false,
                },
                decision: d,
                signal: rx,
                hold_write: None,
            }
        });
        // The hold was placed in this call, so the write this call made carries it.
        if let Admission::Queued { hold_write, .. } = &mut admission {
            *hold_write = written;
        }
        admission
    }

    /// The first generated token of a job's (streamed) response arrived.
    pub fn first_token(&self, id: JobId) {
        self.with_core(|st, now, _| st.gate.on_first_token(now, id));
    }

    /// Let time pass in the core (drops queued jobs whose slack died).
    pub fn tick(&self) {
        self.with_core(|st, now, _| st.gate.tick(now));
        self.check_drain_idle();
    }

    /// Where requests that are not admission-controlled go: the first live pool's upstream.
    pub fn passthrough_upstream(&self) -> Option<UpstreamBase> {
        self.with_core(|st, _, _| {
            (0..st.gate.pool_count())
                .map(PoolId)
                .filter(|p| st.gate.pool_live(*p))
                .find_map(|p| first_endpoint(st, p))
        })
    }

    /// The name of the pool whose upstream [`Shared::passthrough_upstream`] picks.
    pub fn passthrough_pool_name(&self) -> Option<String> {
        self.with_core(|st, _, _| {
            (0..st.gate.pool_count())
                .map(PoolId)
                .filter(|p| st.gate.pool_live(*p))
                .find(|p| first_endpoint(st, *p).is_some())
                .map(|p| st.gate.pool_name(p).to_string())
        })
    }

    /// A snapshot of the core for `/metrics` and `/stats`.
    pub fn snapshot(&self) -> slackgate_core::GateSnapshot {
        self.with_core(|st, now, _| st.gate.snapshot(now))
    }

    /// Log and count a request refused before it reached the core (bad input).
    pub fn log_error(&self, reason: Reason, status: u16, path: &str, label: Option<String>) {
        self.log_unqueued(Action::Error, reason.as_str(), Some(status), path, label);
    }

    /// Log a pass-through request the upstream failed (`status` 502 or 504), with `message`,
    /// the reason as the client was told it.
    pub fn log_upstream_error(&self, reason: Reason, status: u16, path: &str, message: &str) {
        self.emit(&mut [LogLine {
            message: Some(message.to_string()),
            ..unqueued_line(Action::Error, reason.as_str(), Some(status), path, None)
        }]);
    }

    /// Log and count a request that ended before it reached the core: `action` is `error`
    /// (bad input, with the `status` answered) or `cancel` (the client vanished mid-upload).
    /// `reason` is a reason code; the few codes that are not core reasons (such as
    /// `body_read_timeout`) are defined in [`crate::wire::response`].
    pub fn log_unqueued(
        &self,
        action: Action,
        reason: &'static str,
        status: Option<u16>,
        path: &str,
        label: Option<String>,
    ) {
        self.emit(&mut [unqueued_line(action, reason, status, path, label)]);
    }

    /// End job `id` in the core and log its end line; `message` (why an upstream request
    /// failed) goes in the line's `message` field.
    fn end(
        &self,
        id: JobId,
        outcome: Option<Outcome>,
        wasted: u64,
        cancel_reason: Reason,
        message: Option<String>,
    ) {
        self.with_core(|st, now, lines| {
            let ended = match outcome {
                Some(o) => st.gate.on_complete(
                    now,
                    id,
                    Completion {
                        ok: o.ok,
                        prompt_tokens: o.prompt_tokens,
                        completion_tokens: o.completion_tokens,
                    },
                ),
                None => st.gate.cancel_wasted(now, id, wasted),
            };
            // Only a job the core really ended loses its waiter: if the core did not know the
            // job (already dropped, or ended by another path) the entry is not ours to touch.
            let Some(c) = ended else { return };
            if let Some(w) = st.waiting.remove(&id) {
                let mut line = end_line(&c, &w.meta, outcome, wasted, cancel_reason);
                line.message = message;
                lines.push(line);
            }
        });
    }
}

/// Releases a job exactly once: on completion, on error, or (by `Drop`) when the request or
/// its response body is dropped because the client went away.
pub struct JobGuard {
    shared: Arc<Shared>,
    id: JobId,
    done: bool,
}

impl JobGuard {
    /// The job.
    pub fn id(&self) -> JobId {
        self.id
    }

    /// The shared state (for first-token notes).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The response ended (normally or not).
    pub fn finish(mut self, outcome: Outcome) {
        self.done = true;
        self.shared
            .end(self.id, Some(outcome), 0, Reason::ClientCancelled, None);
    }

    /// The request failed upstream (no response, or none in time): `message` says why, on
    /// the end line as in the answer to the client.
    pub fn fail(mut self, outcome: Outcome, message: &str) {
        self.done = true;
        self.shared.end(
            self.id,
            Some(outcome),
            0,
            Reason::ClientCancelled,
            Some(message.to_string()),
        );
    }

    /// The client went away after `wasted` tokens were generated for it.
    pub fn cancel(self, wasted: u64) {
        self.cancel_with(Reason::ClientCancelled, wasted);
    }

    /// The gate cancelled the job (`drained`, `shutting_down`) after `wasted` tokens were
    /// generated for it.
    pub fn cancel_with(mut self, reason: Reason, wasted: u64) {
        self.done = true;
        self.shared.end(self.id, None, wasted, reason, None);
    }
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        if !self.done {
            self.done = true;
            // Past the shutdown grace period the gate closes connections itself: that is
            // not the client leaving.
            let reason = if self.shared.control.cutting_off() {
                Reason::ShuttingDown
            } else {
                Reason::ClientCancelled
            };
            self.shared.end(self.id, None, 0, reason, None);
        }
    }
}

/// The base URL of a pool's first endpoint that takes work (not ejected, drained or
/// retired), else its first endpoint with a URL: where pass-through routes go.
fn first_endpoint(st: &CoreState, pool: PoolId) -> Option<UpstreamBase> {
    let urls = st.upstreams.get(pool.0)?;
    let views = st.gate.endpoints(0, pool);
    let usable = views
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.ejected && !v.draining && !v.retired)
        .find_map(|(i, _)| urls.get(i).cloned().flatten());
    usable.or_else(|| urls.iter().find_map(Clone::clone))
}

/// Perform the core's events: wake dispatched jobs, tell dropped ones.
pub(crate) fn pump(st: &mut CoreState, now: Millis, lines: &mut Vec<LogLine>) {
    while let Some(ev) = st.gate.poll(now) {
        match ev {
            Event::Dispatch {
                job_id,
                pool,
                endpoint,
                queue_wait_ms,
                deadline_slack_ms,
                est_service_ms,
                in_flight,
                pool_depth,
                ..
            } => {
                let Some(w) = st.waiting.get_mut(&job_id) else {
                    // Nobody waits for this job (its request is gone): a slot must not stay
                    // taken by it, so end it in the core at once. Its end line went out with
                    // whichever path removed the waiter.
                    let _ = st.gate.cancel(now, job_id);
                    continue;
                };
                let endpoint_name = st
                    .gate
                    .endpoint_name(pool, endpoint)
                    .unwrap_or_default()
                    .to_string();
                w.meta.endpoint = Some(endpoint_name.clone());
                let mut line = base_line(job_id, &w.meta, Action::Dispatch, Reason::SlotFree);
                line.queue_wait_ms = Some(queue_wait_ms);
                line.deadline_slack_ms = deadline_slack_ms;
                line.est_service_ms = Some(est_service_ms);
                line.in_flight = Some(in_flight);
                line.pool_depth = Some(pool_depth);
                lines.push(line);
                if w.reservation {
                    // The worker holds the slot from now until it commits or cancels.
                    continue;
                }
                let upstream = st
                    .upstreams
                    .get(pool.0)
                    .and_then(|e| e.get(endpoint))
                    .cloned()
                    .flatten();
                let (abort_tx, abort) = oneshot::channel();
                w.abort = Some(abort_tx);
                let sent = match (w.tx.take(), upstream) {
                    (Some(tx), Some(upstream)) => tx
                        .send(Signal::Go(Go {
                            pool,
                            pool_name: st.gate.pool_name(pool).to_string(),
                            endpoint,
                            endpoint_name,
                            upstream,
                            queue_wait_ms,
                            abort,
                        }))
                        .is_ok(),
                    // No upstream for its pool (cannot happen with a validated config):
                    // dropping the sender answers the request with an error.
                    _ => false,
                };
                if !sent {
                    // The client left between admission and dispatch: give the slot back now.
                    if let (Some(c), Some(w)) =
                        (st.gate.cancel(now, job_id), st.waiting.remove(&job_id))
                    {
                        lines.push(end_line(&c, &w.meta, None, 0, Reason::ClientCancelled));
                    }
                }
            }
            Event::Drop {
                job_id,
                reason,
                queue_wait_ms,
                deadline_slack_ms,
                projected_wait_ms,
                in_flight,
                pool_depth,
                retry_after_ms,
                should_retry,
                ..
            } => {
                let Some(mut w) = st.waiting.remove(&job_id) else {
                    continue;
                };
                let mut line = base_line(job_id, &w.meta, Action::Drop, reason);
                line.queue_wait_ms = Some(queue_wait_ms);
                line.deadline_slack_ms = deadline_slack_ms;
                line.projected_wait_ms = Some(projected_wait_ms);
                line.in_flight = Some(in_flight);
                line.pool_depth = Some(pool_depth);
                line.tokens_held = Some(w.meta.tokens_held);
                lines.push(line);
                if let Some(tx) = w.tx.take() {
                    let advice = retry_after_ms.map(|after_ms| RetryAdvice {
                        after_ms,
                        should_retry,
                    });
                    let _ = tx.send(Signal::Dropped(
                        reason,
                        AdmissionBody {
                            action: Action::Drop.as_str(),
                            reason: reason.as_str(),
                            queue_age_ms: None,
                            queue_wait_ms: Some(queue_wait_ms),
                            deadline_slack_ms,
                            projected_wait_ms,
                            forecast_wait_ms: None,
                            est_service_ms: 0,
                            in_flight,
                            queued_ahead: None,
                            pool_depth: Some(pool_depth),
                            retry_hint: None,
                            retry_after_ms,
                            job_id: job_id.0,
                            class: Some(w.meta.class.clone()),
                            idempotency_key: w.meta.idempotency_key.clone(),
                            ledger: None,
                        },
                        advice,
                    ));
                }
            }
        }
    }
}

/// Classify against the live class table, decide, and fill in the facts the log needs.
fn decide(
    st: &mut CoreState,
    now: Millis,
    label: Option<&str>,
    req: &mut Request,
    meta: &mut JobMeta,
) -> Decision {
    req.class = st.gate.classify(label);
    let d = st.gate.offer(now, req.clone());
    meta.class = d
        .class
        .map(|c| st.gate.class_name(c).to_string())
        .unwrap_or_default();
    meta.pool = d
        .pool
        .map(|p| st.gate.pool_name(p).to_string())
        .unwrap_or_default();
    if meta.arrived_epoch_ms == 0 {
        meta.arrived_epoch_ms = epoch_ms();
    }
    meta.tokens_held = d.tokens_held;
    meta.idempotency_key = Some(d.idempotency_key.clone()).filter(|k| !k.is_empty());
    d
}

fn base_line(id: JobId, meta: &JobMeta, action: Action, reason: Reason) -> LogLine {
    LogLine {
        ts_ms: epoch_ms(),
        job_id: id.0,
        class: (!meta.class.is_empty()).then(|| meta.class.clone()),
        class_label: meta.label.clone(),
        tenant: meta.tenant.clone(),
        idempotency_key: meta.idempotency_key.clone(),
        enqueued_at_ms: Some(meta.arrived_epoch_ms),
        action: action.as_str(),
        reason: reason.as_str(),
        pool: (!meta.pool.is_empty()).then(|| meta.pool.clone()),
        endpoint: meta.endpoint.clone(),
        path: Some(meta.path.clone()),
        attempt: meta.attempt,
        ..LogLine::default()
    }
}

fn decision_line(d: &Decision, meta: &JobMeta) -> LogLine {
    let mut line = base_line(d.job_id, meta, d.action, d.reason);
    line.queue_age_ms = Some(d.queue_age_ms);
    line.deadline_slack_ms = d.deadline_slack_ms;
    line.projected_wait_ms = Some(d.projected_wait_ms);
    line.forecast_wait_ms = Some(d.forecast_wait_ms);
    line.est_service_ms = Some(d.est_service_ms);
    line.in_flight = Some(d.in_flight);
    line.queued_ahead = Some(d.queued_ahead);
    // A rejection holds nothing: `null`, on the proxy's and the reservation API's alike.
    line.tokens_held = d.admitted().then_some(meta.tokens_held);
    line.displaced_job_id = d.displaced.map(|id| id.0);
    if !d.admitted() {
        // The status the client is answered: a duplicate is a conflict, the rest "not now".
        line.status = Some(if d.reason == Reason::RejectDuplicate {
            409
        } else {
            429
        });
    }
    line
}

/// The decision-log line of a request that ended before it reached the core.
fn unqueued_line(
    action: Action,
    reason: &'static str,
    status: Option<u16>,
    path: &str,
    label: Option<String>,
) -> LogLine {
    LogLine {
        ts_ms: epoch_ms(),
        action: action.as_str(),
        reason,
        status,
        path: Some(path.to_string()),
        class_label: label,
        ..LogLine::default()
    }
}

fn end_line(
    c: &Completed,
    meta: &JobMeta,
    outcome: Option<Outcome>,
    wasted: u64,
    cancel_reason: Reason,
) -> LogLine {
    let (action, reason) = match outcome {
        Some(o) => (
            Action::Complete,
            o.reason.unwrap_or(if o.ok {
                Reason::Completed
            } else {
                Reason::UpstreamError
            }),
        ),
        None => (Action::Cancel, cancel_reason),
    };
    let mut line = base_line(c.job_id, meta, action, reason);
    line.queue_wait_ms = Some(c.queue_wait_ms);
    line.deadline_slack_ms = c.deadline_slack_ms;
    line.in_flight = Some(c.in_flight);
    line.pool_depth = Some(c.pool_depth);
    line.turnaround_ms = Some(c.turnaround_ms);
    line.ttft_ms = c.time_to_first_token_ms;
    line.tokens_held = Some(meta.tokens_held);
    if c.dispatched {
        line.est_service_ms = Some(c.est_service_ms);
        line.service_ms = Some(c.service_ms);
        line.concurrency = Some((c.concurrency * 100.0).round() / 100.0);
        if outcome.is_some_and(|o| o.ok) {
            let actual = c.service_ms.max(1) as f64;
            let e = (c.est_service_ms as f64 - actual) / actual;
            line.est_error = Some((e * 1000.0).round() / 1000.0);
        }
    }
    if let Some(o) = outcome {
        line.status = Some(o.status);
    }
    // The ledger's settlement is the truth for tokens; without one (never reserved), fall
    // back to what the response reported.
    match &c.hold {
        Some(h) => {
            line.tokens_spent = Some(h.tokens_spent);
            line.tokens_wasted = Some(h.tokens_wasted);
            if h.state == slackgate_core::HoldState::Expired {
                line.reason = Reason::HoldExpired.as_str();
            }
        }
        None => {
            let spent = outcome.map_or(0, |o| {
                u64::from(o.prompt_tokens.unwrap_or(0))
                    + u64::from(o.completion_tokens.unwrap_or(0))
            });
            line.tokens_spent = Some(spent);
            line.tokens_wasted = Some(if outcome.is_some() { 0 } else { wasted });
        }
    }
    line
}

fn admission_body(d: &Decision, meta: &JobMeta, retry_hint: Option<String>) -> AdmissionBody {
    AdmissionBody {
        action: d.action.as_str(),
        reason: d.reason.as_str(),
        queue_age_ms: Some(d.queue_age_ms),
        queue_wait_ms: None,
        deadline_slack_ms: d.deadline_slack_ms,
        projected_wait_ms: d.projected_wait_ms,
        forecast_wait_ms: Some(d.forecast_wait_ms),
        est_service_ms: d.est_service_ms,
        in_flight: d.in_flight,
        queued_ahead: Some(d.queued_ahead),
        pool_depth: None,
        retry_hint,
        retry_after_ms: d.retry_after_ms,
        job_id: d.job_id.0,
        class: (!meta.class.is_empty()).then(|| meta.class.clone()),
        idempotency_key: (!d.idempotency_key.is_empty()).then(|| d.idempotency_key.clone()),
        ledger: d.ledger.clone(),
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
