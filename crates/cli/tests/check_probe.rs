//! `slackgate check --config FILE --probe` as a real process: one pool with a live endpoint (a
//! minimal HTTP/1.1 responder in this process) and one whose port refuses connections. Both
//! are reported, the dead one with the address that refused, and the exit status says a probe
//! failed; without `--probe` the same file is only validated.
#![cfg(unix)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::process::Command;
use std::time::Duration;

/// Answer every request with `200 OK` and an empty model list; the request lines seen.
fn live_upstream() -> (SocketAddr, std::sync::mpsc::Receiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for conn in listener.incoming().take(8) {
            let Ok(mut s) = conn else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let head = slackgate_testkit::read_request_head(&mut s);
            let _ = tx.send(head.lines().next().unwrap_or_default().to_string());
            let body = r#"{"object":"list","data":[]}"#;
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes());
        }
    });
    (addr, rx)
}

#[test]
fn the_probe_reports_every_endpoint_and_fails_on_a_dead_one() {
    let (live, seen) = live_upstream();
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let text = format!(
        r#"
default_class = "interactive"
[[pools]]
name = "gpu"
endpoints = [
  {{ name = "live", url = "http://{live}", slots = 2 }},
  {{ name = "dead", url = "http://{dead}", slots = 2 }},
]
[[classes]]
name = "interactive"
pool = "gpu"
priority = 100
deadline_ms = 30000
"#
    );
    let file = slackgate_testkit::temp_dir("check-probe").join("slackgate.toml");
    std::fs::write(&file, text).unwrap();

    // Without --probe nothing is contacted and the file is fine.
    let plain = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(plain.status.success(), "{plain:?}");
    assert!(seen.try_recv().is_err(), "check without --probe connected");

    let out = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .args(["check", "--probe", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a dead endpoint must fail: {stdout}");
    let line = |name: &str| {
        stdout
            .lines()
            .find(|l| l.contains(&format!("endpoint {name} ")))
            .unwrap_or_else(|| panic!("no line for {name}: {stdout}"))
            .to_string()
    };
    let ok = line("live");
    assert!(
        ok.contains(&format!(
            "http://{live}/v1/models: ok, GET /v1/models answered 200 OK"
        )),
        "{ok}"
    );
    let failed = line("dead");
    assert!(
        failed.contains("FAILED: upstream request failed"),
        "{failed}"
    );
    assert!(
        failed.contains(&format!("connect to {dead} failed")),
        "{failed}"
    );
    assert!(failed.to_lowercase().contains("refused"), "{failed}");
    assert!(
        stderr.contains("1 of 2 endpoints failed the probe"),
        "{stderr}"
    );
    assert_eq!(
        seen.recv_timeout(Duration::from_secs(5)).ok().as_deref(),
        Some("GET /v1/models HTTP/1.1")
    );
}
