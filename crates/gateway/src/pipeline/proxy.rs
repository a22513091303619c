//! The proxy path of an admission-controlled request (`POST /v1/...`), as named phases:
//!
//! ```text
//! arrive -> read (headers, body, JSON) -> offer -> decide -> wait for a slot
//!        -> prepare the upstream request -> exchange (failover inside) -> settle:
//!           classify the answer and stream it back
//! ```
//!
//! The deadline counts from arrival: a slow upload spends the client's budget. A rejected
//! request never touches the upstream. An admitted one waits for its dispatch signal; while it
//! waits, dropping the request (client gone) drops its job guard, which takes it out of the
//! queue. Every ending after dispatch is settled in one place ([`super::settle`]).

use super::arrival::{self, Arrival};
use super::{exchange, settle, slot};
use crate::engine::state::Shared;
use crate::wire::request_info::Endpoint;
use crate::wire::response::ResBody;
use bytes::Bytes;
use http::{Request, Response};
use std::sync::Arc;

/// Handle an admission-controlled request (`POST /v1/...`) to an endpoint of kind `kind`.
pub async fn admitted<B>(shared: Arc<Shared>, req: Request<B>, kind: Endpoint) -> Response<ResBody>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // A deliberately slower build, to prove the regression guard fails on one.
    #[cfg(feature = "perf-slowdown")]
    perf_slowdown();
    let (arrival, body) = Arrival::new(&shared, req, kind);
    let asked = match arrival::read(&shared, &arrival, body).await {
        Ok(asked) => asked,
        Err(answer) => return answer,
    };
    let (offer, meta) = arrival::offer(&shared, &arrival, &asked);
    let job = match slot::decide(&shared, &asked, offer, meta) {
        Ok(job) => job,
        Err(answer) => return answer,
    };
    let go = match slot::wait(&shared, job.signal, &job.decision, job.hold_write).await {
        Ok(go) => go,
        Err(refused) => return settle::refused(job.guard, refused),
    };
    let mut up = exchange::prepare(&shared, arrival.parts, &job.decision, go, asked.bytes);
    let ending = exchange::run(&shared, &mut up, &job.decision, job.hold_write).await;
    settle::ended(&shared, job.guard, &job.decision, up, ending)
}

/// About 200 µs of busy work on the request's worker thread (feature `perf-slowdown` only).
#[cfg(feature = "perf-slowdown")]
fn perf_slowdown() {
    let until = std::time::Instant::now() + std::time::Duration::from_micros(200);
    while std::time::Instant::now() < until {
        std::hint::spin_loop();
    }
}
