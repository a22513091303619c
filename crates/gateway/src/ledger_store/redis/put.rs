//! One call of the put script ([`lua::PUT`]): the head of the writer's queue coalesced to the
//! newest version of each hold, encoded as JSON, sent as one `EVALSHA`, and the script's
//! answer read back.

use super::link::Link;
use super::lua;
use super::shared::Keys;
use crate::ledger_store::prune::CARRY_PREFIX;
use slackgate_core::ledger::{HoldRecord, HoldState, GENERATED_KEY_PREFIX, NEVER};
use std::collections::HashMap;

/// A batch ready for the put script.
pub(super) struct PutBatch {
    /// `(key, record JSON)` in the order the script must apply them.
    payload: Vec<(String, Vec<u8>)>,
    /// Records that could not be encoded (not sent; counted lost by the writer).
    pub(super) unstorable: u64,
}

impl PutBatch {
    /// Coalesce `records` (see [`coalesce`]) and encode each as JSON. An untimed hold (a
    /// proxied request's: `expires_at_ms` is [`NEVER`]) is stored with an expiry `hold_ttl_ms`
    /// after its creation: its replica settles it, or dies with it; in Redis it must not lock
    /// its key for ever (the put script lets a new hold of the key in once it has expired).
    pub(super) fn encode<'a>(
        records: impl Iterator<Item = &'a HoldRecord>,
        hold_ttl_ms: u64,
    ) -> PutBatch {
        let mut batch = coalesce(records);
        for r in &mut batch {
            if r.state == HoldState::Held && r.expires_at_ms == NEVER {
                r.expires_at_ms = r.created_at_ms.saturating_add(hold_ttl_ms);
            }
        }
        let mut payload: Vec<(String, Vec<u8>)> = Vec::with_capacity(batch.len());
        let mut unstorable = 0u64;
        for r in &batch {
            match serde_json::to_vec(r) {
                Ok(json) => payload.push((r.key.to_string(), json)),
                Err(_) => unstorable += 1,
            }
        }
        PutBatch {
            payload,
            unstorable,
        }
    }

    /// Send the batch in one call of the put script on `link`, written by `owner` leading
    /// under `epoch` (see [`lua::PUT`]'s fencing).
    pub(super) fn send(
        &self,
        link: &mut Link,
        keys: &Keys,
        (owner, epoch): (String, u64),
    ) -> redis::RedisResult<PutReply> {
        let epoch = epoch.to_string();
        let mut args: Vec<&[u8]> = Vec::with_capacity(4 + 2 * self.payload.len());
        args.push(GENERATED_KEY_PREFIX.as_bytes());
        args.push(CARRY_PREFIX.as_bytes());
        args.push(owner.as_bytes());
        args.push(epoch.as_bytes());
        for (key, json) in &self.payload {
            args.push(key.as_bytes());
            args.push(json);
        }
        let keys = [
            keys.holds.as_str(),
            keys.settled.as_str(),
            keys.lease_epoch.as_str(),
        ];
        link.eval::<PutReply>(lua::PUT, &keys, &args)
    }
}

/// Within one batch, later versions of the same hold replace earlier ones (a `held` and its
/// `done` queued together become one write). Different holds of one key keep their order:
/// the put script must see a cancelled hold before the retry that follows it.
fn coalesce<'a>(records: impl Iterator<Item = &'a HoldRecord>) -> Vec<HoldRecord> {
    let mut out: Vec<HoldRecord> = Vec::new();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for r in records {
        if let Some(&i) = last.get(&*r.key) {
            let prev = &mut out[i];
            if prev.attempt == r.attempt && prev.created_at_ms == r.created_at_ms {
                if r.version > prev.version {
                    *prev = r.clone();
                }
                continue;
            }
        }
        last.insert(&r.key, out.len());
        out.push(r.clone());
    }
    out
}

/// The put script's answer.
#[derive(Debug, Default)]
pub(super) struct PutReply {
    pub(super) terminal_conflicts: u64,
    pub(super) held_conflicts: u64,
    pub(super) first_terminal: String,
    pub(super) first_held: String,
    pub(super) unreadable: u64,
    pub(super) refused: Vec<(String, u64)>,
    /// Records of other owners' holds refused because the writer does not lead under the
    /// lease's current epoch.
    pub(super) fenced: u64,
}

impl redis::FromRedisValue for PutReply {
    fn from_redis_value(v: &redis::Value) -> redis::RedisResult<PutReply> {
        type Raw = (u64, u64, u64, u64, String, String, u64, Vec<String>, u64);
        let (_written, _stale, term, held, first_term, first_held, bad, flat, fenced): Raw =
            redis::FromRedisValue::from_redis_value(v)?;
        let refused = flat
            .chunks(2)
            .filter_map(|c| match c {
                [k, t] => Some((k.clone(), t.parse::<u64>().ok()?)),
                _ => None,
            })
            .collect();
        Ok(PutReply {
            terminal_conflicts: term,
            held_conflicts: held,
            first_terminal: first_term,
            first_held,
            unreadable: bad,
            refused,
            fenced,
        })
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use slackgate_core::ledger::HoldState;

    pub(in super::super) fn rec(
        key: &str,
        attempt: u32,
        created: u64,
        state: HoldState,
        version: u64,
    ) -> HoldRecord {
        HoldRecord {
            key: key.into(),
            tenant: None,
            state,
            attempt,
            tokens_held: 10,
            tokens_spent: 0,
            tokens_wasted: 0,
            created_at_ms: created,
            expires_at_ms: created + 1,
            updated_at_ms: created,
            version,
            prior_spent: 0,
            prior_wasted: 0,
            reservation: false,
            owner: None,
            dispatched: None,
        }
    }

    #[test]
    fn coalescing_keeps_different_holds_of_a_key_in_order() {
        let records = [
            rec("k", 0, 1, HoldState::Held, 1),
            rec("k", 0, 1, HoldState::Cancelled, 2),
            rec("k", 1, 5, HoldState::Held, 5),
            rec("j", 0, 1, HoldState::Held, 1),
            rec("k", 1, 5, HoldState::Done, 6),
            rec("k", 1, 5, HoldState::Held, 5),
        ];
        let out = coalesce(records.iter());
        let got: Vec<(&str, u32, HoldState)> =
            out.iter().map(|r| (&*r.key, r.attempt, r.state)).collect();
        assert_eq!(
            got,
            [
                ("k", 0, HoldState::Cancelled),
                ("k", 1, HoldState::Done),
                ("j", 0, HoldState::Held)
            ]
        );
    }
}
