//! The checker of a fault run: it reads what the run left behind (the stub's own record of
//! every request that reached it, the replicas' decision logs, the shared ledger once the run
//! has quiesced, each client request's answer and timing) and sorts what it finds into
//! violations of the fail-closed guarantees and documented exceptions.
//!
//! The rules (docs/deployment.md, "What is guaranteed under partition"):
//!
//! - **slots**: at no moment does the upstream run more than the pool's slots, not counting
//!   the requests a replica decided alone by `fail_mode = "open"` (`"cluster":"degraded"` on
//!   its `admit` line): those may exceed the slots by design (each replica decides on its
//!   share) and are counted as the exception `slots_exceeded_by_fail_open`;
//!   An `open` class's request dispatched while its replica's link to Redis was faulted (a
//!   proxy fault, Redis killed) counts as fail-open too: its class goes ahead without a
//!   durable hold or dispatch record, which a new leader then cannot count;
//! - **keys**: no idempotency key reaches the upstream twice, unless one of its admissions was
//!   a fail-open one (the exception `key_spent_twice_by_fail_open`, which includes an `open`
//!   class's run while Redis was out of reach), or all its runs but one failed (timed out,
//!   broke, cancelled once sent: `key_retried_after_a_failed_run`, a legitimate retry: the
//!   failed run's hold is settled cancelled), or the second run came more than a hold TTL
//!   after the first (`key_rerun_after_its_hold_ttl`: a key whose run's fate is unknown, its
//!   replica dead or cut off with it, is held for the hold TTL, then expires), or Redis
//!   restarted empty between the two runs
//!   (`key_spent_twice_after_redis_lost_data`: a settled key that no running replica knew is
//!   gone, docs/deployment.md "Redis");
//! - **deadline**: every request is answered within its deadline plus one lease TTL (plus a
//!   margin for a starved machine), unless the replica it was sent to was itself killed or
//!   stopped while it ran (the exception `own_replica_faulted`); an exchange that failed
//!   (connection refused, broken, no answer) without such a fault is a violation too;
//! - **closed**: a `closed` class is never admitted by fail mode;
//! - **holds**: no key is left `held` in the shared ledger once the run has quiesced.
//!
//! Every violation names the time it was seen and the faults in force around it.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One client request of the run.
#[derive(Clone, Debug)]
pub struct Attempt {
    pub key: String,
    pub class: &'static str,
    pub replica: usize,
    pub deadline_ms: u64,
    /// When it was sent, epoch ms (the harness's clock, which no fault touches).
    pub sent_unix_ms: u64,
    /// How long until its answer ended (or the exchange failed).
    pub took_ms: u64,
    /// `None`: no answer (the exchange failed: see `error`).
    pub status: Option<u16>,
    pub reason: String,
    pub error: String,
}

/// What the stub recorded about one request that reached it.
#[derive(Clone, Debug)]
pub struct Upstream {
    /// The request's `x-stub-request-id`: its idempotency key.
    pub key: String,
    pub slot_unix_ms: u64,
    pub busy_ms: u64,
}

/// One admission of a key, from a replica's decision log.
#[derive(Clone, Debug)]
pub struct Admission {
    pub replica: usize,
    /// `leader` or `degraded`.
    pub mode: String,
}

/// One injected fault, for attribution.
#[derive(Clone, Debug)]
pub struct Fault {
    pub kind: &'static str,
    /// What it hit: `r1`, `redis`, `proxy r0`.
    pub target: String,
    /// Replica whose own clients it cut off (kill, stop), if any.
    pub replica_down: Option<usize>,
    pub start_unix_ms: u64,
    pub end_unix_ms: u64,
}

/// Everything the checker reads.
pub struct Evidence {
    pub slots: usize,
    pub lease_ttl_ms: u64,
    /// The ledger's hold TTL: a key whose run's fate is unknown (its replica died with it,
    /// its `done` lost) is held this long, then may run again.
    pub hold_ttl_ms: u64,
    /// Added to every bound: time a 2-core machine may lose between the gate and the client.
    pub margin_ms: u64,
    pub attempts: Vec<Attempt>,
    pub upstream: Vec<Upstream>,
    pub admissions: BTreeMap<String, Vec<Admission>>,
    /// Per key, its runs sent upstream that did not end `completed` (see `faults.rs`).
    pub failed_runs: BTreeMap<String, usize>,
    /// Per key, its runs that ended `completed` in a decision log.
    pub completed_runs: BTreeMap<String, usize>,
    pub faults: Vec<Fault>,
    /// Keys still `held` in the shared ledger after quiescing, with their records.
    pub held: Vec<(String, String)>,
}

/// Violations and exceptions by kind, each with its findings in plain words.
#[derive(Default, Debug)]
pub struct Findings {
    pub violations: BTreeMap<&'static str, Vec<String>>,
    pub exceptions: BTreeMap<&'static str, Vec<String>>,
}

impl Findings {
    pub fn violation_count(&self) -> usize {
        self.violations.values().map(Vec::len).sum()
    }

    fn violation(&mut self, kind: &'static str, what: String) {
        self.violations.entry(kind).or_default().push(what);
    }

    fn exception(&mut self, kind: &'static str, what: String) {
        self.exceptions.entry(kind).or_default().push(what);
    }
}

impl Evidence {
    /// Run every rule.
    pub fn check(&self) -> Findings {
        let mut f = Findings::default();
        self.check_slots(&mut f);
        self.check_keys(&mut f);
        self.check_answers(&mut f);
        self.check_closed(&mut f);
        for (key, record) in &self.held {
            f.violation("hold_left_behind", format!("{key}: {record}"));
        }
        f
    }

    /// Whether any admission of `key` was decided alone by fail mode.
    fn fail_open(&self, key: &str) -> bool {
        self.admissions
            .get(key)
            .is_some_and(|a| a.iter().any(|a| a.mode == "degraded"))
    }

    /// Whether the run of `key` that got its slot at `t` went ahead as its class's fail mode
    /// allows: admitted alone (degraded), or an `open` class while a fault cut the replicas
    /// off from Redis (its hold or dispatch record not durable).
    fn ran_fail_open(&self, key: &str, t: u64) -> bool {
        self.fail_open(key) || (self.class_of(key) == Some("open") && self.redis_faulted(key, t))
    }

    fn class_of(&self, key: &str) -> Option<&'static str> {
        self.attempts.iter().find(|a| a.key == key).map(|a| a.class)
    }

    /// A fault between Redis and a replica that admitted `key` (a fault of that replica's
    /// proxy, or of Redis itself) in force at `t` or ended a lease before.
    fn redis_faulted(&self, key: &str, t: u64) -> bool {
        let admitters: Vec<String> = self
            .admissions
            .get(key)
            .map(|a| a.iter().map(|a| format!("proxy r{}", a.replica)).collect())
            .unwrap_or_default();
        self.faults.iter().any(|x| {
            // A proxy fault's target is `proxy r<i>`, a delay's followed by its amount.
            let proxy_of = |p: &String| x.target == *p || x.target.starts_with(&format!("{p} "));
            let reaches = x.kind.starts_with("redis_")
                || (x.kind.starts_with("proxy_") && admitters.iter().any(proxy_of));
            reaches && x.start_unix_ms <= t && t <= x.end_unix_ms + self.lease_ttl_ms
        })
    }

    /// Redis restarted without its data between `from` and `to`.
    fn redis_emptied(&self, from: u64, to: u64) -> bool {
        self.faults.iter().any(|x| {
            x.kind == "redis_kill9_restart_empty" && from <= x.end_unix_ms && x.start_unix_ms <= to
        })
    }

    fn how_admitted(&self, key: &str) -> String {
        match self.admissions.get(key) {
            Some(a) if !a.is_empty() => a
                .iter()
                .map(|a| format!("r{}:{}", a.replica, a.mode))
                .collect::<Vec<_>>()
                .join("+"),
            _ => "no admit line".to_owned(),
        }
    }

    /// The faults in force at `t` or ended within two lease TTLs before it.
    pub fn faults_at(&self, t: u64) -> String {
        let after = 2 * self.lease_ttl_ms + 1000;
        let near: Vec<String> = self
            .faults
            .iter()
            .filter(|x| x.start_unix_ms <= t && t <= x.end_unix_ms + after)
            .map(|x| {
                let since = t.saturating_sub(x.start_unix_ms);
                format!("{} {} (+{since} ms)", x.kind, x.target)
            })
            .collect();
        if near.is_empty() {
            "no fault in force".to_owned()
        } else {
            near.join(", ")
        }
    }

    /// Sweep the upstream's timeline: every moment more requests ran than the slots.
    fn check_slots(&self, f: &mut Findings) {
        let mut events: Vec<(u64, i8, usize)> = Vec::new();
        for (i, u) in self.upstream.iter().enumerate() {
            if u.slot_unix_ms == 0 {
                continue;
            }
            events.push((u.slot_unix_ms, 1, i));
            events.push((u.slot_unix_ms + u.busy_ms, -1, i));
        }
        // At one millisecond, ends before starts: back to back is not at once.
        events.sort_by_key(|&(t, d, i)| (t, d, i));
        let mut running: BTreeMap<usize, ()> = BTreeMap::new();
        // One finding per episode (from the first moment over the slots until back within).
        let mut in_episode = false;
        for (t, d, i) in events {
            if d < 0 {
                running.remove(&i);
                if running.len() <= self.slots {
                    in_episode = false;
                }
                continue;
            }
            running.insert(i, ());
            if running.len() <= self.slots || in_episode {
                continue;
            }
            in_episode = true;
            let keys: Vec<&Upstream> = running.keys().map(|&j| &self.upstream[j]).collect();
            let by_leader = keys
                .iter()
                .filter(|u| !self.ran_fail_open(&u.key, u.slot_unix_ms))
                .count();
            let list: Vec<String> = keys
                .iter()
                .map(|u| format!("{} [{}]", u.key, self.how_admitted(&u.key)))
                .collect();
            let what = format!(
                "{} at once on {} slots ({by_leader} not fail-open) at t={t}: {}; faults: {}",
                keys.len(),
                self.slots,
                list.join(", "),
                self.faults_at(t)
            );
            if by_leader > self.slots {
                f.violation("slots_exceeded", what);
            } else {
                f.exception("slots_exceeded_by_fail_open", what);
            }
        }
    }

    fn check_keys(&self, f: &mut Findings) {
        let mut by_key: BTreeMap<&str, Vec<&Upstream>> = BTreeMap::new();
        for u in &self.upstream {
            by_key.entry(&u.key).or_default().push(u);
        }
        for (key, runs) in by_key {
            if runs.len() < 2 {
                continue;
            }
            let at = runs.iter().map(|u| u.slot_unix_ms).max().unwrap_or(0);
            let what = format!(
                "{key} reached the upstream {} times (slots at {:?}), admitted {}; faults: {}",
                runs.len(),
                runs.iter().map(|u| u.slot_unix_ms).collect::<Vec<_>>(),
                self.how_admitted(key),
                self.faults_at(at)
            );
            let first = runs.iter().map(|u| u.slot_unix_ms).min().unwrap_or(0);
            let failed = self.failed_runs.get(key).copied().unwrap_or(0);
            let completed = self.completed_runs.get(key).copied().unwrap_or(0);
            // Runs no decision log saw end (their replica died or was cut off with them).
            let unknown = runs.len().saturating_sub(failed + completed);
            if runs.len().saturating_sub(failed) <= 1 {
                f.exception("key_retried_after_a_failed_run", what);
            } else if runs.iter().any(|u| self.ran_fail_open(key, u.slot_unix_ms)) {
                f.exception("key_spent_twice_by_fail_open", what);
            } else if at.saturating_sub(first) > self.hold_ttl_ms && unknown > 0 {
                f.exception("key_rerun_after_its_hold_ttl", what);
            } else if self.redis_emptied(first, at) {
                f.exception("key_spent_twice_after_redis_lost_data", what);
            } else {
                f.violation("key_spent_twice", what);
            }
        }
    }

    /// Whether replica `r` was killed or stopped at some moment of `from..=to`.
    fn replica_faulted(&self, r: usize, from: u64, to: u64) -> bool {
        self.faults.iter().any(|x| {
            x.replica_down == Some(r) && x.start_unix_ms <= to && from <= x.end_unix_ms + 100
        })
    }

    fn check_answers(&self, f: &mut Findings) {
        for a in &self.attempts {
            let end = a.sent_unix_ms + a.took_ms;
            let bound = a.deadline_ms + self.lease_ttl_ms + self.margin_ms;
            let late = a.took_ms > bound;
            if !late && a.status.is_some() {
                continue;
            }
            let what = match a.status {
                Some(s) => format!(
                    "{} ({}) on r{}: {s} {} after {} ms, bound {bound} ms (deadline {} + lease \
                     {} + margin {}); faults: {}",
                    a.key,
                    a.class,
                    a.replica,
                    a.reason,
                    a.took_ms,
                    a.deadline_ms,
                    self.lease_ttl_ms,
                    self.margin_ms,
                    self.faults_at(end)
                ),
                None => format!(
                    "{} ({}) on r{}: no answer after {} ms ({}); faults: {}",
                    a.key,
                    a.class,
                    a.replica,
                    a.took_ms,
                    a.error,
                    self.faults_at(end)
                ),
            };
            let kind = if a.status.is_some() {
                "answered_past_deadline_plus_ttl"
            } else {
                "no_answer"
            };
            if self.replica_faulted(a.replica, a.sent_unix_ms, end) {
                f.exception("own_replica_faulted", format!("{kind}: {what}"));
            } else {
                f.violation(kind, what);
            }
        }
    }

    fn check_closed(&self, f: &mut Findings) {
        for a in &self.attempts {
            if a.class == "closed" && a.status == Some(200) && self.fail_open(&a.key) {
                f.violation(
                    "closed_class_admitted_by_fail_mode",
                    format!("{} on r{}: {}", a.key, a.replica, self.how_admitted(&a.key)),
                );
            }
        }
    }
}

/// The findings as report lines: counts by kind, then up to `show` findings of each.
pub fn render(findings: &Findings, show: usize) -> String {
    let mut out = String::new();
    let total = findings.violation_count();
    let _ = writeln!(out, "violations (fail-closed guarantees): {total}");
    for (kind, list) in &findings.violations {
        let _ = writeln!(out, "  {kind}: {}", list.len());
        for what in list.iter().take(show) {
            let _ = writeln!(out, "    - {what}");
        }
    }
    let excepted: usize = findings.exceptions.values().map(Vec::len).sum();
    let _ = writeln!(out, "documented exceptions (not violations): {excepted}");
    for (kind, list) in &findings.exceptions {
        let _ = writeln!(out, "  {kind}: {}", list.len());
        for what in list.iter().take(show) {
            let _ = writeln!(out, "    - {what}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn up(key: &str, at: u64, busy: u64) -> Upstream {
        Upstream {
            key: key.to_owned(),
            slot_unix_ms: at,
            busy_ms: busy,
        }
    }

    fn admitted(pairs: &[(&str, usize, &str)]) -> BTreeMap<String, Vec<Admission>> {
        let mut m: BTreeMap<String, Vec<Admission>> = BTreeMap::new();
        for (k, r, mode) in pairs {
            m.entry((*k).to_owned()).or_default().push(Admission {
                replica: *r,
                mode: (*mode).to_owned(),
            });
        }
        m
    }

    fn evidence(upstream: Vec<Upstream>, admissions: BTreeMap<String, Vec<Admission>>) -> Evidence {
        Evidence {
            slots: 2,
            lease_ttl_ms: 1000,
            hold_ttl_ms: 8_000,
            margin_ms: 500,
            attempts: Vec::new(),
            upstream,
            admissions,
            failed_runs: BTreeMap::new(),
            completed_runs: BTreeMap::new(),
            faults: vec![Fault {
                kind: "leader_sigstop",
                target: "r0".to_owned(),
                replica_down: Some(0),
                start_unix_ms: 1000,
                end_unix_ms: 3000,
            }],
            held: Vec::new(),
        }
    }

    #[test]
    fn three_leader_requests_at_once_on_two_slots_is_a_violation_naming_the_fault() {
        let e = evidence(
            vec![up("a", 3000, 300), up("b", 3100, 300), up("c", 3200, 300)],
            admitted(&[("a", 0, "leader"), ("b", 1, "leader"), ("c", 1, "leader")]),
        );
        let f = e.check();
        let v = &f.violations["slots_exceeded"];
        assert_eq!(v.len(), 1, "{f:?}");
        assert!(v[0].contains("3 at once on 2 slots"), "{v:?}");
        assert!(v[0].contains("leader_sigstop r0"), "{v:?}");
    }

    #[test]
    fn back_to_back_is_not_at_once_and_fail_open_excess_is_an_exception() {
        // a ends exactly when c starts: never three at once.
        let e = evidence(
            vec![up("a", 10, 300), up("b", 100, 400), up("c", 310, 100)],
            admitted(&[]),
        );
        assert_eq!(e.check().violation_count(), 0);
        let e = evidence(
            vec![up("a", 10, 300), up("b", 100, 400), up("c", 200, 300)],
            admitted(&[("c", 2, "degraded")]),
        );
        let f = e.check();
        assert_eq!(f.violation_count(), 0, "{f:?}");
        assert_eq!(f.exceptions["slots_exceeded_by_fail_open"].len(), 1);
    }

    #[test]
    fn a_key_twice_upstream_is_a_violation_unless_admitted_by_fail_mode() {
        let e = evidence(
            vec![
                up("k", 0, 10),
                up("k", 50, 10),
                up("o", 0, 10),
                up("o", 50, 10),
            ],
            admitted(&[("k", 0, "leader"), ("o", 1, "degraded")]),
        );
        let f = e.check();
        assert_eq!(f.violations["key_spent_twice"].len(), 1, "{f:?}");
        assert!(f.violations["key_spent_twice"][0].starts_with("k "));
        assert_eq!(f.exceptions["key_spent_twice_by_fail_open"].len(), 1);
    }

    #[test]
    fn late_or_missing_answers_are_violations_unless_their_replica_was_down() {
        let attempt = |key: &str, replica, took_ms, status| Attempt {
            key: key.to_owned(),
            class: "closed",
            replica,
            deadline_ms: 1000,
            sent_unix_ms: 2000,
            took_ms,
            status,
            reason: String::new(),
            error: "broken".to_owned(),
        };
        let mut e = evidence(Vec::new(), admitted(&[("fo", 1, "degraded")]));
        e.attempts = vec![
            attempt("ok", 1, 2500, Some(503)),
            attempt("late", 1, 2501, Some(200)),
            attempt("gone", 1, 10, None),
            attempt("frozen", 0, 9000, Some(200)),
            attempt("fo", 1, 10, Some(200)),
        ];
        e.held = vec![("h".to_owned(), "{}".to_owned())];
        let f = e.check();
        assert_eq!(f.violations["answered_past_deadline_plus_ttl"].len(), 1);
        assert_eq!(f.violations["no_answer"].len(), 1);
        assert_eq!(f.violations["closed_class_admitted_by_fail_mode"].len(), 1);
        assert_eq!(f.violations["hold_left_behind"].len(), 1);
        assert_eq!(f.exceptions["own_replica_faulted"].len(), 1);
        assert_eq!(f.violation_count(), 4);
        let text = render(&f, 1);
        assert!(
            text.contains("violations (fail-closed guarantees): 4"),
            "{text}"
        );
    }

    fn asked(key: &str, class: &'static str) -> Attempt {
        Attempt {
            key: key.to_owned(),
            class,
            replica: 0,
            deadline_ms: 10_000,
            sent_unix_ms: 0,
            took_ms: 10,
            status: Some(200),
            reason: String::new(),
            error: String::new(),
        }
    }

    fn fault(kind: &'static str, start: u64, end: u64) -> Fault {
        Fault {
            kind,
            target: "proxy r0".to_owned(),
            replica_down: None,
            start_unix_ms: start,
            end_unix_ms: end,
        }
    }

    #[test]
    fn an_open_class_without_redis_is_an_exception_a_closed_one_is_not() {
        // The same key run twice by leaders while r0's link to Redis is blackholed: an open
        // class goes ahead without a durable hold (documented), a closed one must not.
        let mut e = evidence(
            vec![
                up("o", 100, 10),
                up("o", 900, 10),
                up("c", 100, 10),
                up("c", 900, 10),
            ],
            admitted(&[
                ("o", 0, "leader"),
                ("o", 1, "leader"),
                ("c", 0, "leader"),
                ("c", 1, "leader"),
            ]),
        );
        e.attempts = vec![asked("o", "open"), asked("c", "closed")];
        e.faults = vec![fault("proxy_blackhole", 50, 2000)];
        let f = e.check();
        assert_eq!(f.violations["key_spent_twice"].len(), 1, "{f:?}");
        assert!(f.violations["key_spent_twice"][0].starts_with("c "));
        assert_eq!(f.exceptions["key_spent_twice_by_fail_open"].len(), 1);
        // Without the fault, both are violations.
        e.faults.clear();
        assert_eq!(e.check().violations["key_spent_twice"].len(), 2);
    }

    #[test]
    fn a_key_run_again_after_redis_lost_its_data_is_a_documented_exception() {
        let mut e = evidence(
            vec![up("c", 100, 10), up("c", 5_000, 10)],
            admitted(&[("c", 0, "leader")]),
        );
        e.attempts = vec![asked("c", "closed")];
        e.faults = vec![fault("redis_kill9_restart_empty", 2_000, 2_500)];
        let f = e.check();
        assert_eq!(f.violation_count(), 0, "{f:?}");
        assert_eq!(
            f.exceptions["key_spent_twice_after_redis_lost_data"].len(),
            1
        );
        // Both runs after the loss: a violation.
        e.upstream = vec![up("c", 3_000, 10), up("c", 5_000, 10)];
        assert_eq!(e.check().violations["key_spent_twice"].len(), 1);
    }

    #[test]
    fn a_key_retried_after_its_run_failed_is_not_spent_twice() {
        let mut e = evidence(
            vec![up("t", 100, 2_000), up("t", 3_000, 10)],
            admitted(&[("t", 0, "leader"), ("t", 1, "leader")]),
        );
        e.attempts = vec![asked("t", "closed")];
        e.failed_runs.insert("t".to_owned(), 1);
        let f = e.check();
        assert_eq!(f.violation_count(), 0, "{f:?}");
        assert_eq!(f.exceptions["key_retried_after_a_failed_run"].len(), 1);
        // Two runs that both completed: a violation, whatever failed besides.
        e.upstream.push(up("t", 5_000, 10));
        assert_eq!(e.check().violations["key_spent_twice"].len(), 1);
    }

    #[test]
    fn a_key_run_again_only_after_its_hold_ttl_is_a_documented_exception() {
        let mut e = evidence(
            vec![up("h", 100, 10), up("h", 9_000, 10)],
            admitted(&[("h", 0, "leader"), ("h", 1, "leader")]),
        );
        e.attempts = vec![asked("h", "closed")];
        // The first run's end is in no log (its replica died with it); the second completed.
        e.completed_runs.insert("h".to_owned(), 1);
        let f = e.check();
        assert_eq!(f.violation_count(), 0, "{f:?}");
        assert_eq!(f.exceptions["key_rerun_after_its_hold_ttl"].len(), 1);
        // Both completed: the first's `done` was known, so the rerun is a violation.
        e.completed_runs.insert("h".to_owned(), 2);
        assert_eq!(e.check().violations["key_spent_twice"].len(), 1);
        e.completed_runs.insert("h".to_owned(), 1);
        // Within the hold TTL: a violation.
        e.upstream = vec![up("h", 100, 10), up("h", 7_000, 10)];
        assert_eq!(e.check().violations["key_spent_twice"].len(), 1);
    }
}
