//! The gate's side of the reservation ledger: key-based settlement for the reservation API
//! (workers that call the model themselves), hold expiry, restore after a restart, and the
//! records the caller must persist.

use super::{Gate, JobId, Settle};
use crate::ledger::{
    HoldRecord, HoldState, Ledger, LedgerStats, SettleError, GENERATED_KEY_PREFIX,
};
use crate::reason::Reason;
use crate::Millis;

impl Gate {
    /// Ledger records changed since the last call, oldest first: persist them.
    pub fn take_ledger_records(&mut self) -> Vec<HoldRecord> {
        std::mem::take(&mut self.ledger_out)
    }

    /// The ledger (read-only).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Ledger totals.
    pub fn ledger_stats(&self) -> LedgerStats {
        self.ledger.stats()
    }

    /// Tag generated idempotency keys (`gen-<tag>-<job id>`) with something unique per process
    /// start, so they never collide with those persisted by an earlier run.
    pub fn set_key_run_tag(&mut self, tag: &str) {
        self.key_prefix = format!("{GENERATED_KEY_PREFIX}{tag}-");
    }

    /// Rebuild the ledger from persisted records after a restart. Holds still inside their TTL
    /// keep counting (tokens held, tenant grants); holds past it expire with their tokens
    /// wasted (those records are queued for persistence); done keys still answer duplicates.
    pub fn restore_ledger(&mut self, records: Vec<HoldRecord>, now: Millis) {
        let now = self.clock(now);
        let owner = self.hold_owner.clone();
        let (mut ledger, changed) = Ledger::restore(self.ledger.config().clone(), records, now);
        ledger.set_owner(owner);
        self.ledger = ledger;
        self.ledger_out.extend(changed);
    }

    /// Name this gate in every hold it places from now on (cluster mode: its replica id; see
    /// [`HoldRecord::owner`]).
    pub fn set_hold_owner(&mut self, owner: &str) {
        self.hold_owner = Some(owner.to_string());
        self.ledger.set_owner(self.hold_owner.clone());
    }

    /// Keys of this gate's live jobs.
    fn live_keys(&self) -> std::collections::HashSet<String> {
        self.keys
            .iter()
            .filter(|(_, id)| self.jobs.contains_key(id))
            .map(|(k, _)| k.to_string())
            .collect()
    }

    /// Cluster mode, on the leader: expire the proxied holds whose request no process will
    /// settle: not a live job of this gate, and placed by no replica in `alive` (the others
    /// still checking in; this gate's own id does not belong there: its holds are live jobs
    /// or nothing). Returns how many expired (tokens wasted; records queued for the store).
    pub fn expire_orphans(
        &mut self,
        now: Millis,
        alive: &std::collections::HashSet<String>,
    ) -> usize {
        let now = self.clock(now);
        let live = self.live_keys();
        let out = self.ledger.expire_orphans(now, &live, alive);
        let n = out.len();
        self.ledger_out.extend(out);
        n
    }

    /// Take over a ledger shared with other gates (cluster mode: this replica has just become
    /// the leader and `records` are everything the shared store holds).
    ///
    /// The store is the truth, except where this gate knows better: the record of one of its
    /// live jobs' keys, and a hold it placed itself (its `owner` is this gate), when its own
    /// copy is newer (a write that has not reached the store yet). When `store_lost_data`
    /// (the store came back empty), every record this gate knows and the store lacks is kept
    /// too, and written back, so a settled key still answers duplicates. Without it, a key
    /// the store lacks was pruned there (its tokens folded into a carry record) and is not
    /// brought back: that would count its tokens twice.
    ///
    /// Holds of this gate's live jobs keep counting; the proxied holds of processes gone
    /// expire at once (their connections died with them), those of the replicas in `alive`
    /// keep their TTL (still running: they settle them; [`Gate::expire_orphans`] catches
    /// those that stop), and reservation-API holds keep theirs. The records that changed
    /// are queued for persistence.
    ///
    /// Requests another gate dispatched ([`HoldRecord::dispatched`]) and not yet settled in
    /// the store occupy their endpoint's slot here until their estimate plus `grace_ms` has
    /// run out: they may still run on the server, so "never above the slots" holds across a
    /// takeover. The hold of such a request whose process is gone (or cut off) stays held for
    /// its TTL (`hold_ttl_ms` from its creation), not expired at once: whether it ran to its
    /// end is unknown, so a retry of its key meanwhile is a duplicate, not a second run.
    pub fn adopt_ledger(
        &mut self,
        mut records: Vec<HoldRecord>,
        now: Millis,
        alive: &std::collections::HashSet<String>,
        store_lost_data: bool,
        grace_ms: u64,
    ) {
        let now = self.clock(now);
        let me = self.hold_owner.clone();
        self.inherit_dispatched(&mut records, now, alive, me.as_deref(), grace_ms);
        let live = self.live_keys();
        let shared: std::collections::HashMap<&str, (u64, u32, Millis)> = records
            .iter()
            .map(|r| (&*r.key, (r.version, r.attempt, r.created_at_ms)))
            .collect();
        let me = me.as_deref();
        let mine: Vec<HoldRecord> = self
            .ledger
            .records()
            .filter(|r| match shared.get(&*r.key) {
                // Only a newer version of the same hold (versions of different holds come
                // from different replicas' clocks): this gate's live job's, or one it placed.
                Some((version, attempt, created)) => {
                    *version < r.version
                        && *attempt == r.attempt
                        && *created == r.created_at_ms
                        && (live.contains(&*r.key) || (me.is_some() && r.owner.as_deref() == me))
                }
                // A key the store lacks was pruned there (its writes were flushed before the
                // load), unless the store lost its data.
                None => store_lost_data || live.contains(&*r.key),
            })
            .cloned()
            .collect();
        drop(shared);
        self.ledger_out.extend(mine.iter().cloned());
        records.extend(mine);
        let (mut ledger, changed) =
            Ledger::restore_keeping(self.ledger.config().clone(), records, now, &live, alive);
        ledger.set_owner(self.hold_owner.clone());
        self.ledger = ledger;
        self.ledger_out.extend(changed);
    }

    /// The requests in `records` another gate dispatched and the store has not seen settle:
    /// each takes its endpoint's slot until its estimate plus `grace_ms`, and the hold of one
    /// whose process is gone stays held for its TTL (see [`Gate::adopt_ledger`]).
    fn inherit_dispatched(
        &mut self,
        records: &mut [HoldRecord],
        now: Millis,
        alive: &std::collections::HashSet<String>,
        me: Option<&str>,
        grace_ms: u64,
    ) {
        let hold_ttl = self.ledger.config().hold_ttl_ms;
        for p in &mut self.pools {
            for e in &mut p.endpoints {
                e.inherited.clear();
            }
        }
        for r in records.iter_mut() {
            let Some(d) = &r.dispatched else { continue };
            let foreign = r.owner.is_none() || r.owner.as_deref() != me;
            if r.state != crate::ledger::HoldState::Held || r.reservation || !foreign {
                continue;
            }
            let until = d.until(grace_ms);
            if !r.owner.as_ref().is_some_and(|o| alive.contains(&**o)) {
                // Whether it ran to its end is unknown (its `done` may be lost with its
                // process, or cut off with it): its key stays held for the hold's TTL, so a
                // retry is a duplicate rather than a second run.
                r.expires_at_ms = until.max(r.created_at_ms.saturating_add(hold_ttl));
            }
            if until <= now {
                continue;
            }
            let endpoint = self
                .pools
                .iter_mut()
                .find(|p| p.name == d.pool && !p.retired)
                .and_then(|p| p.endpoints.iter_mut().find(|e| e.name == d.endpoint));
            if let Some(e) = endpoint {
                e.inherited.push(until);
            }
        }
    }

    /// Keys held here for another gate of the cluster (their holds name another owner, no
    /// job of this gate holds them): their settlement happens elsewhere, and is learned from
    /// the shared store ([`Gate::learn_settled`]). At most `limit`.
    pub fn foreign_held(&self, limit: usize) -> Vec<String> {
        let me = self.hold_owner.as_deref();
        let live = self.live_keys();
        self.ledger
            .records()
            .filter(|r| r.state == crate::ledger::HoldState::Held && !r.reservation)
            .filter(|r| r.owner.is_some() && r.owner.as_deref() != me)
            .filter(|r| !live.contains(&*r.key))
            .map(|r| r.key.to_string())
            .take(limit)
            .collect()
    }

    /// Take the settlements another gate wrote for holds held here (records read back from
    /// the shared store for [`Gate::foreign_held`]'s keys). Returns how many applied.
    pub fn learn_settled(&mut self, now: Millis, records: &[HoldRecord]) -> usize {
        let now = self.clock(now);
        records
            .iter()
            .filter(|r| self.ledger.learn_settled(now, r))
            .count()
    }

    /// The live job holding `key`, if any.
    pub fn job_for_key(&self, key: &str) -> Option<JobId> {
        self.keys
            .get(key)
            .copied()
            .filter(|id| self.jobs.contains_key(id))
    }

    /// Settle a key as done with `spent` tokens (the reservation API's commit). Ends its job,
    /// queued or in flight, exactly once.
    pub fn commit_key(
        &mut self,
        now: Millis,
        key: &str,
        spent: u64,
    ) -> Result<HoldRecord, SettleError> {
        self.settle_key(now, key, Settle::Commit(spent))
    }

    /// Settle a key as cancelled with `wasted` tokens (the reservation API's cancel).
    pub fn cancel_key(
        &mut self,
        now: Millis,
        key: &str,
        wasted: u64,
    ) -> Result<HoldRecord, SettleError> {
        self.settle_key(now, key, Settle::Cancel(wasted))
    }

    fn settle_key(
        &mut self,
        now: Millis,
        key: &str,
        settle: Settle,
    ) -> Result<HoldRecord, SettleError> {
        let now = self.clock(now);
        // An expired hold is refused (and settles as expired), whatever the job's state.
        self.expire_holds(now);
        if let Some(id) = self.job_for_key(key) {
            // A proxied request's hold is settled by its own response: the reservation API
            // may not end it (or free its slot) from outside.
            if self.jobs.get(&id).is_some_and(|j| !j.reservation) {
                return Err(SettleError::NotAReservation);
            }
            if let Some((job, pool, started)) = self.take_job(id) {
                let done = self.finish(now, id, job, pool, started, settle);
                return done.hold.ok_or(SettleError::MissingHold);
            }
        }
        // No live job (e.g. restored after a restart): settle the ledger alone.
        let r = match settle {
            Settle::Commit(spent) => self.ledger.commit(now, key, spent),
            Settle::Cancel(wasted) => self.ledger.cancel(now, key, wasted),
            Settle::AlreadyExpired => return Err(SettleError::MissingHold),
        };
        // Only a settlement is new here: a hold past its TTL was expired (and its record
        // queued) by `expire_holds` above, so a `HoldExpired` answer is that same record and
        // must not be persisted twice.
        if let Ok(rec) = &r {
            self.ledger_out.push(rec.clone());
        }
        r
    }

    /// Expire holds whose TTL passed; a live job under an expired hold releases its queue
    /// place or slot at once, and its client is told (`hold_expired`).
    pub(super) fn expire_holds(&mut self, now: Millis) {
        // A live proxied request (queued or in flight) has a connection that will settle its
        // hold: renew it rather than free its slot under a call still running upstream.
        // Reservation holds and holds without a live request expire.
        let jobs = &self.jobs;
        let keys = &self.keys;
        let due = self.ledger.expire_due_except(now, |k| {
            keys.get(k)
                .and_then(|id| jobs.get(id))
                .is_some_and(|j| !j.reservation)
        });
        for r in due {
            if r.state == HoldState::Held {
                // Renewed: persist the new expiry, nothing else changes.
                self.ledger_out.push(r);
                continue;
            }
            let mut generated = r.key.starts_with(GENERATED_KEY_PREFIX);
            if let Some(id) = self.keys.remove(&r.key) {
                if let Some((job, pool, started)) = self.take_job(id) {
                    generated |= job.generated_key;
                    let ev = self.drop_event(now, id, &job, pool, 0, Reason::HoldExpired);
                    self.finish(now, id, job, pool, started, Settle::AlreadyExpired);
                    self.events.push_back(ev);
                }
            }
            if generated {
                // Nobody can replay a generated key: persisted, not remembered.
                self.ledger.forget(&r.key);
            }
            self.ledger_out.push(r);
        }
    }
}
