//! Pure arithmetic of waits: how long a request would wait for a slot (water filling of the
//! queued work over the slots' free times), its slack against a deadline, how many requests it
//! will share the server with, and the jitter that spreads Retry-Afters. Nothing here changes
//! the gate; every function is O(classes) or O(slots).

use super::*;

pub(super) fn slack(
    now: Millis,
    wait: u64,
    deadline: Option<Millis>,
    first_token_deadline: Option<Millis>,
    est: Estimate,
) -> Option<i64> {
    let start = now.saturating_add(wait);
    let whole = deadline.map(|d| signed_diff(d, start.saturating_add(est.service_ms)));
    let first =
        first_token_deadline.map(|d| signed_diff(d, start.saturating_add(est.first_token_ms)));
    match (whole, first) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

pub(super) fn signed_diff(a: Millis, b: Millis) -> i64 {
    let d = i128::from(a) - i128::from(b);
    d.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// Scale an estimate by a class's correction.
pub(super) fn scale_estimate(e: Estimate, factor: f64) -> Estimate {
    let f = |v: u64| ((v as f64) * factor).round().clamp(1.0, 1e15) as u64;
    Estimate {
        service_ms: f(e.service_ms),
        first_token_ms: f(e.first_token_ms).min(f(e.service_ms)),
    }
}

/// Estimated time left of one in-flight job: its estimate minus what it has run. A job past
/// its estimate is treated as likely to run about as long again as it has overrun (a stuck
/// slot must look stuck, not about to free), and never as done: an eighth of its estimate is
/// the floor once it has overrun. A job still inside its estimate gets no floor: padding
/// the last seconds of every running job would make a later re-check (`tick`) see waits
/// that the admission did not, and drop work that was going to make it.
pub(super) fn remaining(now: Millis, started: Millis, est: u64) -> u64 {
    let elapsed = now.saturating_sub(started);
    if elapsed < est {
        return est - elapsed;
    }
    (elapsed - est).max(est / 8).max(1)
}

/// The wait projected on a pool with no available endpoint (all ejected or drained): a day,
/// which no deadline survives; best-effort work queues until an endpoint returns.
pub(super) const UNAVAILABLE_WAIT_MS: u64 = crate::config::MAX_CONFIG_MS;

/// Slot counts up to this are handled on the stack when projecting a wait (2 KiB, zeroed
/// only for pools wider than [`SMALL_SLOTS`]: see `slot_scratch!`).
pub(super) const STACK_SLOTS: usize = 256;

/// Slot counts up to this project on a small stack array (most pools).
pub(super) const SMALL_SLOTS: usize = 16;

/// `n` zeroed slot times as `&mut [u64]`: a small stack array for the usual narrow pool, a
/// [`STACK_SLOTS`] one (zeroed only then) for a wide one, the heap beyond.
macro_rules! slot_scratch {
    ($r:ident, $n:expr) => {
        let n: usize = $n;
        let mut small = [0u64; $crate::gate::projection::SMALL_SLOTS];
        let mut wide: [u64; $crate::gate::projection::STACK_SLOTS];
        let mut heap: Vec<u64>;
        let $r: &mut [u64] = if n <= $crate::gate::projection::SMALL_SLOTS {
            &mut small[..n]
        } else if n <= $crate::gate::projection::STACK_SLOTS {
            wide = [0u64; $crate::gate::projection::STACK_SLOTS];
            &mut wide[..n]
        } else {
            heap = vec![0u64; n];
            &mut heap[..]
        };
    };
}
pub(super) use slot_scratch;

impl PoolState {
    /// Bring the in-flight integral up to `now`; call before the in-flight set changes.
    pub(super) fn advance_busy(&mut self, now: Millis) {
        let dt = now.saturating_sub(self.busy_at);
        self.busy = self
            .busy
            .saturating_add(u128::from(dt) * self.sharing_count() as u128);
        self.context_busy += dt as f64 * self.context_now;
        self.busy_at = self.busy_at.max(now);
    }

    /// What a job dispatched at `started_at` shared the server with until `now`.
    pub(super) fn sharing_since(
        &self,
        now: Millis,
        started_at: Millis,
        (busy_at_start, context_at_start, prefill_at_start): (u128, f64, u64),
        own_context: f64,
    ) -> Sharing {
        let concurrency = self.concurrency_since(now, started_at, busy_at_start);
        let dt = now.saturating_sub(started_at);
        let total = if dt == 0 {
            self.context_now
        } else {
            let area =
                self.context_busy + now.saturating_sub(self.busy_at) as f64 * self.context_now;
            (area - context_at_start) / dt as f64
        };
        Sharing {
            concurrency,
            others_context: (total - own_context).max(0.0),
            others_prefill: self.prefill_dispatched.saturating_sub(prefill_at_start) as f64,
        }
    }

    /// The integral as it stands at `now` (without moving it).
    pub(super) fn busy_until(&self, now: Millis) -> u128 {
        let dt = now.saturating_sub(self.busy_at);
        self.busy
            .saturating_add(u128::from(dt) * self.sharing_count() as u128)
    }

    /// Requests running on the pool's servers now: the gate's own and, by the servers' own
    /// metrics, its neighbours' (they batch with the gate's and slow them alike).
    pub(super) fn sharing_count(&self) -> usize {
        self.in_flight.len() + self.outside_running() as usize
    }

    /// Mean in-flight count (at least 1: the job itself) over a job's life so far.
    pub(super) fn concurrency_since(
        &self,
        now: Millis,
        started_at: Millis,
        busy_at_start: u128,
    ) -> f64 {
        let dt = now.saturating_sub(started_at);
        if dt == 0 {
            return (self.sharing_count() as f64).max(1.0);
        }
        let area = self.busy_until(now).saturating_sub(busy_at_start);
        (area as f64 / dt as f64).max(1.0)
    }

    /// How many requests a newcomer will share the server with while it runs: every slot's
    /// worth when it has to wait for one (the pool is saturated), otherwise what runs now plus
    /// what is queued ahead and itself, or the recent usual if that is more (others arrive
    /// while it runs); never more than the slots.
    pub(super) fn expected_concurrency(&self, wait: u64, count_ahead: u32) -> f64 {
        let slots = f64::from(self.slots.max(1));
        if wait > 0 {
            return slots;
        }
        let others = self.sharing_count() as f64 + f64::from(count_ahead);
        if others == 0.0 {
            // An idle pool: alone, whatever ran before (the recent mean is history and only
            // decays with completions, which an idle pool does not have).
            return 1.0;
        }
        (others + 1.0).max(self.recent_concurrency).min(slots)
    }

    /// [`PoolState::expected_concurrency`] with the others' context: each other request as
    /// long as the longer of what runs now (mean) and what recently ran beside completions.
    /// `others_prefill`: what the class's recent completions saw start beside them.
    pub(super) fn expected_sharing(
        &self,
        wait: u64,
        count_ahead: u32,
        others_prefill: f64,
    ) -> Sharing {
        let k = self.expected_concurrency(wait, count_ahead);
        let current = if self.in_flight.is_empty() {
            0.0
        } else {
            self.context_now / self.in_flight.len() as f64
        };
        Sharing {
            others_prefill,
            ..Sharing::with(k, current.max(self.recent_other_context))
        }
    }

    /// A request's prompt tokens: counted from its characters with the learned relation when
    /// the gateway gave them, else as the caller estimated.
    pub(super) fn prompt_tokens(&self, req: &Request) -> u32 {
        match req.prompt_chars {
            Some(chars) => self.tokens.tokens(chars, req.model.as_deref()),
            None => req.prompt_tokens,
        }
    }

    /// Estimated work left of all in-flight jobs (saturating: a few slots stuck for ages must
    /// not wrap to a short wait).
    pub(super) fn in_flight_remaining(&self, now: Millis) -> u64 {
        self.in_flight
            .values()
            .map(|run| remaining(now, run.started, run.est))
            .fold(0, u64::saturating_add)
    }

    /// When a slot is free for a job behind `work_ahead` ms of queued work: "water filling"
    /// over the slots. Each slot is free after its in-flight job's remaining time (free slots
    /// at once); the queued work ahead pours into the slots as they free up; the job starts
    /// when that work is absorbed. A long job thus only takes its own slot out of the
    /// picture instead of being averaged over every slot. O(slots).
    pub(super) fn wait_for_slot(&self, now: Millis, work_ahead: u64) -> u64 {
        slot_scratch!(r, self.slot_count());
        let filled = self.free_times_unordered(now, r);
        if filled == 0 {
            return UNAVAILABLE_WAIT_MS;
        }
        water_fill_unordered(&mut r[..filled], work_ahead)
    }

    /// How long the pool has failed to free a slot: when every slot is busy, the age of the
    /// youngest in-flight job (all of them have held their slot at least that long); 0 when a
    /// slot is free.
    pub(super) fn slot_age(&self, now: Millis) -> u64 {
        if self.free_now(now) > 0 {
            return 0;
        }
        self.in_flight
            .values()
            .map(|run| now.saturating_sub(run.started))
            .min()
            .unwrap_or(0)
    }
}

/// Spread rejected clients out: add 0 to `percent`% to a Retry-After, deterministically from
/// the job id (splitmix64), so clients rejected together do not return in lockstep and the
/// same inputs still give the same decisions.
pub(super) fn jitter(after_ms: u64, job_id: JobId, percent: u32) -> u64 {
    if percent == 0 || after_ms == 0 {
        return after_ms;
    }
    let mut z = job_id.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let span = u128::from(after_ms) * u128::from(percent.min(100)) / 100;
    let extra = if span == 0 {
        0
    } else {
        u128::from(z) % (span + 1)
    };
    (u128::from(after_ms) + extra).min(u128::from(u64::MAX)) as u64
}

/// [`water_fill`] for a sequence of non-decreasing amounts of work over the same slots, in
/// O(slots + queries) overall instead of O(slots) per query: the level only rises, so the
/// number of slots taking part only grows. `tick` asks once per queued job.
pub(super) struct WaterFiller<'a> {
    r: &'a [u64],
    j: usize,
    prefix: u128,
}

impl<'a> WaterFiller<'a> {
    pub(super) fn new(r: &'a [u64]) -> Self {
        WaterFiller {
            r,
            j: 0,
            prefix: r.first().map_or(0, |&v| u128::from(v)),
        }
    }

    /// `water_fill(r, work)`; `work` must not decrease between calls.
    pub(super) fn level(&mut self, work: u64) -> u64 {
        if self.r.is_empty() {
            return 0;
        }
        loop {
            let active = (self.j + 1) as u128;
            let level = (u128::from(work) + self.prefix)
                .div_ceil(active)
                .max(u128::from(self.r[self.j]));
            match self.r.get(self.j + 1) {
                Some(&next) if level > u128::from(next) => {
                    self.j += 1;
                    self.prefix += u128::from(next);
                }
                _ => return level.min(u128::from(u64::MAX)) as u64,
            }
        }
    }
}

/// Smallest `t >= r[0]` with `sum(max(0, t - r_i)) >= work`, for `r` sorted ascending (0 for
/// no slots). O(slots).
pub(super) fn water_fill(r: &[u64], work: u64) -> u64 {
    WaterFiller::new(r).level(work)
}

/// [`water_fill`] of `r` in any order (reordered in place when needed). When the work ahead
/// lifts the level above every slot's time, every slot takes part and the level is the mean,
/// found in O(slots) without sorting: with a deep queue, the usual case on the decision path.
pub(super) fn water_fill_unordered(r: &mut [u64], work: u64) -> u64 {
    let (Some(&top), n) = (r.iter().max(), r.len()) else {
        return 0;
    };
    let total: u128 = r.iter().map(|&v| u128::from(v)).sum::<u128>() + u128::from(work);
    let level = total.div_ceil(n as u128);
    // Strictly above the highest slot: the sorted fill cannot stop before the last slot
    // (stopping at slot j means the level is at most the next slot's time, and then the mean
    // over all slots is at most the highest), so it ends on this same mean.
    if level > u128::from(top) {
        return level.min(u128::from(u64::MAX)) as u64;
    }
    r.sort_unstable();
    water_fill(r, work)
}

impl Gate {
    /// Work and count queued ahead of a request of `priority` on `pool`, and the oldest
    /// enqueue time among them: O(classes of the pool).
    pub(super) fn ahead(&self, pool: PoolId, priority: u32) -> (u64, u32, Option<Millis>) {
        let mut work = 0u64;
        let mut count = 0u32;
        let mut oldest: Option<Millis> = None;
        for id in &self.pools[pool.0].classes {
            let c = &self.classes[id.0];
            if c.priority < priority {
                break; // sorted by priority, highest first
            }
            work = work.saturating_add(c.queue.work_ms());
            count = count.saturating_add(c.queue.len() as u32);
            if let Some(t) = c.queue.oldest_enqueued_at() {
                oldest = Some(oldest.map_or(t, |o: Millis| o.min(t)));
            }
        }
        (work, count, oldest)
    }

    /// Projected wait for a slot given the work ahead: nothing if a slot is free for it,
    /// otherwise in-flight remainder plus queued work, spread over the slots. (The headroom
    /// holds back only work without a deadline, whose wait promises nothing: see
    /// `headroom`.)
    pub(super) fn projected_wait(
        &self,
        pool: PoolId,
        now: Millis,
        work_ahead: u64,
        count_ahead: u32,
    ) -> u64 {
        let p = &self.pools[pool.0];
        // Neighbours waiting in the server's own queue start before anything sent next.
        let outside = p.outside_waiting();
        if count_ahead.saturating_add(outside) < p.free_now(now) {
            return 0;
        }
        let outside_work = u64::from(outside).saturating_mul(p.outside_unit_ms());
        p.wait_for_slot(now, work_ahead.saturating_add(outside_work))
    }

    pub(super) fn pool_depth(&self, pool: PoolId) -> u32 {
        self.pools[pool.0]
            .classes
            .iter()
            .map(|c| self.classes[c.0].queue.len() as u32)
            .sum()
    }
}
