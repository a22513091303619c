//! Shared server state: the slot semaphore, the counters behind `/stub/stats`, the per-request
//! records behind `/stub/requests`, and the registries of held requests and occupations that
//! `/stub/release` wakes.
//!
//! Every counter that goes up for a request goes down in a guard's `Drop`, never in a handler's
//! happy path, because a request can vanish at any `.await` (client disconnect drops the future)
//! and a leaked slot would make the stub slowly lock up in long drills.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::latency::{LatencySpec, Prng};
use crate::records::{Outcome, Records, RequestLog, RequestRecord, Tag, MAX_REQUEST_RECORDS};
use crate::{StubConfig, StubStats};

/// Most slots a stub may have: far beyond any real server, and small enough that the semaphore
/// (which panics above its own limit) and `acquire_many` (which takes a `u32`) accept it.
pub(crate) const MAX_SLOTS: usize = 1 << 20;

/// State shared by every connection of one stub.
pub(crate) struct Shared {
    /// The configuration the stub was started with.
    pub cfg: StubConfig,
    /// One permit per upstream slot; tokio's semaphore is FIFO, which gives the internal queue.
    pub slots: Arc<Semaphore>,
    stats: Mutex<StubStats>,
    /// Slot-holding time of every request so far, in microseconds, behind `busy_ms_total`. Only
    /// updated under the `stats` lock, so a snapshot agrees with `served` and `cancelled`.
    busy_us_total: AtomicU64,
    records: Mutex<Records>,
    rng: Mutex<Prng>,
    waiters: Mutex<Waiters>,
    response_ids: AtomicU64,
    /// The context window it claims (0: none), served as llama.cpp's `/props` and vLLM's
    /// `max_model_len`; see [`crate::Stub::set_context_tokens`].
    pub context_tokens: std::sync::atomic::AtomicU32,
}

/// Requests waiting on `/stub/release`, and occupations that a release-all ends early.
#[derive(Default)]
struct Waiters {
    next_id: u64,
    holds: HashMap<u64, (String, oneshot::Sender<()>)>,
    occupations: HashMap<u64, oneshot::Sender<()>>,
}

/// Locks a mutex, ignoring poisoning: the data behind these locks are plain counters and maps that
/// stay consistent even if a holder panicked, and the stub must keep serving.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    /// Creates the state for a stub with `cfg`, refusing a slot count the stub cannot serve.
    pub fn new(cfg: StubConfig) -> std::io::Result<Arc<Self>> {
        Self::with_record_cap(cfg, MAX_REQUEST_RECORDS)
    }

    /// [`Shared::new`] keeping at most `cap` request records, so tests can reach the cap.
    pub fn with_record_cap(cfg: StubConfig, cap: usize) -> std::io::Result<Arc<Self>> {
        if cfg.slots == 0 || cfg.slots > MAX_SLOTS {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("slots must be between 1 and {MAX_SLOTS}, got {}", cfg.slots),
            ));
        }
        Ok(Arc::new(Shared {
            slots: Arc::new(Semaphore::new(cfg.slots)),
            rng: Mutex::new(Prng::new(cfg.seed)),
            stats: Mutex::new(StubStats::default()),
            busy_us_total: AtomicU64::new(0),
            records: Mutex::new(Records::with_cap(cap)),
            waiters: Mutex::new(Waiters::default()),
            response_ids: AtomicU64::new(0),
            context_tokens: std::sync::atomic::AtomicU32::new(0),
            cfg,
        }))
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StubStats {
        let s = lock(&self.stats);
        StubStats {
            busy_ms_total: self.busy_us_total.load(Ordering::Relaxed) / 1000,
            ..s.clone()
        }
    }

    /// Runs `f` on the request records under their lock, e.g. to serialize them without a copy.
    pub fn with_requests<R>(&self, f: impl FnOnce(&RequestLog) -> R) -> R {
        f(lock(&self.records).log())
    }

    /// A copy of the request records kept so far, in completion order.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.records).list().to_vec()
    }

    /// Every request record so far (and the dropped count), leaving the log empty.
    pub fn take_requests(&self) -> RequestLog {
        lock(&self.records).take()
    }

    /// Adds a finished request's record.
    fn record(&self, record: RequestRecord) {
        lock(&self.records).push(record);
    }

    /// A fresh number for a response id; unique within this stub.
    pub fn next_response_id(&self) -> u64 {
        self.response_ids.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Requests holding a slot now: what a batching latency spec slows each step by.
    pub fn in_flight(&self) -> usize {
        lock(&self.stats).in_flight
    }

    /// Counts a model request as received.
    pub fn count_request(&self) {
        lock(&self.stats).requests += 1;
    }

    /// Plans a request's timing with the shared, seeded generator.
    pub fn schedule(
        &self,
        spec: &LatencySpec,
        prompt: u32,
        tokens: u32,
    ) -> crate::latency::Schedule {
        spec.schedule(prompt, tokens, &mut lock(&self.rng))
    }

    /// Waits FIFO for a slot. While waiting the request counts as `queued`; once it has the slot
    /// it counts as `in_flight` until the returned guard is dropped. A request with a `tag` is
    /// recorded when it ends, including when it is dropped while still waiting.
    pub async fn acquire_slot(self: &Arc<Self>, tag: Option<Tag>) -> Option<SlotGuard> {
        let mut queued = QueuedGuard::new(self, tag);
        // Only fails if the semaphore is closed, which the stub never does.
        let permit = self.slots.clone().acquire_owned().await.ok()?;
        let acquired = Instant::now();
        let acquired_unix_ms = crate::records::unix_ms_now();
        let (tag, queued_for) = queued.admit(acquired);
        drop(queued);
        let mut s = lock(&self.stats);
        s.in_flight += 1;
        s.max_in_flight_seen = s.max_in_flight_seen.max(s.in_flight);
        Some(SlotGuard {
            _permit: permit,
            shared: self.clone(),
            outcome: Outcome::Cancelled,
            acquired,
            acquired_unix_ms,
            queued_for,
            tag,
        })
    }

    /// Waits for `n` slots for an occupation and marks them occupied until the guard drops.
    pub async fn occupy(self: &Arc<Self>, n: usize) -> Option<OccupyGuard> {
        let n32 = u32::try_from(n).ok()?;
        let permit = self.slots.clone().acquire_many_owned(n32).await.ok()?;
        lock(&self.stats).occupied += n;
        Some(OccupyGuard {
            _permit: permit,
            shared: self.clone(),
            n,
        })
    }

    /// Registers a hold named `name`; the receiver resolves when it is released.
    pub fn register_hold(self: &Arc<Self>, name: &str) -> (HoldGuard, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let mut w = lock(&self.waiters);
        w.next_id += 1;
        let id = w.next_id;
        w.holds.insert(id, (name.to_owned(), tx));
        let guard = HoldGuard {
            shared: self.clone(),
            id,
        };
        (guard, rx)
    }

    /// Registers an occupation that a release-all should end early.
    pub fn register_occupation(self: &Arc<Self>) -> (OccupationEntry, oneshot::Receiver<()>) {
        let (tx, rx) = oneshot::channel();
        let mut w = lock(&self.waiters);
        w.next_id += 1;
        let id = w.next_id;
        w.occupations.insert(id, tx);
        let entry = OccupationEntry {
            shared: self.clone(),
            id,
        };
        (entry, rx)
    }

    /// Releases holds named `name` (or every hold and occupation if `name` is `None`); returns
    /// how many live waiters were woken.
    pub fn release(&self, name: Option<&str>) -> usize {
        let mut w = lock(&self.waiters);
        let ids: Vec<u64> = w
            .holds
            .iter()
            .filter(|(_, (n, _))| match name {
                None => true,
                Some(want) => want == n,
            })
            .map(|(id, _)| *id)
            .collect();
        let mut woken = 0;
        for id in ids {
            if let Some((_, tx)) = w.holds.remove(&id) {
                woken += usize::from(tx.send(()).is_ok());
            }
        }
        if name.is_none() {
            for (_, tx) in w.occupations.drain() {
                woken += usize::from(tx.send(()).is_ok());
            }
        }
        woken
    }
}

/// Counts a request as `queued` while it waits for a slot. If it is dropped while still holding
/// the request's tag, the client went away before getting a slot: that is recorded as cancelled
/// with no busy time.
struct QueuedGuard<'a> {
    shared: &'a Shared,
    since: Instant,
    tag: Option<Tag>,
}

impl<'a> QueuedGuard<'a> {
    fn new(shared: &'a Shared, tag: Option<Tag>) -> Self {
        lock(&shared.stats).queued += 1;
        QueuedGuard {
            shared,
            since: Instant::now(),
            tag,
        }
    }

    /// The request got its slot at `now`: hands its tag on to the slot guard, with the time
    /// it waited.
    fn admit(&mut self, now: Instant) -> (Option<Tag>, Duration) {
        (self.tag.take(), now.saturating_duration_since(self.since))
    }
}

impl Drop for QueuedGuard<'_> {
    fn drop(&mut self) {
        // Record before the counter drops, so whoever sees `queued` fall also sees the record.
        if let Some(tag) = self.tag.take() {
            let record =
                tag.into_record(self.since.elapsed(), Duration::ZERO, Outcome::Cancelled, 0);
            self.shared.record(record);
        }
        lock(&self.shared.stats).queued -= 1;
    }
}

/// One held slot. Dropping it frees the slot, adds its holding time to `busy_ms_total`, bumps
/// `served`, `cancelled` or neither according to [`SlotGuard::settle`], and writes the request's
/// record if it has a tag; that happens exactly once, whichever path drops it.
pub(crate) struct SlotGuard {
    _permit: OwnedSemaphorePermit,
    shared: Arc<Shared>,
    outcome: Outcome,
    /// When the slot was acquired; busy time runs from here to the drop.
    acquired: Instant,
    /// The same moment on the wall clock, epoch milliseconds, for the request's record.
    acquired_unix_ms: u64,
    /// How long the request waited for the slot.
    queued_for: Duration,
    tag: Option<Tag>,
}

impl SlotGuard {
    /// Records how the request ended; takes effect when the guard is dropped.
    pub fn settle(&mut self, outcome: Outcome) {
        self.outcome = outcome;
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        let busy = self.acquired.elapsed();
        // Record before `in_flight` drops (and before the permit field is dropped after this
        // body), so whoever sees the slot free also sees the record, and records stay in
        // completion order.
        if let Some(tag) = self.tag.take() {
            let record =
                tag.into_record(self.queued_for, busy, self.outcome, self.acquired_unix_ms);
            self.shared.record(record);
        }
        let busy_us = u64::try_from(busy.as_micros()).unwrap_or(u64::MAX);
        let mut s = lock(&self.shared.stats);
        let total = self.shared.busy_us_total.load(Ordering::Relaxed);
        self.shared
            .busy_us_total
            .store(total.saturating_add(busy_us), Ordering::Relaxed);
        s.in_flight -= 1;
        match self.outcome {
            Outcome::Served => s.served += 1,
            Outcome::Cancelled => s.cancelled += 1,
            Outcome::Faulted => {}
        }
    }
}

/// Slots taken by `/stub/occupy`; counted in `occupied` until dropped.
pub(crate) struct OccupyGuard {
    _permit: OwnedSemaphorePermit,
    shared: Arc<Shared>,
    n: usize,
}

impl Drop for OccupyGuard {
    fn drop(&mut self) {
        lock(&self.shared.stats).occupied -= self.n;
    }
}

/// Removes a hold from the registry when its request ends, so dead requests are never counted
/// as released.
pub(crate) struct HoldGuard {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for HoldGuard {
    fn drop(&mut self) {
        lock(&self.shared.waiters).holds.remove(&self.id);
    }
}

/// Removes an occupation from the registry when it ends.
pub(crate) struct OccupationEntry {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for OccupationEntry {
    fn drop(&mut self) {
        lock(&self.shared.waiters).occupations.remove(&self.id);
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
