//! Headroom for work that cannot wait: trunk reservation on a pool's slots.
//!
//! A server does not preempt. When a batch burst takes every free slot, an interactive
//! request arriving a moment later waits for a batch job to end (seconds) although its own
//! deadline is a few seconds: it is refused, and the batch work could have waited minutes.
//! So a job of a lower class starts only while enough slots stay free after it for the
//! higher classes' arrivals: the pool's *headroom*, less the slots those classes already
//! hold (their running jobs are their reserve in use). Held-back work stays queued (it has
//! the slack; the admission projected its wait with the headroom out of its reach) and
//! starts as soon as slots free up past the headroom; the higher classes still take every
//! slot when they need it. A lower class thus always keeps `slots - headroom` slots when the
//! higher ones are quiet, and at least one slot (the headroom is capped at the slots less
//! one).
//!
//! `headroom = "learned"` (the default) sizes it from the higher classes' recent demand as
//! the wait forecast measures it ([`Gate::higher_demand`]: admitted work plus a share of the
//! refused, over the pool's forecast window): their mean busy slots `m`, plus half of `sqrt(m)`
//! for the spread of concurrent arrivals, rounded up; 0 while they have asked for nothing.
//! A number pins it, `"off"` turns it off. The top-priority classes of a pool have nothing
//! above them and are never held; neither is anything under `admit_always` or `shadow` (the
//! gate must not change what it only watches).

use super::*;
use crate::config::Headroom;

/// The learned headroom's margin over the higher classes' mean busy slots, in units of its
/// square root (concurrent arrivals of a Poisson-like stream spread about that much).
const LEARNED_SPREAD: f64 = 0.5;

impl Gate {
    /// The headroom kept on `pool` for the classes above `priority`: learned or pinned, at
    /// most the pool's slots less one.
    pub(super) fn headroom_target(&self, now: Millis, pool: PoolId, priority: u32) -> u32 {
        if self.cfg.admit_always || self.cfg.shadow {
            return 0;
        }
        let p = &self.pools[pool.0];
        // Lanes are ordered highest priority first.
        let above = p
            .classes
            .first()
            .is_some_and(|l| self.classes[l.0].priority > priority);
        if !above {
            return 0;
        }
        let n = match p.headroom {
            Headroom::Off => 0,
            Headroom::Slots(n) => n,
            Headroom::Learned => {
                let busy = self.higher_demand(now, pool, priority) * f64::from(p.slots);
                if busy > 0.0 {
                    (busy + LEARNED_SPREAD * busy.sqrt())
                        .ceil()
                        .min(f64::from(u32::MAX)) as u32
                } else {
                    0
                }
            }
        };
        n.min(p.slots.saturating_sub(1))
    }

    /// Slots that must stay free after a job of `priority` starts on `pool`: the headroom
    /// less what the classes above already run.
    pub(super) fn headroom_now(&self, now: Millis, pool: PoolId, priority: u32) -> u32 {
        let target = self.headroom_target(now, pool, priority);
        if target == 0 {
            return 0;
        }
        let held = self.pools[pool.0]
            .in_flight
            .values()
            .filter(|r| {
                self.classes
                    .get(r.lane.0)
                    .is_some_and(|l| l.priority > priority)
            })
            .count();
        target.saturating_sub(u32::try_from(held).unwrap_or(u32::MAX))
    }

    /// A queued job must wait for the headroom: it has no deadline (a job with one was
    /// promised a wait on the slots as they are, and is never held), and starting it now
    /// would leave fewer slots free than the headroom asks.
    pub(super) fn held_for_headroom(&self, now: Millis, pool: PoolId, job: &Job) -> bool {
        if job.deadline.is_some() || job.first_token_deadline.is_some() {
            return false;
        }
        let keep = self.headroom_now(now, pool, self.classes[job.class.0].priority);
        keep > 0 && self.pools[pool.0].free_now(now) <= keep
    }
}
