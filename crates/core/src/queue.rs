//! One class's queue: earliest deadline first, with an age index and a running work sum.
//!
//! The three views are kept in step on every push and remove so that the questions a decision
//! asks (how much work is queued, how old is the oldest job, who goes next) are answered in
//! O(log n) or O(1), never by walking the queue.

use crate::gate::JobId;
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
}

impl ClassQueue {
    pub(crate) fn push(&mut self, key: QueueKey, enqueued_at: Millis, id: JobId, est_ms: u64) {
        if self.order.insert(key, id).is_some() {
            return; // same key twice: keys embed a unique sequence number, so never happens
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

    pub(crate) fn oldest_enqueued_at(&self) -> Option<Millis> {
        self.by_age.first().map(|(t, _)| *t)
    }

    /// Jobs enqueued at or after `since`, oldest first. Sequence numbers are job ids.
    pub(crate) fn enqueued_since(&self, since: Millis) -> impl Iterator<Item = JobId> + '_ {
        self.by_age.range((since, 0)..).map(|&(_, seq)| JobId(seq))
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
        q.push((500, 1), 10, JobId(1), 100);
        q.push((200, 2), 20, JobId(2), 50);
        q.push((Millis::MAX, 3), 5, JobId(3), 7);
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
        q.push((Millis::MAX, 4), 30, JobId(4), 9);
        assert_eq!(q.best_effort(), (1, 9));
        let dl: Vec<_> = q.iter_deadlined().map(|(_, id)| id).collect();
        assert_eq!(dl, vec![JobId(2), JobId(1)]);
        assert_eq!(q.iter_all().count(), 3);
    }
}
