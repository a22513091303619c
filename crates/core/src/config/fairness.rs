//! `[fairness]`: weighted fair share between tenants inside a class (the gate's `tenants`
//! module applies it).

use serde::Deserialize;
use std::collections::BTreeMap;

/// How ids not listed in `[fairness.weights]` are counted.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Unlisted {
    /// Every unlisted id shares one bucket (`other`), with `default_weight`: a client that
    /// mints fresh API keys or ids gets no more than that one bucket's share. The default.
    #[default]
    Shared,
    /// Every id gets a bucket of its own with `default_weight`, up to `max_tenants` per class
    /// (the rest share `other`). Only where the ids cannot be minted by a client: the header
    /// is set by a proxy that authenticates, or keys are checked before the gate.
    Own,
}

/// Weighted fair share of a pool between the tenants of one class.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FairnessConfig {
    /// Weight of the `other` bucket and, with `unlisted = "own"`, of each unlisted tenant.
    pub default_weight: f64,
    /// Weight per fairness id: the `[fairness] header`'s value as sent, or the tenant id
    /// (`k:<hash>` from the bearer key, `t:<hash>` from a trusted `X-Tenant`).
    pub weights: BTreeMap<String, f64>,
    /// How ids not in `weights` are counted.
    pub unlisted: Unlisted,
    /// Tenants tracked per class at most (the state and the metrics stay bounded); beyond it,
    /// new ids share `other` until a tracked one goes idle.
    pub max_tenants: usize,
    /// A tenant with nothing queued counts in the share for this long after its last
    /// arrival (its weight stays in the sum, so the others stay held to their shares), then
    /// leaves it and its state is forgotten: a tenant returning from idle starts afresh and
    /// banks no credit.
    pub active_ms: u64,
    /// Tenant headroom: a tenant that runs its share of a pool's slots does not take the last
    /// free ones while the other tenants' recent arrivals say they will need them (a server
    /// does not preempt: a flood of long requests would otherwise fill every idle slot), and
    /// waits for a slot of its own share while its deadline allows. A kept slot idles while
    /// the others do not come; this is the most of the pool's slot time the headroom may
    /// leave idle by that forecast (their running jobs taken as Poisson with their recent
    /// mean): it keeps a slot only where the others' demand makes that slot likely used.
    /// `0`: no tenant headroom, fully work-conserving (shares held at admission only); `1`:
    /// every slot the forecast asks for.
    pub headroom_max_idle: f64,
}

/// The bucket every unlisted id shares (with `unlisted = "shared"`), and untagged requests.
pub const OTHER_TENANT: &str = "other";

/// Most tenants per class a config may ask to track.
pub const MAX_TRACKED_TENANTS: usize = 1_000_000;

impl Default for FairnessConfig {
    fn default() -> Self {
        FairnessConfig {
            default_weight: 1.0,
            weights: BTreeMap::new(),
            unlisted: Unlisted::Shared,
            max_tenants: 10_000,
            active_ms: 60_000,
            headroom_max_idle: 0.05,
        }
    }
}

impl FairnessConfig {
    /// The bucket a request's fairness id is counted in, and its weight: its own when listed
    /// (or unlisted ids get their own), else `other`. `tracked` says whether a new own bucket
    /// still fits under `max_tenants`.
    pub fn bucket<'a>(
        &self,
        id: Option<&'a str>,
        tracked: impl Fn(&str) -> bool,
    ) -> (&'a str, f64) {
        let Some(id) = id.filter(|s| !s.is_empty() && *s != OTHER_TENANT) else {
            return (OTHER_TENANT, self.default_weight);
        };
        if let Some(w) = self.weights.get(id) {
            return (id, *w);
        }
        if self.unlisted == Unlisted::Own && tracked(id) {
            return (id, self.default_weight);
        }
        (OTHER_TENANT, self.default_weight)
    }
}
