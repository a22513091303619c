//! The work that will overtake a request while it waits.
//!
//! The projected wait counts the work queued and running ahead of a request *now*. A request
//! of a lower priority also waits for the higher-priority work that arrives while it waits:
//! every such arrival goes ahead of it. Without that, a batch request is admitted on a wait of
//! a few seconds, then the interactive stream keeps overtaking it until its slack is gone and
//! it is dropped after minutes: an admission that turns into a refusal.
//!
//! In a fluid model, a request that sees `W0` of work ahead spread over the slots, while
//! higher-priority work takes a share `rho` of the pool, starts when `W = W0 + rho * W`:
//! `W = W0 / (1 - rho)` (priority queueing's inflation of the base wait by the higher-priority
//! load). The forecast part of the wait is `W - W0`.
//!
//! `rho` is the higher classes' recent *demand*: per bucket of the pool's window
//! (`forecast_window_ms`), the estimated work they admitted plus a share
//! (`forecast_refused_weight`) of what they were refused for want of capacity, capped at what
//! the slots can serve in that bucket (more than that is not served ahead of anyone), and
//! averaged over the window. Counting refused work is what tells a saturated higher class
//! (it would take every slot it gets) from a light one: its admitted work alone shrinks as
//! lower work occupies slots, which would invite yet more lower work.
//!
//! Work the gate did not send counts the same way, for every lane: when the servers' own
//! metrics show neighbours (see [`super::endpoints`]), the slots they held and the requests
//! they queued over the window are their demand, and their requests keep arriving straight at
//! the server while the gate's wait (they take a freed slot before the gate's next job). So
//! `rho` is the higher classes' demand plus the neighbours'.
//!
//! A top-priority lane has nothing above it and, without neighbours, gets no forecast; neither
//! does a request that starts at once (`W0 = 0`: nothing overtakes a job that is running). Pure integer
//! bookkeeping in the windows (no `exp`, so the same inputs give the same decisions on every
//! machine); O(lanes of the pool x buckets) per decision.

use super::*;

/// Buckets in a demand window.
pub(super) const FORECAST_BUCKETS: usize = 12;
/// Buckets kept: the window's, plus the one it is sliding out of (the window starts inside it).
const RING: usize = FORECAST_BUCKETS + 1;
/// The higher-priority share counted at most: at 1 the lower class would never start, and
/// its wait would be infinite; this caps the inflation at 1 / (1 - 0.98) = 50x.
pub(super) const MAX_RHO: f64 = 0.98;

/// Estimated work (ms) recorded per bucket of `bucket_ms` over the last [`FORECAST_BUCKETS`]
/// buckets and the one before, in a ring aligned on multiples of `bucket_ms`: O(1) to record
/// and to read one bucket.
#[derive(Clone, Debug, Default)]
pub(super) struct RateWindow {
    buckets: [u64; RING],
    bucket_ms: u64,
    /// Index of the bucket that `head_start` opens.
    head: usize,
    /// Start of the newest bucket.
    head_start: Millis,
    /// When the first work was recorded: buckets before it are not history, they are
    /// before the lane existed.
    since: Option<Millis>,
}

impl RateWindow {
    /// Record `work_ms` of estimated work at `now`, in buckets of `bucket_ms` (a new width
    /// starts the window again).
    pub(super) fn record(&mut self, now: Millis, work_ms: u64, bucket_ms: u64) {
        let bucket_ms = bucket_ms.max(1);
        let start = now - now % bucket_ms;
        if bucket_ms != self.bucket_ms {
            *self = RateWindow {
                bucket_ms,
                head_start: start,
                ..RateWindow::default()
            };
        }
        if start > self.head_start {
            let steps = (start - self.head_start) / bucket_ms;
            if steps >= RING as u64 {
                self.buckets = [0; RING];
            } else {
                for _ in 0..steps {
                    self.head = (self.head + 1) % RING;
                    self.buckets[self.head] = 0;
                }
            }
            self.head_start = start;
        }
        self.since.get_or_insert(now);
        self.buckets[self.head] = self.buckets[self.head].saturating_add(work_ms);
    }

    /// Work recorded in the bucket that starts at `start` (0 outside the ring or for a
    /// different width).
    pub(super) fn at(&self, start: Millis, bucket_ms: u64) -> u64 {
        if bucket_ms != self.bucket_ms || start > self.head_start {
            return 0;
        }
        let back = (self.head_start - start) / bucket_ms;
        if back >= RING as u64 {
            return 0;
        }
        self.buckets[(self.head + RING - back as usize) % RING]
    }

    /// When work was first recorded in buckets of `bucket_ms` (`None`: never, or in another
    /// width, which is no history for this one).
    pub(super) fn since(&self, bucket_ms: u64) -> Option<Millis> {
        self.since.filter(|_| self.bucket_ms == bucket_ms)
    }
}

impl Gate {
    /// The part of the wait of a request on `lane` that higher-priority arrivals will add
    /// while it waits `base_wait`: `base_wait * rho / (1 - rho)`, `rho` the higher classes'
    /// share of the lane's pool (see the module docs); 0 for a lane without `forecast`.
    pub(super) fn forecast_wait(&self, now: Millis, lane: LaneId, base_wait: u64) -> u64 {
        let l = &self.classes[lane.0];
        if base_wait == 0 || !l.forecast {
            return 0;
        }
        let rho = (self.higher_demand(now, l.pool, l.priority)
            + self.neighbour_demand(now, l.pool))
        .min(MAX_RHO);
        if rho <= 0.0 {
            return 0;
        }
        (base_wait as f64 * rho / (1.0 - rho)).round().min(1e15) as u64
    }

    /// The share of `pool`'s slots that classes above `priority` asked for over the window
    /// ending at `now`: each bucket's demand capped at what the slots serve in a bucket, the
    /// bucket the window starts inside weighted by the part of it inside, over the window's
    /// length (or the time since the first record, if shorter: a fresh gate is not diluted by
    /// a window of nothing; at least a quarter bucket). See the module docs.
    pub(super) fn higher_demand(&self, now: Millis, pool: PoolId, priority: u32) -> f64 {
        let p = &self.pools[pool.0];
        let width = p.forecast_bucket_ms.max(1);
        // Lanes are ordered highest priority first; a lane retired by a reload takes no new
        // work, so its history says nothing of what will arrive.
        let higher = || {
            p.classes
                .iter()
                .map(|l| &self.classes[l.0])
                .take_while(move |l| l.priority > priority)
                .filter(|l| !l.retired)
        };
        let since = higher()
            .flat_map(|l| [l.admitted.since(width), l.refused.since(width)])
            .flatten()
            .min();
        demand_share(p, now, since, |start| {
            higher()
                .map(|l| {
                    l.admitted.at(start, width) as f64
                        + p.forecast_refused_weight * l.refused.at(start, width) as f64
                })
                .sum()
        })
    }

    /// The share of `pool`'s slots the servers' neighbours take (0 without a server
    /// signal): what they held or queued for over the window ending at `now` (as
    /// [`Gate::higher_demand`]), or what they hold and queue for now, whichever is more.
    /// Neighbours come in bursts the window averages away; while one lasts, the ones there
    /// now are the best guess of what keeps arriving.
    pub(super) fn neighbour_demand(&self, now: Millis, pool: PoolId) -> f64 {
        let p = &self.pools[pool.0];
        let width = p.forecast_bucket_ms.max(1);
        let window = demand_share(p, now, p.neighbours.since(width), |start| {
            p.neighbours.at(start, width) as f64
        });
        let current = f64::from(
            p.outside_running()
                .saturating_add(p.outside_waiting())
                .min(p.slots),
        ) / f64::from(p.slots.max(1));
        window.max(current)
    }
}

/// Demand over the window ending at `now`, as a share of the pool's slots: `asked(start)` is
/// the demand in the bucket starting at `start`, each capped at what the slots serve in a
/// bucket, the bucket the window starts inside weighted by the part of it inside, over the
/// window's length (or the time since `since`, the first record, if shorter; at least a
/// quarter bucket). 0 with no record.
fn demand_share(
    p: &PoolState,
    now: Millis,
    since: Option<Millis>,
    asked: impl Fn(Millis) -> f64,
) -> f64 {
    let Some(since) = since else {
        return 0.0;
    };
    let width = p.forecast_bucket_ms.max(1);
    let slots = f64::from(p.slots.max(1));
    let capacity = slots * width as f64;
    let newest = now - now % width;
    let into = now - newest;
    let mut served = 0.0;
    for back in 0..RING as u64 {
        let Some(start) = newest.checked_sub(back * width) else {
            break;
        };
        if start.saturating_add(width) <= since {
            break;
        }
        let inside = if back == FORECAST_BUCKETS as u64 {
            (width - into) as f64 / width as f64
        } else {
            1.0
        };
        served += inside * asked(start).min(capacity);
    }
    let window = width.saturating_mul(FORECAST_BUCKETS as u64);
    let span = window.min(now.saturating_sub(since)).max(width / 4).max(1);
    served / (slots * span as f64)
}
