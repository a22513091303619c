//! Displacement: a newcomer that does not fit may take the place of a longer job of its class
//! admitted moments ago (Moore-Hodgson's "drop the longest", one for one).

use super::*;

impl Gate {
    /// The queued job a newcomer of `lane` that does not fit may displace: the longest one
    /// of the lane that is longer than the newcomer, was admitted within the lane's
    /// `displace_within_ms`, is not protected (warm-up, reservation), and without which the
    /// newcomer's projected wait fits its slack. Moore and Hodgson's rule for the most jobs on
    /// time (drop the longest) restricted to one-for-one swaps of recent admissions, so the
    /// queue never holds fewer jobs and a displaced client hears it soon after it arrived.
    /// With the newcomer's wait without it, and that wait's forecast part. O(log queued +
    /// slots), amortised: jobs leave the window in arrival order and are pruned once.
    pub(super) fn displacement_victim(
        &mut self,
        now: Millis,
        lane: LaneId,
        e: &Eval,
    ) -> Option<(JobId, u64, u64)> {
        let window = self.classes[lane.0].displace_within_ms?;
        let slack = e.slack_ms?;
        let c = &mut self.classes[lane.0];
        c.queue.prune_displaceable(now.saturating_sub(window));
        let (longest, id) = c.queue.longest_recent()?;
        // "Longer" by the measure the newcomer's own check used (for a sizeless request, an
        // upper quantile of its class), so a swap never trades a job for a likely longer one.
        if longest <= e.own_service_ms {
            return None;
        }
        let priority = c.priority;
        let (work, count, _) = self.ahead(e.pool, priority);
        let wait = self.projected_wait(
            e.pool,
            now,
            work.saturating_sub(longest),
            count.saturating_sub(1),
        );
        let forecast = self.forecast_wait(now, lane, wait);
        let wait = wait.saturating_add(forecast);
        (i128::from(wait) <= i128::from(slack)).then_some((id, wait, forecast))
    }

    /// Refuse a queued job to make room for another: release its hold (nothing was spent)
    /// and tell its client (`displaced`) when a retry could fit: a retry has its whole
    /// relative deadline again (not so an absolute one), and would wait behind what is
    /// queued now.
    pub(super) fn displace(&mut self, now: Millis, id: JobId) {
        let Some(job) = self.jobs.remove(&id) else {
            return;
        };
        self.unqueue(id, &job);
        self.settle_hold(now, &job, Settle::Cancel(0));
        let priority = self.classes[job.class.0].priority;
        let (work, count, _) = self.ahead(job.pool, priority);
        let wait = self.projected_wait(job.pool, now, work, count);
        let budget = job
            .deadline
            .map(|d| signed_diff(d, job.arrived_at).saturating_sub(job.est.service_ms as i64));
        let (after, useful) = self.retry_after(
            id,
            Reason::ProjectedWaitExceedsSlack,
            wait,
            budget,
            count,
            job.pool,
            false,
        );
        let mut ev = self.drop_event(now, id, &job, job.pool, 0, Reason::Displaced);
        if let Event::Drop {
            retry_after_ms,
            should_retry,
            ..
        } = &mut ev
        {
            *retry_after_ms = Some(after);
            *should_retry = useful && !job.deadline_is_absolute;
        }
        self.events.push_back(ev);
    }
}
