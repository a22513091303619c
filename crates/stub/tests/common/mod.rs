//! A tiny HTTP/1.1 client for the stub's integration tests: one connection per request, so a test
//! can vanish mid-response by aborting the connection task.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use slackgate_stub::{Stub, StubConfig, StubStats};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Starts a stub on an ephemeral port.
pub async fn start(cfg: StubConfig) -> Result<Stub, Error> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    Ok(Stub::spawn(listener, cfg)?)
}

/// A response whose connection can be cut by dropping or aborting `conn`.
pub struct Open {
    pub resp: Response<Incoming>,
    pub conn: JoinHandle<()>,
}

/// Sends one request on a fresh connection and returns as soon as the head arrives.
pub async fn open(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Open, Error> {
    let stream = TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    let conn = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body.to_owned())))?;
    let resp = sender.send_request(req).await?;
    Ok(Open { resp, conn })
}

/// Sends one request and reads the whole response.
pub async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<(StatusCode, Bytes), Error> {
    let open = open(addr, method, path, headers, body).await?;
    let status = open.resp.status();
    let bytes = open.resp.into_body().collect().await?.to_bytes();
    Ok((status, bytes))
}

/// Sends one request and parses the JSON response.
pub async fn call_json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<(StatusCode, Value), Error> {
    let (status, bytes) = call(addr, method, path, headers, body).await?;
    Ok((status, serde_json::from_slice(&bytes)?))
}

/// Reads every body frame with its arrival time.
pub async fn frames(resp: Response<Incoming>) -> Result<Vec<(Instant, String)>, Error> {
    let mut body = resp.into_body();
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame?.into_data() {
            out.push((Instant::now(), String::from_utf8(data.to_vec())?));
        }
    }
    Ok(out)
}

/// The JSON payloads of the `data:` events in `text` (without `[DONE]`).
pub fn events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect()
}

/// Polls the stub's stats until `pred` holds, or fails after `within`.
pub async fn wait_for(
    stub: &Stub,
    within: Duration,
    pred: impl Fn(&StubStats) -> bool,
) -> Result<StubStats, Error> {
    let deadline = Instant::now() + within;
    loop {
        let s = stub.stats();
        if pred(&s) {
            return Ok(s);
        }
        if Instant::now() > deadline {
            return Err(format!("condition not met within {within:?}; stats {s:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A chat request body with `chars` characters of prompt.
pub fn chat(chars: usize, extra: &str) -> String {
    let content = "a".repeat(chars);
    let sep = if extra.is_empty() { "" } else { "," };
    format!(r#"{{"model":"m1","messages":[{{"role":"user","content":"{content}"}}]{sep}{extra}}}"#)
}

/// [`call`] on a background task (owning its arguments), so a test can do other things meanwhile.
pub fn spawn_call(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: String,
) -> JoinHandle<Result<(StatusCode, Bytes), Error>> {
    let path = path.to_owned();
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    tokio::spawn(async move {
        let hs: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        call(addr, "POST", &path, &hs, &body).await
    })
}
