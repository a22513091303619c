//! The slots each endpoint of a pool has in force: its configured slots, reconciled by name
//! when a reload changes the pool's endpoints, and this gate's share of them when the
//! replicas of a cluster split every pool ([`Gate::set_capacity_share`]). A limit a
//! provider's 429 lowered stays lowered through both.

use super::endpoints::EndpointState;
use super::Gate;
use crate::config::{EndpointConfig, PoolConfig};

/// Bring a pool's endpoints in line with its configuration, by name: a kept endpoint keeps
/// its runtime state (health, drain, pause, speed, in-flight count) unless its URL changed
/// (then only its in-flight count: that work still runs); its configured slots are taken as
/// given, and a lowered limit stays lowered at most to them. A removed endpoint is retired,
/// not removed: ids are positions, and its in-flight jobs name it. A pool without an
/// upstream (the simulator's) gets one endpoint with the pool's slots.
pub(super) fn reconcile_endpoints(endpoints: &mut Vec<EndpointState>, pc: &PoolConfig, parts: u32) {
    let mut wanted = pc.endpoint_list();
    if wanted.is_empty() {
        wanted.push(EndpointConfig {
            name: "e0".into(),
            url: String::new(),
            slots: pc.slots,
        });
    }
    for e in endpoints.iter_mut() {
        e.retired = !wanted.iter().any(|w| w.name == e.name);
    }
    for w in wanted {
        match endpoints.iter_mut().find(|e| e.name == w.name) {
            Some(e) => {
                if e.url != w.url {
                    let in_flight = e.in_flight;
                    *e = EndpointState::new(&w.name, &w.url, w.slots);
                    e.in_flight = in_flight;
                } else {
                    // The limit follows in `apply_share`.
                    e.slots = w.slots;
                }
            }
            None => endpoints.push(EndpointState::new(&w.name, &w.url, w.slots)),
        }
    }
    apply_share(endpoints, parts);
}

/// Give this gate `1/parts` of each endpoint's configured slots (rounded down), the whole of
/// them for `parts = 1`. A limit lowered by a 429 stays lowered (at most the new ceiling);
/// one at its ceiling follows the new one. A pool whose share rounds to nothing keeps one
/// slot on its first usable endpoint: a share of nothing would refuse all of its work, and
/// one slot over the split is the smaller harm.
pub(super) fn apply_share(endpoints: &mut [EndpointState], parts: u32) {
    let parts = parts.max(1);
    for e in endpoints.iter_mut() {
        let ceiling = e.slots / parts;
        e.limit = if e.limit < e.ceiling {
            e.limit.min(ceiling)
        } else {
            ceiling
        };
        e.ceiling = ceiling;
    }
    let total = endpoints
        .iter()
        .filter(|e| e.available())
        .fold(0u32, |a, e| a.saturating_add(e.ceiling));
    if total == 0 {
        if let Some(e) = endpoints.iter_mut().find(|e| e.available() && e.slots > 0) {
            e.ceiling = 1;
            e.limit = e.limit.max(1);
        }
    }
}

impl Gate {
    /// Split every pool's slots `parts` ways: this replica decides alone on its share when
    /// the replicas of a cluster cannot coordinate (Redis or the leader out of reach; a class
    /// failing open). `1` gives the whole pool back. The projection and dispatch follow at
    /// once; work already running keeps its slot (a pool may run over its share until it
    /// ends).
    pub fn set_capacity_share(&mut self, parts: u32) {
        let parts = parts.max(1);
        if parts == self.share_parts {
            return;
        }
        self.share_parts = parts;
        for p in &mut self.pools {
            apply_share(&mut p.endpoints, parts);
            p.refresh_capacity();
        }
    }

    /// The split in force ([`Gate::set_capacity_share`]): 1 when this gate has whole pools.
    pub fn capacity_share(&self) -> u32 {
        self.share_parts
    }
}
