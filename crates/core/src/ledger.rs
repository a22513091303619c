//! The token reservation ledger (seed 001): every admitted request holds its estimated tokens
//! under an idempotency key until it is settled, cancelled or expires, so a retry can never
//! reserve or spend twice and a crash cannot leak budget.
//!
//! Like the rest of the core this is a pure state machine: time comes in as `now` (epoch
//! milliseconds here, because holds must survive a restart), and every change comes back out
//! as a [`HoldRecord`] for the caller to persist. Restoring from persisted records rebuilds
//! the same state.
//!
//! Per key, holds are a sequence of attempts. A key whose latest hold is `held` or `done`
//! answers duplicates; a key whose latest hold was `rejected`, `cancelled` or `expired` may be
//! tried again (with a higher attempt number, up to the retry cap). Every hold ends in exactly
//! one terminal state (`done`, `cancelled`, `expired`), or was `rejected` at the door.

use crate::Millis;

mod index;
mod restore;
mod types;
use index::ExpiryIndex;
pub use types::*;

#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    held: u64,
    spent: u64,
    wasted: u64,
}

impl Usage {
    fn consumed(&self) -> u64 {
        self.held
            .saturating_add(self.spent)
            .saturating_add(self.wasted)
    }
}

/// A tenant's usage under its one shared id (the map's value carries the id, so one lookup
/// gives both).
#[derive(Clone, Debug)]
struct Tenant {
    id: Shared,
    usage: Usage,
}

/// What placing a hold reads of the key's previous record: read with one lookup, before
/// anything changes.
#[derive(Clone, Copy, Debug)]
struct Prior {
    state: HoldState,
    attempt: u32,
    version: u64,
    updated_at_ms: Millis,
    /// Spend and waste of the key's earlier holds, carried into its next record so that a
    /// restart (which keeps one record per key) loses none of a retried key's history.
    carried: (u64, u64),
}

impl Prior {
    fn of(r: &HoldRecord) -> Prior {
        Prior {
            state: r.state,
            attempt: r.attempt,
            version: r.version,
            updated_at_ms: r.updated_at_ms,
            carried: (
                r.prior_spent.saturating_add(r.tokens_spent),
                r.prior_wasted.saturating_add(r.tokens_wasted),
            ),
        }
    }

    /// Versions never go back, even for a key forgotten after the retention and reserved
    /// again: at least the time of the change, and above the key's previous version.
    fn next_version(prior: Option<Prior>, now: Millis) -> u64 {
        prior.map_or(0, |p| p.version).saturating_add(1).max(now)
    }

    /// The cap counts the key's own attempts, not only what the client claims: a key tried
    /// before is at least on its next attempt.
    fn attempt(prior: Option<Prior>, claimed: u32) -> u32 {
        prior.map_or(claimed, |p| claimed.max(p.attempt.saturating_add(1)))
    }
}

/// A held or done key is a duplicate: a replay must never reserve or spend again.
fn duplicate_of(prior: Option<&HoldRecord>) -> Result<(), LedgerReject> {
    match prior {
        Some(r) if matches!(r.state, HoldState::Held | HoldState::Done) => {
            Err(LedgerReject::Duplicate {
                state: r.state,
                tokens_held: r.tokens_held,
            })
        }
        _ => Ok(()),
    }
}

/// The reservation ledger.
#[derive(Debug, Default)]
pub struct Ledger {
    cfg: LedgerConfig,
    holds: std::collections::HashMap<Shared, HoldRecord>,
    /// Unsettled holds with a TTL, by expiry time.
    expiry: ExpiryIndex,
    /// Settled or rejected keys by last change, for forgetting them after `retention_ms`.
    settled: std::collections::BTreeSet<(Millis, Shared)>,
    /// Per tenant ("" for none), with the tenant's one shared copy of its id.
    tenants: std::collections::HashMap<Shared, Tenant>,
    totals: LedgerStats,
    /// Written into every hold placed ([`HoldRecord::owner`]).
    owner: Option<Shared>,
}

impl Ledger {
    /// An empty ledger.
    pub fn new(cfg: LedgerConfig) -> Ledger {
        Ledger {
            cfg,
            ..Ledger::default()
        }
    }

    fn count_state(&mut self, s: HoldState) {
        match s {
            HoldState::Done => self.totals.done += 1,
            HoldState::Cancelled => self.totals.cancelled += 1,
            HoldState::Expired => self.totals.expired += 1,
            HoldState::Rejected => self.totals.rejected += 1,
            HoldState::Held => {}
        }
    }

    /// Change what a tenant ("" for the requests without one) has held, spent and wasted,
    /// counting it from nothing the first time it is seen; returns its one shared id. One
    /// lookup for a known tenant.
    fn tenant_usage(&mut self, tenant: &str, f: impl FnOnce(&mut Usage)) -> Shared {
        if let Some(t) = self.tenants.get_mut(tenant) {
            f(&mut t.usage);
            return t.id.clone();
        }
        let id = Shared::from(tenant);
        let mut usage = Usage::default();
        f(&mut usage);
        let t = Tenant {
            id: id.clone(),
            usage,
        };
        self.tenants.insert(id.clone(), t);
        id
    }

    /// Write `owner` into every hold placed from now on ([`HoldRecord::owner`]).
    pub fn set_owner(&mut self, owner: Option<String>) {
        self.owner = owner.map(Shared::from);
    }

    /// Every key's current record (any order).
    pub fn records(&self) -> impl Iterator<Item = &HoldRecord> {
        self.holds.values()
    }

    /// The configuration in force.
    pub fn config(&self) -> &LedgerConfig {
        &self.cfg
    }

    /// Apply a reloaded configuration: later holds get the new TTL, cap and grants; holds
    /// already placed keep their expiry.
    pub fn set_config(&mut self, cfg: LedgerConfig) {
        self.cfg = cfg;
    }

    /// Record where and when a held key's request was sent upstream (cluster mode: see
    /// [`HoldRecord::dispatched`]). Returns the updated record, to persist.
    pub fn mark_dispatched(
        &mut self,
        now: Millis,
        key: &str,
        mark: Dispatched,
    ) -> Option<HoldRecord> {
        let r = self.holds.get_mut(key)?;
        if r.state != HoldState::Held {
            return None;
        }
        r.dispatched = Some(mark);
        r.version = r.version.saturating_add(1).max(now);
        r.updated_at_ms = now;
        Some(r.clone())
    }

    /// Another gate settled a hold this ledger has `held` (the same hold: attempt, creation
    /// and owner), as `settled` says, read back from a shared store: take its state and
    /// tokens. Returns whether it applied. Nothing is produced to persist (the store has it).
    pub fn learn_settled(&mut self, now: Millis, settled: &HoldRecord) -> bool {
        let same = self.holds.get(&settled.key).is_some_and(|r| {
            r.state == HoldState::Held
                && r.attempt == settled.attempt
                && r.created_at_ms == settled.created_at_ms
                && r.owner == settled.owner
        });
        if !same || settled.state == HoldState::Held {
            return false;
        }
        let end = (settled.state, settled.tokens_spent, settled.tokens_wasted);
        self.end(now, &settled.key, |_| end).is_some()
    }

    /// Mark a held key as a reservation-API hold (called right after `reserve`).
    pub fn mark_reservation(&mut self, key: &str) -> Option<HoldRecord> {
        let r = self.holds.get_mut(key)?;
        if r.state != HoldState::Held {
            return None;
        }
        r.reservation = true;
        Some(r.clone())
    }

    /// The latest hold under a key.
    pub fn get(&self, key: &str) -> Option<&HoldRecord> {
        self.holds.get(key)
    }

    /// Tokens left in a tenant's grant (`None`: unlimited).
    pub fn remaining(&self, tenant: Option<&str>) -> Option<u64> {
        let t = tenant.unwrap_or("");
        let grant = self
            .cfg
            .grants
            .get(t)
            .copied()
            .or(self.cfg.default_grant_tokens)?;
        let used = self.tenants.get(t).map_or(0, |t| t.usage.consumed());
        Some(grant.saturating_sub(used))
    }

    /// Would a reservation be accepted? Read-only: duplicates, retry cap, budget.
    pub fn check(
        &self,
        key: &str,
        tenant: Option<&str>,
        attempt: u32,
        tokens: u64,
    ) -> Result<(), LedgerReject> {
        self.check_prior(self.holds.get(key), tenant, attempt, tokens)
    }

    /// [`Ledger::check`] against the key's previous record, already looked up.
    fn check_prior(
        &self,
        prior: Option<&HoldRecord>,
        tenant: Option<&str>,
        attempt: u32,
        tokens: u64,
    ) -> Result<(), LedgerReject> {
        duplicate_of(prior)?;
        let attempt = Prior::attempt(prior.map(Prior::of), attempt);
        if attempt > self.cfg.retry_cap {
            return Err(LedgerReject::RetryCap {
                attempt,
                retry_cap: self.cfg.retry_cap,
            });
        }
        if let Some(remaining) = self.remaining(tenant) {
            if tokens > remaining {
                return Err(LedgerReject::BudgetExhausted {
                    remaining,
                    requested: tokens,
                });
            }
        }
        Ok(())
    }

    /// The attempt a reservation under `key` counts as: what the client claims, and at least
    /// the key's next one if it was tried before.
    pub fn effective_attempt(&self, key: &str, claimed: u32) -> u32 {
        Prior::attempt(self.holds.get(key).map(Prior::of), claimed)
    }

    /// Place a hold. The previous record of the key (rejected, cancelled or expired) is
    /// replaced; a held or done key is a duplicate.
    pub fn reserve(
        &mut self,
        now: Millis,
        key: &str,
        tenant: Option<&str>,
        attempt: u32,
        tokens: u64,
    ) -> Result<HoldRecord, LedgerReject> {
        self.place(now, key, None, tenant, attempt, tokens, Placing::default())
    }

    /// Place a hold past the retry cap and the tenant grant (the `admit_always` rollback),
    /// but never over a held or done key: a replay still cannot spend twice.
    pub fn reserve_unchecked(
        &mut self,
        now: Millis,
        key: &str,
        tenant: Option<&str>,
        attempt: u32,
        tokens: u64,
    ) -> Result<HoldRecord, LedgerReject> {
        let how = Placing {
            unchecked: true,
            ..Placing::default()
        };
        self.place(now, key, None, tenant, attempt, tokens, how)
    }

    /// [`Ledger::reserve`] (or, with [`Placing::unchecked`], [`Ledger::reserve_unchecked`])
    /// under a key the caller already holds shared: the hold takes that copy rather than
    /// making its own. With [`Placing::untimed`] the hold has no TTL.
    pub fn reserve_shared(
        &mut self,
        now: Millis,
        key: &Shared,
        tenant: Option<&str>,
        attempt: u32,
        tokens: u64,
        how: Placing,
    ) -> Result<HoldRecord, LedgerReject> {
        self.place(now, key, Some(key), tenant, attempt, tokens, how)
    }

    /// Check and place a hold under `key` (shared as `given` when the caller has it so). The
    /// key's previous record is looked up once, and the new one stored with one more lookup.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &mut self,
        now: Millis,
        key: &str,
        given: Option<&Shared>,
        tenant: Option<&str>,
        attempt: u32,
        tokens: u64,
        how: Placing,
    ) -> Result<HoldRecord, LedgerReject> {
        let tokens = tokens.min(MAX_TOKENS);
        let (prior, key_id) = match self.holds.get_key_value(key) {
            Some((k, r)) => {
                match how.unchecked {
                    true => duplicate_of(Some(r))?,
                    false => self.check_prior(Some(r), tenant, attempt, tokens)?,
                }
                (Some(Prior::of(r)), k.clone())
            }
            None => {
                if !how.unchecked {
                    self.check_prior(None, tenant, attempt, tokens)?;
                }
                (None, given.map_or_else(|| Shared::from(key), Shared::clone))
            }
        };
        let tenant_id = self.tenant_usage(tenant.unwrap_or(""), |u| {
            u.held = u.held.saturating_add(tokens);
        });
        let mut r = self.next_record(prior, key_id, now, attempt, tokens);
        r.tenant = tenant.map(|_| tenant_id);
        if !how.untimed {
            r.expires_at_ms = now.saturating_add(self.cfg.hold_ttl_ms);
        }
        self.totals.held += 1;
        self.totals.tokens_held = self.totals.tokens_held.saturating_add(tokens);
        self.expiry.track(&r);
        self.holds.insert(r.key.clone(), r.clone());
        Ok(r)
    }

    /// Record that admission refused this key (nothing reserved). A held or done key is left
    /// alone (the refusal was a duplicate); returns the record to persist otherwise.
    pub fn record_rejection(
        &mut self,
        now: Millis,
        key: &str,
        tenant: Option<&str>,
        attempt: u32,
        tokens: u64,
    ) -> Option<HoldRecord> {
        let (prior, key_id) = match self.holds.get_key_value(key) {
            Some((k, r)) => {
                duplicate_of(Some(r)).ok()?;
                (Some(Prior::of(r)), k.clone())
            }
            None => (None, Shared::from(key)),
        };
        // A refusal reserves nothing: a tenant it names is not counted (a client cycling
        // keys must not grow the tenant table), only its id shared where already known.
        let tenant_id = tenant.map(|t| {
            self.tenants
                .get(t)
                .map_or_else(|| Shared::from(t), |t| t.id.clone())
        });
        let mut r = self.next_record(prior, key_id, now, attempt, tokens.min(MAX_TOKENS));
        r.tenant = tenant_id;
        r.state = HoldState::Rejected;
        r.expires_at_ms = now;
        self.totals.rejected += 1;
        self.settled.insert((now, r.key.clone()));
        self.holds.insert(r.key.clone(), r.clone());
        Some(r)
    }

    /// The key's next record at `now`, replacing `prior` (never a held one: that is a
    /// duplicate), which leaves the retention index. It carries the key's attempts, version,
    /// spend and waste forward; it holds `tokens` (already capped), with no tenant and no TTL.
    fn next_record(
        &mut self,
        prior: Option<Prior>,
        key: Shared,
        now: Millis,
        attempt: u32,
        tokens: u64,
    ) -> HoldRecord {
        if let Some(p) = prior.filter(|p| p.state != HoldState::Held) {
            self.settled.remove(&(p.updated_at_ms, key.clone()));
        }
        let carried = prior.map_or((0, 0), |p| p.carried);
        HoldRecord {
            key,
            tenant: None,
            state: HoldState::Held,
            attempt: Prior::attempt(prior, attempt),
            tokens_held: tokens,
            tokens_spent: 0,
            tokens_wasted: 0,
            created_at_ms: now,
            expires_at_ms: NEVER,
            updated_at_ms: now,
            version: Prior::next_version(prior, now),
            prior_spent: carried.0,
            prior_wasted: carried.1,
            reservation: false,
            owner: self.owner.clone(),
            dispatched: None,
        }
    }

    /// End a held key in the state, with the spent and wasted tokens, that `how` gives for its
    /// record, moving its tokens from held to spent or wasted. `None` if it is not held.
    fn end(
        &mut self,
        now: Millis,
        key: &str,
        how: impl FnOnce(&HoldRecord) -> (HoldState, u64, u64),
    ) -> Option<HoldRecord> {
        let r = self.holds.get_mut(key)?;
        if r.state != HoldState::Held {
            return None;
        }
        let end = how(r);
        let r = end_held(r, &mut self.expiry, now, end);
        self.account_end(&r);
        self.settled.insert((now, r.key.clone()));
        Some(r)
    }

    /// Count an ended hold's tokens (see [`end_held`]) in its tenant's usage and the totals.
    fn account_end(&mut self, r: &HoldRecord) {
        self.tenant_usage(r.tenant.as_deref().unwrap_or(""), |u| {
            u.held = u.held.saturating_sub(r.tokens_held);
            u.spent = u.spent.saturating_add(r.tokens_spent);
            u.wasted = u.wasted.saturating_add(r.tokens_wasted);
        });
        self.totals.held = self.totals.held.saturating_sub(1);
        self.totals.tokens_held = self.totals.tokens_held.saturating_sub(r.tokens_held);
        self.totals.tokens_spent = self.totals.tokens_spent.saturating_add(r.tokens_spent);
        self.totals.tokens_wasted = self.totals.tokens_wasted.saturating_add(r.tokens_wasted);
        self.count_state(r.state);
    }

    /// Expire a held key now: its tokens held count as wasted. `None` if it is not held.
    fn expire(&mut self, now: Millis, key: &str) -> Option<HoldRecord> {
        self.end(now, key, |r| (HoldState::Expired, 0, r.tokens_held))
    }

    /// Settle a held key as `how` says, with one lookup of the key. A hold whose TTL has
    /// passed ends as `expired` instead (its tokens wasted), reported as
    /// [`SettleError::HoldExpired`] with its record (to persist when this call expired it; a
    /// hold the ledger had already expired is reported as it stands). With `remember` false the
    /// settled record is forgotten at once, as [`Ledger::forget`] would (a key the gate
    /// generated: nobody can replay it).
    pub(crate) fn settle_as(
        &mut self,
        now: Millis,
        key: &str,
        how: Settlement,
        remember: bool,
    ) -> Result<HoldRecord, SettleError> {
        let Some(r) = self.holds.get_mut(key) else {
            return Err(SettleError::MissingHold);
        };
        let end = match r.state {
            HoldState::Held if now >= r.expires_at_ms => (HoldState::Expired, 0, r.tokens_held),
            HoldState::Held => match how {
                Settlement::Done { spent } => (HoldState::Done, spent, 0),
                Settlement::Cancelled { wasted } => (HoldState::Cancelled, 0, wasted),
            },
            HoldState::Expired => {
                let r = r.clone();
                if !remember {
                    self.forget(key);
                }
                return Err(SettleError::HoldExpired(Box::new(r)));
            }
            other => return Err(SettleError::NotHeld(other)),
        };
        let r = end_held(r, &mut self.expiry, now, end);
        self.account_end(&r);
        match remember {
            true => {
                self.settled.insert((now, r.key.clone()));
            }
            false => {
                self.holds.remove(key);
            }
        }
        match r.state {
            HoldState::Expired => Err(SettleError::HoldExpired(Box::new(r))),
            _ => Ok(r),
        }
    }

    /// Settle a hold as `done`: the upstream used `spent` tokens.
    pub fn commit(
        &mut self,
        now: Millis,
        key: &str,
        spent: u64,
    ) -> Result<HoldRecord, SettleError> {
        self.settle_as(now, key, Settlement::Done { spent }, true)
    }

    /// Settle a hold as `cancelled`: `wasted` tokens were generated for nobody.
    pub fn cancel(
        &mut self,
        now: Millis,
        key: &str,
        wasted: u64,
    ) -> Result<HoldRecord, SettleError> {
        self.settle_as(now, key, Settlement::Cancelled { wasted }, true)
    }

    /// Expire every hold whose TTL has passed (its tokens count as wasted), and forget settled
    /// keys older than the retention. Returns the expired records, to persist.
    pub fn expire_due(&mut self, now: Millis) -> Vec<HoldRecord> {
        self.expire_due_except(now, |_| false)
    }

    /// [`Ledger::expire_due`], but a due hold for which `renew(key)` is true is renewed for
    /// another TTL instead (its request is alive and will settle it). Renewed records are
    /// returned too, to persist.
    pub fn expire_due_except(
        &mut self,
        now: Millis,
        renew: impl Fn(&str) -> bool,
    ) -> Vec<HoldRecord> {
        let mut out = Vec::new();
        let mut renewed = Vec::new();
        while let Some(key) = self.expiry.pop_due(now) {
            if renew(&key) {
                renewed.push(key);
                continue;
            }
            if let Some(r) = self.expire(now, &key) {
                out.push(r);
            }
        }
        for key in renewed {
            let ttl = self.cfg.hold_ttl_ms;
            if let Some(r) = self.holds.get_mut(&key) {
                if r.state == HoldState::Held {
                    r.expires_at_ms = now.saturating_add(ttl.max(1));
                    r.updated_at_ms = now;
                    r.version = r.version.saturating_add(1);
                    self.expiry.track(r);
                    out.push(r.clone());
                }
            }
        }
        let horizon = now.saturating_sub(self.cfg.retention_ms);
        while self.settled.first().is_some_and(|(at, _)| *at < horizon) {
            let Some((_, key)) = self.settled.pop_first() else {
                break;
            };
            self.holds.remove(&key);
        }
        out
    }

    /// Forget a settled key now (its totals stay counted). For keys the gate generated: no
    /// client can replay them, so remembering them for the retention would only cost memory.
    pub fn forget(&mut self, key: &str) {
        if let Some(r) = self.holds.get(key) {
            if r.state != HoldState::Held {
                self.settled.remove(&(r.updated_at_ms, r.key.clone()));
                self.holds.remove(key);
            }
        }
    }

    /// Current totals.
    pub fn stats(&self) -> LedgerStats {
        let mut s = self.totals;
        s.amplification = (s.tokens_spent > 0)
            .then(|| (s.tokens_spent as f64 + s.tokens_wasted as f64) / s.tokens_spent as f64);
        s
    }

    /// Keys currently remembered (held, or settled within the retention).
    pub fn len(&self) -> usize {
        self.holds.len()
    }

    /// True when no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.holds.is_empty()
    }
}

/// End the held record `r` in `state` with `spent` and `wasted` tokens, dropping it from the
/// expiry index; returns a copy of the ended record. Its tokens are counted by
/// [`Ledger::account_end`].
fn end_held(
    r: &mut HoldRecord,
    expiry: &mut ExpiryIndex,
    now: Millis,
    (state, spent, wasted): (HoldState, u64, u64),
) -> HoldRecord {
    expiry.untrack(r);
    r.state = state;
    r.tokens_spent = spent.min(MAX_TOKENS);
    r.tokens_wasted = wasted.min(MAX_TOKENS);
    r.updated_at_ms = now;
    r.version = r.version.saturating_add(1);
    r.clone()
}

#[cfg(test)]
mod tests;
