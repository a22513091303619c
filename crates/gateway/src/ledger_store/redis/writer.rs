//! The Redis store's writer thread: group commit of the queued records, one put-script call
//! per round, a failed round kept at the head of the queue and retried with backoff, and the
//! answers to flushes and loads once what they wait for is out of the queue.

use super::super::{Ack, Counters, StoreError};
use super::link::Link;
use super::load;
use super::put::{PutBatch, PutReply};
use super::shared::Shared;
use super::{BACKOFF_MAX, BACKOFF_MIN, BATCH_MAX, FLUSH_WAITERS_MAX, QUEUE_MAX};
use slackgate_core::ledger::HoldRecord;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// What the writer thread is asked to do, in order.
pub(super) enum Msg {
    Write(Vec<HoldRecord>),
    Flush(Ack),
    Load(mpsc::SyncSender<Result<Vec<HoldRecord>, StoreError>>),
}

/// A flush waiting for the first `upto` records the writer received to be settled, until
/// `until`: its caller gives up then (the store's timeout), so it is answered and dropped.
struct Waiter {
    upto: u64,
    ack: Ack,
    until: Instant,
}

/// The writer thread's state.
pub(super) struct Writer {
    link: Link,
    shared: Arc<Shared>,
    /// Records not yet committed, oldest first.
    queue: VecDeque<HoldRecord>,
    /// Records received so far (queued or dropped); a flush waits for this many to be out
    /// of the queue.
    received: u64,
    waiters: Vec<Waiter>,
    loads: Vec<mpsc::SyncSender<Result<Vec<HoldRecord>, StoreError>>>,
    backoff: Duration,
    retry_at: Option<Instant>,
    lost_since_flush: u64,
    last_error: String,
    /// Kinds already reported on stderr (each is logged once, then only counted).
    logged: crate::ledger_store::NotedKinds,
}

impl Writer {
    pub(super) fn new(link: Link, shared: Arc<Shared>) -> Writer {
        Writer {
            link,
            shared,
            queue: VecDeque::new(),
            received: 0,
            waiters: Vec::new(),
            loads: Vec::new(),
            backoff: BACKOFF_MIN,
            retry_at: None,
            lost_since_flush: 0,
            last_error: String::new(),
            logged: Default::default(),
        }
    }

    pub(super) fn run(mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            let first = match self.idle_wait() {
                None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                Some(d) => rx.recv_timeout(d),
            };
            let mut open = true;
            match first {
                Ok(msg) => self.take(msg),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => open = false,
            }
            // Everything already queued joins this round (group commit).
            while open {
                match rx.try_recv() {
                    Ok(msg) => self.take(msg),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => open = false,
                }
            }
            if !open {
                self.finish();
                return;
            }
            let due = match self.retry_at {
                Some(t) => Instant::now() >= t,
                None => true,
            };
            if !self.queue.is_empty() && due {
                self.commit_round();
            }
            self.answer_waiters();
            self.drop_expired_waiters();
            for reply in std::mem::take(&mut self.loads) {
                let _ = reply.send(self.load());
            }
            self.shared
                .flushes_waiting
                .store(self.waiters.len() as u64, Ordering::Relaxed);
        }
    }

    /// How long to wait for a message: forever when idle, until the retry when backing off
    /// (or the first waiter's deadline, if sooner), not at all when there is something to
    /// send.
    fn idle_wait(&self) -> Option<Duration> {
        if self.queue.is_empty() {
            return None;
        }
        let until = match self.retry_at {
            Some(t) => t,
            None => return Some(Duration::ZERO),
        };
        let until = self.waiters.first().map_or(until, |w| w.until.min(until));
        Some(until.saturating_duration_since(Instant::now()))
    }

    fn take(&mut self, msg: Msg) {
        match msg {
            Msg::Write(records) => {
                let n = records.len();
                self.received += n as u64;
                let room = QUEUE_MAX.saturating_sub(self.queue.len());
                let dropped = n.saturating_sub(room);
                self.queue.extend(records.into_iter().take(room));
                if dropped > 0 {
                    Counters::sub(&self.shared.counters.pending, dropped as u64);
                    self.lose(
                        dropped as u64,
                        "queue_full",
                        &format!("more than {QUEUE_MAX} records queued while Redis is away"),
                    );
                }
            }
            Msg::Flush(ack) => self.wait(ack),
            Msg::Load(reply) => self.loads.push(reply),
        }
    }

    /// Keep a flush until what was written before it is settled, or its caller's timeout.
    /// At [`FLUSH_WAITERS_MAX`] (a flood of flushes while Redis is away) it is answered at
    /// once: it could only time out.
    fn wait(&mut self, ack: Ack) {
        if self.waiters.len() >= FLUSH_WAITERS_MAX && self.settled() < self.received {
            ack.send(Err(self.shared.unavailable(format!(
                "{FLUSH_WAITERS_MAX} flushes already wait for Redis ({})",
                self.last_error
            ))));
            return;
        }
        self.waiters.push(Waiter {
            upto: self.received,
            ack,
            until: Instant::now() + self.shared.timeout,
        });
    }

    /// Answer and drop the waiters whose callers have given up (past the store's timeout,
    /// or gone): while Redis is down nothing else would, and every request that waits for
    /// durability adds one.
    fn drop_expired_waiters(&mut self) {
        let now = Instant::now();
        // Waiters are kept in the order they came, so by deadline: the first says whether
        // any is due (one scan per timeout, not per round).
        if self.waiters.first().is_none_or(|w| w.until > now) {
            return;
        }
        let (expired, kept): (Vec<Waiter>, Vec<Waiter>) = std::mem::take(&mut self.waiters)
            .into_iter()
            .partition(|w| w.until <= now || w.ack.abandoned());
        self.waiters = kept;
        for w in expired {
            w.ack.send(Err(self.shared.unavailable(format!(
                "not committed within {} ms ({})",
                self.shared.timeout.as_millis(),
                self.last_error
            ))));
        }
    }

    /// Records out of the queue (committed or given up on).
    fn settled(&self) -> u64 {
        self.received - self.queue.len() as u64
    }

    fn answer_waiters(&mut self) {
        let settled = self.settled();
        if !self.waiters.iter().any(|w| w.upto <= settled) {
            return;
        }
        let lost = std::mem::take(&mut self.lost_since_flush);
        let (ready, waiting): (Vec<Waiter>, Vec<Waiter>) = std::mem::take(&mut self.waiters)
            .into_iter()
            .partition(|w| w.upto <= settled);
        self.waiters = waiting;
        for w in ready {
            w.ack.send(match lost {
                0 => Ok(()),
                records => Err(StoreError::Lost {
                    records,
                    error: self.last_error.clone(),
                }),
            });
        }
    }

    /// Send the head of the queue (at most [`BATCH_MAX`] records) in one script call.
    /// Returns whether it was committed.
    fn commit_round(&mut self) -> bool {
        let n = self.queue.len().min(BATCH_MAX);
        let batch = PutBatch::encode(self.queue.range(..n), self.shared.hold_ttl_ms);
        let unstorable = batch.unstorable;
        let outcome = batch.send(&mut self.link, &self.shared.keys, self.shared.fence());
        match outcome {
            Ok(reply) => {
                self.shared.saw(true);
                self.backoff = BACKOFF_MIN;
                self.retry_at = None;
                self.queue.drain(..n);
                let c = &self.shared.counters;
                Counters::sub(&c.pending, n as u64);
                Counters::add(&c.records_written, n as u64 - unstorable);
                Counters::add(&c.batches_committed, 1);
                if unstorable > 0 {
                    self.lose(unstorable, "unstorable", "a record could not be encoded");
                }
                self.count_conflicts(&reply);
                self.shared.remember_refused(reply.refused);
                true
            }
            Err(e) => {
                self.shared.saw(false);
                Counters::add(&self.shared.counters.write_errors, 1);
                self.last_error = e.to_string();
                let kind = format!("error:{:?}", e.kind());
                self.log_once(
                    &kind,
                    &format!("write failed (kept queued, retried with backoff): {e}"),
                );
                self.retry_at = Some(Instant::now() + self.backoff);
                self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                false
            }
        }
    }

    fn count_conflicts(&mut self, r: &PutReply) {
        let conflicts = r.terminal_conflicts + r.held_conflicts + r.fenced;
        Counters::add(&self.shared.counters.conflicts, conflicts);
        if r.fenced > 0 {
            self.log_once(
                "conflict:fenced",
                &format!(
                    "refused {} writes of other replicas' holds: this replica no longer leads \
                     under the lease's current epoch (a deposed leader writing late)",
                    r.fenced
                ),
            );
        }
        if r.terminal_conflicts > 0 {
            self.log_once(
                "conflict:terminal",
                &format!(
                    "refused a second terminal state for one hold (the first wins; a deposed \
                     leader settling late?): key {}",
                    r.first_terminal
                ),
            );
        }
        if r.held_conflicts > 0 {
            self.log_once(
                "conflict:held",
                &format!(
                    "refused a new hold of a key held or done elsewhere: key {}",
                    r.first_held
                ),
            );
        }
        if r.unreadable > 0 {
            self.lose(
                r.unreadable,
                "unreadable",
                "Redis could not decode a record",
            );
        }
    }

    /// Commit everything queued (one attempt per batch), then read the whole hash.
    fn load(&mut self) -> Result<Vec<HoldRecord>, StoreError> {
        while !self.queue.is_empty() {
            if !self.commit_round() {
                return Err(self.shared.unavailable(format!(
                    "load: cannot commit the queued records first: {}",
                    self.last_error
                )));
            }
        }
        load::scan_all(&mut self.link, &self.shared)
    }

    /// The store is being dropped: try to commit what is queued for at most the timeout,
    /// then count the rest lost and answer everyone.
    fn finish(&mut self) {
        let give_up = Instant::now() + self.shared.timeout;
        while !self.queue.is_empty() && Instant::now() < give_up {
            if !self.commit_round() {
                std::thread::sleep(
                    self.backoff
                        .min(give_up.saturating_duration_since(Instant::now())),
                );
            }
        }
        let left = self.queue.len() as u64;
        if left > 0 {
            self.queue.clear();
            Counters::sub(&self.shared.counters.pending, left);
            self.lose(
                left,
                "closed",
                "the store closed while Redis was unavailable",
            );
        }
        self.answer_waiters();
        for reply in std::mem::take(&mut self.loads) {
            let _ = reply.send(Err(StoreError::WriterStopped));
        }
    }

    fn lose(&mut self, records: u64, kind: &str, why: &str) {
        Counters::add(&self.shared.counters.records_lost, records);
        self.lost_since_flush += records;
        self.last_error = why.to_owned();
        self.log_once(kind, &format!("{records} records lost: {why}"));
    }

    fn log_once(&mut self, kind: &str, message: &str) {
        self.logged.note(&self.shared.shown, kind, message);
    }
}
