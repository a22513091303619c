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
use serde::{Deserialize, Serialize};

/// Where a key's latest hold stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldState {
    /// Tokens reserved; the request is queued or running.
    Held,
    /// Settled: the upstream answered; `tokens_spent` is what it used.
    Done,
    /// The client went away; `tokens_wasted` is what was generated for nobody.
    Cancelled,
    /// The hold outlived its TTL (a crash, a worker that never committed); its tokens are
    /// counted as wasted.
    Expired,
    /// Refused at admission; nothing was reserved.
    Rejected,
}

impl HoldState {
    /// The stable code used in logs, bodies and the database.
    pub fn as_str(self) -> &'static str {
        match self {
            HoldState::Held => "held",
            HoldState::Done => "done",
            HoldState::Cancelled => "cancelled",
            HoldState::Expired => "expired",
            HoldState::Rejected => "rejected",
        }
    }

    /// Parse a stored code.
    pub fn parse(s: &str) -> Option<HoldState> {
        Some(match s {
            "held" => HoldState::Held,
            "done" => HoldState::Done,
            "cancelled" => HoldState::Cancelled,
            "expired" => HoldState::Expired,
            "rejected" => HoldState::Rejected,
            _ => return None,
        })
    }

    /// True for `done`, `cancelled` and `expired`: the hold's tokens are accounted for.
    pub fn is_terminal(self) -> bool {
        matches!(self, HoldState::Done | HoldState::Cancelled | HoldState::Expired)
    }
}

/// One key's latest hold, as persisted (one row per key in the embedded store).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldRecord {
    /// The idempotency key (client-sent, or generated).
    pub key: String,
    /// Hashed tenant, if known.
    pub tenant: Option<String>,
    /// Where the hold stands.
    pub state: HoldState,
    /// Attempt number of this hold (0 for the first try).
    pub attempt: u32,
    /// Tokens reserved (prompt estimate + output cap or expectation).
    pub tokens_held: u64,
    /// Tokens the upstream reported using (set when `done`).
    pub tokens_spent: u64,
    /// Tokens wasted (set when `cancelled` or `expired`).
    pub tokens_wasted: u64,
    /// When the hold was placed (epoch ms).
    pub created_at_ms: Millis,
    /// When an unsettled hold expires (epoch ms).
    pub expires_at_ms: Millis,
    /// Last change (epoch ms).
    pub updated_at_ms: Millis,
    /// Monotonic version of this key's record: a store keeps the highest, so replays and
    /// reordered writes can never move a key backwards.
    pub version: u64,
}
