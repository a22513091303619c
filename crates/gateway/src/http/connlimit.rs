//! Connection limits: how many client connections a listener holds, for how long, and who
//! goes first when it is full.
//!
//! Each listener (the proxy's, the admin API's) has one [`ConnTracker`]. A connection is
//! registered when accepted and deregistered when its task ends. Its IO is wrapped in
//! [`Tracked`], which notes every byte read, and its responses in [`ResponseGuard`], which
//! notes when a request is being served; from that the tracker knows, without locks on the
//! IO path, what each connection is doing:
//!
//! - *awaiting headers* (from accept, or from a request's first byte after keep-alive idle):
//!   the header read timeout runs from the phase's start, whatever trickles in meanwhile, so
//!   a client sending one byte every half second is closed all the same (slowloris);
//! - *idle* between requests on a keep-alive connection: the idle timeout runs;
//! - *busy* serving a request: no connection timeout (the body read timeout, the write-stall
//!   guard and the request's own deadline cover that time).
//!
//! One reaper task per listener scans the table a few times per timeout and closes what is
//! overdue, so a slow client costs no work on the request path of others. Overload, in the
//! spirit of Envoy's overload manager: once the listener holds more than half its total cap,
//! both timeouts shrink linearly, to a tenth at the cap; at the cap a new connection evicts
//! the idlest one that is not serving a request (longest without a byte read) and is refused
//! only when every connection is busy. Per client address the cap is hard: a connection
//! beyond it is closed at once. Every close for a limit is counted by reason
//! (`slackgate_connections_closed_total`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

/// Share of the total cap beyond which timeouts start to shrink.
pub const OVERLOAD_START: f64 = 0.5;
/// What the timeouts shrink to, as a share of their configured values, at the total cap.
pub const OVERLOAD_MIN_FACTOR: f64 = 0.1;

const AWAITING_HEADERS: u8 = 0;
const IDLE: u8 = 1;
const BUSY: u8 = 2;

/// A listener's limits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// A request's headers must be complete within this long of its start.
    pub header_read_timeout: Duration,
    /// A keep-alive connection with no request for this long is closed.
    pub idle_timeout: Duration,
    /// Open connections at most, all addresses together.
    pub max_connections: usize,
    /// Open connections at most from one client IP address.
    pub max_connections_per_addr: usize,
}

/// Why the gate closed (or refused) a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    /// Headers not complete within the (possibly shrunk) header read timeout.
    HeaderTimeout,
    /// Idle between requests for longer than the (possibly shrunk) idle timeout.
    IdleTimeout,
    /// The idlest connection, closed to let a new one in at the total cap.
    Evicted,
    /// Refused at accept: its address already holds its cap.
    PerAddrCap,
    /// Refused at accept: the total cap is reached and every connection is busy.
    TotalCap,
}

impl CloseReason {
    /// Every reason, in the order of the metric's rows.
    pub const ALL: [CloseReason; 5] = [
        CloseReason::HeaderTimeout,
        CloseReason::IdleTimeout,
        CloseReason::Evicted,
        CloseReason::PerAddrCap,
        CloseReason::TotalCap,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            CloseReason::HeaderTimeout => "header_timeout",
            CloseReason::IdleTimeout => "idle_timeout",
            CloseReason::Evicted => "evicted",
            CloseReason::PerAddrCap => "per_addr_cap",
            CloseReason::TotalCap => "total_cap",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What one connection is doing, shared between its IO, its responses and the reaper.
#[derive(Debug)]
pub struct ConnState {
    id: u64,
    ip: IpAddr,
    epoch: Instant,
    phase: AtomicU8,
    /// When the phase began (ms since the tracker's epoch).
    since_ms: AtomicU64,
    /// When a byte was last read (ms since the tracker's epoch).
    last_read_ms: AtomicU64,
    close: Notify,
}

impl ConnState {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Bytes arrived: an idle connection starts a request's headers.
    fn on_read(&self) {
        let now = self.now_ms();
        self.last_read_ms.store(now, Ordering::Relaxed);
        if self
            .phase
            .compare_exchange(IDLE, AWAITING_HEADERS, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.since_ms.store(now, Ordering::Relaxed);
        }
    }

    /// A request's headers are in: it is being served.
    pub fn begin_request(&self) {
        self.phase.store(BUSY, Ordering::Release);
    }

    /// Its response is written (or abandoned): idle until the next request.
    fn end_request(&self) {
        self.since_ms.store(self.now_ms(), Ordering::Relaxed);
        self.phase.store(IDLE, Ordering::Release);
    }

    /// Resolves when the tracker wants this connection closed.
    pub async fn closed(&self) {
        self.close.notified().await;
    }
}

/// Connections open and closed, for `/metrics`.
#[derive(Debug, Default)]
struct Counters {
    closed: [AtomicU64; 5],
}

#[derive(Debug, Default)]
struct Table {
    next_id: u64,
    conns: HashMap<u64, Arc<ConnState>>,
    per_addr: HashMap<IpAddr, usize>,
}

impl Table {
    fn remove(&mut self, id: u64) -> bool {
        let Some(c) = self.conns.remove(&id) else {
            return false;
        };
        if let Some(n) = self.per_addr.get_mut(&c.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_addr.remove(&c.ip);
            }
        }
        true
    }
}

/// One listener's open connections and its limits.
#[derive(Debug)]
pub struct ConnTracker {
    limits: Limits,
    epoch: Instant,
    table: Mutex<Table>,
    counters: Counters,
}

/// A registered connection; deregisters on drop.
#[derive(Debug)]
pub struct ConnGuard {
    tracker: Arc<ConnTracker>,
    state: Arc<ConnState>,
}

impl ConnGuard {
    /// The connection's state, for its IO and responses.
    pub fn state(&self) -> &Arc<ConnState> {
        &self.state
    }
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.tracker.lock().remove(self.state.id);
    }
}

impl ConnTracker {
    /// A tracker enforcing `limits`.
    pub fn new(limits: Limits) -> Arc<ConnTracker> {
        Arc::new(ConnTracker {
            limits,
            epoch: Instant::now(),
            table: Mutex::new(Table::default()),
            counters: Counters::default(),
        })
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        // The table holds no invariant a panic elsewhere could break half way.
        self.table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn count(&self, reason: CloseReason) {
        self.counters.closed[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Open connections now.
    pub fn open(&self) -> usize {
        self.lock().conns.len()
    }

    /// Connections serving a request now: its headers read, its response not yet written.
    /// What a test waits for before it acts on a request the gate has begun.
    pub fn busy(&self) -> usize {
        self.lock()
            .conns
            .values()
            .filter(|c| c.phase.load(Ordering::Acquire) == BUSY)
            .count()
    }

    /// Connections closed or refused for `reason` so far.
    pub fn closed(&self, reason: CloseReason) -> u64 {
        self.counters.closed[reason.index()].load(Ordering::Relaxed)
    }

    /// Register a connection just accepted from `ip`, or say why it must be closed at once.
    /// At the total cap the idlest connection not serving a request is closed to make room.
    pub fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<ConnGuard, CloseReason> {
        let now = self.now_ms();
        let mut t = self.lock();
        if t.per_addr.get(&ip).copied().unwrap_or(0) >= self.limits.max_connections_per_addr {
            drop(t);
            self.count(CloseReason::PerAddrCap);
            return Err(CloseReason::PerAddrCap);
        }
        if t.conns.len() >= self.limits.max_connections {
            // O(open connections), only at the cap: cheaper than keeping an ordered index
            // up to date on every byte read.
            let idlest = t
                .conns
                .values()
                .filter(|c| c.phase.load(Ordering::Acquire) != BUSY)
                .min_by_key(|c| c.last_read_ms.load(Ordering::Relaxed))
                .map(Arc::clone);
            let Some(victim) = idlest else {
                drop(t);
                self.count(CloseReason::TotalCap);
                return Err(CloseReason::TotalCap);
            };
            t.remove(victim.id);
            victim.close.notify_one();
            self.count(CloseReason::Evicted);
        }
        t.next_id += 1;
        let state = Arc::new(ConnState {
            id: t.next_id,
            ip,
            epoch: self.epoch,
            phase: AtomicU8::new(AWAITING_HEADERS),
            since_ms: AtomicU64::new(now),
            last_read_ms: AtomicU64::new(now),
            close: Notify::new(),
        });
        t.conns.insert(state.id, Arc::clone(&state));
        *t.per_addr.entry(ip).or_insert(0) += 1;
        Ok(ConnGuard {
            tracker: Arc::clone(self),
            state,
        })
    }

    /// How much the timeouts are scaled with `open` connections: 1 up to
    /// [`OVERLOAD_START`] of the cap, then linearly down to [`OVERLOAD_MIN_FACTOR`] at it.
    pub fn overload_factor(&self, open: usize) -> f64 {
        let cap = self.limits.max_connections.max(1) as f64;
        let load = (open as f64 / cap).min(1.0);
        if load <= OVERLOAD_START {
            return 1.0;
        }
        let t = (load - OVERLOAD_START) / (1.0 - OVERLOAD_START);
        1.0 - t * (1.0 - OVERLOAD_MIN_FACTOR)
    }

    /// Close every connection past its (scaled) timeout; returns how many.
    pub fn reap(&self) -> usize {
        let now = self.now_ms();
        let mut t = self.lock();
        let factor = self.overload_factor(t.conns.len());
        let header = (self.limits.header_read_timeout.as_millis() as f64 * factor) as u64;
        let idle = (self.limits.idle_timeout.as_millis() as f64 * factor) as u64;
        let mut overdue = Vec::new();
        for c in t.conns.values() {
            let since = c.since_ms.load(Ordering::Relaxed);
            let age = now.saturating_sub(since);
            match c.phase.load(Ordering::Acquire) {
                AWAITING_HEADERS if age >= header => {
                    overdue.push((c.id, CloseReason::HeaderTimeout))
                }
                IDLE if age >= idle => overdue.push((c.id, CloseReason::IdleTimeout)),
                _ => {}
            }
        }
        for (id, reason) in &overdue {
            if let Some(c) = t.conns.get(id).map(Arc::clone) {
                t.remove(*id);
                c.close.notify_one();
                self.count(*reason);
            }
        }
        overdue.len()
    }

    /// How often the reaper scans: a tenth of the shorter timeout, between 10 ms and 1 s, so a
    /// connection is closed at most about 10% late.
    pub fn reap_period(&self) -> Duration {
        let shortest = self
            .limits
            .header_read_timeout
            .min(self.limits.idle_timeout)
            .mul_f64(OVERLOAD_MIN_FACTOR);
        (shortest / 10).clamp(Duration::from_millis(10), Duration::from_secs(1))
    }

    /// Reap until the task is aborted.
    pub async fn reaper(self: Arc<Self>) {
        let mut interval = tokio::time::interval(self.reap_period());
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            self.reap();
        }
    }
}

/// The listeners' connection families on the metrics page, as counted at scrape time.
#[derive(Debug)]
pub struct ConnGauges(Vec<(&'static str, usize, [u64; CloseReason::ALL.len()])>);

impl ConnGauges {
    /// Each listener's open connections and closes, by its name (`proxy`, `admin`) now.
    pub fn new(listeners: &[(&'static str, &ConnTracker)]) -> ConnGauges {
        ConnGauges(
            listeners
                .iter()
                .map(|(name, t)| (*name, t.open(), CloseReason::ALL.map(|r| t.closed(r))))
                .collect(),
        )
    }
}

impl prometheus_client::collector::Collector for ConnGauges {
    fn encode(
        &self,
        encoder: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        let mut f = crate::observe::exposition::Families::new(encoder);
        f.gauge(
            "slackgate_connections_open",
            "Client connections open, by listener.",
            self.0
                .iter()
                .map(|(name, open, _)| ([("listener", *name)], *open as f64)),
        )?;
        f.counter(
            "slackgate_connections_closed_total",
            "Client connections closed or refused by a connection limit, by listener and reason.",
            self.0.iter().flat_map(|(name, _, closed)| {
                CloseReason::ALL
                    .iter()
                    .zip(closed)
                    .map(|(r, n)| ([("listener", *name), ("reason", r.as_str())], *n))
            }),
        )
    }
}

pin_project_lite::pin_project! {
    /// An IO that tells its connection's state about every byte read.
    #[derive(Debug)]
    pub struct Tracked<T> {
        #[pin]
        inner: T,
        state: Arc<ConnState>,
    }
}

impl<T> Tracked<T> {
    /// Wrap `inner` for the connection `state`.
    pub fn new(inner: T, state: Arc<ConnState>) -> Self {
        Tracked { inner, state }
    }
}

impl<T: AsyncRead> AsyncRead for Tracked<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.project();
        let before = buf.filled().len();
        let r = this.inner.poll_read(cx, buf);
        if buf.filled().len() > before {
            this.state.on_read();
        }
        r
    }
}

impl<T: AsyncWrite> AsyncWrite for Tracked<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.project().inner.poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().inner.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().inner.poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.project().inner.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Marks its connection idle when dropped: put in a response body, which hyper drops once
/// the body is written (or abandoned).
#[derive(Debug)]
pub struct ResponseGuard(Arc<ConnState>);

impl ResponseGuard {
    /// Mark `state` busy until the guard drops.
    pub fn new(state: Arc<ConnState>) -> ResponseGuard {
        state.begin_request();
        ResponseGuard(state)
    }
}

impl Drop for ResponseGuard {
    fn drop(&mut self) {
        self.0.end_request();
    }
}

/// `body`, marking the connection idle once it is dropped.
pub fn guard_body(
    body: crate::wire::response::ResBody,
    guard: ResponseGuard,
) -> crate::wire::response::ResBody {
    use http_body_util::BodyExt;
    GuardedBody {
        inner: body,
        _guard: guard,
    }
    .boxed()
}

struct GuardedBody {
    inner: crate::wire::response::ResBody,
    _guard: ResponseGuard,
}

impl http_body::Body for GuardedBody {
    type Data = bytes::Bytes;
    type Error = crate::wire::response::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_addr: usize) -> Limits {
        Limits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: total,
            max_connections_per_addr: per_addr,
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn the_per_address_cap_refuses_and_frees_on_close() {
        let t = ConnTracker::new(limits(100, 2));
        let a = t.admit(ip(1)).ok();
        let b = t.admit(ip(1)).ok();
        assert!(a.is_some() && b.is_some());
        assert_eq!(t.admit(ip(1)).err(), Some(CloseReason::PerAddrCap));
        assert!(t.admit(ip(2)).is_ok(), "another address is not affected");
        drop(a);
        assert!(
            t.admit(ip(1)).is_ok(),
            "a closed connection frees its place"
        );
        assert_eq!(t.closed(CloseReason::PerAddrCap), 1);
    }

    #[test]
    fn at_the_total_cap_the_idlest_non_busy_connection_is_evicted() {
        let t = ConnTracker::new(limits(3, 10));
        let a = t.admit(ip(1)).ok();
        let b = t.admit(ip(1)).ok();
        let c = t.admit(ip(1)).ok();
        let (Some(a), Some(b), Some(c)) = (a, b, c) else {
            panic!("admitted");
        };
        // `a` is serving a request: never evicted; `b` read last longest ago.
        a.state().begin_request();
        b.state().last_read_ms.store(0, Ordering::Relaxed);
        c.state().last_read_ms.store(5, Ordering::Relaxed);
        let d = t.admit(ip(2));
        assert!(d.is_ok());
        assert_eq!(t.closed(CloseReason::Evicted), 1);
        let table = t.lock();
        assert!(!table.conns.contains_key(&b.state().id), "b evicted");
        assert!(table.conns.contains_key(&c.state().id));
        assert!(table.conns.contains_key(&a.state().id));
    }

    #[test]
    fn when_every_connection_is_busy_the_newcomer_is_refused() {
        let t = ConnTracker::new(limits(1, 10));
        let a = t.admit(ip(1));
        let Ok(a) = a else { panic!("admitted") };
        assert_eq!(t.busy(), 0, "awaiting headers is not busy");
        a.state().begin_request();
        assert_eq!(t.busy(), 1);
        assert_eq!(t.admit(ip(2)).err(), Some(CloseReason::TotalCap));
        a.state().end_request();
        assert_eq!(t.busy(), 0);
    }

    #[test]
    fn timeouts_shrink_past_half_the_cap() {
        let t = ConnTracker::new(limits(100, 100));
        assert_eq!(t.overload_factor(10), 1.0);
        assert_eq!(t.overload_factor(50), 1.0);
        assert!((t.overload_factor(75) - 0.55).abs() < 1e-9);
        assert!((t.overload_factor(100) - OVERLOAD_MIN_FACTOR).abs() < 1e-9);
        assert!((t.overload_factor(1000) - OVERLOAD_MIN_FACTOR).abs() < 1e-9);
    }

    #[test]
    fn the_reaper_closes_overdue_headers_and_idle_connections_but_not_busy_ones() {
        let t = ConnTracker::new(limits(100, 100));
        let (Ok(h), Ok(i), Ok(b)) = (t.admit(ip(1)), t.admit(ip(1)), t.admit(ip(1))) else {
            panic!("admitted");
        };
        i.state().end_request();
        b.state().begin_request();
        for g in [&h, &i, &b] {
            // Pretend every phase began an hour before the tracker's epoch... by moving "now".
            g.state().since_ms.store(0, Ordering::Relaxed);
        }
        // Nothing is overdue yet (the epoch is now).
        assert_eq!(t.reap(), 0);
        let late = ConnTracker {
            limits: t.limits,
            epoch: t.epoch - Duration::from_secs(3600),
            table: Mutex::new(Table::default()),
            counters: Counters::default(),
        };
        {
            let mut src = t.lock();
            let mut dst = late.lock();
            std::mem::swap(&mut *src, &mut *dst);
        }
        assert_eq!(late.reap(), 2);
        assert_eq!(late.closed(CloseReason::HeaderTimeout), 1);
        assert_eq!(late.closed(CloseReason::IdleTimeout), 1);
        assert_eq!(late.open(), 1, "the busy connection stays");
    }
}
