//! Property tests of the token reservation ledger (seed 001), alone and behind the gate.
//!
//! **A. The ledger alone.** A random configuration (TTL 1-40 ms, retry cap 0-3, grants for two
//! tenants, sometimes a default grant) and up to 80 random operations over 6 keys and 4 tenant
//! choices, with time advancing: `reserve` and `reserve_unchecked` (any attempt; 0, small,
//! `MAX_TOKENS` and `u64::MAX` tokens), `record_rejection`, `commit`, `cancel`, `expire_due`,
//! and a simulated crash: a new ledger restored from every record the operations returned so
//! far, shuffled and with duplicates (so older versions arrive after newer ones). A reference
//! model predicts every answer and record. After every operation:
//!
//! 1. no double spend: a key's `tokens_spent` is set once, by the one `done` record of its hold,
//!    and a `done` key is never reserved again (`Duplicate`); `stats().tokens_spent` equals the
//!    sum of `tokens_spent` over every `done` record ever returned;
//! 2. terminal exactly once: per key the returned records go `held -> done | cancelled |
//!    expired` with nothing in between, never two terminals for one hold; a commit or cancel of
//!    a key that is not held (missing, settled, rejected, expired) is an error and changes
//!    neither the key's record nor the stats;
//! 3. no leak: `stats().held` / `tokens_held` equal the count / sum over keys whose latest
//!    record is `held`, and after `expire_due` far in the future nothing is held;
//! 4. tenant grants: `remaining()` is `grant - (held + spent + wasted)` saturated at zero, and
//!    a reservation that would exceed it is refused with `BudgetExhausted`;
//! 5. versions go up by exactly one per change of a key; restoring from the records (any order,
//!    duplicates, older versions) gives the live ledger's per-key records, held count and
//!    tokens held; its spent, wasted and counts are those of the latest records, which is the
//!    live ledger's own totals whenever no key was retried since the last restore (see
//!    `restore_forgets_the_waste_of_a_retried_key` for what is lost otherwise);
//! 6. amplification is `None` until something is spent, then `(spent + wasted) / spent >= 1`.
//!
//! **B. The gate with its ledger.** Random offers with idempotency keys from a small set (or
//! none), tenants, attempts, classes, sizes; completions (ok or failed, with and without usage),
//! cancels, `commit_key` / `cancel_key` (of held, settled and unknown keys), ticks, time passing
//! (past the hold TTL too) and the `admit_always` flag; `poll` is drained after every step and
//! `take_ledger_records` collected. Checked:
//!
//! 1. no key is ever held by two live jobs, and `job_for_key` names the model's live job;
//! 2. `reject_duplicate` happens exactly when the key's latest record is `held` or `done`; an
//!    admitted request's key is then `held` with the decision's `tokens_held`;
//! 3. every hold placed is settled exactly once: per key the records go up by one version at a
//!    time, each `held` followed by exactly one terminal record (no record persisted twice),
//!    and after a tick far in the future no job is live and nothing is held;
//! 4. `stats()` spent, wasted, held and tokens held equal the sums over the records.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use slackgate_core::ledger::{
    Ledger, LedgerConfig, LedgerReject, LedgerStats, SettleError, MAX_TOKENS,
};
use slackgate_core::{
    ClassConfig, Completion, Event, Gate, GateConfig, HoldRecord, HoldState, JobId, LaneId, Millis,
    PoolConfig, Reason, Request,
};
use std::collections::{BTreeMap, BTreeSet};

const KEYS: usize = 6;
const TENANTS: [Option<&str>; 4] = [None, Some("t0"), Some("t1"), Some("t2")];

fn key(i: usize) -> String {
    format!("k{}", i % KEYS)
}

fn tenant(i: usize) -> Option<&'static str> {
    TENANTS[i % TENANTS.len()]
}

/// Token counts worth trying: nothing, ordinary, the cap, and far past it.
fn tokens() -> impl Strategy<Value = u64> {
    prop_oneof![
        1 => Just(0u64),
        6 => 1u64..600,
        1 => Just(MAX_TOKENS),
        1 => Just(u64::MAX),
    ]
}

/// A small deterministic generator, for shuffling the records handed to `restore`.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Every record, about a third of them twice, in a random order.
fn shuffled(log: &[HoldRecord], seed: u64) -> Vec<HoldRecord> {
    let mut rng = SplitMix(seed);
    let mut out: Vec<HoldRecord> = log.to_vec();
    for r in log {
        if rng.below(3) == 0 {
            out.push(r.clone());
        }
    }
    for i in (1..out.len()).rev() {
        let j = rng.below(i + 1);
        out.swap(i, j);
    }
    out
}

/// The latest record of each key: the highest version wins.
fn latest_of(records: &[HoldRecord]) -> BTreeMap<String, HoldRecord> {
    let mut m: BTreeMap<String, HoldRecord> = BTreeMap::new();
    for r in records {
        match m.get(&*r.key) {
            Some(p) if p.version >= r.version => {}
            _ => {
                m.insert(r.key.to_string(), r.clone());
            }
        }
    }
    m
}

/// Check the life of every key in `log` (records in the order they were returned): versions
/// go up by one per record, a `held` record is followed by exactly one terminal one, a
/// terminal never follows a terminal, nothing follows `done`, and the token fields fit the
/// state. With `all_settled`, no key may end `held`.
fn check_lifecycles(log: &[HoldRecord], all_settled: bool) -> Result<(), TestCaseError> {
    let mut per_key: BTreeMap<&str, Vec<&HoldRecord>> = BTreeMap::new();
    for r in log {
        per_key.entry(&*r.key).or_default().push(r);
    }
    for (k, recs) in per_key {
        let mut prev: Option<&HoldRecord> = None;
        for r in &recs {
            match r.state {
                HoldState::Done => prop_assert_eq!(r.tokens_wasted, 0, "{:?}", r),
                HoldState::Cancelled | HoldState::Expired => {
                    prop_assert_eq!(r.tokens_spent, 0, "{:?}", r)
                }
                HoldState::Held | HoldState::Rejected => {
                    prop_assert_eq!((r.tokens_spent, r.tokens_wasted), (0, 0), "{:?}", r)
                }
            }
            prop_assert!(r.tokens_held <= MAX_TOKENS, "{:?}", r);
            if r.state == HoldState::Expired {
                prop_assert_eq!(r.tokens_wasted, r.tokens_held, "expiry wastes the hold");
            }
            match prev {
                None => {
                    prop_assert!(r.version >= 1, "first record of {}: {:?}", k, r);
                    prop_assert!(
                        matches!(r.state, HoldState::Held | HoldState::Rejected),
                        "{} starts {:?}",
                        k,
                        r.state
                    );
                }
                Some(p) => {
                    // A settlement is the next version; a new hold (or rejection) of a key
                    // jumps to at least the current time, so versions never go back even after
                    // the retention forgets a key.
                    if p.state == HoldState::Held {
                        prop_assert_eq!(
                            r.version,
                            p.version + 1,
                            "{}: {:?} after {:?} (a record returned twice, or a skipped version)",
                            k,
                            r,
                            p
                        );
                    } else {
                        prop_assert!(r.version > p.version, "{}: {:?} after {:?}", k, r, p);
                        prop_assert_eq!(r.prior_spent, p.prior_spent + p.tokens_spent);
                        prop_assert_eq!(r.prior_wasted, p.prior_wasted + p.tokens_wasted);
                    }
                    // A live request's hold renewed at its TTL: the same hold, later expiry.
                    let renewal = p.state == HoldState::Held
                        && r.state == HoldState::Held
                        && r.created_at_ms == p.created_at_ms
                        && r.tokens_held == p.tokens_held
                        && r.expires_at_ms > p.expires_at_ms;
                    if p.state == HoldState::Held && !renewal {
                        prop_assert!(
                            r.state.is_terminal(),
                            "{}: held must end in exactly one terminal, got {:?}",
                            k,
                            r.state
                        );
                        // The terminal record settles that very hold.
                        prop_assert_eq!(
                            (&r.tenant, r.attempt, r.tokens_held, r.created_at_ms),
                            (&p.tenant, p.attempt, p.tokens_held, p.created_at_ms)
                        );
                    } else {
                        prop_assert!(
                            p.state != HoldState::Done,
                            "{}: a done key changed again: {:?}",
                            k,
                            r
                        );
                        prop_assert!(
                            matches!(r.state, HoldState::Held | HoldState::Rejected),
                            "{}: {:?} after {:?} (a second terminal)",
                            k,
                            r.state,
                            p.state
                        );
                    }
                }
            }
            prev = Some(r);
        }
        if all_settled {
            prop_assert!(
                prev.is_none_or(|p| p.state != HoldState::Held),
                "{} still held",
                k
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// A. The ledger alone
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum LOp {
    Advance(u64),
    Reserve {
        key: usize,
        tenant: usize,
        attempt: u32,
        tokens: u64,
        unchecked: bool,
    },
    Reject {
        key: usize,
        tenant: usize,
        attempt: u32,
        tokens: u64,
    },
    Commit {
        key: usize,
        tokens: u64,
    },
    Cancel {
        key: usize,
        tokens: u64,
    },
    ExpireDue,
    /// Crash and restart: a new ledger from every record so far (shuffled by this seed).
    Restore(u64),
}

fn ledger_op() -> impl Strategy<Value = LOp> {
    prop_oneof![
        3 => prop_oneof![0u64..5, 5u64..30, Just(100u64)].prop_map(LOp::Advance),
        6 => (0..KEYS, 0..TENANTS.len(), 0u32..5, tokens(), prop::bool::weighted(0.15)).prop_map(
            // Idempotency keys belong to one tenant (a key is a client's own request id):
            // each key always comes from the same tenant.
            |(key, _tenant, attempt, tokens, unchecked)| LOp::Reserve {
                key,
                tenant: key % TENANTS.len(),
                attempt,
                tokens,
                unchecked,
            }
        ),
        1 => (0..KEYS, 0..TENANTS.len(), 0u32..5, tokens()).prop_map(
            |(key, _tenant, attempt, tokens)| LOp::Reject {
                key,
                tenant: key % TENANTS.len(),
                attempt,
                tokens,
            }
        ),
        3 => (0..KEYS, tokens()).prop_map(|(key, tokens)| LOp::Commit { key, tokens }),
        2 => (0..KEYS, tokens()).prop_map(|(key, tokens)| LOp::Cancel { key, tokens }),
        1 => Just(LOp::ExpireDue),
        1 => any::<u64>().prop_map(LOp::Restore),
    ]
}

fn ledger_config() -> impl Strategy<Value = LedgerConfig> {
    (
        1u64..40,
        0u32..=3,
        0u64..3000,
        0u64..3000,
        prop::option::of(0u64..3000),
    )
        .prop_map(|(ttl, cap, g0, g1, default)| LedgerConfig {
            hold_ttl_ms: ttl,
            retry_cap: cap,
            // Never forget settled keys here: `versions_restart_after_the_retention` covers it.
            retention_ms: u64::MAX,
            default_grant_tokens: default,
            grants: [("t0".to_string(), g0), ("t1".to_string(), g1)]
                .into_iter()
                .collect(),
        })
}

/// Totals the model expects from `stats()` (amplification is derived).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Totals {
    held: u64,
    tokens_held: u64,
    spent: u64,
    wasted: u64,
    done: u64,
    cancelled: u64,
    expired: u64,
    rejected: u64,
}

impl Totals {
    fn of(s: &LedgerStats) -> Totals {
        Totals {
            held: s.held,
            tokens_held: s.tokens_held,
            spent: s.tokens_spent,
            wasted: s.tokens_wasted,
            done: s.done,
            cancelled: s.cancelled,
            expired: s.expired,
            rejected: s.rejected,
        }
    }

    /// What a ledger rebuilt from exactly these latest records reports.
    fn of_latest<'a>(latest: impl IntoIterator<Item = &'a HoldRecord>) -> Totals {
        let mut t = Totals::default();
        for r in latest {
            // Earlier holds of a retried key travel in its latest record.
            t.spent += r.prior_spent;
            t.wasted += r.prior_wasted;
            match r.state {
                HoldState::Held => {
                    t.held += 1;
                    t.tokens_held += r.tokens_held;
                }
                s => {
                    t.spent += r.tokens_spent;
                    t.wasted += r.tokens_wasted;
                    match s {
                        HoldState::Done => t.done += 1,
                        HoldState::Cancelled => t.cancelled += 1,
                        HoldState::Expired => t.expired += 1,
                        _ => t.rejected += 1,
                    }
                }
            }
        }
        t
    }
}

/// Tenant usage (held + spent + wasted) per tenant id, `""` for none.
fn usage_of_latest<'a>(latest: impl IntoIterator<Item = &'a HoldRecord>) -> BTreeMap<String, u64> {
    let mut u: BTreeMap<String, u64> = BTreeMap::new();
    for r in latest {
        let add = r.prior_spent
            + r.prior_wasted
            + match r.state {
                HoldState::Held => r.tokens_held,
                _ => r.tokens_spent + r.tokens_wasted,
            };
        *u.entry(r.tenant.as_deref().unwrap_or_default().to_string())
            .or_default() += add;
    }
    u
}

/// The reference model: what every key's latest record, the totals and the tenant usage must
/// be, computed independently of the ledger's own bookkeeping.
struct Model {
    cfg: LedgerConfig,
    now: Millis,
    latest: BTreeMap<String, HoldRecord>,
    totals: Totals,
    usage: BTreeMap<String, u64>,
    /// Every record the ledger returned to persist, in order.
    log: Vec<HoldRecord>,
    /// Some key started a new hold or rejection over an older settled record since the last
    /// restore: a restore keeps only the latest record, so history (waste) is lost.
    retried: bool,
}

impl Model {
    fn new(cfg: LedgerConfig) -> Model {
        Model {
            cfg,
            now: 0,
            latest: BTreeMap::new(),
            totals: Totals::default(),
            usage: BTreeMap::new(),
            log: Vec::new(),
            retried: false,
        }
    }

    fn grant(&self, t: Option<&str>) -> Option<u64> {
        let t = t.unwrap_or("");
        self.cfg
            .grants
            .get(t)
            .copied()
            .or(self.cfg.default_grant_tokens)
    }

    fn used(&self, t: Option<&str>) -> u64 {
        self.usage.get(t.unwrap_or("")).copied().unwrap_or(0)
    }

    fn remaining(&self, t: Option<&str>) -> Option<u64> {
        self.grant(t).map(|g| g.saturating_sub(self.used(t)))
    }

    fn use_tokens(&mut self, t: Option<&str>, add: u64, sub: u64) {
        let u = self.usage.entry(t.unwrap_or("").to_string()).or_default();
        *u = (*u + add).checked_sub(sub).expect("usage never negative");
    }

    fn next_version(&self, k: &str) -> u64 {
        self.latest
            .get(k)
            .map_or(0, |r| r.version)
            .saturating_add(1)
            .max(self.now)
    }

    fn carried(&self, k: &str) -> (u64, u64) {
        self.latest.get(k).map_or((0, 0), |r| {
            (
                r.prior_spent + r.tokens_spent,
                r.prior_wasted + r.tokens_wasted,
            )
        })
    }

    fn duplicate(&self, k: &str) -> Option<LedgerReject> {
        self.latest
            .get(k)
            .filter(|r| matches!(r.state, HoldState::Held | HoldState::Done))
            .map(|r| LedgerReject::Duplicate {
                state: r.state,
                tokens_held: r.tokens_held,
            })
    }

    fn reserve(
        &mut self,
        k: &str,
        t: Option<&str>,
        attempt: u32,
        tokens: u64,
        unchecked: bool,
    ) -> Result<HoldRecord, LedgerReject> {
        let tokens = tokens.min(MAX_TOKENS);
        if let Some(d) = self.duplicate(k) {
            return Err(d);
        }
        // A key tried before is at least on its next attempt.
        let attempt = self
            .latest
            .get(k)
            .map_or(attempt, |r| attempt.max(r.attempt + 1));
        if !unchecked {
            if attempt > self.cfg.retry_cap {
                return Err(LedgerReject::RetryCap {
                    attempt,
                    retry_cap: self.cfg.retry_cap,
                });
            }
            if let Some(remaining) = self.remaining(t) {
                if tokens > remaining {
                    return Err(LedgerReject::BudgetExhausted {
                        remaining,
                        requested: tokens,
                    });
                }
            }
        }
        let r = HoldRecord {
            key: k.into(),
            tenant: t.map(Into::into),
            state: HoldState::Held,
            attempt,
            tokens_held: tokens,
            tokens_spent: 0,
            tokens_wasted: 0,
            created_at_ms: self.now,
            expires_at_ms: self.now + self.cfg.hold_ttl_ms,
            updated_at_ms: self.now,
            version: self.next_version(k),
            prior_spent: self.carried(k).0,
            prior_wasted: self.carried(k).1,
            reservation: false,
            owner: None,
            dispatched: None,
        };
        self.retried |= self.latest.contains_key(k);
        self.use_tokens(t, tokens, 0);
        self.totals.held += 1;
        self.totals.tokens_held += tokens;
        self.latest.insert(k.to_string(), r.clone());
        Ok(r)
    }

    fn reject(
        &mut self,
        k: &str,
        t: Option<&str>,
        attempt: u32,
        tokens: u64,
    ) -> Option<HoldRecord> {
        if self.duplicate(k).is_some() {
            return None;
        }
        let attempt = self
            .latest
            .get(k)
            .map_or(attempt, |r| attempt.max(r.attempt + 1));

        let r = HoldRecord {
            key: k.into(),
            tenant: t.map(Into::into),
            state: HoldState::Rejected,
            attempt,
            tokens_held: tokens.min(MAX_TOKENS),
            tokens_spent: 0,
            tokens_wasted: 0,
            created_at_ms: self.now,
            expires_at_ms: self.now,
            updated_at_ms: self.now,
            version: self.next_version(k),
            prior_spent: self.carried(k).0,
            prior_wasted: self.carried(k).1,
            reservation: false,
            owner: None,
            dispatched: None,
        };
        self.retried |= self.latest.contains_key(k);
        self.totals.rejected += 1;
        self.latest.insert(k.to_string(), r.clone());
        Some(r)
    }

    /// End a held key; returns the new record.
    fn end(&mut self, k: &str, state: HoldState, spent: u64, wasted: u64) -> HoldRecord {
        let mut r = self.latest[k].clone();
        assert_eq!(r.state, HoldState::Held);
        r.state = state;
        r.tokens_spent = spent.min(MAX_TOKENS);
        r.tokens_wasted = wasted.min(MAX_TOKENS);
        r.updated_at_ms = self.now;
        r.version += 1;
        let t = r.tenant.clone();
        self.use_tokens(
            t.as_deref(),
            r.tokens_spent + r.tokens_wasted,
            r.tokens_held,
        );
        self.totals.held -= 1;
        self.totals.tokens_held -= r.tokens_held;
        self.totals.spent += r.tokens_spent;
        self.totals.wasted += r.tokens_wasted;
        match state {
            HoldState::Done => self.totals.done += 1,
            HoldState::Cancelled => self.totals.cancelled += 1,
            HoldState::Expired => self.totals.expired += 1,
            _ => unreachable!(),
        }
        self.latest.insert(k.to_string(), r.clone());
        r
    }

    /// Commit (`Done`) or cancel (`Cancelled`); `Ok(Some)` / `Err` with `changed` telling
    /// whether the ledger produced a new record to persist.
    fn settle(
        &mut self,
        k: &str,
        state: HoldState,
        n: u64,
    ) -> (Result<HoldRecord, SettleError>, bool) {
        let Some(r) = self.latest.get(k).cloned() else {
            return (Err(SettleError::MissingHold), false);
        };
        match r.state {
            HoldState::Held if self.now >= r.expires_at_ms => {
                let rec = self.end(k, HoldState::Expired, 0, r.tokens_held);
                (Err(SettleError::HoldExpired(Box::new(rec))), true)
            }
            HoldState::Held => {
                let (spent, wasted) = if state == HoldState::Done {
                    (n, 0)
                } else {
                    (0, n)
                };
                (Ok(self.end(k, state, spent, wasted)), true)
            }
            HoldState::Expired => (Err(SettleError::HoldExpired(Box::new(r))), false),
            other => (Err(SettleError::NotHeld(other)), false),
        }
    }

    /// Expire every hold due at `now`, in expiry order (then key order).
    fn expire_due(&mut self) -> Vec<HoldRecord> {
        let mut due: Vec<(Millis, String)> = self
            .latest
            .values()
            .filter(|r| r.state == HoldState::Held && r.expires_at_ms <= self.now)
            .map(|r| (r.expires_at_ms, r.key.to_string()))
            .collect();
        due.sort();
        due.into_iter()
            .map(|(_, k)| {
                let held = self.latest[&k].tokens_held;
                self.end(&k, HoldState::Expired, 0, held)
            })
            .collect()
    }

    /// A restart: proxied holds (every hold here: none is a reservation) lost their
    /// connection with the process and expire at once, in key order.
    fn expire_on_restore(&mut self) -> Vec<HoldRecord> {
        let mut held: Vec<String> = self
            .latest
            .values()
            .filter(|r| r.state == HoldState::Held && !r.reservation)
            .map(|r| r.key.to_string())
            .collect();
        held.sort();
        held.into_iter()
            .map(|k| {
                let h = self.latest[&k].tokens_held;
                self.end(&k, HoldState::Expired, 0, h)
            })
            .collect()
    }

    /// After a restart: the totals and usage are those of the latest records.
    fn rebase(&mut self) {
        self.totals = Totals::of_latest(self.latest.values());
        self.usage = usage_of_latest(self.latest.values());
        self.retried = false;
    }
}

/// Everything that must hold between operations.
fn check_ledger(l: &Ledger, m: &Model, restore_seed: u64) -> Result<(), TestCaseError> {
    // Per-key records: exactly the model's.
    for i in 0..KEYS {
        let k = key(i);
        prop_assert_eq!(l.get(&k), m.latest.get(&k), "key {}", k);
    }
    prop_assert_eq!(l.len(), m.latest.len());
    // Totals (1, 2, 3).
    let s = l.stats();
    prop_assert_eq!(Totals::of(&s), m.totals);
    // 3: held count and tokens equal the sums over keys whose latest record is held.
    let held: Vec<&HoldRecord> = m
        .latest
        .values()
        .filter(|r| r.state == HoldState::Held)
        .collect();
    prop_assert_eq!(s.held, held.len() as u64);
    prop_assert_eq!(
        s.tokens_held,
        held.iter().map(|r| r.tokens_held).sum::<u64>()
    );
    // 1: spent is the sum over every `done` record ever returned; a done key is never lost,
    // so this holds across restores too.
    let spent: u64 = m
        .log
        .iter()
        .filter(|r| r.state == HoldState::Done)
        .map(|r| r.tokens_spent)
        .sum();
    prop_assert_eq!(s.tokens_spent, spent);
    // 6: amplification.
    match s.amplification {
        None => prop_assert_eq!(s.tokens_spent, 0),
        Some(a) => {
            prop_assert!(s.tokens_spent > 0);
            prop_assert!(a >= 1.0, "amplification {} < 1", a);
            let want = (s.tokens_spent as f64 + s.tokens_wasted as f64) / s.tokens_spent as f64;
            prop_assert!((a - want).abs() <= want * 1e-12);
        }
    }
    // 4: grants.
    for t in TENANTS {
        let r = l.remaining(t);
        prop_assert_eq!(r, m.remaining(t), "tenant {:?}", t);
        if let (Some(r), Some(g)) = (r, m.grant(t)) {
            prop_assert!(r <= g);
        }
    }
    // 5: the log's latest records are the live ones, and a ledger rebuilt from the log (any
    // order, duplicates) matches. Restoring at time 0 expires and forgets nothing, so it is a
    // pure rebuild.
    let from_log = latest_of(&m.log);
    prop_assert_eq!(&from_log, &m.latest, "the persisted records lag the ledger");
    // Marked as reservations so the rebuild keeps their holds (a proxied hold would expire:
    // its connection died with the process).
    let as_reservations: Vec<HoldRecord> = shuffled(&m.log, restore_seed)
        .into_iter()
        .map(|mut r| {
            r.reservation = true;
            r
        })
        .collect();
    let (r, changed) = Ledger::restore(m.cfg.clone(), as_reservations, 0);
    prop_assert!(changed.is_empty());
    for i in 0..KEYS {
        let k = key(i);
        let restored = r.get(&k).map(|h| HoldRecord {
            reservation: false,
            ..h.clone()
        });
        prop_assert_eq!(restored.as_ref(), l.get(&k), "restored key {}", k);
    }
    let rs = r.stats();
    prop_assert_eq!(Totals::of(&rs), Totals::of_latest(m.latest.values()));
    // Tokens (and so grants and amplification) survive a restore exactly, retried keys
    // included; state counts are per latest record after a restore.
    prop_assert_eq!(
        (
            rs.held,
            rs.tokens_held,
            rs.tokens_spent,
            rs.tokens_wasted,
            rs.amplification
        ),
        (
            s.held,
            s.tokens_held,
            s.tokens_spent,
            s.tokens_wasted,
            s.amplification
        ),
        "restore must reproduce the token totals"
    );
    if !m.retried {
        prop_assert_eq!(rs, s, "restore must reproduce the stats");
        // A key retried under a *different* tenant carries its history into the new tenant's
        // record on restore; grants match exactly when keys stay with one tenant.
        for t in TENANTS {
            prop_assert_eq!(r.remaining(t), l.remaining(t));
        }
    }
    check_lifecycles(&m.log, false)
}

fn run_ledger(cfg: &LedgerConfig, ops: &[LOp]) -> Result<(), TestCaseError> {
    let mut l = Ledger::new(cfg.clone());
    let mut m = Model::new(cfg.clone());
    for (step, op) in ops.iter().enumerate() {
        let seed = step as u64;
        match *op {
            LOp::Advance(dt) => m.now += dt,
            LOp::Reserve {
                key: k,
                tenant: t,
                attempt,
                tokens,
                unchecked,
            } => {
                let (k, t) = (key(k), tenant(t));
                let before = m.remaining(t);
                let got = if unchecked {
                    l.reserve_unchecked(m.now, &k, t, attempt, tokens)
                } else {
                    l.reserve(m.now, &k, t, attempt, tokens)
                };
                let want = m.reserve(&k, t, attempt, tokens, unchecked);
                prop_assert_eq!(&got, &want, "{:?}", op);
                if let Ok(r) = got {
                    // 4: a checked reservation fits the grant.
                    if let (false, Some(rem)) = (unchecked, before) {
                        prop_assert!(r.tokens_held <= rem);
                    }
                    m.log.push(r);
                }
            }
            LOp::Reject {
                key: k,
                tenant: t,
                attempt,
                tokens,
            } => {
                let (k, t) = (key(k), tenant(t));
                let got = l.record_rejection(m.now, &k, t, attempt, tokens);
                let want = m.reject(&k, t, attempt, tokens);
                prop_assert_eq!(&got, &want, "{:?}", op);
                m.log.extend(got);
            }
            LOp::Commit { key: k, tokens } | LOp::Cancel { key: k, tokens } => {
                let k = key(k);
                let done = matches!(op, LOp::Commit { .. });
                let (stats, rec) = (l.stats(), l.get(&k).cloned());
                let got = if done {
                    l.commit(m.now, &k, tokens)
                } else {
                    l.cancel(m.now, &k, tokens)
                };
                let state = if done {
                    HoldState::Done
                } else {
                    HoldState::Cancelled
                };
                let (want, changed) = m.settle(&k, state, tokens);
                prop_assert_eq!(&got, &want, "{:?}", op);
                if changed {
                    match got {
                        Ok(r) => m.log.push(r),
                        Err(SettleError::HoldExpired(r)) => m.log.push(*r),
                        Err(e) => prop_assert!(false, "changed but {:?}", e),
                    }
                } else {
                    // 2: settling a key that is not held changes nothing.
                    prop_assert_eq!(l.stats(), stats);
                    prop_assert_eq!(l.get(&k), rec.as_ref());
                }
            }
            LOp::ExpireDue => {
                let got = l.expire_due(m.now);
                let want = m.expire_due();
                prop_assert_eq!(&got, &want);
                m.log.extend(got);
            }
            LOp::Restore(s) => {
                let (r, changed) = Ledger::restore(cfg.clone(), shuffled(&m.log, s), m.now);
                l = r;
                let want = m.expire_on_restore();
                prop_assert_eq!(
                    &changed,
                    &want,
                    "restore expires proxied holds (their connections died)"
                );
                m.log.extend(changed);
                m.rebase();
            }
        }
        check_ledger(&l, &m, seed)?;
    }
    // 3: far in the future nothing is held, and every hold ended exactly once.
    m.now += 10 * cfg.hold_ttl_ms + 1;
    let got = l.expire_due(m.now);
    let want = m.expire_due();
    prop_assert_eq!(&got, &want);
    m.log.extend(got);
    check_ledger(&l, &m, u64::MAX)?;
    let s = l.stats();
    prop_assert_eq!((s.held, s.tokens_held), (0, 0));
    check_lifecycles(&m.log, true)
}

// ---------------------------------------------------------------------------------------------
// B. The gate with its ledger
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Offer {
    /// Index into the key set, or `None` for a generated key.
    key: Option<usize>,
    tenant: usize,
    attempt: u32,
    class: usize,
    prompt_tokens: u32,
    max_tokens: Option<u32>,
    hold_tokens: Option<u64>,
    deadline_ms: Option<u64>,
}

#[derive(Clone, Debug)]
enum GOp {
    Offer(Offer),
    Advance(u64),
    Tick,
    /// Complete the in-flight job at this index (modulo), `ok` or failed, with or without usage.
    Complete {
        pick: usize,
        ok: bool,
        usage: Option<(u32, u32)>,
    },
    /// Cancel the live job at this index (modulo).
    Cancel {
        pick: usize,
        wasted: u64,
    },
    CommitKey {
        key: usize,
        tokens: u64,
    },
    CancelKey {
        key: usize,
        tokens: u64,
    },
    AdmitAlways(bool),
}

fn offer() -> impl Strategy<Value = Offer> {
    (
        prop::option::weighted(0.85, 0..KEYS),
        0..TENANTS.len(),
        0u32..5,
        0usize..2,
        0u32..2000,
        prop_oneof![Just(None), Just(Some(0u32)), (1u32..300).prop_map(Some)],
        prop::option::weighted(0.5, tokens()),
        prop::option::weighted(0.3, 0u64..20_000),
    )
        .prop_map(
            |(key, tenant, attempt, class, prompt_tokens, max_tokens, hold_tokens, deadline_ms)| {
                Offer {
                    key,
                    tenant,
                    attempt,
                    class,
                    prompt_tokens,
                    max_tokens,
                    hold_tokens,
                    deadline_ms,
                }
            },
        )
}

fn gate_op() -> impl Strategy<Value = GOp> {
    prop_oneof![
        8 => offer().prop_map(GOp::Offer),
        4 => prop_oneof![0u64..500, 500u64..5_000, 5_000u64..40_000].prop_map(GOp::Advance),
        2 => Just(GOp::Tick),
        4 => (any::<usize>(), prop::bool::weighted(0.8), prop::option::of((0u32..500, 0u32..500)))
            .prop_map(|(pick, ok, usage)| GOp::Complete { pick, ok, usage }),
        2 => (any::<usize>(), 0u64..300).prop_map(|(pick, wasted)| GOp::Cancel { pick, wasted }),
        2 => (0..KEYS, tokens()).prop_map(|(key, tokens)| GOp::CommitKey { key, tokens }),
        1 => (0..KEYS, tokens()).prop_map(|(key, tokens)| GOp::CancelKey { key, tokens }),
        1 => prop::bool::weighted(0.3).prop_map(GOp::AdmitAlways),
    ]
}

#[derive(Clone, Debug)]
struct GateSpec {
    slots: u32,
    ttl_ms: u64,
    retry_cap: u32,
    grant_t0: u64,
    grant_t1: u64,
    chat_deadline_ms: u64,
}

fn gate_spec() -> impl Strategy<Value = GateSpec> {
    (
        1u32..=3,
        1_000u64..30_000,
        0u32..=3,
        0u64..20_000,
        0u64..20_000,
        1_000u64..60_000,
    )
        .prop_map(
            |(slots, ttl_ms, retry_cap, grant_t0, grant_t1, chat_deadline_ms)| GateSpec {
                slots,
                ttl_ms,
                retry_cap,
                grant_t0,
                grant_t1,
                chat_deadline_ms,
            },
        )
}

fn gate_config(s: &GateSpec) -> GateConfig {
    GateConfig {
        pools: vec![PoolConfig {
            slots: s.slots,
            max_queued: 8,
            ..PoolConfig::default()
        }],
        classes: vec![
            ClassConfig {
                name: "chat".into(),
                priority: 100,
                deadline_ms: Some(s.chat_deadline_ms),
                ..ClassConfig::default()
            },
            ClassConfig {
                name: "batch".into(),
                priority: 10,
                ..ClassConfig::default()
            },
        ],
        default_class: None,
        ledger: LedgerConfig {
            hold_ttl_ms: s.ttl_ms,
            retry_cap: s.retry_cap,
            grants: [
                ("t0".to_string(), s.grant_t0),
                ("t1".to_string(), s.grant_t1),
            ]
            .into_iter()
            .collect(),
            ..LedgerConfig::default()
        },
        ..GateConfig::default()
    }
}

/// What the test knows of the gate's live jobs.
#[derive(Default)]
struct Jobs {
    /// Live job -> (key, in flight?).
    live: BTreeMap<JobId, (String, bool)>,
    /// Every record `take_ledger_records` returned, in order.
    log: Vec<HoldRecord>,
}

impl Jobs {
    fn end(&mut self, id: JobId) -> Result<(), TestCaseError> {
        prop_assert!(self.live.remove(&id).is_some(), "job {} ended twice", id);
        Ok(())
    }

    /// Drain `poll` and the ledger records.
    fn drain(&mut self, g: &mut Gate, now: Millis) -> Result<(), TestCaseError> {
        while let Some(ev) = g.poll(now) {
            match ev {
                Event::Dispatch { job_id, .. } => {
                    let j = self.live.get_mut(&job_id);
                    prop_assert!(j.as_ref().is_some_and(|j| !j.1), "dispatch of {}", job_id);
                    if let Some(j) = j {
                        j.1 = true;
                    }
                }
                Event::Drop { job_id, reason, .. } => {
                    prop_assert!(matches!(
                        reason,
                        Reason::DeadlineUnmeetable | Reason::HoldExpired
                    ));
                    self.end(job_id)?;
                }
            }
        }
        self.log.extend(g.take_ledger_records());
        Ok(())
    }

    /// Drain, then check the gate-level invariants.
    fn sync(&mut self, g: &mut Gate, now: Millis) -> Result<(), TestCaseError> {
        self.drain(g, now)?;
        prop_assert_eq!(g.live_jobs(), self.live.len());
        // 1: one live job per key, and the gate knows which.
        let mut by_key: BTreeMap<&str, JobId> = BTreeMap::new();
        for (id, (k, _)) in &self.live {
            if let Some(other) = by_key.insert(k.as_str(), *id) {
                prop_assert!(false, "key {} held by jobs {} and {}", k, other, id);
            }
            prop_assert_eq!(g.job_for_key(k), Some(*id));
            // A live job's hold is held (or past its TTL, not yet expired).
            let r = g.ledger().get(k);
            prop_assert_eq!(
                r.map(|r| r.state),
                Some(HoldState::Held),
                "job {} key {}",
                id,
                k
            );
        }
        for i in 0..KEYS {
            let k = key(i);
            if !by_key.contains_key(k.as_str()) {
                prop_assert_eq!(g.job_for_key(&k), None);
            }
        }
        // 4: the stats are the sums over the records.
        let latest = latest_of(&self.log);
        let s = g.ledger_stats();
        let mut want = (0u64, 0u64, 0u64, 0u64);
        for r in &self.log {
            want.0 += r.tokens_spent;
            want.1 += r.tokens_wasted;
        }
        for r in latest.values().filter(|r| r.state == HoldState::Held) {
            want.2 += 1;
            want.3 += r.tokens_held;
        }
        prop_assert_eq!(
            (s.tokens_spent, s.tokens_wasted, s.held, s.tokens_held),
            want
        );
        // The persisted records keep up with the ledger. Settled generated keys are persisted
        // but forgotten in memory (no client can replay them).
        for (k, r) in &latest {
            if k.starts_with("gen-") && r.state != HoldState::Held {
                prop_assert_eq!(g.ledger().get(k), None, "generated key {} remembered", k);
                continue;
            }
            prop_assert_eq!(g.ledger().get(k), Some(r), "persisted record of {} lags", k);
        }
        check_lifecycles(&self.log, false)
    }
}

fn run_gate(spec: &GateSpec, ops: &[GOp]) -> Result<(), TestCaseError> {
    let mut g = Gate::new(gate_config(spec)).expect("valid config");
    let mut jobs = Jobs::default();
    let mut now: Millis = 1_000;
    for op in ops {
        match op {
            GOp::Offer(o) => {
                let k = o.key.map(key);
                let before = k.as_deref().and_then(|k| g.ledger().get(k).cloned());
                let d = g.offer(
                    now,
                    Request {
                        class: Some(LaneId(o.class)),
                        deadline: o.deadline_ms.map(|d| now + d),
                        prompt_tokens: o.prompt_tokens,
                        max_tokens: o.max_tokens,
                        idempotency_key: k.clone(),
                        tenant: tenant(o.tenant).map(str::to_string),
                        attempt: o.attempt,
                        hold_tokens: o.hold_tokens,
                        ..Request::default()
                    },
                );
                // 2: duplicate exactly when the key's latest hold is held (and not past its
                // TTL: an offer expires due holds first) or done.
                let dup = before.as_ref().is_some_and(|r| match r.state {
                    // A live request's hold is renewed at its TTL rather than expired.
                    HoldState::Held => {
                        r.expires_at_ms > now || jobs.live.values().any(|(k, _)| **k == *r.key)
                    }
                    HoldState::Done => true,
                    _ => false,
                });
                prop_assert_eq!(
                    d.reason == Reason::RejectDuplicate,
                    dup,
                    "{:?} over {:?}: {:?}",
                    o,
                    before,
                    d.reason
                );
                if dup {
                    // A duplicate changes nothing but, at most, a renewal of the live hold.
                    let now_rec = g.ledger().get(k.as_deref().unwrap()).cloned();
                    let same = |a: &HoldRecord, b: &HoldRecord| {
                        (a.state, a.tokens_held, a.created_at_ms, a.attempt)
                            == (b.state, b.tokens_held, b.created_at_ms, b.attempt)
                    };
                    prop_assert!(
                        match (&now_rec, &before) {
                            (Some(a), Some(b)) => same(a, b),
                            (a, b) => a == b,
                        },
                        "{:?} -> {:?}",
                        before,
                        now_rec
                    );
                }
                if d.admitted() {
                    let r = g.ledger().get(&d.idempotency_key).cloned();
                    prop_assert!(r.as_ref().is_some_and(|r| r.state == HoldState::Held
                        && r.tokens_held == d.tokens_held
                        && r.created_at_ms == now));
                    jobs.live
                        .insert(d.job_id, (d.idempotency_key.to_string(), false));
                } else {
                    prop_assert_eq!(d.tokens_held, 0);
                }
            }
            GOp::Advance(dt) => now += dt,
            GOp::Tick => g.tick(now),
            GOp::Complete { pick, ok, usage } => {
                let flying: Vec<JobId> = jobs
                    .live
                    .iter()
                    .filter(|(_, (_, f))| *f)
                    .map(|(id, _)| *id)
                    .collect();
                if !flying.is_empty() {
                    let id = flying[pick % flying.len()];
                    let c = g.on_complete(
                        now,
                        id,
                        Completion {
                            ok: *ok,
                            prompt_tokens: usage.map(|u| u.0),
                            completion_tokens: usage.map(|u| u.1),
                        },
                    );
                    prop_assert!(c.as_ref().is_some_and(|c| c.hold.is_some()), "{:?}", c);
                    jobs.end(id)?;
                    // Ending it again does nothing.
                    prop_assert!(g.on_complete(now, id, Completion::default()).is_none());
                }
            }
            GOp::Cancel { pick, wasted } => {
                let live: Vec<JobId> = jobs.live.keys().copied().collect();
                if !live.is_empty() {
                    let id = live[pick % live.len()];
                    let c = g.cancel_wasted(now, id, *wasted);
                    prop_assert!(c.as_ref().is_some_and(|c| c.hold.is_some()), "{:?}", c);
                    jobs.end(id)?;
                    prop_assert!(g.cancel(now, id).is_none());
                }
            }
            GOp::CommitKey { key: k, tokens } | GOp::CancelKey { key: k, tokens } => {
                let k = key(*k);
                let owner = g.job_for_key(&k);
                let r = if matches!(op, GOp::CommitKey { .. }) {
                    g.commit_key(now, &k, *tokens)
                } else {
                    g.cancel_key(now, &k, *tokens)
                };
                // An expired hold ends its job with a `hold_expired` drop; a settlement ends
                // it silently.
                jobs.drain(&mut g, now)?;
                if let Some(id) = owner {
                    if jobs.live.contains_key(&id) && g.job_for_key(&k) != Some(id) {
                        prop_assert!(r.is_ok(), "job {} ended by {:?}", id, r);
                        jobs.end(id)?;
                    }
                }
                if let Ok(rec) = &r {
                    prop_assert!(rec.state.is_terminal());
                }
            }
            GOp::AdmitAlways(on) => g.set_admit_always(*on),
        }
        // Holds expired by a tick or a key settlement end their jobs (`hold_expired` drops are
        // seen in `sync`); a settlement through `commit_key` ends its job silently.
        jobs.sync(&mut g, now)?;
    }
    // 3: a live proxied request's hold is renewed, never expired under it; so first its
    // client goes away (every live job is cancelled), then far in the future every hold has
    // ended, and so has every job.
    let live: Vec<JobId> = jobs.live.keys().copied().collect();
    for id in live {
        let c = g.cancel(now, id);
        prop_assert!(c.is_some_and(|c| c.hold.is_some()));
        jobs.end(id)?;
    }
    jobs.sync(&mut g, now)?;
    now += spec.ttl_ms + 1;
    g.tick(now);
    jobs.sync(&mut g, now)?;
    prop_assert_eq!(g.live_jobs(), 0);
    let s = g.ledger_stats();
    prop_assert_eq!((s.held, s.tokens_held), (0, 0));
    check_lifecycles(&jobs.log, true)?;
    let keys: BTreeSet<&str> = jobs.log.iter().map(|r| &*r.key).collect();
    for k in keys {
        // Client keys are remembered settled; generated ones are forgotten once settled.
        let remembered = g.ledger().get(k);
        if k.starts_with("gen-") {
            prop_assert!(remembered.is_none_or(|r| r.state != HoldState::Held));
        } else {
            prop_assert!(remembered.is_some_and(|r| r.state != HoldState::Held));
        }
    }
    Ok(())
}

/// Found by part B (fixed in `Gate::settle_key`): settling a key whose hold passed its TTL
/// expired it in `expire_holds` and then queued the same expired record a second time.
#[test]
fn settling_an_expired_key_persists_its_expiry_once() {
    let spec = GateSpec {
        slots: 1,
        ttl_ms: 8_256,
        retry_cap: 1,
        grant_t0: 0,
        grant_t1: 0,
        chat_deadline_ms: 1_000,
    };
    let mut g = Gate::new(gate_config(&spec)).unwrap();
    let d = g.offer(
        1_000,
        Request {
            class: Some(LaneId(0)),
            idempotency_key: Some("k3".into()),
            reservation: true,
            ..Request::default()
        },
    );
    assert!(d.admitted());
    while g.poll(1_000).is_some() {}
    assert!(matches!(
        g.commit_key(1_000 + 8_256, "k3", 0),
        Err(SettleError::HoldExpired(_))
    ));
    let records = g.take_ledger_records();
    let states: Vec<(HoldState, u64)> = records.iter().map(|r| (r.state, r.version)).collect();
    assert_eq!(
        states,
        [(HoldState::Held, 1000), (HoldState::Expired, 1001)],
        "{records:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Regressions for gaps the property tests found (both fixed): history lost on restore, and
// versions going back after the retention.
// ---------------------------------------------------------------------------------------------

/// A store keeps one record per key, so a restart forgets what earlier holds of a retried key
/// wasted: the tenant gets that part of its grant back and amplification drops.
#[test]
fn restore_forgets_the_waste_of_a_retried_key() {
    let cfg = LedgerConfig {
        hold_ttl_ms: 1_000,
        grants: [("t0".to_string(), 1_000)].into_iter().collect(),
        ..LedgerConfig::default()
    };
    let mut l = Ledger::new(cfg.clone());
    let log = vec![
        l.reserve(0, "k", Some("t0"), 0, 600).unwrap(),
        l.cancel(1, "k", 600).unwrap(), // 600 generated for nobody
        l.reserve(2, "k", Some("t0"), 1, 400).unwrap(),
        l.commit(3, "k", 400).unwrap(),
    ];
    assert_eq!(l.remaining(Some("t0")), Some(0));
    assert_eq!(l.stats().amplification, Some(2.5));
    let (r, _) = Ledger::restore(cfg, log, 4);
    assert_eq!(
        r.remaining(Some("t0")),
        Some(0),
        "grant regained by a restart"
    );
    let (a, b) = (r.stats(), l.stats());
    assert_eq!(
        (a.tokens_spent, a.tokens_wasted, a.amplification),
        (b.tokens_spent, b.tokens_wasted, b.amplification)
    );
}

/// After `retention_ms` a settled key is forgotten, and its next hold starts again at
/// version one. A store keeps the highest version per key (a tie keeps what is there), so it
/// ignores the new hold and its settlement; after a restart the key is restored from its old
/// `cancelled` record (here forgotten at once, being past the retention), and a replay of the
/// request that was just done is admitted again.
#[test]
fn versions_restart_after_the_retention() {
    let cfg = LedgerConfig {
        hold_ttl_ms: 1_000,
        retention_ms: 10_000,
        ..LedgerConfig::default()
    };
    let mut l = Ledger::new(cfg.clone());
    let mut store: Vec<HoldRecord> = Vec::new();
    store.push(l.reserve(0, "k", None, 0, 100).unwrap()); // v1 held
    store.push(l.cancel(1, "k", 0).unwrap()); // v2 cancelled
    assert!(l.expire_due(20_000).is_empty());
    assert!(l.get("k").is_none(), "forgotten after the retention");
    let again = l.reserve(20_000, "k", None, 0, 100).unwrap();
    store.push(again.clone());
    store.push(l.commit(20_001, "k", 100).unwrap());
    let (r, _) = Ledger::restore(cfg, store, 20_002);
    // Was: `again.version` was 1, so the store kept the cancelled v2 over the done v2
    // (a tie keeps what is there), the restore forgets it as past the retention, and a replay
    // of the done request is admitted.
    assert!(
        r.check("k", None, 0, 100).is_err(),
        "a done request admitted again"
    );
    assert_eq!(r.get("k").map(|r| r.state), Some(HoldState::Done));
    assert!(again.version > 2, "version went back to {}", again.version);
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Part A: properties 1-6 of the ledger alone, against the model.
    #[test]
    fn ledger_ops_match_the_model_and_keep_the_invariants(
        cfg in ledger_config(),
        ops in prop::collection::vec(ledger_op(), 0..80),
    ) {
        run_ledger(&cfg, &ops)?;
    }

    /// Part B: properties 1-4 of the gate with its ledger.
    #[test]
    fn gate_holds_are_placed_once_and_settled_once(
        spec in gate_spec(),
        ops in prop::collection::vec(gate_op(), 0..120),
    ) {
        run_gate(&spec, &ops)?;
    }
}
