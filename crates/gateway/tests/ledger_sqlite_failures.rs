//! The SQLite ledger failing under a live gate (issue 31): the file is locked from a second
//! connection, as another process (an operator's `sqlite3` session, a backup tool) would
//! hold it. A request whose hold could not be stored is refused 503 `ledger_unavailable` when
//! its class fails closed, and sent upstream when it fails open; the failure reaches the
//! request whose hold it was, not whichever flush happens to come next.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use rusqlite::Connection;
use slackgate_gateway::ledger_store::{LedgerStore, SqliteOptions, SqliteStore};
use slackgate_gateway::Config;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

const CONFIG: &str = r#"
    default_class = "lenient"
    [[pools]]
    name = "default"
    slots = 1
    upstream = "{UPSTREAM}"
    [[classes]]
    name = "strict"
    priority = 100
    fail_mode = "closed"
    [[classes]]
    name = "lenient"
    priority = 10
    fail_mode = "open"
"#;

/// A ledger file in a fresh directory, removed when dropped.
struct LedgerDir(PathBuf);

impl LedgerDir {
    fn new(name: &str) -> LedgerDir {
        let dir = temp_log(&format!("sqlite-failures-{name}")).with_extension("d");
        std::fs::create_dir_all(&dir).unwrap();
        LedgerDir(dir)
    }

    fn db(&self) -> PathBuf {
        self.0.join("ledger.db")
    }
}

impl Drop for LedgerDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A gate over a SQLite ledger the test keeps a handle on. A lock held by another
/// connection fails a commit after 20 ms (instead of the default 5 s), so a batch is given up
/// after its retries within a few hundred milliseconds.
async fn gate_on_sqlite(
    dir: &LedgerDir,
    upstream: std::net::SocketAddr,
) -> (TestGate, Arc<SqliteStore>) {
    let opts = SqliteOptions {
        busy_timeout_ms: 20,
        ..SqliteOptions::default()
    };
    let store = Arc::new(SqliteStore::open(&dir.db(), opts).unwrap());
    let text = CONFIG.replace("{UPSTREAM}", &format!("http://{upstream}"));
    let cfg = Config::from_toml(&text).unwrap();
    let as_store: Arc<dyn LedgerStore> = store.clone();
    let gate = TestGate::start_on_store(cfg, "sqlite-failures", None, None, as_store).await;
    (gate, store)
}

/// Take the file's write lock from a second connection, as another process would.
fn lock(db: &std::path::Path) -> Connection {
    let other = Connection::open(db).unwrap();
    other.execute_batch("BEGIN EXCLUSIVE").unwrap();
    other
}

fn code(r: &Resp) -> String {
    r.json()["error"]["code"].as_str().unwrap_or("").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_ledger_refuses_a_fail_closed_request_and_lets_a_fail_open_one_through() {
    let s = stub(4, "fixed:10ms").await;
    let dir = LedgerDir::new("locked");
    let (g, _store) = gate_on_sqlite(&dir, s.local_addr()).await;
    let url = g.url("/v1/chat/completions");

    let other = lock(&dir.db());
    let r = post(&url, &[("x-job-class", "strict")], &chat(4)).await;
    assert_eq!(
        (r.status.as_u16(), code(&r)),
        (503, "ledger_unavailable".into())
    );
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("database is locked"), "{message}");
    assert_eq!(
        s.stats().requests,
        0,
        "nothing of a fail-closed class went upstream"
    );

    let r = post(&url, &[("x-job-class", "lenient")], &chat(4)).await;
    assert_eq!(r.status, 200, "a fail-open class goes ahead: {:?}", r.body);
    assert_eq!(s.stats().requests, 1);

    // The lock goes away: the strict class is served again.
    other.execute_batch("ROLLBACK").unwrap();
    let r = post(&url, &[("x-job-class", "strict")], &chat(4)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(s.stats().requests, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_whose_batch_failed_is_refused_even_after_another_flush_saw_the_failure() {
    let s = stub(4, "fixed:10ms").await;
    let dir = LedgerDir::new("charged");
    let (g, store) = gate_on_sqlite(&dir, s.local_addr()).await;
    let url = g.url("/v1/chat/completions");

    // A fail-open request holds the gate's one slot (its hold is stored: no lock yet).
    let first = spawn_upstream(
        &url,
        &s,
        &[("x-job-class", "lenient"), ("x-stub-hold", "first")],
        chat(4),
    )
    .await;

    // With the file locked, a fail-closed request queues behind it: its hold's batch fails
    // every attempt and is given up while it waits for the slot.
    let other = lock(&dir.db());
    let lost_before = store.stats().records_lost;
    let strict = spawn_post(&url, &[("x-job-class", "strict")], chat(4));
    wait_until(
        Duration::from_secs(10),
        "the strict hold given up",
        || async { store.stats().records_lost > lost_before },
    )
    .await;
    // Someone else flushes first (shutdown, a reservation-API call, another request): it
    // learns that something it covers failed...
    assert!(store.flush().is_err(), "the flush covering the lost hold");
    // ...and the lock goes away before the strict request is dispatched.
    other.execute_batch("ROLLBACK").unwrap();
    post(
        &format!("http://{}/stub/release", s.local_addr()),
        &[],
        r#"{"name":"first"}"#,
    )
    .await;
    assert_eq!(first.await.unwrap().status, 200);

    // The strict request's hold never reached the file: it must not go upstream, however
    // many flushes succeeded since.
    let r = strict.await.unwrap();
    assert_eq!(
        (r.status.as_u16(), code(&r)),
        (503, "ledger_unavailable".into()),
        "{:?}",
        r.body
    );
    assert_eq!(
        s.stats().requests,
        1,
        "only the first request went upstream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_ledger_answers_within_the_configured_flush_timeout() {
    let s = stub(4, "fixed:10ms").await;
    let dir = LedgerDir::new("timeout");
    // Opened as `serve` opens it: the default busy_timeout (5 s) lets each commit attempt
    // wait that long for the lock; the flush gives up after 150 ms.
    let text = CONFIG.replace("{UPSTREAM}", &format!("http://{}", s.local_addr()))
        + &format!(
            "[server]\nledger = {:?}\nledger_flush_timeout_ms = 150\n",
            dir.db().display().to_string()
        );
    let cfg = Config::from_toml(&text).unwrap();
    let store = slackgate_gateway::server::open_configured_store(&cfg).unwrap();
    let g = TestGate::start_on_store(cfg, "sqlite-timeout", None, None, store).await;
    let url = g.url("/v1/chat/completions");

    let other = lock(&dir.db());
    let started = std::time::Instant::now();
    let r = post(&url, &[("x-job-class", "strict")], &chat(4)).await;
    assert_eq!(
        (r.status.as_u16(), code(&r)),
        (503, "ledger_unavailable".into())
    );
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(message.contains("150 ms"), "{message}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(s.stats().requests, 0);

    let r = post(&url, &[("x-job-class", "lenient")], &chat(4)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(s.stats().requests, 1);
    // Let the writer's pending attempt through before the store is dropped.
    other.execute_batch("ROLLBACK").unwrap();
}

/// The reservation API is held to the same rule: a worker of a class failing closed is not
/// told to go ahead on a hold that was never stored (before, the error only fed a metric and
/// the answer was 202). Its hold is released; a class failing open is told to go ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_whose_hold_was_not_stored_is_refused_when_its_class_fails_closed() {
    let s = stub(4, "fixed:10ms").await;
    let dir = LedgerDir::new("reserve");
    let (g, _store) = gate_on_sqlite(&dir, s.local_addr()).await;
    let reserve = g.url("/admission/v1/reserve");
    let other = lock(&dir.db());
    let r = post(
        &reserve,
        &[],
        r#"{"class":"strict","idempotency_key":"job-1","tokens":100}"#,
    )
    .await;
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["reason"], "ledger_unavailable");
    let message = r.json()["message"].as_str().unwrap().to_owned();
    assert!(message.contains("database is locked"), "{message}");
    assert_eq!(r.header("x-should-retry").as_deref(), Some("true"));
    let r = post(
        &reserve,
        &[],
        r#"{"class":"lenient","idempotency_key":"job-2","tokens":100}"#,
    )
    .await;
    assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
    other.execute_batch("ROLLBACK").unwrap();
    // The refused hold was released: only the lenient one is held, and the same key can be
    // reserved again once the store works.
    assert_eq!(g.stats().await["ledger"]["held"], 1);
    let r = post(
        &reserve,
        &[],
        r#"{"class":"strict","idempotency_key":"job-1","tokens":100,"attempt":1}"#,
    )
    .await;
    assert_eq!(r.status, 202, "{}", String::from_utf8_lossy(&r.body));
}
