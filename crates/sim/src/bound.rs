//! Upper bounds on what any policy could have served on time, to say how close a policy is
//! to the best possible and not only to the other policies.
//!
//! **Work bound** (an LP relaxation, solved exactly): let every request with a deadline be
//! divisible, preemptible, and runnable on all slots at once; the upstream is then one machine
//! of speed `slots`, and the most work that can be done inside the requests' windows
//! `[first sent, deadline]` is a transportation problem over time intervals. Earliest deadline
//! first on that fluid machine solves it exactly (a work-conserving EDF never leaves capacity
//! unused that a later-deadline job could have taken). Any real schedule's on-time work
//! (nominal service of the requests completed by their deadline) is a feasible point of the
//! relaxation, so it is at most this bound.
//!
//! **Count bound**: on-time requests of any schedule have total size at most the work bound,
//! so their number is at most the largest k whose k smallest sizes fit in it (loose: it ignores
//! when the small requests arrive).

use crate::engine::RequestResult;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Bounds on on-time work for one scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct Bound {
    /// On-time work bound (nominal server-ms).
    pub work_ms: f64,
    /// On-time request count bound.
    pub count: u64,
    /// Total nominal work of requests with deadlines (ms).
    pub offered_work_ms: f64,
}

/// Compute the bounds over the requests with deadlines, for `slots` slots.
pub fn bound(requests: &[RequestResult], slots: u32) -> Bound {
    bound_at_speed(requests, f64::from(slots.max(1)))
}

/// The bounds on a fluid machine of `speed` alone-work per unit of time:
/// [`Upstream::speed`](crate::scenario::Upstream::speed), which on a batching server is below
/// the slot count. Sizes are alone service times; since no schedule on a batching server gets
/// through more alone-work per unit of time than that speed, the bound still holds.
pub fn bound_at_speed(requests: &[RequestResult], speed: f64) -> Bound {
    let mut jobs: Vec<(u64, u64, u64)> = requests
        .iter()
        .filter_map(|r| r.deadline_ms.map(|d| (r.first_at_ms, d, r.size_ms)))
        .filter(|&(at, d, size)| d > at && size > 0)
        .collect();
    jobs.sort_unstable();
    let offered_work_ms = jobs.iter().map(|j| j.2 as f64).sum();
    let work_ms = edf_fluid(&jobs, speed);
    let mut sizes: Vec<u64> = jobs
        .iter()
        .filter(|&&(at, d, size)| size <= d - at)
        .map(|j| j.2)
        .collect();
    sizes.sort_unstable();
    let mut count = 0u64;
    let mut sum = 0f64;
    for s in sizes {
        sum += s as f64;
        if sum > work_ms + 1e-6 {
            break;
        }
        count += 1;
    }
    Bound {
        work_ms,
        count,
        offered_work_ms,
    }
}

/// Most work (ms) done inside the windows on a fluid machine of speed `speed`, jobs
/// `(release, deadline, size)` sorted by release.
fn edf_fluid(jobs: &[(u64, u64, u64)], speed: f64) -> f64 {
    // Heap of (deadline, index) with remaining work per job.
    let mut remaining: Vec<f64> = jobs.iter().map(|j| j.2 as f64).collect();
    let mut heap: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut done = 0f64;
    let mut cur = 0f64;
    let mut i = 0usize;
    loop {
        if heap.is_empty() {
            let Some(j) = jobs.get(i) else { break };
            cur = cur.max(j.0 as f64);
        }
        while let Some(j) = jobs.get(i) {
            if (j.0 as f64) > cur {
                break;
            }
            heap.push(Reverse((j.1, i)));
            i += 1;
        }
        let next_release = jobs.get(i).map_or(f64::INFINITY, |j| j.0 as f64);
        // Serve earliest deadlines until the next release.
        while cur < next_release {
            let Some(Reverse((deadline, k))) = heap.pop() else {
                break;
            };
            let d = deadline as f64;
            if d <= cur {
                continue; // expired with work left
            }
            let until = d.min(next_release);
            let room = speed * (until - cur);
            if remaining[k] <= room {
                done += remaining[k];
                cur += remaining[k] / speed;
                remaining[k] = 0.0;
            } else {
                // Time runs out first (its deadline or the next release): land exactly there.
                done += room;
                remaining[k] -= room;
                cur = until;
                if d > cur {
                    heap.push(Reverse((deadline, k)));
                }
            }
        }
    }
    done
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn fluid_bound_by_hand() {
        // One slot; two jobs of 10 in the window [0, 15]: only 15 fits.
        assert_eq!(edf_fluid(&[(0, 15, 10), (0, 15, 10)], 1.0), 15.0);
        // Two slots: both fit (20 <= 2 x 15).
        assert_eq!(edf_fluid(&[(0, 15, 10), (0, 15, 10)], 2.0), 20.0);
        // A late release: [0,10] size 10, then [10,20] size 10: both fit on one slot.
        assert_eq!(edf_fluid(&[(0, 10, 10), (10, 20, 10)], 1.0), 20.0);
        // Idle gap: job at 100 fits after nothing.
        assert_eq!(edf_fluid(&[(0, 5, 3), (100, 110, 20)], 1.0), 13.0);
        // EDF beats FIFO: the long early job must yield to the tight later one.
        assert_eq!(edf_fluid(&[(0, 100, 50), (10, 20, 10)], 1.0), 60.0);
    }

    #[test]
    fn count_bound_takes_smallest() {
        let r = |at, d, size| RequestResult {
            class: 0,
            first_at_ms: at,
            deadline_ms: Some(d),
            outcome: crate::engine::Outcome::Pending,
            answered_at_ms: 0,
            offers: 1,
            admitted: 0,
            ttft_ms: None,
            busy_ms: 0,
            size_ms: size,
            output_tokens: 0,
            prompt_tokens: 0,
            reason: "",
            tenant: None,
        };
        let b = bound(&[r(0, 15, 10), r(0, 15, 4), r(0, 15, 4)], 1);
        assert_eq!(b.work_ms, 15.0);
        assert_eq!(b.count, 2);
    }
}
