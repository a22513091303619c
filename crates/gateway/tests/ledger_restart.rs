//! The ledger survives a restart on its SQLite file: holds still inside their TTL keep
//! counting, holds past it expire with their tokens wasted, done keys still answer
//! duplicates. Real gateway, real sockets, real SQLite file.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use slackgate_gateway::ledger_store::{SqliteOptions, SqliteStore};
use slackgate_gateway::{Config, DecisionLog, Gateway};
use std::sync::Arc;
use std::time::Duration;

const CONFIG: &str = r#"
    default_class = "batch"
    [[pools]]
    name = "default"
    slots = 4
    upstream = "{UPSTREAM}"
    [pools.prior]
    overhead_ms = 100
    learn = false
    [[classes]]
    name = "batch"
    priority = 10
    [ledger]
    hold_ttl_ms = 1500
    retry_cap = 3
"#;

async fn start(cfg: &Config, db: &std::path::Path) -> Gateway {
    let store = SqliteStore::open(db, SqliteOptions::default()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    Gateway::spawn_with_store(listener, cfg, DecisionLog::off(), Arc::new(store)).unwrap()
}

async fn reserve(g: &Gateway, key: &str, tokens: u64) -> Resp {
    post(
        &format!("http://{}/admission/v1/reserve", g.local_addr()),
        &[],
        &format!(r#"{{"idempotency_key":"{key}","tokens":{tokens}}}"#),
    )
    .await
}

async fn stats(g: &Gateway) -> serde_json::Value {
    get(&format!("http://{}/admission/v1/stats", g.local_addr()))
        .await
        .json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_survive_a_restart_and_expire_on_time() {
    let stub = stub(4, "fixed:10ms").await;
    let text = CONFIG.replace("{UPSTREAM}", &format!("http://{}", stub.local_addr()));
    let cfg = Config::from_toml(&text).unwrap();
    let dir = std::env::temp_dir().join(format!("slackgate-restart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("ledger.db");
    let _ = std::fs::remove_file(&db);

    let g = start(&cfg, &db).await;
    assert_eq!(reserve(&g, "a", 100).await.status, 202);
    assert_eq!(reserve(&g, "b", 200).await.status, 202);
    assert_eq!(reserve(&g, "c", 300).await.status, 202);
    let r = post(
        &format!("http://{}/admission/v1/commit", g.local_addr()),
        &[],
        r#"{"idempotency_key":"a","tokens_spent":90}"#,
    )
    .await;
    assert_eq!(r.status, 200);
    g.shutdown().await;

    // The operator can read the ledger with plain SQL.
    {
        let conn = rusqlite::Connection::open(&db).unwrap();
        let mut q = conn
            .prepare("select state, count(*), sum(tokens_held), sum(tokens_spent) from holds group by state order by state")
            .unwrap();
        let rows: Vec<(String, i64, i64, i64)> = q
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .unwrap()
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(
            rows,
            vec![("done".into(), 1, 100, 90), ("held".into(), 2, 500, 0)]
        );
    }

    // Restart on the same file, inside the TTL: the two holds keep counting and every key
    // still answers duplicates.
    let g = start(&cfg, &db).await;
    let s = stats(&g).await;
    assert_eq!(
        (s["held"].as_u64(), s["tokens_held"].as_u64()),
        (Some(2), Some(500)),
        "{s}"
    );
    assert_eq!(s["tokens_spent"], 90);
    let r = reserve(&g, "a", 100).await;
    assert_eq!(
        (r.status.as_u16(), r.json()["state"].as_str()),
        (409, Some("done"))
    );
    let r = reserve(&g, "b", 200).await;
    assert_eq!(
        (r.status.as_u16(), r.json()["state"].as_str()),
        (409, Some("held"))
    );

    // Past the TTL the restored holds expire, their tokens wasted, and are persisted so. The
    // time is the test, and it is real time: the restored holds carry epoch milliseconds
    // written by the first gate, which the new gate's clock (started from the system clock)
    // must pass.
    tokio::time::sleep(Duration::from_millis(1700)).await;
    let r = post(
        &format!("http://{}/admission/v1/expire", g.local_addr()),
        &[],
        "",
    )
    .await;
    assert_eq!(r.status, 200);
    let s = stats(&g).await;
    assert_eq!(
        (s["held"].as_u64(), s["tokens_wasted"].as_u64()),
        (Some(0), Some(500)),
        "{s}"
    );
    let amp = s["amplification"].as_f64().unwrap();
    assert!((amp - 590.0 / 90.0).abs() < 1e-9, "{amp}");
    // An expired key may be tried again (attempt 1), and is held anew.
    let r = post(
        &format!("http://{}/admission/v1/reserve", g.local_addr()),
        &[],
        r#"{"idempotency_key":"b","tokens":200,"attempt":1}"#,
    )
    .await;
    assert_eq!(r.status, 202, "{:?}", r.body);
    g.shutdown().await;

    // A third start sees b held again and c expired, with b's earlier waste carried along.
    let g = start(&cfg, &db).await;
    let s = stats(&g).await;
    assert_eq!(
        (s["held"].as_u64(), s["tokens_wasted"].as_u64()),
        (Some(1), Some(500)),
        "{s}"
    );
    g.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    drop(stub);
}
