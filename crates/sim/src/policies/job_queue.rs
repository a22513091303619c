//! `JobQueue`: the FIFO-plus-in-flight bookkeeping the queue-based baselines share (the FIFO
//! gates, seed 000's rule, CoDel).

use std::collections::{BTreeSet, VecDeque};

use crate::policy::Action;

/// A FIFO of admitted jobs and the set of dispatched ones: each id is queued once, dispatched
/// at most once and forgotten exactly once (completion or cancellation).
#[derive(Clone, Debug, Default)]
pub(crate) struct JobQueue {
    /// Queued jobs in arrival order: `(id, arrival_ms)`.
    queued: VecDeque<(u64, u64)>,
    /// Dispatched jobs that have not completed or been cancelled.
    in_flight: BTreeSet<u64>,
}

impl JobQueue {
    /// Queue an admitted job at the tail.
    pub(crate) fn push(&mut self, id: u64, arrival_ms: u64) {
        self.queued.push_back((id, arrival_ms));
    }

    /// Number of queued (not yet dispatched) jobs.
    pub(crate) fn len(&self) -> usize {
        self.queued.len()
    }

    /// True when nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// Arrival time of the oldest queued job.
    pub(crate) fn oldest_arrival(&self) -> Option<u64> {
        self.queued.front().map(|&(_, arrival)| arrival)
    }

    /// Take the oldest queued job out of the queue (the caller dispatches or drops it).
    pub(crate) fn pop_front(&mut self) -> Option<(u64, u64)> {
        self.queued.pop_front()
    }

    /// Record that `id` (already taken out of the queue) now runs upstream.
    pub(crate) fn start(&mut self, id: u64) {
        self.in_flight.insert(id);
    }

    /// Dispatch up to `free` jobs in arrival order.
    pub(crate) fn dispatch_fifo(&mut self, free: u32, out: &mut Vec<Action>) {
        for _ in 0..free {
            let Some((id, _)) = self.queued.pop_front() else {
                break;
            };
            self.start(id);
            out.push(Action::Dispatch(id));
        }
    }

    /// A dispatched job finished; unknown ids are ignored.
    pub(crate) fn complete(&mut self, id: u64) {
        self.in_flight.remove(&id);
    }

    /// Forget `id` wherever it is; false if the id is not (or no longer) known.
    pub(crate) fn cancel(&mut self, id: u64) -> bool {
        if let Some(pos) = self.queued.iter().position(|&(q, _)| q == id) {
            self.queued.remove(pos);
            return true;
        }
        self.in_flight.remove(&id)
    }
}
