//! Upstream failures that name their cause, over real sockets: a CA certificate served as the
//! server's own, a certificate for another name, one from an unknown issuer, a host that does
//! not resolve, a refused connection. Each 502's message carries the whole error chain (the
//! certificate problem and the rule it broke, the host, the address), the request's `complete`
//! line in the decision log carries the same text, and so does a pass-through route's `error`
//! line.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
mod tls_upstream;

use common::{get, post, TestGate};
use slackgate_gateway::Config;
use tls_upstream::{Leaf, TestCa, TlsUpstream};

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hello"}],"max_tokens":8}"#;

/// One pool in front of `url`, trusting only the CA file `ca` when given.
fn config(url: &str, ca: Option<&std::path::Path>) -> Config {
    let tls = match ca {
        Some(p) => format!(
            "[pools.tls]\nca_file = {:?}\nsystem_roots = false\n",
            p.display().to_string()
        ),
        None => String::new(),
    };
    let text = format!(
        r#"
default_class = "interactive"
[[pools]]
name = "p"
slots = 2
upstream = "{url}"
[pools.prior]
overhead_ms = 5.0
prefill_ms_per_token = 0.0
decode_ms_per_token = 1.0
learn = false
{tls}
[[classes]]
name = "interactive"
pool = "p"
priority = 100
deadline_ms = 20000
"#
    );
    Config::from_toml(&text).unwrap()
}

/// Send one chat completion through a gate in front of `url`; the 502's message, after
/// checking that the request's `complete` line says the same.
async fn failed_message(url: &str, ca: Option<&std::path::Path>, name: &str) -> String {
    let gate = TestGate::start_cfg(config(url, ca), name).await;
    let r = post(&gate.url("/v1/chat/completions"), &[], CHAT).await;
    assert_eq!(r.status, 502, "{:?}", r.body);
    assert_eq!(r.json()["error"]["code"], "upstream_unavailable");
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    let lines = gate.log_lines().await;
    let complete = lines
        .iter()
        .find(|l| l["action"] == "complete")
        .unwrap_or_else(|| panic!("no complete line: {lines:?}"));
    assert_eq!(complete["reason"], "upstream_unavailable");
    assert_eq!(complete["message"].as_str(), Some(msg.as_str()));
    let _ = std::fs::remove_file(&gate.log_path);
    msg
}

#[tokio::test]
async fn a_ca_certificate_served_as_the_servers_own_is_named_with_its_rule() {
    let ca = TestCa::with_leaf("ca-as-leaf", Leaf::CaItself);
    let up = TlsUpstream::start(&ca, false).await;
    let ca_file = ca.write_ca("ca-as-leaf");
    let msg = failed_message(&up.url(), Some(&ca_file), "err-ca-leaf").await;
    assert!(
        msg.contains(&format!("TLS handshake with {} failed", up.addr)),
        "{msg}"
    );
    assert!(
        msg.contains("the server presented a CA certificate as its own"),
        "{msg}"
    );
    assert!(
        msg.contains("rule: a server's own certificate must be an end-entity certificate"),
        "{msg}"
    );
    assert!(msg.contains("CaUsedAsEndEntity"), "{msg}");
    assert!(
        msg.ends_with(&format!("(connecting to {})", up.url())),
        "{msg}"
    );
    assert!(up.seen().is_empty());
    let _ = std::fs::remove_file(ca_file);
}

#[tokio::test]
async fn a_certificate_for_another_name_names_both_names_and_the_rule() {
    let ca = TestCa::with_leaf("wrong-name", Leaf::WrongName);
    let up = TlsUpstream::start(&ca, false).await;
    let ca_file = ca.write_ca("wrong-name");
    let msg = failed_message(&up.url(), Some(&ca_file), "err-wrong-name").await;
    assert!(
        msg.contains("it is not valid for 127.0.0.1 (it names other.example)"),
        "{msg}"
    );
    assert!(
        msg.contains("subject alternative names must include the host"),
        "{msg}"
    );
    let _ = std::fs::remove_file(ca_file);
}

#[tokio::test]
async fn a_certificate_from_an_unknown_issuer_says_which_roots_it_needs() {
    let ca = TestCa::new("real-issuer");
    let other = TestCa::new("other-issuer");
    let up = TlsUpstream::start(&ca, true).await;
    let wrong = other.write_ca("other-issuer");
    let msg = failed_message(&up.url(), Some(&wrong), "err-unknown-issuer").await;
    assert!(msg.contains("unknown issuer"), "{msg}");
    assert!(msg.contains("[pools.tls] ca_file"), "{msg}");
    let _ = std::fs::remove_file(wrong);
}

#[tokio::test]
async fn a_host_that_does_not_resolve_is_named() {
    // A label of 64 characters is not a DNS name (63 at most): the resolver refuses it
    // without sending a query (checked with strace: no packet leaves the machine), under
    // `.invalid`, which never resolves anyway (RFC 2606).
    let host = format!("{}.invalid", "x".repeat(64));
    let url = format!("http://{host}:9");
    let msg = failed_message(&url, None, "err-dns").await;
    assert!(
        msg.contains(&format!("dns lookup of {host} failed")),
        "{msg}"
    );
    assert!(msg.ends_with(&format!("(connecting to {url})")), "{msg}");
}

#[tokio::test]
async fn a_refused_connection_names_the_address_and_passthrough_logs_it() {
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let url = format!("http://{addr}");
    let msg = failed_message(&url, None, "err-refused").await;
    assert!(msg.contains(&format!("connect to {addr} failed")), "{msg}");
    assert!(msg.to_lowercase().contains("refused"), "{msg}");

    // A pass-through route answers and logs the same way.
    let gate = TestGate::start_cfg(config(&url, None), "err-refused-pass").await;
    let r = get(&gate.url("/v1/models")).await;
    assert_eq!(r.status, 502, "{:?}", r.body);
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains(&format!("connect to {addr} failed")), "{msg}");
    let lines = gate.log_lines().await;
    let error = lines.iter().find(|l| l["action"] == "error").unwrap();
    assert_eq!(error["message"].as_str(), Some(msg.as_str()));
    assert_eq!(error["status"], 502);
    let _ = std::fs::remove_file(&gate.log_path);
}
