//! A fake OpenAI-compatible upstream model server for tests, drills and benchmarks.
//!
//! It behaves like a small inference server as far as the gateway can tell: a fixed number of
//! slots serve requests concurrently and the rest wait in the server's own FIFO queue; service
//! time follows a [`LatencySpec`]; responses, streams and usage follow the OpenAI schema. On top
//! of that it takes orders from the test that drives it:
//!
//! - `x-stub-output-tokens: N`, `x-stub-latency: <spec>` override a request's size and timing;
//! - `x-stub-hold: NAME` keeps a request in its slot until `POST /stub/release`;
//! - `x-stub-fault: status:503 | reset | hang` injects failures;
//! - `x-stub-request-id: ID` (1 to 128 visible ASCII characters) asks for the request to be
//!   accounted: when it ends, a [`RequestRecord`] notes how long it queued, how long it held a
//!   slot and how it ended (`served`, `faulted` or `cancelled`, also when the client gave up
//!   mid-way). Requests without the header are not recorded. A malformed value of any of these
//!   headers is a 400 with code `invalid_header`;
//! - `POST /stub/occupy` takes slots away, `GET /stub/stats` reports [`StubStats`];
//! - `GET /metrics` serves the same queue in the Prometheus text format, under llama.cpp's
//!   names (`llamacpp:requests_processing`, `llamacpp:requests_deferred`) and vLLM's
//!   (`vllm:num_requests_running`, `vllm:num_requests_waiting` with `model_name="stub"`):
//!   requests holding a slot and requests queued for one; slots taken by `/stub/occupy` are
//!   not requests and count in neither;
//! - `GET /stub/requests` returns every record so far as a [`RequestLog`]
//!   (`{"requests":[..],"dropped":N}`, in completion order), and `POST /stub/requests/clear`
//!   (or `DELETE /stub/requests`) returns the same and empties the log. At most
//!   [`MAX_REQUEST_RECORDS`] are kept between clears; later ones only count in `dropped`.
//!
//! [`ConnConfig::idle_close`] (`slackgate stub --idle-close-ms N`) closes keep-alive connections
//! left idle, like real model servers, including the race where a request arrives just as the
//! connection is being closed (see the `idle` module).
//!
//! Only requests that pass validation and queue for a slot are recorded: a request refused with a
//! 4xx before that has used no upstream time.
//!
//! Like mini-redis, the server takes an already bound listener, so tests bind `127.0.0.1:0` and
//! never race for ports.

mod control;
mod idle;
mod latency;
mod openai;
mod records;
mod reply;
mod server;
mod state;
mod stream;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use idle::ConnConfig;
pub use latency::{LatencySpec, SpecError, MAX_SPEC_DURATION};
pub use records::{Outcome, RequestLog, RequestRecord, MAX_REQUEST_RECORDS};

/// How the stub behaves when a request does not say otherwise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StubConfig {
    /// Requests served concurrently (1 to 2^20); the rest queue FIFO.
    pub slots: usize,
    /// Service time model.
    pub latency: LatencySpec,
    /// Output tokens when the request sets neither `max_completion_tokens` nor `max_tokens`.
    pub default_output_tokens: u32,
    /// Seed of the latency jitter generator, so runs are reproducible.
    pub seed: u64,
}

impl Default for StubConfig {
    fn default() -> Self {
        StubConfig {
            slots: 4,
            latency: LatencySpec::Fixed(Duration::from_millis(50)),
            default_output_tokens: 16,
            seed: 1,
        }
    }
}

/// A snapshot of the stub's counters, as served by `GET /stub/stats`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct StubStats {
    /// Requests currently holding a slot.
    pub in_flight: usize,
    /// Requests waiting for a slot.
    pub queued: usize,
    /// Requests whose response was delivered completely.
    pub served: u64,
    /// Requests whose client went away while holding a slot, before the response ended.
    pub cancelled: u64,
    /// Highest `in_flight` observed since start.
    pub max_in_flight_seen: usize,
    /// Slots currently taken by `/stub/occupy`.
    pub occupied: usize,
    /// Model requests received (chat, completions, embeddings), including refused ones.
    pub requests: u64,
    /// Milliseconds of slot-holding time summed over every request so far, recorded or not
    /// (`/stub/occupy` is not a request and does not count). Summed exactly, then rounded down,
    /// so it may exceed the sum of the records' rounded-down `busy_ms`.
    pub busy_ms_total: u64,
}

/// Handle to a running stub. Dropping it stops the server, like [`Stub::shutdown`] without the
/// wait.
pub struct Stub {
    addr: SocketAddr,
    shared: Arc<state::Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Stub {
    /// Serves on an already bound listener. Returns at once; the server runs on spawned tokio
    /// tasks, so this must be called from inside a tokio runtime (an error otherwise). A `slots`
    /// of 0 or above 2^20 is an `InvalidInput` error.
    pub fn spawn(listener: TcpListener, cfg: StubConfig) -> std::io::Result<Stub> {
        Stub::spawn_with(listener, cfg, ConnConfig::default())
    }

    /// Like [`Stub::spawn`], with connection behaviour (closing idle keep-alives) set by `conn`.
    pub fn spawn_with(
        listener: TcpListener,
        cfg: StubConfig,
        conn: ConnConfig,
    ) -> std::io::Result<Stub> {
        let runtime = tokio::runtime::Handle::try_current().map_err(std::io::Error::other)?;
        let addr = listener.local_addr()?;
        let shared = state::Shared::new(cfg)?;
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async move {
            // Resolves on an explicit stop and when the handle is dropped.
            let _ = stopped.await;
        };
        let task = runtime.spawn(server::serve(listener, shared.clone(), conn, shutdown));
        Ok(Stub {
            addr,
            shared,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Claim a context window of `tokens` (`None`: claim none, the default): `GET /props`
    /// answers as llama.cpp does (`default_generation_settings.n_ctx`) and `/v1/models` names
    /// it as vLLM does (`max_model_len`), so a gate can discover it. The stub itself still
    /// serves any size.
    pub fn set_context_tokens(&self, tokens: Option<u32>) {
        self.shared
            .context_tokens
            .store(tokens.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
    }

    /// The address the stub listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StubStats {
        self.shared.stats()
    }

    /// The records of requests that carried `x-stub-request-id`, in completion order, as
    /// `GET /stub/requests` returns them.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared.requests()
    }

    /// Every record so far and the dropped count, emptying the log, like
    /// `POST /stub/requests/clear`.
    pub fn take_requests(&self) -> RequestLog {
        self.shared.take_requests()
    }

    /// Stops accepting, aborts every open connection, and waits until that is done.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

/// Serves on `listener` until `shutdown` resolves, then aborts open connections. This is the
/// entry point for `slackgate stub`.
pub async fn run_until(
    listener: TcpListener,
    cfg: StubConfig,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    run_until_with(listener, cfg, ConnConfig::default(), shutdown).await
}

/// Like [`run_until`], with connection behaviour set by `conn` (`slackgate stub
/// --idle-close-ms`).
pub async fn run_until_with(
    listener: TcpListener,
    cfg: StubConfig,
    conn: ConnConfig,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    server::serve(listener, state::Shared::new(cfg)?, conn, shutdown).await
}
