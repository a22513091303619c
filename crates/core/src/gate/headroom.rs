//! Headroom for work that cannot wait: trunk reservation on a pool's slots.
//!
//! A server does not preempt. When a batch burst takes every free slot, an interactive
//! request arriving a moment later waits for a batch job to end (seconds) although its own
//! deadline is a few seconds: it is refused, and the batch work could have waited minutes.
//! So a job of a lower class starts only while enough slots stay free after it for the
//! higher classes' arrivals: the pool's *headroom*, less the slots those classes already
//! hold (their running jobs are their reserve in use). Only work without a deadline is held
//! (work with one was promised a wait on the slots as they are); it stays queued and starts
//! as soon as slots free up past the headroom, while work queued behind it that may start
//! does; the higher classes still take every slot when they need it. Held work ages in its
//! queue like work behind busy slots: a class with `max_queue_age_ms` or a full `max_queued`
//! refuses newcomers on those rules meanwhile (the sheddable classes shed first). A lower class thus always keeps `slots - headroom` slots when the
//! higher ones are quiet, and at least one slot (the headroom is capped at the slots less
//! one).
//!
//! `headroom = "learned"` (the default) sizes it from the higher classes' recent demand as
//! the wait forecast measures it ([`Gate::higher_demand`]: admitted work plus a share of the
//! refused, over the pool's forecast window): their mean busy slots `m`, plus half of `sqrt(m)`
//! for the spread of concurrent arrivals, rounded; 0 while they have asked for little.
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
        // A live class above it (a retired or disabled one takes no new work, so nothing is
        // kept for it).
        let above = p
            .classes
            .iter()
            .map(|l| &self.classes[l.0])
            .take_while(|l| l.priority > priority)
            .any(|l| !l.retired && l.enabled);
        if !above {
            return 0;
        }
        let n = match p.headroom {
            Headroom::Off => 0,
            Headroom::Slots(n) => n,
            Headroom::Learned => {
                // Rounded, not raised: one request of the class above over a window is no
                // reason to keep a slot for five minutes.
                let busy = self.higher_demand(now, pool, priority) * f64::from(p.slots);
                (busy + LEARNED_SPREAD * busy.sqrt())
                    .round()
                    .clamp(0.0, f64::from(u32::MAX)) as u32
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
        let running_above = self.pools[pool.0]
            .in_flight
            .values()
            .filter(|r| {
                self.classes
                    .get(r.lane.0)
                    .is_some_and(|l| l.priority > priority)
            })
            .count();
        target.saturating_sub(u32::try_from(running_above).unwrap_or(u32::MAX))
    }

    /// A queued job must wait for the headroom: it has no deadline (a job with one was
    /// promised a wait on the slots as they are, and is never held), and starting it now
    /// would leave fewer slots free than the headroom asks.
    pub(super) fn held_for_headroom(&self, now: Millis, pool: PoolId, job: &Job) -> bool {
        if job.deadline.is_some() || job.first_token_deadline.is_some() {
            return false;
        }
        let keep = self.headroom_now(now, pool, self.classes[job.class.0].priority);
        // The gate's own count (neighbours by the server's gauges never shut a slot: see
        // `startable`), so a neighbour's load cannot hold best-effort work forever.
        keep > 0
            && self.pools[pool.0].free_now_seen(now, super::endpoints::Neighbours::Ignored) <= keep
    }
}
