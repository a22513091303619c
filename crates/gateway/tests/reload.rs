//! Hot reload over real sockets: a good config applies without dropping queued or in-flight
//! work, a bad one is refused with the field at fault and the old one stays in force, and a
//! file replaced by rename (an editor's save, a Kubernetes ConfigMap) is picked up by the
//! watcher.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use slackgate_gateway::ops::control::ConfigSource;
use slackgate_gateway::Config;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A fresh directory for one test's config file.
fn temp_dir(name: &str) -> PathBuf {
    slackgate_testkit::temp_dir(&format!("reload-{name}"))
}

/// `slots` slots, interactive (deadline `deadline_ms`) and batch, plus `extra` TOML.
fn config(upstream: SocketAddr, slots: u32, deadline_ms: u64, poll_ms: u64, extra: &str) -> String {
    format!(
        r#"
default_class = "interactive"
[server]
tick_ms = 10
config_poll_ms = {poll_ms}
[[pools]]
name = "default"
slots = {slots}
upstream = "http://{upstream}"
[pools.prior]
overhead_ms = 5
prefill_ms_per_token = 0
decode_ms_per_token = 10
[[classes]]
name = "interactive"
priority = 100
deadline_ms = {deadline_ms}
[[classes]]
name = "batch"
priority = 10
{extra}
"#
    )
}

async fn start(dir: &Path, text: &str, name: &str) -> TestGate {
    let path = dir.join("slackgate.toml");
    std::fs::write(&path, text).unwrap();
    let cfg = Config::from_file(&path).unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    TestGate::start_with(
        cfg,
        name,
        Some((admin, Some(TOKEN.to_string()))),
        Some(ConfigSource::file(path)),
    )
    .await
}

/// Replace the file the way editors and Kubernetes do: write a sibling, rename it over.
fn replace_by_rename(dir: &Path, text: &str) {
    let tmp = dir.join(".slackgate.toml.swp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join("slackgate.toml")).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_reload_keeps_queued_and_in_flight_work() {
    // The stub has room for both of the gate's slots after the reload.
    let stub = stub(2, "tokens:prefill_us=0,decode_us=10000").await;
    let up = stub.local_addr();
    let dir = temp_dir("good");
    let gate = start(&dir, &config(up, 1, 30_000, 0, ""), "reload-good").await;
    let url = gate.url("/v1/chat/completions");
    // One request holds the only slot, two more queue behind it.
    let held = [("x-job-class", "batch"), ("x-stub-hold", "h1")];
    let mut tasks = vec![spawn_upstream(&url, &stub, &held, chat(5)).await];
    for _ in 0..2 {
        tasks.push(spawn_post(&url, &[("x-job-class", "batch")], chat(5)));
    }
    let queued = eventually(Duration::from_secs(3), || async {
        admin(&gate, "GET", "/admin/queues", "").await.json()["classes"][1]["depth"] == 2
    })
    .await;
    assert!(queued);
    // A runtime rollback flipped before the reload must survive it.
    admin(&gate, "PUT", "/admin/flags/shadow", r#"{"value":true}"#).await;

    // Two slots, a new class: the queued work is kept and the new slot takes one at once.
    std::fs::write(
        dir.join("slackgate.toml"),
        config(
            up,
            2,
            30_000,
            0,
            "[[classes]]\nname = \"eval\"\npriority = 5\n",
        ),
    )
    .unwrap();
    let r = admin(&gate, "POST", "/admin/reload", "").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    let body = r.json();
    assert_eq!(body["generation"], 2);
    assert_eq!(
        body["changes"]["classes_added"],
        serde_json::json!(["eval"])
    );
    assert_eq!(body["changes"]["estimators_reset"], serde_json::json!([]));
    let q = admin(&gate, "GET", "/admin/queues", "").await.json();
    assert_eq!(q["pools"][0]["slots"], 2, "{q}");
    // The second slot serves the queued jobs one after the other while the first is held.
    let moved = eventually(Duration::from_secs(3), || async {
        admin(&gate, "GET", "/admin/queues", "").await.json()["classes"][1]["depth"] == 0
    })
    .await;
    assert!(moved, "the second slot took the queued jobs");
    let flags = admin(&gate, "GET", "/admin/flags", "").await.json();
    assert_eq!(flags["shadow"]["value"], true, "the override survived");
    assert_eq!(flags["config_generation"], 2);
    assert_eq!(
        metric(&gate.metrics().await, "slackgate_config_generation"),
        Some(2.0)
    );
    // The new class is live.
    assert_eq!(
        post(&url, &[("x-job-class", "eval")], &chat(1))
            .await
            .status,
        200
    );

    post(&format!("http://{up}/stub/release"), &[], r#"{"all":true}"#).await;
    for t in tasks {
        assert_eq!(
            t.await.unwrap().status,
            200,
            "nothing dropped by the reload"
        );
    }
    let lines = gate.log_lines().await;
    let reloads: Vec<_> = lines.iter().filter(|l| l["action"] == "reload").collect();
    assert_eq!(reloads.len(), 1);
    assert_eq!(reloads[0]["reason"], "config_reloaded");
    assert!(reloads[0]["actor"].as_str().unwrap().starts_with("test@"));
    assert!(!lines
        .iter()
        .any(|l| l["action"] == "drop" || l["action"] == "cancel"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_reload_is_refused_and_the_old_config_stays() {
    let stub = stub(1, "fixed:1ms").await;
    let up = stub.local_addr();
    let dir = temp_dir("bad");
    let gate = start(&dir, &config(up, 1, 30_000, 0, ""), "reload-bad").await;
    let url = gate.url("/v1/chat/completions");
    let cases = [
        (
            config(up, 1, 30_000, 0, "").replace(
                "name = \"batch\"\npriority = 10\n",
                "name = \"batch\"\npriority = 10\ndeadline_ms = \"soon\"\n",
            ),
            "classes[1].deadline_ms",
        ),
        (
            config(
                up,
                1,
                30_000,
                0,
                "[[classes]]\nname = \"eval\"\npool = \"gpu\"\n",
            ),
            "classes[2].pool",
        ),
        (config(up, 0, 30_000, 0, ""), "pools[0].slots"),
        ("[[pools]\nname=".to_string(), "slackgate.toml"),
        (
            config(up, 1, 30_000, 0, "").replace("http://", "ftp://"),
            "pools[0].upstream",
        ),
    ];
    for (text, field) in &cases {
        std::fs::write(dir.join("slackgate.toml"), text).unwrap();
        let r = admin(&gate, "POST", "/admin/reload", "").await;
        assert_eq!(r.status, 400, "{field}: {:?}", r.body);
        let b = r.json();
        assert_eq!(b["error"]["code"], "invalid_config");
        let msg = b["error"]["message"].as_str().unwrap();
        assert!(msg.contains(field), "{field} not named in {msg}");
    }
    // The old config is in force: one slot, the old classes, generation 1.
    let flags = admin(&gate, "GET", "/admin/flags", "").await.json();
    assert_eq!(flags["config_generation"], 1);
    assert_eq!(
        metric(&gate.metrics().await, "slackgate_config_generation"),
        Some(1.0)
    );
    assert_eq!(
        post(&url, &[("x-job-class", "batch")], &chat(1))
            .await
            .status,
        200
    );
    let lines = gate.log_lines().await;
    let refused: Vec<_> = lines
        .iter()
        .filter(|l| l["action"] == "reload" && l["reason"] == "config_rejected")
        .collect();
    assert_eq!(refused.len(), cases.len());
    assert!(refused[0]["message"]
        .as_str()
        .unwrap()
        .contains("classes[1].deadline_ms"));
    let m = gate.metrics().await;
    assert_eq!(
        metric(
            &m,
            "slackgate_decisions_total{class=\"none\",action=\"reload\",reason=\"config_rejected\"}"
        ),
        Some(cases.len() as f64)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_replaced_by_rename_is_reloaded_by_the_watcher() {
    let stub = stub(1, "fixed:1ms").await;
    let up = stub.local_addr();
    let dir = temp_dir("rename");
    let gate = start(&dir, &config(up, 1, 30_000, 100, ""), "reload-rename").await;
    let url = gate.url("/v1/chat/completions");
    let generation = || async {
        admin(&gate, "GET", "/admin/flags", "").await.json()["config_generation"]
            .as_u64()
            .unwrap()
    };
    // The new file switches batch off.
    replace_by_rename(
        &dir,
        &config(up, 1, 30_000, 100, "").replace(
            "name = \"batch\"\npriority = 10\n",
            "name = \"batch\"\npriority = 10\nenabled = false\n",
        ),
    );
    let reloaded = eventually(Duration::from_secs(5), || async { generation().await == 2 }).await;
    assert!(reloaded, "{:?}", gate.log_lines().await);
    let r = post(&url, &[("x-job-class", "batch")], &chat(1)).await;
    assert_eq!(r.json()["error"]["code"], "class_disabled");
    // A bad file by rename: refused, logged once, the config in force stays.
    replace_by_rename(&dir, "[[classes]]\nname = \"a\"\ndeadlin_ms = 5\n");
    let refused = eventually(Duration::from_secs(5), || async {
        gate.log_lines()
            .await
            .iter()
            .any(|l| l["reason"] == "config_rejected")
    })
    .await;
    assert!(refused);
    // Four more polls of the same bad file: none may report it again. Nothing happens to
    // wait for; the time is the test.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(generation().await, 2);
    let lines = gate.log_lines().await;
    let rejected: Vec<_> = lines
        .iter()
        .filter(|l| l["reason"] == "config_rejected")
        .collect();
    assert_eq!(
        rejected.len(),
        1,
        "a bad file is reported once, not every poll"
    );
    assert_eq!(rejected[0]["actor"], "watcher");
    assert!(rejected[0]["message"]
        .as_str()
        .unwrap()
        .contains("classes[0].deadlin_ms"));
    // Touching the file without changing it is not a reload.
    assert_eq!(
        post(&url, &[("x-job-class", "batch")], &chat(1))
            .await
            .status,
        429
    );
    // A good file again: batch is back.
    replace_by_rename(&dir, &config(up, 1, 30_000, 100, ""));
    assert!(eventually(Duration::from_secs(5), || async { generation().await == 3 }).await);
    assert_eq!(
        post(&url, &[("x-job-class", "batch")], &chat(1))
            .await
            .status,
        200
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_survives_a_reload_that_moves_the_class_to_another_pool() {
    let stub = stub(2, "fixed:1ms").await;
    let up = stub.local_addr();
    let dir = temp_dir("drain-move");
    let on = |pool: &str| {
        config(
            up,
            1,
            30_000,
            0,
            &format!(
                "pool = \"{pool}\"\n[[pools]]\nname = \"other\"\nslots = 1\nupstream = \"http://{up}\"\n"
            ),
        )
    };
    let gate = start(&dir, &on("default"), "reload-drain-move").await;
    let url = gate.url("/v1/chat/completions");
    let r = admin(&gate, "POST", "/admin/drain", r#"{"classes":["batch"]}"#).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    std::fs::write(dir.join("slackgate.toml"), on("other")).unwrap();
    let r = admin(&gate, "POST", "/admin/reload", "").await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    // Still drained on its new pool, seen once, by its name.
    let r = post(&url, &[("x-job-class", "batch")], &chat(1)).await;
    assert_eq!(r.json()["error"]["code"], "class_disabled", "{:?}", r.body);
    let st = admin(&gate, "GET", "/admin/drain", "").await.json();
    assert_eq!(st["classes"].as_array().unwrap().len(), 1, "{st}");
    assert_eq!(st["classes"][0]["name"], "batch", "{st}");
    let m = gate.metrics().await;
    assert_eq!(
        metric(&m, "slackgate_class_draining{class=\"batch\"}"),
        Some(1.0)
    );
    let flags = admin(&gate, "GET", "/admin/flags", "").await.json();
    assert_eq!(flags["classes"]["batch"]["draining"], true, "{flags}");
    // Ending the drain clears it.
    let r = admin(&gate, "DELETE", "/admin/drain", "").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["classes"], serde_json::json!([]));
    let r = post(&url, &[("x-job-class", "batch")], &chat(1)).await;
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(r.header("x-slackgate-pool").as_deref(), Some("other"));
    let m = gate.metrics().await;
    assert_eq!(
        metric(&m, "slackgate_class_draining{class=\"batch\"}"),
        Some(0.0)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_written_in_place_is_applied_once_complete() {
    // `cat > slackgate.toml`: the watcher may read the file half written. Cut before the
    // batch class, it is still a valid config, one that would retire batch. The half-written
    // file stands for a tenth of a poll period, so no two polls can both read it unless one
    // read is delayed by nine tenths of a period more than the next (a loaded machine delayed
    // one by a quarter of a 300 ms period: hence the long period).
    let stub = stub(1, "fixed:1ms").await;
    let up = stub.local_addr();
    let dir = temp_dir("in-place");
    let gate = start(&dir, &config(up, 1, 30_000, 500, ""), "reload-in-place").await;
    let full = config(up, 1, 30_000, 500, "").replace(
        "name = \"batch\"\npriority = 10\n",
        "name = \"batch\"\npriority = 10\nenabled = false\n",
    );
    let cut = full.find("[[classes]]\nname = \"batch\"").unwrap();
    let path = dir.join("slackgate.toml");
    for _ in 0..3 {
        std::fs::write(&path, &full[..cut]).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        std::fs::write(&path, &full).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let generation = || async {
        admin(&gate, "GET", "/admin/flags", "").await.json()["config_generation"]
            .as_u64()
            .unwrap()
    };
    assert!(eventually(Duration::from_secs(5), || async { generation().await == 2 }).await);
    // Two more poll periods with the complete file: no second reload may come of them. Nothing
    // happens to wait for; the time is the test.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let lines = gate.log_lines().await;
    let reloads: Vec<_> = lines.iter().filter(|l| l["action"] == "reload").collect();
    assert_eq!(
        reloads.len(),
        1,
        "only the complete file is applied: {reloads:?}"
    );
    assert!(
        !reloads[0]["message"]
            .as_str()
            .unwrap()
            .contains("\"batch\""),
        "batch was never removed: {reloads:?}"
    );
    assert_eq!(generation().await, 2);
    let r = post(
        &gate.url("/v1/chat/completions"),
        &[("x-job-class", "batch")],
        &chat(1),
    )
    .await;
    assert_eq!(r.json()["error"]["code"], "class_disabled");
    let _ = std::fs::remove_dir_all(&dir);
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubernetes_style_symlink_swap_is_reloaded() {
    // A ConfigMap volume: slackgate.toml -> ..data/slackgate.toml, ..data -> ..v1; an update
    // writes ..v2 and swaps ..data by renaming a new symlink over it.
    use std::os::unix::fs::symlink;
    let stub = stub(1, "fixed:1ms").await;
    let up = stub.local_addr();
    let dir = temp_dir("k8s");
    std::fs::create_dir_all(dir.join("..v1")).unwrap();
    std::fs::write(
        dir.join("..v1/slackgate.toml"),
        config(up, 1, 30_000, 100, ""),
    )
    .unwrap();
    symlink("..v1", dir.join("..data")).unwrap();
    symlink("..data/slackgate.toml", dir.join("slackgate.toml")).unwrap();
    let path = dir.join("slackgate.toml");
    let cfg = Config::from_file(&path).unwrap();
    let admin_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gate = TestGate::start_with(
        cfg,
        "reload-k8s",
        Some((admin_listener, Some(TOKEN.to_string()))),
        Some(ConfigSource::file(path)),
    )
    .await;
    std::fs::create_dir_all(dir.join("..v2")).unwrap();
    std::fs::write(
        dir.join("..v2/slackgate.toml"),
        config(up, 3, 30_000, 100, ""),
    )
    .unwrap();
    symlink("..v2", dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    let swapped = eventually(Duration::from_secs(5), || async {
        admin(&gate, "GET", "/admin/queues", "").await.json()["pools"][0]["slots"] == 3
    })
    .await;
    assert!(swapped, "the swapped ConfigMap was reloaded");
    let _ = std::fs::remove_dir_all(&dir);
}
