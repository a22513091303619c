//! Applying a new configuration to a live gate (hot reload) without losing work.
//!
//! Pools are matched by name and lanes (a class's queue on one pool) by class name and pool,
//! so a reload keeps every queue, every slot taken, every learned estimate and every drain
//! in place, and only changes the thresholds. Ids never move: a pool or lane the new file
//! adds is appended, and one it removes is *retired*, not deleted. A retired lane takes no
//! new work (its labels are gone: such requests go to the default class, or are refused as
//! unlabeled), but its queued jobs keep their place and are dispatched as before, and its
//! in-flight jobs end normally. A retired pool likewise keeps its slots and upstream until
//! the work it already had is done. So a reload never drops or cuts a request; retired
//! entries vanish from snapshots once empty. A class moved to another pool leaves its queued
//! work where it was admitted (a retired lane there) and takes new work on the new pool.
//!
//! A retired lane's slot is freed once nothing refers to it (no queued or in-flight job, no
//! busy overflow lane learning into it): the next lane a reload creates takes that slot
//! instead of growing the table, so renaming classes back and forth, reload after reload,
//! keeps the lanes (and the per-decision scans over them) bounded by the live classes plus
//! those still finishing work.
//!
//! A pool's learned estimator survives the reload unless its `prior` or its `upstream`
//! changed (a new model or new defaults mean the old figures no longer apply). A class's
//! learned output length survives too.

use super::queue::ClassQueue;
use super::{Gate, LaneId, LaneState, PoolId, PoolState};
use crate::config::{ClassConfig, ConfigError, GateConfig, PoolConfig};
use crate::estimator::{ErrorTracker, Estimator};
use crate::tokens::TokenCounter;
use crate::Millis;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

/// What a reload changed, for the decision log and the admin API's answer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReconfigureReport {
    /// Pools the new configuration adds.
    pub pools_added: Vec<String>,
    /// Pools it removes (retired: their work in progress finishes).
    pub pools_removed: Vec<String>,
    /// Pools whose learned estimator restarts from the (changed) prior or upstream.
    pub estimators_reset: Vec<String>,
    /// Classes it adds.
    pub classes_added: Vec<String>,
    /// Classes it removes (retired: their queued and in-flight work finishes).
    pub classes_removed: Vec<String>,
}

impl Gate {
    /// Apply `cfg` to the live gate: validated first (an invalid one changes nothing), then
    /// matched by name as the module docs describe. Queued and in-flight jobs are kept; the
    /// caller should poll afterwards (more slots may dispatch work at once).
    pub fn reconfigure(
        &mut self,
        now: Millis,
        cfg: GateConfig,
    ) -> Result<ReconfigureReport, ConfigError> {
        cfg.validate()?;
        self.clock(now);
        let mut report = ReconfigureReport::default();
        let pool_ids = self.reconfigure_pools(now, &cfg, &mut report);
        let primaries = self.reconfigure_lanes(&cfg, &pool_ids, &mut report)?;
        self.order_dispatch();
        self.relabel(&cfg, &primaries);
        self.ledger.set_config(cfg.ledger.clone());
        // Tracked tenants take their new weights at once (a bucket keeps its id: an id the
        // new weights no longer list keeps its bucket until it goes idle).
        for lane in &mut self.classes {
            lane.tenants.reweight(|id| {
                cfg.fairness
                    .weights
                    .get(id)
                    .copied()
                    .unwrap_or(cfg.fairness.default_weight)
            });
        }
        self.cfg = cfg;
        Ok(report)
    }

    /// Pools, by name: each configured pool updated in place or added, each one the
    /// configuration no longer names retired. Returns the id of every configured pool.
    fn reconfigure_pools<'a>(
        &mut self,
        now: Millis,
        cfg: &'a GateConfig,
        report: &mut ReconfigureReport,
    ) -> HashMap<&'a str, PoolId> {
        let parts = self.share_parts;
        let mut pool_ids: HashMap<&str, PoolId> = HashMap::new();
        for pc in &cfg.pools {
            let id = match self.pools.iter().position(|p| p.name == pc.name) {
                Some(i) => self.update_pool(i, pc, parts, report),
                None => {
                    report.pools_added.push(pc.name.clone());
                    self.add_pool(now, pc, parts)
                }
            };
            pool_ids.insert(pc.name.as_str(), id);
        }
        for p in &mut self.pools {
            if !p.retired && !pool_ids.contains_key(p.name.as_str()) {
                p.retired = true;
                report.pools_removed.push(p.name.clone());
            }
        }
        pool_ids
    }

    /// Bring pool `i` to `pc`, keeping its slots taken and (unless its prior or upstream
    /// changed) what its estimator learned; a retired pool comes back.
    fn update_pool(
        &mut self,
        i: usize,
        pc: &PoolConfig,
        parts: u32,
        report: &mut ReconfigureReport,
    ) -> PoolId {
        let p = &mut self.pools[i];
        if p.retired {
            report.pools_added.push(pc.name.clone());
        }
        if p.prior != pc.prior || p.upstream != pc.upstream {
            p.estimator = Estimator::new(&pc.prior);
            p.tokens = TokenCounter::new(pc.prior.chars_per_token);
            if !p.retired {
                report.estimators_reset.push(pc.name.clone());
            }
            // The classes' records were measured against the model just thrown
            // away: their corrections and errors start again with it.
            for c in self.classes.iter_mut().filter(|c| c.pool == PoolId(i)) {
                c.errors = ErrorTracker::default();
                c.ratios.clear();
                c.refresh_record();
            }
        }
        p.prior = pc.prior.clone();
        p.upstream = pc.upstream.clone();
        p.retired = false;
        super::capacity::reconcile_endpoints(&mut p.endpoints, pc, parts);
        p.refresh_capacity();
        p.max_depth_factor = pc.max_depth_factor;
        p.max_queued = pc.max_queued;
        p.forecast_bucket_ms = forecast_bucket_ms(pc);
        p.forecast_refused_weight = pc.forecast_refused_weight;
        p.headroom = pc.headroom;
        p.promise_guard_ms = pc.promise_guard_ms;
        p.default_output_tokens = pc.prior.default_output_tokens;
        p.limits = pc.limits.clone();
        PoolId(i)
    }

    /// Append a new pool for `pc`, with its endpoints and nothing learned.
    fn add_pool(&mut self, now: Millis, pc: &PoolConfig, parts: u32) -> PoolId {
        self.pools.push(PoolState {
            prior: pc.prior.clone(),
            upstream: pc.upstream.clone(),
            retired: false,
            name: pc.name.clone(),
            slots: 0,
            max_depth_factor: pc.max_depth_factor,
            max_queued: pc.max_queued,
            forecast_bucket_ms: forecast_bucket_ms(pc),
            forecast_refused_weight: pc.forecast_refused_weight,
            headroom: pc.headroom,
            promise_guard_ms: pc.promise_guard_ms,
            default_output_tokens: pc.prior.default_output_tokens,
            limits: pc.limits.clone(),
            discovered_context: None,
            estimator: Estimator::new(&pc.prior),
            tokens: TokenCounter::new(pc.prior.chars_per_token),
            busy: 0,
            busy_at: now,
            context_now: 0.0,
            context_busy: 0.0,
            recent_other_context: 0.0,
            prefill_dispatched: 0,
            recent_concurrency: 1.0,
            in_flight: BTreeMap::new(),
            endpoints: Vec::new(),
            recent_service_ms: 0.0,
            neighbours: super::RateWindow::default(),
            classes: Vec::new(),
        });
        if let Some(p) = self.pools.last_mut() {
            super::capacity::reconcile_endpoints(&mut p.endpoints, pc, parts);
            p.refresh_capacity();
        }
        PoolId(self.pools.len() - 1)
    }

    /// Lanes, by (class name, pool). Primary lanes first, in configuration order, so a new
    /// gate's classes are ids 0..n in the order of the file; then each class's overflow lane;
    /// every other lane is retired. Returns the primary lane of each configured class.
    fn reconfigure_lanes(
        &mut self,
        cfg: &GateConfig,
        pool_ids: &HashMap<&str, PoolId>,
        report: &mut ReconfigureReport,
    ) -> Result<Vec<LaneId>, ConfigError> {
        let live_before: BTreeSet<String> = self.class_names().into_iter().collect();
        // Drains belong to the class, whatever pool it runs on after the reload.
        let drained: BTreeSet<String> = self
            .classes
            .iter()
            .filter(|c| c.draining && c.overflow_of.is_none() && !c.retired)
            .map(|c| c.name.clone())
            .collect();
        let mut wanted: BTreeSet<usize> = BTreeSet::new();
        let mut free = self.free_lanes(cfg, pool_ids);
        let mut primaries = Vec::with_capacity(cfg.classes.len());
        for c in &cfg.classes {
            let pool = pool_ids
                .get(c.pool.as_str())
                .copied()
                .ok_or_else(|| unknown_pool(&c.pool))?;
            let id = self.lane(&c.name, pool, c.expected_output_tokens, &mut free);
            self.classes[id.0].apply_primary(c);
            wanted.insert(id.0);
            primaries.push(id);
        }
        for (c, &primary) in cfg.classes.iter().zip(&primaries) {
            let Some(o) = &c.overflow_pool else { continue };
            let pool = pool_ids
                .get(o.as_str())
                .copied()
                .ok_or_else(|| unknown_pool(o))?;
            let id = self.lane(&c.name, pool, None, &mut free);
            self.classes[id.0].apply_overflow(c, primary);
            wanted.insert(id.0);
            self.classes[primary.0].overflow = Some((id, c.overflow));
        }
        for (i, l) in self.classes.iter_mut().enumerate() {
            if !wanted.contains(&i) {
                l.retired = true;
            }
            // A new lane for a drained class (moved to another pool) stays drained; its
            // overflow lane follows the class; a removed class's drain ends with it.
            l.draining = l.overflow_of.is_none()
                && drained.contains(&l.name)
                && live_after_has(cfg, &l.name);
        }
        let live_after: BTreeSet<String> = self.class_names().into_iter().collect();
        report.classes_added = live_after.difference(&live_before).cloned().collect();
        report.classes_removed = live_before.difference(&live_after).cloned().collect();
        Ok(primaries)
    }

    /// Dispatch order per pool: every lane on it, retired ones included (their queued work
    /// still runs), highest priority first, ties by id.
    fn order_dispatch(&mut self) {
        for p in &mut self.pools {
            p.classes.clear();
        }
        for (i, l) in self.classes.iter().enumerate() {
            self.pools[l.pool.0].classes.push(LaneId(i));
        }
        let classes = &self.classes;
        for p in &mut self.pools {
            p.classes
                .sort_by_key(|id| (std::cmp::Reverse(classes[id.0].priority), id.0));
        }
    }

    /// Labels, from the live classes only (`primaries`: each configured class's lane), and
    /// the default class.
    fn relabel(&mut self, cfg: &GateConfig, primaries: &[LaneId]) {
        self.labels.clear();
        for (c, &id) in cfg.classes.iter().zip(primaries) {
            for label in std::iter::once(&c.name).chain(c.aliases.iter()) {
                self.labels.insert(label.to_ascii_lowercase(), id);
            }
        }
        self.default_class = cfg
            .default_class
            .as_ref()
            .and_then(|d| self.labels.get(&d.to_ascii_lowercase()).copied());
    }

    /// Lanes whose slot a new lane may take: not kept by `cfg` (so retired by this reload
    /// or an earlier one), with no job on them and no lane with jobs learning into them
    /// (an overflow lane's completions teach its class's lane). Lowest ids first.
    fn free_lanes(&self, cfg: &GateConfig, pool_ids: &HashMap<&str, PoolId>) -> Vec<usize> {
        let mut kept: BTreeSet<(&str, PoolId)> = BTreeSet::new();
        for c in &cfg.classes {
            for pool in std::iter::once(&c.pool).chain(c.overflow_pool.as_ref()) {
                if let Some(&p) = pool_ids.get(pool.as_str()) {
                    kept.insert((c.name.as_str(), p));
                }
            }
        }
        let mut busy: BTreeSet<usize> = BTreeSet::new();
        for j in self.jobs.values() {
            busy.insert(j.class.0);
            busy.insert(self.home(j.class).0);
        }
        let mut free: Vec<usize> = self
            .classes
            .iter()
            .enumerate()
            .filter(|(i, l)| {
                !busy.contains(i)
                    && l.queue.is_empty()
                    && !kept.contains(&(l.name.as_str(), l.pool))
            })
            .map(|(i, _)| i)
            .collect();
        // Popped from the end: reverse so the lowest id is reused first.
        free.reverse();
        free
    }

    /// Lanes in the table, live and retired (for tests and the admin views).
    pub fn lane_count(&self) -> usize {
        self.classes.len()
    }

    /// The lane of class `name` on `pool`, created if it does not exist yet: in a freed
    /// slot from `free` when there is one, else appended.
    fn lane(
        &mut self,
        name: &str,
        pool: PoolId,
        expected_output: Option<u32>,
        free: &mut Vec<usize>,
    ) -> LaneId {
        if let Some(i) = self
            .classes
            .iter()
            .position(|l| l.name == name && l.pool == pool)
        {
            return LaneId(i);
        }
        let fresh = LaneState {
            name: name.to_string(),
            pool,
            priority: 0,
            enabled: true,
            draining: false,
            default_deadline_ms: None,
            max_queue_age_ms: None,
            queue: ClassQueue::default(),
            expected_output: expected_output.map(f64::from),
            output_q: None,
            retry_hint: None,
            overflow: None,
            overflow_of: None,
            retired: false,
            displace_within_ms: None,
            errors: ErrorTracker::default(),
            probe_interval_ms: 0,
            last_probe: None,
            probes: 0,
            last_admit_at: None,
            ratios: VecDeque::new(),
            wait_errors: VecDeque::new(),
            wait_margin: 0.0,
            tenants: Default::default(),
            recent_others_prefill: 0.0,
            record: Default::default(),
            forecast: true,
            admitted: super::RateWindow::default(),
            refused: super::RateWindow::default(),
        };
        if let Some(i) = free.pop() {
            self.classes[i] = fresh;
            return LaneId(i);
        }
        self.classes.push(fresh);
        LaneId(self.classes.len() - 1)
    }
}

impl LaneState {
    /// Take a class's settings as its primary lane.
    fn apply_primary(&mut self, c: &ClassConfig) {
        self.priority = c.priority;
        self.enabled = c.enabled;
        self.default_deadline_ms = c.deadline_ms;
        self.max_queue_age_ms = c.max_queue_age_ms;
        self.displace_within_ms = c.displace_within_ms;
        self.probe_interval_ms = c.probe_interval_ms;
        self.forecast = c.forecast;
        self.retry_hint = c.retry_hint.clone();
        self.overflow = None;
        self.overflow_of = None;
        self.retired = false;
    }

    /// Take a class's settings as its overflow lane, beside `primary`: always enabled, no
    /// displacement, probes or hint of its own.
    fn apply_overflow(&mut self, c: &ClassConfig, primary: LaneId) {
        self.priority = c.priority;
        self.enabled = true;
        self.default_deadline_ms = c.deadline_ms;
        self.max_queue_age_ms = c.max_queue_age_ms;
        self.displace_within_ms = None;
        self.probe_interval_ms = 0;
        self.forecast = c.forecast;
        self.retry_hint = None;
        self.overflow = None;
        self.overflow_of = Some(primary);
        self.retired = false;
    }
}

/// The width of one bucket of the pool's demand windows.
fn forecast_bucket_ms(pc: &PoolConfig) -> u64 {
    (pc.forecast_window_ms / super::FORECAST_BUCKETS as u64).max(1)
}

fn live_after_has(cfg: &GateConfig, name: &str) -> bool {
    cfg.classes.iter().any(|c| c.name == name)
}

fn unknown_pool(name: &str) -> ConfigError {
    ConfigError {
        path: "classes".into(),
        message: format!("unknown pool {name:?}"),
    }
}

#[cfg(test)]
mod lane_reuse_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::tests::{cfg, drain, req};
    use super::super::*;

    fn renamed(base: &GateConfig, from: &str, to: &str) -> GateConfig {
        let mut c = base.clone();
        for class in &mut c.classes {
            if class.name == from {
                class.name = to.to_string();
            }
        }
        c
    }

    #[test]
    fn renaming_a_class_back_and_forth_does_not_grow_the_lanes() {
        let base = cfg(1, 100.0);
        let mut g = Gate::new(base.clone()).unwrap();
        let start = g.lane_count();
        for i in 0..200u64 {
            let (from, to) = if i % 2 == 0 {
                ("probe", "batch")
            } else {
                ("batch", "probe")
            };
            let next = renamed(g.config(), from, to);
            g.reconfigure(i, next).unwrap();
        }
        assert!(
            g.lane_count() <= start + 1,
            "{} lanes after 200 renames (started with {start})",
            g.lane_count()
        );
        // The live classes still work.
        assert_eq!(
            g.classify(Some("prod"))
                .map(|c| g.class_name(c).to_string()),
            Some("prod".into())
        );
        assert!(g.classify(Some("probe")).is_some());
    }

    #[test]
    fn a_retired_lane_with_work_is_not_reused_until_the_work_ends() {
        let base = cfg(1, 100.0);
        let mut g = Gate::new(base.clone()).unwrap();
        // One probe job running, one queued behind it.
        let running = g.offer(0, req(&g, "probe")).job_id;
        drain(&mut g, 0);
        let queued = g.offer(0, req(&g, "probe")).job_id;
        assert_eq!(g.live_jobs(), 2);
        let lanes = g.lane_count();
        // Rename probe -> batch: the old lane is busy, so the new class gets a new slot.
        g.reconfigure(1, renamed(&base, "probe", "batch")).unwrap();
        assert_eq!(g.lane_count(), lanes + 1);
        // Rename again (batch -> other): probe's lane is still busy; batch's is free.
        let again = renamed(g.config(), "batch", "other");
        g.reconfigure(2, again).unwrap();
        assert_eq!(g.lane_count(), lanes + 1, "batch's empty lane was reused");
        let snap = g.snapshot(2);
        assert!(snap.classes.iter().any(|c| c.name == "probe" && c.retired));
        // The retired probe jobs still run to their end.
        g.on_complete(100, running, Completion::default()).unwrap();
        let ev = drain(&mut g, 100);
        assert!(
            matches!(ev[..], [Event::Dispatch { job_id, .. }] if job_id == queued),
            "{ev:?}"
        );
        g.on_complete(200, queued, Completion::default()).unwrap();
        // Now probe's lane is free: the next new class takes it.
        let third = renamed(g.config(), "other", "third");
        g.reconfigure(300, third).unwrap();
        assert_eq!(g.lane_count(), lanes + 1, "no growth once the work ended");
        assert_eq!(g.live_jobs(), 0);
    }
}
