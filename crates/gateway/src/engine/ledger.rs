//! The token ledger as the gate's request paths and the cluster use it: reservations and
//! settlements by key, the ledger's views, and (in a cluster) adopting, republishing and
//! checking the shared ledger in Redis.

use crate::engine::lines::{base_line, decision_line};
use crate::engine::pump::decide;
use crate::engine::state::Waiting;
use crate::engine::state::{JobMeta, Shared};
use crate::ledger_store::StoreError;
use slackgate_core::{Action, Decision, JobId, Reason, Request};
use std::collections::HashSet;
use std::sync::Arc;

impl Shared {
    /// Place a reservation-API hold (seed 001): the same decision and the same ledger as the
    /// proxy, but no request waits on it. Returns the decision, the ledger's held count and
    /// the number of the ledger write that carries the hold (see [`Shared::durable_for`]).
    pub fn reserve(
        &self,
        label: Option<&str>,
        mut req: Request,
        mut meta: JobMeta,
    ) -> (Decision, u64, Option<crate::ledger_store::WriteSeq>) {
        let ((d, held), write) = self.with_core_written(|st, now, lines| {
            let d = decide(st, now, label, &mut req, &mut meta);
            lines.push(decision_line(&d, &meta));
            if d.admitted() {
                st.waiting.insert(
                    d.job_id,
                    Waiting {
                        meta,
                        tx: None,
                        reservation: true,
                        abort: None,
                    },
                );
            }
            (d, st.gate.ledger_stats().held)
        });
        (d, held, write)
    }

    /// Settle a key as done (`spent`) or cancelled (`wasted`) through the reservation API.
    pub fn settle_key(
        &self,
        key: &str,
        commit: bool,
        tokens: u64,
    ) -> Result<slackgate_core::HoldRecord, slackgate_core::ledger::SettleError> {
        self.settle_key_because(key, commit, tokens, None)
    }

    /// [`Shared::settle_key`], logging the cancel under `reason` (a hold the shared ledger
    /// refused is a `reject_duplicate`, not a client's cancel).
    pub fn settle_key_because(
        &self,
        key: &str,
        commit: bool,
        tokens: u64,
        reason: Option<Reason>,
    ) -> Result<slackgate_core::HoldRecord, slackgate_core::ledger::SettleError> {
        self.with_core(|st, now, lines| {
            let job = st.gate.job_for_key(key);
            let r = if commit {
                st.gate.commit_key(now, key, tokens)
            } else {
                st.gate.cancel_key(now, key, tokens)
            };
            // Only a job the settlement really ended loses its waiter (a refused settlement,
            // such as a proxied request's key, leaves the request running).
            let ended = job.filter(|id| st.gate.job_for_key(key) != Some(*id));
            if let Some(w) = ended.and_then(|id| st.waiting.remove(&id).map(|w| (id, w))) {
                let (id, w) = w;
                let hold = match &r {
                    Ok(h) => Some(h),
                    Err(slackgate_core::ledger::SettleError::HoldExpired(h)) => Some(&**h),
                    Err(_) => None,
                };
                let action = if commit {
                    Action::Complete
                } else {
                    Action::Cancel
                };
                let reason = match hold.map(|h| h.state) {
                    Some(slackgate_core::HoldState::Expired) => Reason::HoldExpired,
                    _ if commit => Reason::Completed,
                    _ => reason.unwrap_or(Reason::ClientCancelled),
                };
                let mut line = base_line(id, &w.meta, action, reason);
                line.tokens_held = Some(w.meta.tokens_held);
                line.tokens_spent = hold.map(|h| h.tokens_spent);
                line.tokens_wasted = hold.map(|h| h.tokens_wasted);
                lines.push(line);
            }
            r
        })
    }

    /// Expire due holds now (the reservation API's `/expire`): (released, tokens wasted).
    pub fn expire_now(&self) -> (u64, u64) {
        self.with_core(|st, now, _| {
            let before = st.gate.ledger_stats();
            st.gate.tick(now);
            let after = st.gate.ledger_stats();
            (
                after.expired.saturating_sub(before.expired),
                after.tokens_wasted.saturating_sub(before.tokens_wasted),
            )
        })
    }

    /// Lanes in the core's table, live and retired (reloads reuse freed ones).
    pub fn lane_count(&self) -> usize {
        self.with_core(|st, _, _| st.gate.lane_count())
    }

    /// Ledger totals and the projected wait a default request would see, for `/stats`.
    pub fn ledger_view(
        &self,
    ) -> (
        slackgate_core::ledger::LedgerStats,
        slackgate_core::GateSnapshot,
    ) {
        self.with_core(|st, now, _| (st.gate.ledger_stats(), st.gate.snapshot(now)))
    }

    /// Tokens held under a key (for a commit that names no spend).
    pub fn held_tokens(&self, key: &str) -> Option<u64> {
        self.with_core(|st, _, _| st.gate.ledger().get(key).map(|r| r.tokens_held))
    }

    /// Tokens spent by a key's settled hold (for a replayed commit).
    pub fn settled_tokens(&self, key: &str) -> Option<u64> {
        self.with_core(|st, _, _| st.gate.ledger().get(key).map(|r| r.tokens_spent))
    }

    /// The configured hold TTL.
    pub fn hold_ttl_ms(&self) -> u64 {
        self.with_core(|st, _, _| st.gate.ledger().config().hold_ttl_ms)
    }

    /// Cluster mode: this replica has just taken the gate's lease. Load every record the
    /// shared store holds and take the ledger over (see the core's `Gate::adopt_ledger`).
    /// Blocking (the store's `load`): called on the lease thread. Returns the records loaded.
    pub fn adopt_shared_ledger(
        &self,
        alive: &std::collections::HashSet<String>,
        store_lost_data: bool,
    ) -> Result<usize, crate::ledger_store::StoreError> {
        let records = load_shared(self.store.as_ref())?;
        Ok(self.adopt_loaded(records, alive, store_lost_data))
    }

    /// [`Shared::adopt_shared_ledger`] on a thread of its own: a large ledger takes longer to
    /// read and adopt than a lease lasts, and the lease thread must go on renewing meanwhile.
    /// `done` is called once it has ended; the receiver has the records adopted, or why not.
    pub fn adopt_in_background(
        self: &Arc<Self>,
        alive: HashSet<String>,
        store_lost_data: bool,
        done: impl FnOnce() + Send + 'static,
    ) -> std::sync::mpsc::Receiver<Result<usize, StoreError>> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let me = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("slackgate-adopt".into())
            .spawn(move || {
                let _ = tx.send(me.adopt_shared_ledger(&alive, store_lost_data));
                done();
            });
        if let Err(e) = spawned {
            // No thread: the receiver reports the sender gone, read as a failed load.
            tracing::warn!("cluster: cannot start the ledger loading thread: {e}");
        }
        rx
    }

    /// Cluster mode, on the leader about once a TTL: the holds it keeps for other replicas
    /// (adopted while they were held) are read back from the shared store, and those their
    /// replicas have settled since are settled here too. Blocking (a Redis call): on the lease
    /// thread. Returns how many.
    pub fn learn_foreign_settlements(&self) -> Result<usize, StoreError> {
        let keys = self.with_core(|st, _, _| st.gate.foreign_held(LEARN_BATCH));
        if keys.is_empty() {
            return Ok(0);
        }
        let records = self.store.read(&keys)?;
        Ok(self.with_core(|st, now, _| st.gate.learn_settled(now, &records)))
    }

    /// Take over the shared ledger from `records` (what [`Shared::load_shared_ledger`] read):
    /// see the core's `Gate::adopt_ledger`. Returns the records adopted.
    pub fn adopt_loaded(
        &self,
        records: Vec<slackgate_core::HoldRecord>,
        alive: &std::collections::HashSet<String>,
        store_lost_data: bool,
    ) -> usize {
        let n = records.len();
        // Written as leader: the lease is this replica's from here (the lease thread makes it
        // lead right after), so the records the takeover changes go to the store.
        // Requests another replica dispatched hold their slots for their estimate plus a
        // lease TTL: the time its lease needed to run out before this replica could lead.
        let grace = self.cluster.as_ref().map_or(0, |c| c.config().lease_ttl_ms);
        let out = self.with_core(|st, now, _| {
            st.gate
                .adopt_ledger(records, now, alive, store_lost_data, grace);
            st.gate.take_ledger_records()
        });
        if !out.is_empty() {
            self.store.write(out);
        }
        n
    }

    /// Cluster mode, after Redis lost its data: write back every record of this replica's
    /// ledger that it placed itself. Returns how many.
    pub fn republish_own_records(&self) -> usize {
        let Some(c) = &self.cluster else {
            return 0;
        };
        let me = c.owner.as_str();
        let records: Vec<slackgate_core::HoldRecord> = self.with_core(|st, _, _| {
            st.gate
                .ledger()
                .records()
                .filter(|r| r.owner.as_deref() == Some(me))
                .cloned()
                .collect()
        });
        let n = records.len();
        if n > 0 {
            self.store.write(records);
        }
        n
    }

    /// After a flush: whether the shared ledger refused the hold of `job` (its client's
    /// idempotency key is held or done there by another hold). Returns the key if so.
    pub fn hold_refused(&self, job: JobId) -> Option<String> {
        // Only a shared store refuses; a gate alone skips the lookups.
        self.cluster.as_ref()?;
        let key = self.with_core(|st, _, _| st.waiting.get(&job)?.meta.idempotency_key.clone())?;
        self.hold_refused_key(&key).then_some(key)
    }

    /// [`Shared::hold_refused`] by key (the reservation API's holds).
    pub fn hold_refused_key(&self, key: &str) -> bool {
        if self.cluster.is_none() {
            return false;
        }
        let created = self.with_core(|st, _, _| st.gate.ledger().get(key).map(|r| r.created_at_ms));
        created.is_some_and(|c| self.store.hold_refused(key, c))
    }

    /// Cluster mode, on the leader: expire the proxied holds of replicas no longer in
    /// `alive` (their requests died with them). Returns how many.
    pub fn expire_orphans(&self, alive: &std::collections::HashSet<String>) -> usize {
        self.with_core(|st, now, _| st.gate.expire_orphans(now, alive))
    }

    /// Split every pool's slots `parts` ways on this replica (cluster mode; 1 on the leader).
    pub fn set_share(&self, parts: u32) {
        self.with_core(|st, _, _| st.gate.set_capacity_share(parts));
    }
}

/// Every record of the shared store, after what this replica wrote while it could not reach
/// it (bounded by the store's timeout; what does not make it is merged from memory by the
/// core).
fn load_shared(
    store: &dyn crate::ledger_store::LedgerStore,
) -> Result<Vec<slackgate_core::HoldRecord>, crate::ledger_store::StoreError> {
    let _ = store.flush();
    store.load()
}

/// Foreign holds read back per round by [`Shared::learn_foreign_settlements`].
const LEARN_BATCH: usize = 1_000;
