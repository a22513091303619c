//! The Redis store's pruner: a thread of its own, on its own connection, that every
//! [`PRUNE_INTERVAL`] runs the prune script over settled keys in batches of [`PRUNE_BATCH`]
//! (see the module docs of `redis`).

use super::super::{Counters, StoreError};
use super::link::Link;
use super::lua;
use super::shared::Shared;
use super::{PRUNE_BATCH, PRUNE_INTERVAL};
use crate::ledger_store::prune::CARRY_PREFIX;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

/// Start the pruner thread: it prunes every [`PRUNE_INTERVAL`] until `stop` is dropped. The
/// first failure is logged, later ones only counted.
pub(super) fn spawn(
    shared: Arc<Shared>,
    upkeep: Arc<Mutex<Link>>,
    retention_ms: u64,
    stop: mpsc::Receiver<()>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("ledger-redis-prune".to_owned())
        .spawn(move || {
            let mut logged = false;
            while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(PRUNE_INTERVAL) {
                let now = crate::support::clock::epoch_ms();
                if let Err(e) = prune(&shared, &upkeep, now, retention_ms) {
                    if !std::mem::replace(&mut logged, true) {
                        tracing::warn!(
                            "ledger store {}: pruning failed: {e} [later \
                             failures are only counted]",
                            shared.shown
                        );
                    }
                }
            }
        })
}

/// Prune until a batch comes back short; counts rows and errors.
pub(super) fn prune(
    shared: &Shared,
    upkeep: &Mutex<Link>,
    now_ms: u64,
    retention_ms: u64,
) -> Result<u64, StoreError> {
    // A poisoned lock only means a pruning call panicked mid-way; the link is still usable
    // (at worst it reconnects).
    let mut link = upkeep
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let horizon = now_ms.saturating_sub(retention_ms).to_string();
    let (batch, now) = (PRUNE_BATCH.to_string(), now_ms.to_string());
    let carry = CARRY_PREFIX;
    let mut total = 0u64;
    loop {
        let args: [&[u8]; 4] = [
            horizon.as_bytes(),
            batch.as_bytes(),
            now.as_bytes(),
            carry.as_bytes(),
        ];
        let keys = [shared.keys.holds.as_str(), shared.keys.settled.as_str()];
        match link.eval::<(u64, u64)>(lua::PRUNE, &keys, &args) {
            Ok((pruned, examined)) => {
                shared.saw(true);
                total += pruned;
                Counters::add(&shared.counters.rows_pruned, pruned);
                if examined < PRUNE_BATCH as u64 {
                    return Ok(total);
                }
            }
            Err(e) => {
                shared.saw(false);
                Counters::add(&shared.counters.prune_errors, 1);
                return Err(shared.unavailable(format!("prune: {e}")));
            }
        }
    }
}
