//! The decision log: one JSON line per decision, dispatch, drop and completion.
//!
//! Lines are serialized on the request path but written by one thread of their own
//! (`decision-log`, in `log_writer.rs`), through a bounded channel: a slow disk or a blocked
//! stdout pipe must never slow admission down. When the channel is full the line is dropped
//! and counted (`slackgate_log_dropped_total`), so an operator can see the log is incomplete
//! rather than find out during a post-mortem.
//!
//! A log file can be rotated two ways, both handled by the writer between batches, so
//! no line is split or lost: [`DecisionLog::reopen`] (on SIGHUP, after logrotate renamed the
//! file: the writer reopens the path, creating a new file) and `log.max_bytes` (the writer
//! itself renames the file to `<path>.1`, replacing an older one, and starts a new one).

use crate::config::LogTarget;
use crate::observe::codes::{LineAction, LineReason};
use crate::observe::log_writer::{self, LogFile, Msg, Sink};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// One line of the decision log. Field names are a stable interface, listed per event kind in
/// docs/reference.md (a test compares that list with this struct); every field is always
/// present, `null` when it does not apply. One name means one thing on every kind of line:
/// `queue_age_ms` is the age of the oldest job ahead (decisions), `queue_wait_ms` the job's
/// own time queued (dispatch, drop, complete, cancel).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct LogLine {
    /// Wall-clock time of the event, epoch milliseconds.
    pub ts_ms: u64,
    /// Position of the line in the order the gate decided (assigned under the core lock,
    /// strictly increasing, starting at 1): lines are written by several threads, so their
    /// order in the file may differ; sort by `seq` to replay the core's order exactly.
    pub seq: u64,
    /// Job id assigned by the gate.
    pub job_id: u64,
    /// Resolved class (`class` everywhere: metrics labels, admin JSON, the reservation API).
    pub class: Option<String>,
    /// The raw `X-Job-Class` label the client sent.
    pub class_label: Option<String>,
    /// Hashed tenant.
    pub tenant: Option<String>,
    /// Idempotency key, if the client sent one.
    pub idempotency_key: Option<String>,
    /// Arrival time, epoch milliseconds.
    pub enqueued_at_ms: Option<u64>,
    /// On decision lines (`admit`, `reject`, `shadow_reject`): age of the oldest job queued
    /// ahead of the request, the figure `max_queue_age_ms` is checked against.
    pub queue_age_ms: Option<u64>,
    /// On `dispatch`, `drop`, `complete` and `cancel` lines: the job's own time in the queue
    /// (arrival to dispatch, or to its end if it never ran).
    pub queue_wait_ms: Option<u64>,
    /// Slack at the event (negative: late).
    pub deadline_slack_ms: Option<i64>,
    /// Projected wait for a slot.
    pub projected_wait_ms: Option<u64>,
    /// On decision lines: the part of `projected_wait_ms` that higher-priority work expected to
    /// arrive while the request waits adds (the class's `forecast`; 0 for the top priority).
    pub forecast_wait_ms: Option<u64>,
    /// Estimated service time.
    pub est_service_ms: Option<u64>,
    /// Tokens reserved for this job (prompt estimate + expected output).
    pub tokens_held: Option<u64>,
    /// Tokens the upstream reported using.
    pub tokens_spent: Option<u64>,
    /// Tokens generated for a client that went away.
    pub tokens_wasted: Option<u64>,
    /// In flight on the pool.
    pub in_flight: Option<u32>,
    /// On decision lines: jobs queued ahead of the request on its pool (its class and the
    /// classes of higher or equal priority), the count `max_depth_factor` is checked against.
    pub queued_ahead: Option<u32>,
    /// On `dispatch`, `drop`, `complete` and `cancel` lines: jobs queued on the pool, every
    /// class, after the event.
    pub pool_depth: Option<u32>,
    /// On `dispatch` lines of best-effort work the pool's headroom held back: the time since
    /// it first waited with a slot free, kept for higher classes (absent when never held).
    pub headroom_held_ms: Option<u64>,
    /// `admit`, `reject`, `shadow_reject`, `dispatch`, `drop`, `complete`, `cancel`, `error`,
    /// and the operator events `flag`, `reload`, `shutdown`.
    pub action: LineAction,
    /// Stable reason code.
    pub reason: LineReason,
    /// Pool name.
    pub pool: Option<String>,
    /// On `dispatch`, `complete` and `cancel` lines of a dispatched job: the endpoint of the
    /// pool it was sent to; on `flag` lines about an endpoint: that endpoint.
    pub endpoint: Option<String>,
    /// HTTP status sent to the client (or received from upstream, on completion).
    pub status: Option<u16>,
    /// Arrival to end of response.
    pub turnaround_ms: Option<u64>,
    /// Arrival to first token.
    pub ttft_ms: Option<u64>,
    /// Request path.
    pub path: Option<String>,
    /// Attempt number (`X-Attempt` / `x-stainless-retry-count`).
    pub attempt: Option<u32>,
    /// On an `admit` line: the queued job refused (`displaced`) to make room for this one.
    pub displaced_job_id: Option<u64>,
    /// On decision lines with `[fairness]` in use: the tenant's share of the pool (its weight
    /// over the active tenants' weights).
    pub tenant_share: Option<f64>,
    /// On `complete`, `cancel` and `drop` lines: the ledger's (spent + wasted) / spent after
    /// this settlement.
    pub amplification: Option<f64>,
    /// On `flag` lines (an operator changed a control through the admin API): which one
    /// (`admit_always`, `shadow`, `enabled`, `drain`, `undrain`).
    pub flag: Option<String>,
    /// On `flag` lines: the new value (`null`: back to the config file's value).
    pub value: Option<serde_json::Value>,
    /// On `complete` lines: dispatch to end of response, as measured by the gate.
    pub service_ms: Option<u64>,
    /// On `complete` lines: how far the admission's estimate was off,
    /// `(est_service_ms - service_ms) / service_ms` (positive: the estimate ran long).
    pub est_error: Option<f64>,
    /// On `complete` lines: the mean number of requests in flight on the pool while this one
    /// ran (itself included): what the estimator learns batching from.
    pub concurrency: Option<f64>,
    /// On `flag`, `reload` and `shutdown` lines: who asked, `x-admin-actor` (else `admin`)
    /// `@` the peer address; `signal:SIGHUP` or `watcher` for reloads nobody asked for over
    /// HTTP; `signal` on `shutdown`; `gate` on the gate's own `drain_idle` line.
    pub actor: Option<String>,
    /// On `reload` lines: what changed, or why the new config was refused; on `shutdown`
    /// lines: the grace period; on `complete` and `error` lines of a request the upstream
    /// failed (`upstream_unavailable`, `upstream_error`, `upstream_timeout`): why, the whole
    /// error chain, as the client was told it.
    pub message: Option<String>,
    /// In cluster mode, on decision lines: `leader` (the lease holder decided, with the whole
    /// gate's state) or `degraded` (no leader in reach: this replica decided alone on its
    /// share of the slots, or refused by the class's `fail_mode`).
    pub cluster: Option<&'static str>,
}

/// Fields set on every line, whatever its kind (`job_id` is 0 on lines about no job).
pub const COMMON_FIELDS: &[&str] = &["ts_ms", "seq", "job_id", "action", "reason"];

/// What a line about one request carries whatever happened to it.
const JOB: [&str; 8] = [
    "class",
    "class_label",
    "tenant",
    "idempotency_key",
    "enqueued_at_ms",
    "pool",
    "path",
    "attempt",
];

/// The fields each kind of line (`action`) may set besides [`COMMON_FIELDS`]; the rest are
/// `null` on it. docs/reference.md prints this table and the `reference_doc` test holds the
/// two equal, and checks over real sockets that no line sets a field outside its kind's list.
pub const FIELDS_BY_KIND: &[(&str, &[&str])] = &[
    ("admit", &DECISION_ADMITTED),
    ("shadow_reject", &DECISION_ADMITTED),
    ("reject", &DECISION_REJECTED),
    ("dispatch", &DISPATCH),
    ("drop", &DROP),
    ("complete", &COMPLETE),
    ("cancel", &CANCEL),
    ("error", &["class_label", "path", "status", "message"]),
    (
        "flag",
        &[
            "class", "pool", "endpoint", "flag", "value", "actor", "message",
        ],
    ),
    ("reload", &["actor", "message"]),
    ("shutdown", &["actor", "message"]),
];

/// What every decision line carries beside the job's fields: the figures it was decided on.
const DECISION: [&str; 17] = concat_fields(
    JOB,
    [
        "cluster",
        "tenant_share",
        "queue_age_ms",
        "deadline_slack_ms",
        "projected_wait_ms",
        "forecast_wait_ms",
        "est_service_ms",
        "in_flight",
        "queued_ahead",
    ],
);
const DECISION_ADMITTED: [&str; 19] = concat_fields(DECISION, ["tokens_held", "displaced_job_id"]);
const DECISION_REJECTED: [&str; 18] = concat_fields(DECISION, ["status"]);
const DISPATCH: [&str; 15] = concat_fields(
    JOB,
    [
        "endpoint",
        "queue_wait_ms",
        "deadline_slack_ms",
        "est_service_ms",
        "in_flight",
        "pool_depth",
        "headroom_held_ms",
    ],
);
const DROP: [&str; 15] = concat_fields(
    JOB,
    [
        "queue_wait_ms",
        "deadline_slack_ms",
        "projected_wait_ms",
        "in_flight",
        "pool_depth",
        "tokens_held",
        "amplification",
    ],
);
const CANCEL: [&str; 22] = concat_fields(
    JOB,
    [
        "endpoint",
        "queue_wait_ms",
        "deadline_slack_ms",
        "in_flight",
        "pool_depth",
        "turnaround_ms",
        "ttft_ms",
        "tokens_held",
        "tokens_spent",
        "tokens_wasted",
        "est_service_ms",
        "service_ms",
        "concurrency",
        "amplification",
    ],
);
const COMPLETE: [&str; 25] = concat_fields(CANCEL, ["status", "est_error", "message"]);

/// `a` then `b`, as one array (a `const` cannot build a slice otherwise).
const fn concat_fields<const A: usize, const B: usize, const N: usize>(
    a: [&'static str; A],
    b: [&'static str; B],
) -> [&'static str; N] {
    assert!(A + B == N);
    let mut out = [""; N];
    let mut i = 0;
    while i < A {
        out[i] = a[i];
        i += 1;
    }
    while i < N {
        out[i] = b[i - A];
        i += 1;
    }
    out
}

/// Handle for writing decision lines; cheap to share.
#[derive(Clone)]
pub struct DecisionLog {
    tx: Option<mpsc::Sender<Msg>>,
    counters: Arc<LogCounters>,
}

/// Lines written and dropped.
#[derive(Debug, Default)]
pub struct LogCounters {
    /// Lines written to the sink (after the write succeeded).
    pub written: AtomicU64,
    /// Lines dropped because the channel was full, the write failed or the writer died.
    pub dropped: AtomicU64,
    /// Times the log file was reopened or rotated.
    pub rotations: AtomicU64,
}

impl DecisionLog {
    /// Start the writer thread (`decision-log`) for `target`.
    pub fn start(target: LogTarget, capacity: usize) -> std::io::Result<DecisionLog> {
        DecisionLog::start_rotating(target, capacity, 0)
    }

    /// [`DecisionLog::start`], rotating a log file to `<path>.1` once it exceeds `max_bytes`
    /// (0: never; rotate with [`DecisionLog::reopen`] instead).
    pub fn start_rotating(
        target: LogTarget,
        capacity: usize,
        max_bytes: u64,
    ) -> std::io::Result<DecisionLog> {
        let (sink, file): (Sink, _) = match &target {
            LogTarget::Off => return Ok(DecisionLog::off()),
            LogTarget::Stdout => (Box::new(std::io::stdout()), None),
            LogTarget::File(path) => {
                let (sink, file) = LogFile::open(path, max_bytes)?;
                (sink, Some(file))
            }
        };
        // The thread is not joined: see `log_writer::spawn`.
        let (log, _writer) = DecisionLog::start_writer(sink, file, capacity)?;
        Ok(log)
    }

    /// A handle on a new writer thread writing to `sink` (`file`: the file it is, for
    /// reopening and rotation), and the thread.
    pub(super) fn start_writer(
        sink: Sink,
        file: Option<LogFile>,
        capacity: usize,
    ) -> std::io::Result<(DecisionLog, std::thread::JoinHandle<()>)> {
        let counters = Arc::new(LogCounters::default());
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let writer = log_writer::spawn(rx, sink, file, counters.clone())?;
        let log = DecisionLog {
            tx: Some(tx),
            counters,
        };
        Ok((log, writer))
    }

    /// Close the log file and open its path again (creating it), after what was queued
    /// before is written: for logrotate's `postrotate` (SIGHUP). A log to stdout or off has
    /// nothing to reopen (`Ok`).
    pub async fn reopen(&self) -> std::io::Result<()> {
        let Some(tx) = &self.tx else {
            return Ok(());
        };
        let (ack, done) = oneshot::channel();
        if tx.send(Msg::Reopen(ack)).await.is_err() {
            return Err(std::io::Error::other("the decision log writer has stopped"));
        }
        done.await
            .unwrap_or_else(|_| Err(std::io::Error::other("the decision log writer has stopped")))
    }

    /// A log that writes nothing (tests, `--log off`).
    pub fn off() -> DecisionLog {
        DecisionLog {
            tx: None,
            counters: Arc::new(LogCounters::default()),
        }
    }

    /// Queue one line; never blocks. Returns false if it was dropped.
    pub fn log(&self, line: &LogLine) -> bool {
        let Some(tx) = &self.tx else {
            return true;
        };
        let Ok(mut s) = serde_json::to_string(line) else {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        s.push('\n');
        match tx.try_send(Msg::Line(s)) {
            Ok(()) => true,
            Err(_) => {
                self.counters.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Wait until every line queued so far is written and flushed (or its write failed).
    pub async fn flush(&self) {
        if let Some(tx) = &self.tx {
            let (ack, done) = oneshot::channel();
            if tx.send(Msg::Flush(ack)).await.is_ok() {
                let _ = done.await;
            }
        }
    }

    /// Counters for metrics.
    pub fn counters(&self) -> &LogCounters {
        &self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The per-kind lists name only fields the line has, each once per kind, and every kind
    /// once: a typo there would make the reference and its test agree on a field that does
    /// not exist.
    #[test]
    fn the_per_kind_lists_name_real_fields() {
        let Ok(serde_json::Value::Object(line)) = serde_json::to_value(LogLine::default()) else {
            panic!("a log line serializes to an object");
        };
        let mut kinds = std::collections::BTreeSet::new();
        for (kind, fields) in FIELDS_BY_KIND {
            assert!(kinds.insert(*kind), "{kind} listed twice");
            let mut seen = std::collections::BTreeSet::new();
            for f in fields.iter().chain(COMMON_FIELDS) {
                assert!(line.contains_key(*f), "{kind}: {f} is not a field");
                assert!(seen.insert(*f), "{kind}: {f} listed twice");
            }
        }
        assert_eq!(kinds.len(), 11);
    }
}
