//! One class's queue: earliest deadline first, with an age index and a running work sum.
//!
//! The three views are kept in step on every push and remove so that the questions a decision
//! asks (how much work is queued, how old is the oldest job, who goes next) are answered in
//! O(log n) or O(1), never by walking the queue.

use super::JobId;
use crate::Millis;
use std::collections::{BTreeMap, BTreeSet};

/// Dispatch order key: deadline (jobs without one sort last), then arrival sequence.
pub(crate) type QueueKey = (Millis, u64);

#[derive(Debug, Default, Clone)]
pub(crate) struct ClassQueue {
    order: BTreeMap<QueueKey, JobId>,
    by_age: BTreeSet<(Millis, u64)>,
    work_ms: u64,
    /// Jobs with a deadline (key below `Millis::MAX`) and their summed work: `tick` walks only
    /// these, and adds best-effort work in bulk.
    deadlined: usize,
    deadlined_work_ms: u64,
    /// Jobs a newcomer may displace (lanes with `displace_within_ms`; see
    /// `Gate::displacement_victim`), by enqueue time so those admitted before the window can
    /// be pruned in order, and by estimated size so the longest is found in O(log n).
    recent: BTreeSet<(Millis, u64, u64)>,
    by_size: BTreeSet<(u64, Millis, u64)>,
}

impl ClassQueue {
    /// Queue a job. `displaceable`: it may be displaced by a shorter newcomer while it is
    /// recent (see [`ClassQueue::longest_recent`]). Sequence numbers are job ids.
    pub(crate) fn push(
        &mut self,
        key: QueueKey,
        enqueued_at: Millis,
        id: JobId,
        est_ms: u64,
        displaceable: bool,
    ) {
        if self.order.insert(key, id).is_some() {
            return; // same key twice: keys embed a unique sequence number, so never happens
        }
        if displaceable {
            self.recent.insert((enqueued_at, key.1, est_ms));
            self.by_size.insert((est_ms, enqueued_at, key.1));
        }
        self.by_age.insert((enqueued_at, key.1));
        self.work_ms = self.work_ms.saturating_add(est_ms);
        if key.0 != Millis::MAX {
            self.deadlined += 1;
            self.deadlined_work_ms = self.deadlined_work_ms.saturating_add(est_ms);
        }
    }

    pub(crate) fn remove(&mut self, key: QueueKey, enqueued_at: Millis, est_ms: u64) -> bool {
        if self.order.remove(&key).is_none() {
            return false;
        }
        self.by_age.remove(&(enqueued_at, key.1));
        if self.recent.remove(&(enqueued_at, key.1, est_ms)) {
            self.by_size.remove(&(est_ms, enqueued_at, key.1));
        }
        self.work_ms = self.work_ms.saturating_sub(est_ms);
        if key.0 != Millis::MAX {
            self.deadlined -= 1;
            self.deadlined_work_ms = self.deadlined_work_ms.saturating_sub(est_ms);
        }
        true
    }

    pub(crate) fn front(&self) -> Option<(QueueKey, JobId)> {
        self.order.first_key_value().map(|(k, v)| (*k, *v))
    }

    /// The queue in dispatch order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (QueueKey, JobId)> + '_ {
        self.order.iter().map(|(k, v)| (*k, *v))
    }

    pub(crate) fn oldest_enqueued_at(&self) -> Option<Millis> {
        self.by_age.first().map(|(t, _)| *t)
    }

    /// Forget displaceable jobs enqueued before `since`: they are out of the window for good
    /// (time only moves forward). Amortised O(log n) per job.
    pub(crate) fn prune_displaceable(&mut self, since: Millis) {
        while let Some(&(at, seq, est)) = self.recent.first() {
            if at >= since {
                break;
            }
            self.recent.pop_first();
            self.by_size.remove(&(est, at, seq));
        }
    }

    /// The longest displaceable job still in the window (ties: the most recently queued),
    /// with its estimated size. Call [`ClassQueue::prune_displaceable`] first.
    pub(crate) fn longest_recent(&self) -> Option<(u64, JobId)> {
        self.by_size.last().map(|&(est, _, seq)| (est, JobId(seq)))
    }

    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Every queued job, in dispatch order.
    pub(crate) fn iter_all(&self) -> impl Iterator<Item = (QueueKey, JobId)> + '_ {
        self.order.iter().map(|(k, v)| (*k, *v))
    }

    pub(crate) fn work_ms(&self) -> u64 {
        self.work_ms
    }

    /// Jobs without a deadline: (count, summed work).
    pub(crate) fn best_effort(&self) -> (usize, u64) {
        (
            self.order.len() - self.deadlined,
            self.work_ms.saturating_sub(self.deadlined_work_ms),
        )
    }

    /// Jobs with a deadline, earliest first (they sort before every best-effort job).
    pub(crate) fn iter_deadlined(&self) -> impl Iterator<Item = (QueueKey, JobId)> + '_ {
        self.order.range(..(Millis::MAX, 0)).map(|(k, v)| (*k, *v))
    }

    /// Jobs with a deadline queued.
    pub(crate) fn deadlined(&self) -> usize {
        self.deadlined
    }

    pub(crate) fn has_deadlined(&self) -> bool {
        self.deadlined > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_views_in_step() {
        let mut q = ClassQueue::default();
        q.push((500, 1), 10, JobId(1), 100, false);
        q.push((200, 2), 20, JobId(2), 50, false);
        q.push((Millis::MAX, 3), 5, JobId(3), 7, false);
        assert_eq!(q.front(), Some(((200, 2), JobId(2))));
        assert_eq!(q.oldest_enqueued_at(), Some(5));
        assert_eq!(q.work_ms(), 157);
        assert!(q.remove((Millis::MAX, 3), 5, 7));
        assert!(
            !q.remove((Millis::MAX, 3), 5, 7),
            "second remove is a no-op"
        );
        assert_eq!(q.oldest_enqueued_at(), Some(10));
        assert_eq!(q.work_ms(), 150);
        assert_eq!(q.len(), 2);
        assert_eq!(q.best_effort(), (0, 0));
        q.push((Millis::MAX, 4), 30, JobId(4), 9, false);
        assert_eq!(q.best_effort(), (1, 9));
        let dl: Vec<_> = q.iter_deadlined().map(|(_, id)| id).collect();
        assert_eq!(dl, vec![JobId(2), JobId(1)]);
        assert_eq!(q.iter_all().count(), 3);
    }

    #[test]
    fn finds_the_longest_recent_displaceable_job_and_forgets_old_ones() {
        let mut q = ClassQueue::default();
        q.push((900, 1), 100, JobId(1), 300, true);
        q.push((900, 2), 200, JobId(2), 500, true);
        q.push((900, 3), 300, JobId(3), 900, false); // a reservation: never displaced
        q.push((900, 4), 400, JobId(4), 500, true);
        // Ties on size go to the most recently queued.
        assert_eq!(q.longest_recent(), Some((500, JobId(4))));
        assert!(q.remove((900, 4), 400, 500));
        assert_eq!(q.longest_recent(), Some((500, JobId(2))));
        // The window moves past job 2 (queued at 200): job 1 went before it.
        q.prune_displaceable(201);
        assert_eq!(q.longest_recent(), None);
        q.push((900, 5), 500, JobId(5), 50, true);
        assert_eq!(q.longest_recent(), Some((50, JobId(5))));
        // Pruning does not touch the queue itself.
        assert_eq!(q.len(), 4);
        // Pruned jobs leave cleanly.
        assert!(q.remove((900, 1), 100, 300));
        assert_eq!(q.longest_recent(), Some((50, JobId(5))));
    }
}
