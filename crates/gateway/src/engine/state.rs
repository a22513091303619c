//! Shared state of a running gate: the admission core behind one mutex, the waiting requests,
//! and the telemetry every transition produces.
//!
//! The core is pure; this module performs what it decides. Every core transition happens in
//! [`Shared::with_core`], which then drains the core's events (dispatch this job, tell that one
//! it was dropped) and, after the lock is released, writes one log line per transition and
//! updates metrics from those same lines, so the log and `/metrics` cannot disagree.

use crate::config::{Config, ServerConfig};
pub use crate::engine::job::JobGuard;
use crate::engine::lines::{admission_body, decision_line, unqueued_line};
use crate::engine::pump::{decide, deliver, first_endpoint, hand_back_queued, pump};
use crate::engine::start::StartError;
use crate::ledger_store::{LedgerStore, MemoryStore, StoreError};
use crate::observe::codes::LineReason;
use crate::observe::metrics::Metrics;
use crate::observe::telemetry::{DecisionLog, LogLine};
use crate::support::clock::{epoch_ms, Clock};
use crate::upstream::{EnvLookup, Transports, UpstreamBase};
use crate::wire::response::{AdmissionBody, RetryAdvice};
use slackgate_core::{Action, Decision, Gate, JobId, Millis, PoolId, Reason, Request};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// A request extension: the cluster routed this request to be decided here as leader (see
/// [`JobMeta::routed_as_leader`]).
#[derive(Clone, Copy, Debug)]
pub struct RoutedAsLeader;

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
    /// Cluster mode: the lease epoch it was admitted under as leader (see
    /// [`JobMeta::led_epoch`]); checked again right before it goes upstream.
    pub led_epoch: Option<u64>,
    /// Fires if the gate cancels the job while it runs (a drain with `cancel`, the end of
    /// the shutdown grace period), with the reason.
    pub abort: oneshot::Receiver<Reason>,
}

/// What a queued request is told when the gate has made up its mind about it.
#[derive(Debug)]
pub enum Signal {
    /// A slot is yours: send the request upstream.
    Go(Go),
    /// Cluster mode: the request was admitted while this replica led, and it no longer does
    /// (its lease ran out or changed hands before a slot freed). It was not sent upstream:
    /// it goes to the new leader, or follows its class's fail mode.
    Deposed,
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
    /// Cluster mode: the lease epoch under which this replica admitted it as leader (`None`:
    /// a gate alone, or a replica deciding by fail mode). It is dispatched only while this
    /// replica still leads under that epoch.
    pub led_epoch: Option<u64>,
    /// Cluster mode: routed here to be decided as leader ([`RoutedAsLeader`]). Once this
    /// replica no longer leads it is not decided here ([`Admission::NotLeader`]).
    pub routed_as_leader: bool,
}

pub(crate) struct Waiting {
    pub(crate) meta: JobMeta,
    pub(crate) tx: Option<oneshot::Sender<Signal>>,
    /// A reservation-API hold: no HTTP request waits on it; the worker calls the model itself
    /// and settles with commit/cancel (or the hold expires).
    pub(crate) reservation: bool,
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
    /// Slots given in this transition, told to their requests once its ledger records are
    /// queued to the store (see [`Shared::with_core_written`]).
    pub(crate) outbox: Vec<(JobId, oneshot::Sender<Signal>, Go)>,
    /// Cluster mode: the lease epoch this replica leads under at this transition (`None`:
    /// it does not lead, or there is no cluster). Set on every entry to the core.
    pub(crate) leading: Option<u64>,
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
            if line.action.settles() {
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
    /// The live page's frames (written by its sampler, about once a second, only while the
    /// admin listener runs): `GET /stats?snapshot=N` reads them back.
    pub frames: crate::observe::frames::FrameStore,
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
    /// Cluster mode: routed here to be decided as leader, and this replica no longer leads.
    /// Nothing was decided: the request goes where the lease is now.
    NotLeader,
}

impl Shared {
    /// Build the shared state for a validated configuration.
    pub fn new(cfg: &Config, log: DecisionLog) -> Result<Shared, StartError> {
        Shared::with_store(cfg, log, Arc::new(MemoryStore::new()))
    }

    /// Build the shared state over a ledger store, restoring the ledger from it: holds still
    /// inside their TTL keep counting, holds past it expire (tokens wasted), done keys still
    /// answer duplicates.
    pub fn with_store(
        cfg: &Config,
        log: DecisionLog,
        store: Arc<dyn LedgerStore>,
    ) -> Result<Shared, StartError> {
        Shared::with_store_env(cfg, log, store, crate::upstream::process_env())
    }

    /// Like [`Shared::with_store`], looking up `pools[].auth.api_key_env` in `env`.
    pub fn with_store_env(
        cfg: &Config,
        log: DecisionLog,
        store: Arc<dyn LedgerStore>,
        env: EnvLookup,
    ) -> Result<Shared, StartError> {
        let transports = Transports::build(
            &cfg.gate.pools,
            Duration::from_millis(cfg.server.upstream_idle_timeout_ms),
            env,
        )
        .map_err(StartError::Transports)?;
        let mut gate = Gate::new(cfg.gate.clone())?;
        let clock = Clock::new();
        restore_ledger(cfg, store.as_ref(), &mut gate, &clock)?;
        check_upstreams(cfg)?;
        let upstreams = crate::engine::controls::pool_upstreams(&gate);
        let tenant_key = tenant_key(cfg, store.as_ref())?;
        Ok(Shared {
            core: Mutex::new(CoreState {
                gate,
                waiting: HashMap::new(),
                upstreams,
                leading: None,
                outbox: Vec::new(),
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
            conns: conn_tracker(
                &cfg.server,
                cfg.server.max_connections,
                cfg.server.max_connections_per_addr,
            ),
            admin_conns: conn_tracker(
                &cfg.server,
                cfg.admin.max_connections,
                cfg.admin.max_connections_per_addr,
            ),
            health: crate::engine::health::Health::default(),
            cluster: None,
            frames: crate::observe::frames::FrameStore::default(),
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
        let mut written;
        let r = {
            // The core never panics on input; a poisoned lock would only follow a bug in this
            // file, and the state is still consistent between calls, so keep going.
            let mut st = self.core.lock().unwrap_or_else(|p| p.into_inner());
            let now = self.clock.now_ms();
            let was = st.leading;
            st.leading = self.cluster.as_ref().and_then(|c| c.lead_epoch());
            let r = f(&mut st, now, &mut lines);
            pump(&mut st, now, &mut lines);
            // Fencing: the lease was lost (or changed epoch) since the last transition: what
            // was queued as leader goes back, unsent (see `pump::hand_back_queued`).
            if was.is_some() && was != st.leading {
                hand_back_queued(&mut st, now, &mut lines);
            }
            written = self.write_records(&mut st);
            // Dispatched requests hear of their slot only now, after the records of this call
            // (a dispatch's record among them) were queued to the store: a request that then
            // waits for durability waits for its dispatch's record too. A request gone since
            // gives its slot back, which may dispatch the next one.
            while deliver(&mut st, now, &mut lines) {
                pump(&mut st, now, &mut lines);
                let later = self.write_records(&mut st);
                written = written.or(later);
            }
            // In a cluster, every decision line says whether the leader made it or a replica
            // that could reach none (its class failing open): as read on entry (`leading`).
            if self.cluster.is_some() {
                let mode = crate::engine::replica::Role::deciding(st.leading.is_some()).as_str();
                for line in lines.iter_mut().filter(|l| l.action.decides()) {
                    line.cluster = Some(mode);
                }
            }
            st.number(&mut lines);
            r
        };
        for line in &lines {
            self.metrics.observe(line);
            self.log.log(line);
        }
        (r, written)
    }

    /// Queue the ledger records the core produced to the store's single writer, while still
    /// under the core's lock, so records reach it in the order the core produced them (the
    /// store also keeps the highest version). The write's number, if the store numbers them.
    fn write_records(&self, st: &mut CoreState) -> Option<crate::ledger_store::WriteSeq> {
        let mut records = st.gate.take_ledger_records();
        // In a cluster only the leader writes the shared ledger as a whole; another replica
        // writes only the holds it placed itself (its fail-open decisions). The rest of what
        // its core changes (a TTL expiry in its stale copy, say) is its own view, and must not
        // overwrite the leader's truth.
        if let Some(c) = &self.cluster {
            if st.leading.is_none() {
                records.retain(|r| r.owner.as_deref() == Some(c.owner.as_str()));
            }
        }
        if records.is_empty() {
            None
        } else {
            self.store.write_numbered(records)
        }
    }

    /// Wait until every ledger record written so far is durable (group commit: concurrent
    /// callers share one transaction). Runs the blocking flush off the async workers.
    pub async fn durable(&self) -> Result<(), StoreError> {
        Arc::clone(&self.store).flush_async().await
    }

    /// Wait, as [`Shared::durable`] does, for everything written so far, but answer for the
    /// ledger write numbered `write` (a request's hold): an error if that write's batch was
    /// given up or the wait timed out, whatever other writes met. `None` (a store that does
    /// not number writes, or no write): as `durable`.
    pub async fn durable_for(
        &self,
        write: Option<crate::ledger_store::WriteSeq>,
    ) -> Result<(), StoreError> {
        Arc::clone(&self.store).flush_write_async(write).await
    }

    /// The ceiling of every Retry-After (`retry.max_retry_after_ms`) in force.
    pub fn retry_ceiling_ms(&self) -> u64 {
        let st = self.core.lock().unwrap_or_else(|p| p.into_inner());
        st.gate.config().retry.max_retry_after_ms
    }

    /// The fail mode of the class a request labelled `label` belongs to (the default class's
    /// for no label; `open` when nothing matches: the core then refuses it itself).
    pub fn fail_mode(&self, label: Option<&str>) -> slackgate_core::FailMode {
        self.with_core(|st, _, _| st.gate.fail_mode(st.gate.classify(label)))
    }

    /// The default deadline (ms) of the class a label names, if it has one.
    pub fn class_deadline_ms(&self, label: Option<&str>) -> Option<u64> {
        self.with_core(|st, _, _| {
            st.gate
                .classify(label)
                .and_then(|l| st.gate.class_deadline_ms(l))
        })
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
            action: Action::Reject.into(),
            reason: Reason::ClusterUnavailable.into(),
            status: Some(503),
            path: Some(path.to_string()),
            class_label: label,
            cluster: Some(crate::engine::replica::Role::Degraded.as_str()),
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

    /// Decide on a request with the client's class label (resolved against the live class
    /// table). Rejections are logged here; admitted jobs are queued.
    pub fn admit_labeled(
        self: &Arc<Self>,
        label: Option<&str>,
        mut req: Request,
        mut meta: JobMeta,
    ) -> Admission {
        let (mut admission, written) = self.with_core_written(|st, now, lines| {
            if meta.routed_as_leader && st.leading.is_none() {
                // Fencing: routed here as leader, and the lease ran out meanwhile. Decided
                // here it would be this replica's own decision on its share, which its class
                // may not allow: it is not decided here at all.
                return Admission::NotLeader;
            }
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
                guard: JobGuard::new(Arc::clone(self), d.job_id),
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

    /// Cluster mode: the store refuses this replica's writes of other replicas' holds unless
    /// it leads under lease `epoch` (0: it does not lead) and that is the lease's epoch now.
    pub fn fence_store(&self, epoch: u64) {
        if let Some(c) = &self.cluster {
            self.store.fence(&c.owner, epoch);
        }
    }

    /// Cluster mode, when this replica stops leading: the requests it queued as leader are
    /// handed back, unsent (each goes to the new leader, or follows its class's fail mode).
    /// Returns how many.
    pub fn hand_back_deposed(&self) -> usize {
        self.with_core(hand_back_queued)
    }

    /// Cluster mode: the lease epoch this replica leads under now (`None`: it does not lead,
    /// or there is no cluster).
    pub fn lead_epoch(&self) -> Option<u64> {
        self.cluster.as_ref().and_then(|c| c.lead_epoch())
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
        self.log_unqueued(Action::Error, reason.into(), Some(status), path, label);
    }

    /// Log a pass-through request the upstream failed (`status` 502 or 504), with `message`,
    /// the reason as the client was told it.
    pub fn log_upstream_error(&self, reason: Reason, status: u16, path: &str, message: &str) {
        self.emit(&mut [LogLine {
            message: Some(message.to_string()),
            ..unqueued_line(Action::Error, reason.into(), Some(status), path, None)
        }]);
    }

    /// Log and count a request that ended before it reached the core: `action` is `error`
    /// (bad input, with the `status` answered) or `cancel` (the client vanished mid-upload).
    /// `reason`: a core reason, or `body_read_timeout`.
    pub fn log_unqueued(
        &self,
        action: Action,
        reason: LineReason,
        status: Option<u16>,
        path: &str,
        label: Option<String>,
    ) {
        self.emit(&mut [unqueued_line(action, reason, status, path, label)]);
    }
}

/// Load the ledger from the store into a new gate: holds still inside their TTL keep
/// counting, holds past it expire (tokens wasted), done keys still answer duplicates.
fn restore_ledger(
    cfg: &Config,
    store: &dyn LedgerStore,
    gate: &mut Gate,
    clock: &Clock,
) -> Result<(), StartError> {
    let records = match store.load() {
        Ok(r) => r,
        // A replica may start while Redis is out of reach: it decides by its classes' fail
        // modes until Redis answers, and the ledger is loaded when it takes the lease.
        Err(e) if cfg.cluster.is_some() => {
            tracing::warn!(
                "cluster: cannot load the shared ledger yet ({e}); starting \
                 without it (it is loaded when this replica takes the lease)"
            );
            Vec::new()
        }
        Err(e) => return Err(StartError::LoadLedger(Box::new(e))),
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
    Ok(())
}

/// Every pool's upstream URLs parse (a validated config's do; a hand-built one may not).
fn check_upstreams(cfg: &Config) -> Result<(), StartError> {
    for (i, p) in cfg.gate.pools.iter().enumerate() {
        let endpoints = p.endpoint_list();
        if endpoints.is_empty() {
            return Err(StartError::NoUpstream(format!("pools[{i}].upstream")));
        }
        for (j, e) in endpoints.iter().enumerate() {
            let at = if p.endpoints.is_empty() {
                format!("pools[{i}].upstream")
            } else {
                format!("pools[{i}].endpoints[{j}].url")
            };
            crate::upstream::parse_base(&e.url).map_err(|why| StartError::Upstream { at, why })?;
        }
    }
    Ok(())
}

/// The key tenant ids are hashed with: configured, or the store's own (shared by a cluster).
fn tenant_key(
    cfg: &Config,
    store: &dyn LedgerStore,
) -> Result<[u8; crate::support::tenant::KEY_BYTES], StartError> {
    let key = match &cfg.server.tenant_hash_key {
        Some(hex) => crate::support::tenant::parse_key(hex).map_err(StartError::TenantKey)?,
        None => store.tenant_hash_key().map_err(|e| {
            if cfg.cluster.is_some() {
                StartError::ClusterTenantKey(Box::new(e))
            } else {
                StartError::StoreTenantKey(Box::new(e))
            }
        })?,
    };
    Ok(key)
}

/// A connection tracker with the server's timeouts and these caps.
fn conn_tracker(
    server: &ServerConfig,
    max_connections: usize,
    max_connections_per_addr: usize,
) -> Arc<crate::http::connlimit::ConnTracker> {
    crate::http::connlimit::ConnTracker::new(crate::http::connlimit::Limits {
        header_read_timeout: Duration::from_millis(server.header_read_timeout_ms),
        idle_timeout: Duration::from_millis(server.idle_timeout_ms),
        max_connections,
        max_connections_per_addr,
    })
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
