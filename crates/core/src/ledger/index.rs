//! The ledger's index of the holds that can expire.

use super::{HoldRecord, Shared, NEVER};
use crate::Millis;

/// Held records by expiry time: exactly those whose `expires_at_ms` is not [`NEVER`] (a hold
/// with no TTL is never due, so it is never in here, and a deep queue of live requests costs
/// nothing at expiry time). Every change to a held record's expiry goes through
/// [`ExpiryIndex::track`] and [`ExpiryIndex::untrack`], which keep that rule in one place.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct ExpiryIndex(std::collections::BTreeSet<(Millis, Shared)>);

impl ExpiryIndex {
    /// Time the held record `r` under its expiry (nothing when it has no TTL).
    pub(super) fn track(&mut self, r: &HoldRecord) {
        if r.expires_at_ms != NEVER {
            self.0.insert((r.expires_at_ms, r.key.clone()));
        }
    }

    /// Stop timing `r`, as it stands before its expiry or state changes.
    pub(super) fn untrack(&mut self, r: &HoldRecord) {
        if r.expires_at_ms != NEVER {
            self.0.remove(&(r.expires_at_ms, r.key.clone()));
        }
    }

    /// Take out the key of the earliest hold due at `now`, if any. Peeks at the time before
    /// cloning anything: this runs on every offer, and almost always finds nothing due.
    pub(super) fn pop_due(&mut self, now: Millis) -> Option<Shared> {
        if self.0.first().is_none_or(|(at, _)| *at > now) {
            return None;
        }
        self.0.pop_first().map(|(_, key)| key)
    }

    /// Every entry, for the tests that check the index against the records.
    #[cfg(test)]
    pub(super) fn entries(&self) -> &std::collections::BTreeSet<(Millis, Shared)> {
        &self.0
    }
}
