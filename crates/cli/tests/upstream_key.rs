//! `slackgate serve` as a real process with a pool key in its environment
//! (`pools[].auth.api_key_env`): the key reaches the upstream as `Bearer KEY`, and appears
//! neither on the gate's stderr nor in its decision log (on stdout here), through a request,
//! a reload refused for an unreadable key file, and the shutdown. The upstream is a minimal
//! HTTP/1.1 responder in this process; every socket is on 127.0.0.1.
#![cfg(unix)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const KEY: &str = "sk-cli-test-5d0c8e7b19a4f2";
const VAR: &str = "SLACKGATE_CLI_TEST_UPSTREAM_KEY";

/// Accept connections and answer each request with a fixed completion, recording the heads.
fn upstream() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming().take(16) {
            let Ok(mut s) = conn else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let head = slackgate_testkit::read_request_head(&mut s);
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            let mut body = vec![0u8; len.min(1 << 20)];
            let _ = s.read_exact(&mut body);
            seen.lock().unwrap().push(head);
            let json = r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;
            let resp = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{json}",
                json.len()
            );
            let _ = s.write_all(resp.as_bytes());
        }
    });
    (addr, heads)
}

fn post(addr: SocketAddr, body: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\nauthorization: Bearer client-key\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn config(upstream: SocketAddr, auth: &str) -> String {
    format!(
        r#"
default_class = "interactive"
[log]
path = "-"
[[pools]]
name = "hosted"
slots = 2
upstream = "http://{upstream}"
[pools.auth]
{auth}
[[classes]]
name = "interactive"
pool = "hosted"
priority = 100
deadline_ms = 30000
"#
    )
}

#[test]
fn the_pool_key_goes_upstream_and_never_to_stderr_or_the_log() {
    let (up, heads) = upstream();
    let file: PathBuf = slackgate_testkit::temp_dir("upstream-key").join("slackgate.toml");
    std::fs::write(&file, config(up, &format!("api_key_env = {VAR:?}"))).unwrap();

    let mut child = Command::new(env!("CARGO_BIN_EXE_slackgate"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&file)
        .env(VAR, KEY)
        .env_remove("SLACKGATE_ADMIN_TOKEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let collect = |r: Box<dyn Read + Send>| {
        let text = Arc::new(Mutex::new(String::new()));
        let t = text.clone();
        let h = std::thread::spawn(move || {
            for line in std::io::BufReader::new(r).lines().map_while(Result::ok) {
                let mut t = t.lock().unwrap();
                t.push_str(&line);
                t.push('\n');
            }
        });
        (text, h)
    };
    let (stderr, err_thread) = collect(Box::new(child.stderr.take().unwrap()));
    let (stdout, out_thread) = collect(Box::new(child.stdout.take().unwrap()));
    let started = Instant::now();
    let addr: SocketAddr = loop {
        let found = stderr.lock().unwrap().lines().find_map(|l| {
            l.split("gate listening on http://")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|a| a.parse().ok())
        });
        if let Some(a) = found {
            break a;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!("slackgate serve did not start: {}", stderr.lock().unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    };

    let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;
    let resp = post(addr, body);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");

    // A reload whose key file cannot be read is refused (on stderr and in the log).
    std::fs::write(
        &file,
        config(up, "api_key_file = \"/nonexistent/slackgate/key\""),
    )
    .unwrap();
    let hup = Command::new("kill")
        .arg("-HUP")
        .arg(pid.to_string())
        .status();
    assert!(hup.is_ok_and(|s| s.success()));
    let refused = Instant::now();
    while !stderr.lock().unwrap().contains("reload refused") {
        assert!(refused.elapsed() < Duration::from_secs(20), "no refusal");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Still the old key.
    let resp = post(addr, body);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");

    let term = Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status();
    assert!(term.is_ok_and(|s| s.success()));
    let stop = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if stop.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("slackgate serve did not stop");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = err_thread.join();
    let _ = out_thread.join();
    let _ = std::fs::remove_file(&file);

    let heads = heads.lock().unwrap().clone();
    // The two requests, and the gate's own questions about the server's context window
    // (`GET /props`, `GET /v1/models`: [pools.limits] discover), all with the pool's key.
    let posts = heads.iter().filter(|h| h.starts_with("POST ")).count();
    assert_eq!(posts, 2, "{heads:?}");
    for h in &heads {
        let auth: Vec<&str> = h
            .lines()
            .filter(|l| l.to_ascii_lowercase().starts_with("authorization:"))
            .collect();
        assert_eq!(auth, vec![format!("authorization: Bearer {KEY}")], "{h}");
    }
    let err = stderr.lock().unwrap().clone();
    let out = stdout.lock().unwrap().clone();
    assert!(err.contains("pools[0].auth.api_key_file"), "{err}");
    assert!(
        out.contains("\"config_rejected\""),
        "the log is on stdout: {out}"
    );
    assert!(!err.contains(KEY), "the key is on stderr: {err}");
    assert!(!out.contains(KEY), "the key is in the log: {out}");
}
