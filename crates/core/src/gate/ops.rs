//! Operator controls on a live gate: shadow mode, drains and the shutdown deadline. The
//! gateway's admin API and its signal handlers call these; like the rest of the core they
//! take `now`, do no I/O and report what the caller must perform (jobs to cancel upstream,
//! queued jobs dropped through [`super::Event::Drop`]).

use super::queue::QueueKey;
use super::{Gate, JobId, LaneId, Settle, WaterFiller};
use crate::reason::Reason;
use crate::Millis;
use serde::Serialize;

/// One drained class: the work it still has.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DrainClass {
    /// Class name.
    pub name: String,
    /// Jobs still queued (on its own pool and its overflow pool).
    pub queued: u32,
    /// Jobs still holding a slot.
    pub in_flight: u32,
}

/// One pool a drained class runs on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DrainPool {
    /// Pool name.
    pub name: String,
    /// Slots taken, by any class.
    pub in_flight: u32,
    /// Jobs queued, any class.
    pub depth: u32,
    /// Nothing in flight and nothing queued.
    pub idle: bool,
}

/// Where a drain stands (seed 002: "report when the pool is idle").
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DrainStatus {
    /// Classes being drained, with the work they still have.
    pub classes: Vec<DrainClass>,
    /// The pools those classes run on.
    pub pools: Vec<DrainPool>,
    /// Unlabeled work is refused for the drain, even with a default class.
    pub unlabeled_suspended: bool,
    /// Every drained class has no work left, queued or in flight.
    pub drained: bool,
    /// Drained, and every pool they run on is idle: safe to reopen interactive traffic.
    pub idle: bool,
}

impl Gate {
    /// Set shadow mode: would-be rejections are admitted and reported as `shadow_reject`,
    /// and nothing is dropped on its deadline.
    pub fn set_shadow(&mut self, on: bool) {
        self.cfg.shadow = on;
    }

    /// A live class (not an overflow lane, not retired) by its canonical name.
    pub fn class_by_name(&self, name: &str) -> Option<LaneId> {
        self.classes
            .iter()
            .position(|c| c.name == name && c.overflow_of.is_none() && !c.retired)
            .map(LaneId)
    }

    /// What a class does when the state it shares is out of reach (its `fail_mode`); `open`
    /// for no class (the gate refuses such work itself).
    pub fn fail_mode(&self, class: Option<LaneId>) -> crate::config::FailMode {
        let Some(class) = class else {
            return crate::config::FailMode::Open;
        };
        let name = self.class_name(class);
        self.cfg
            .classes
            .iter()
            .find(|c| c.name == name)
            .map_or(crate::config::FailMode::Open, |c| c.fail_mode)
    }

    /// `closed` if any class fails closed: for work whose class is not known before its body
    /// is read (the reservation API).
    pub fn strictest_fail_mode(&self) -> crate::config::FailMode {
        if self
            .cfg
            .classes
            .iter()
            .any(|c| c.fail_mode == crate::config::FailMode::Closed)
        {
            crate::config::FailMode::Closed
        } else {
            crate::config::FailMode::Open
        }
    }

    /// Names of the live classes, in configuration order.
    pub fn class_names(&self) -> Vec<String> {
        self.classes
            .iter()
            .filter(|c| c.overflow_of.is_none() && !c.retired)
            .map(|c| c.name.clone())
            .collect()
    }

    /// Every lane of a class, by its name: its own, its overflow lane, and lanes a reload
    /// retired (the pool it moved away from still runs the work admitted there).
    fn lanes_of(&self, class: LaneId) -> Vec<LaneId> {
        let Some(name) = self.classes.get(class.0).map(|c| c.name.as_str()) else {
            return Vec::new();
        };
        (0..self.classes.len())
            .filter(|&i| self.classes[i].name == name)
            .map(LaneId)
            .collect()
    }

    /// Set whether a class is drained. The flag belongs to the class, not to one lane: it is
    /// kept on each of its non-overflow lanes, so a reload that moves the class to another
    /// pool (a new lane) or back (a retired one) finds it whatever lane it picks.
    fn set_draining(&mut self, class: LaneId, on: bool) {
        for lane in self.lanes_of(class) {
            let l = &mut self.classes[lane.0];
            l.draining = on && l.overflow_of.is_none();
        }
    }

    /// Drain classes (seed 002's rollback order): refuse their new work (`class_disabled`)
    /// and, with `cancel`, drop their queued jobs at once (`drained`). Their in-flight jobs
    /// are the caller's to end: with `cancel`, the ids of those the gateway must cancel
    /// upstream are returned (reservation-API holds are not: their workers settle them).
    pub fn drain(&mut self, now: Millis, classes: &[LaneId], cancel: bool) -> Vec<JobId> {
        let now = self.clock(now);
        let mut in_flight = Vec::new();
        for &class in classes {
            if self.classes.get(class.0).is_none() {
                continue;
            }
            self.set_draining(class, true);
            if !cancel {
                continue;
            }
            for lane in self.lanes_of(class) {
                let queued: Vec<JobId> = self.classes[lane.0]
                    .queue
                    .iter_all()
                    .map(|(_, id)| id)
                    .collect();
                for id in queued {
                    if self.jobs.get(&id).is_some_and(|j| j.reservation) {
                        continue;
                    }
                    if let Some((job, pool, _)) = self.take_job(id) {
                        self.settle_hold(now, &job, Settle::Cancel(0));
                        let ev = self.drop_event(now, id, &job, pool, 0, Reason::Drained);
                        self.events.push_back(ev);
                    }
                }
                let pool = self.classes[lane.0].pool;
                in_flight.extend(self.pools[pool.0].in_flight.keys().copied().filter(|id| {
                    self.jobs
                        .get(id)
                        .is_some_and(|j| j.class == lane && !j.reservation)
                }));
            }
        }
        in_flight
    }

    /// End the drain of classes: they admit again (unless switched off by `enabled`).
    pub fn end_drain(&mut self, classes: &[LaneId]) {
        for &class in classes {
            self.set_draining(class, false);
        }
    }

    /// Refuse unlabeled work (`reject_unlabeled`) even when a default class is configured
    /// (seed 002: "stop admitting the offending class and unlabeled work").
    pub fn suspend_unlabeled(&mut self, on: bool) {
        self.unlabeled_suspended = on;
    }

    /// Where the drain stands: what the drained classes still have, and whether their pools
    /// are idle.
    pub fn drain_status(&self) -> DrainStatus {
        let mut classes = Vec::new();
        let mut pools = std::collections::BTreeSet::new();
        // One entry per live class, its work counted over every lane of its name (a lane a
        // reload retired still holds work the class was admitted with).
        for (i, c) in self.classes.iter().enumerate() {
            if !c.draining || c.overflow_of.is_some() || c.retired {
                continue;
            }
            let (mut queued, mut in_flight) = (0u32, 0u32);
            for lane in self.lanes_of(LaneId(i)) {
                let l = &self.classes[lane.0];
                let lane_queued = l.queue.len() as u32;
                let lane_in_flight = self.pools[l.pool.0]
                    .in_flight
                    .keys()
                    .filter(|id| self.jobs.get(id).is_some_and(|j| j.class == lane))
                    .count() as u32;
                if !l.retired || lane_queued + lane_in_flight > 0 {
                    pools.insert(l.pool);
                }
                queued += lane_queued;
                in_flight += lane_in_flight;
            }
            classes.push(DrainClass {
                name: c.name.clone(),
                queued,
                in_flight,
            });
        }
        let pools: Vec<DrainPool> = pools
            .into_iter()
            .map(|p| {
                let in_flight = self.pools[p.0].in_flight.len() as u32;
                let depth = self.pool_depth(p);
                DrainPool {
                    name: self.pools[p.0].name.clone(),
                    in_flight,
                    depth,
                    idle: in_flight == 0 && depth == 0,
                }
            })
            .collect();
        let drained = classes.iter().all(|c| c.queued == 0 && c.in_flight == 0);
        DrainStatus {
            idle: drained && pools.iter().all(|p| p.idle),
            drained,
            classes,
            pools,
            unlabeled_suspended: self.unlabeled_suspended,
        }
    }

    /// Start shutting down: from now on every offer is refused (`shutting_down`), and queued
    /// work that cannot finish by `deadline` (projected wait plus its own service) is dropped
    /// at once with the same reason; so is, at each tick and at dispatch, work that no longer
    /// can. Work that fits keeps running. Reservation-API holds are left alone: their workers
    /// settle them, and the ledger keeps them across the restart.
    pub fn begin_shutdown(&mut self, now: Millis, deadline: Millis) {
        let now = self.clock(now);
        self.closing_at = Some(self.closing_at.map_or(deadline, |d| d.min(deadline)));
        self.shutdown_sweep(now);
    }

    /// Shutting down, and by when queued work must be done.
    pub fn closing_at(&self) -> Option<Millis> {
        self.closing_at
    }

    /// Drop every queued job that cannot finish by the shutdown deadline, in dispatch order
    /// per pool (the water fill of `tick`, over every queued job, best effort included).
    pub(super) fn shutdown_sweep(&mut self, now: Millis) {
        let Some(at) = self.closing_at else { return };
        for pi in 0..self.pools.len() {
            let pool = &self.pools[pi];
            let mut r = vec![0; pool.slot_count()];
            let filled = pool.free_times(now, &mut r);
            let free = pool.free_now(now) as usize;
            let mut filler = WaterFiller::new(&r[..filled]);
            let outside = pool.outside_waiting();
            let mut work = u64::from(outside).saturating_mul(pool.outside_unit_ms());
            let mut count = outside as usize;
            let mut doomed = Vec::new();
            let lanes = pool.classes.clone();
            let mut i = 0;
            while i < lanes.len() {
                let prio = self.classes[lanes[i].0].priority;
                let mut level: Vec<(QueueKey, JobId)> = Vec::new();
                while i < lanes.len() && self.classes[lanes[i].0].priority == prio {
                    level.extend(self.classes[lanes[i].0].queue.iter_all());
                    i += 1;
                }
                level.sort_unstable();
                for (_, id) in level {
                    let Some(job) = self.jobs.get(&id) else {
                        continue;
                    };
                    // No endpoint available: nothing can finish before the shutdown.
                    let wait = if filled == 0 {
                        super::UNAVAILABLE_WAIT_MS
                    } else if count < free {
                        0
                    } else {
                        filler.level(work)
                    };
                    let finish = now.saturating_add(wait).saturating_add(job.est.service_ms);
                    if finish > at && !job.reservation {
                        doomed.push((id, wait));
                    } else {
                        work = work.saturating_add(job.est.service_ms);
                        count += 1;
                    }
                }
            }
            for (id, wait) in doomed {
                if let Some((job, pool, _)) = self.take_job(id) {
                    self.settle_hold(now, &job, Settle::Cancel(0));
                    let ev = self.drop_event(now, id, &job, pool, wait, Reason::ShuttingDown);
                    self.events.push_back(ev);
                }
            }
        }
    }
}

impl Gate {
    /// Number of pools, live and retired: pool ids are `0..pool_count()`, stable for the
    /// gate's life.
    pub fn pool_count(&self) -> usize {
        self.pools.len()
    }

    /// The upstream URL a pool was (last) configured with.
    pub fn pool_upstream(&self, pool: super::PoolId) -> Option<&str> {
        self.pools.get(pool.0).and_then(|p| p.upstream.as_deref())
    }

    /// The live pool named `name` (a retired one of the same name is not it).
    pub fn pool_id(&self, name: &str) -> Option<super::PoolId> {
        self.pools
            .iter()
            .position(|p| !p.retired && p.name == name)
            .map(super::PoolId)
    }

    /// Whether a pool is live (not retired by a reload).
    pub fn pool_live(&self, pool: super::PoolId) -> bool {
        self.pools.get(pool.0).is_some_and(|p| !p.retired)
    }
}
