//! Rebuilding a ledger from persisted records, and expiring the holds nobody will settle
//! (their process is gone).

use super::*;

/// A hold nobody will settle: held, proxied (a reservation-API worker may still be running),
/// not of a `live` key of this process, and placed by no replica in `alive`.
fn orphaned(
    r: &HoldRecord,
    live: &std::collections::HashSet<String>,
    alive: &std::collections::HashSet<String>,
) -> bool {
    r.state == HoldState::Held
        && !r.reservation
        // A dispatched request's hold taken over from another gate expires when its
        // estimate has run out (see `Gate::adopt_ledger`, which sets that expiry), not at once.
        && (r.dispatched.is_none() || r.expires_at_ms == NEVER)
        && !live.contains(&*r.key)
        && !r.owner.as_ref().is_some_and(|o| alive.contains(&**o))
}

impl Ledger {
    /// Rebuild from persisted records (the latest version of each key wins), then expire every
    /// hold whose TTL passed while the process was down. Returns the records that changed, to
    /// persist back.
    pub fn restore(
        cfg: LedgerConfig,
        records: impl IntoIterator<Item = HoldRecord>,
        now: Millis,
    ) -> (Ledger, Vec<HoldRecord>) {
        let none = std::collections::HashSet::new();
        Ledger::restore_keeping(cfg, records, now, &none, &none)
    }

    /// [`Ledger::restore`], except that some proxied holds keep their TTL: those of `live`
    /// keys (their requests still run in this process) and those placed by a replica in
    /// `alive` (another process of the cluster, still running, settles them). A replica
    /// taking a cluster's ledger over thus expires at once only the holds of processes that
    /// are gone.
    pub fn restore_keeping(
        cfg: LedgerConfig,
        records: impl IntoIterator<Item = HoldRecord>,
        now: Millis,
        live: &std::collections::HashSet<String>,
        alive: &std::collections::HashSet<String>,
    ) -> (Ledger, Vec<HoldRecord>) {
        let mut l = Ledger::new(cfg);
        let mut latest: std::collections::HashMap<Shared, HoldRecord> =
            std::collections::HashMap::new();
        for r in records {
            if r.key.is_empty() || r.key.len() > MAX_KEY_LEN {
                continue;
            }
            match latest.get(&r.key) {
                Some(prev) if prev.version >= r.version => {}
                _ => {
                    latest.insert(r.key.clone(), r);
                }
            }
        }
        let mut keys: Vec<Shared> = latest.keys().cloned().collect();
        keys.sort_unstable(); // deterministic rebuild
        for k in keys {
            if let Some(r) = latest.remove(&k) {
                l.install(r);
            }
        }
        // A proxied request's hold is settled by its connection, which died with the process:
        // expire those at once (tokens wasted) rather than lock the key out for a TTL. A
        // reservation-API worker may still be running: its hold keeps its TTL.
        let mut changed = l.expire_orphans(now, live, alive);
        changed.extend(l.expire_due(now));
        (l, changed)
    }

    /// Account a record as the key's current one (no previous record for the key).
    fn install(&mut self, mut r: HoldRecord) {
        // One shared copy of each tenant id, whatever the records carried. Earlier holds of
        // this key (retried after a cancel or an expiry) still count.
        let (held, settled) = match r.state {
            HoldState::Held => (r.tokens_held, (0, 0)),
            _ => (0, (r.tokens_spent, r.tokens_wasted)),
        };
        let id = self.tenant_usage(r.tenant.as_deref().unwrap_or(""), |u| {
            u.held = u.held.saturating_add(held);
            u.spent = u
                .spent
                .saturating_add(r.prior_spent)
                .saturating_add(settled.0);
            u.wasted = u
                .wasted
                .saturating_add(r.prior_wasted)
                .saturating_add(settled.1);
        });
        if r.tenant.is_some() {
            r.tenant = Some(id);
        }
        self.totals.tokens_spent = self.totals.tokens_spent.saturating_add(r.prior_spent);
        self.totals.tokens_wasted = self.totals.tokens_wasted.saturating_add(r.prior_wasted);
        match r.state {
            HoldState::Held => {
                self.totals.held += 1;
                self.totals.tokens_held = self.totals.tokens_held.saturating_add(r.tokens_held);
                self.expiry.track(&r);
            }
            _ => {
                self.totals.tokens_spent = self.totals.tokens_spent.saturating_add(r.tokens_spent);
                self.totals.tokens_wasted =
                    self.totals.tokens_wasted.saturating_add(r.tokens_wasted);
                self.count_state(r.state);
                self.settled.insert((r.updated_at_ms, r.key.clone()));
            }
        }
        self.holds.insert(r.key.clone(), r);
    }

    /// Expire at once the proxied holds nobody will settle: held, not placed through the
    /// reservation API, not of a `live` key, and placed by no replica in `alive`. Tokens held
    /// count as wasted. Returns the records to persist.
    pub fn expire_orphans(
        &mut self,
        now: Millis,
        live: &std::collections::HashSet<String>,
        alive: &std::collections::HashSet<String>,
    ) -> Vec<HoldRecord> {
        let orphans: std::collections::BTreeSet<Shared> = self
            .holds
            .values()
            .filter(|r| orphaned(r, live, alive))
            .map(|r| r.key.clone())
            .collect();
        let mut out = Vec::new();
        for key in orphans {
            if let Some(r) = self.expire(now, &key) {
                out.push(r);
            }
        }
        out
    }
}
