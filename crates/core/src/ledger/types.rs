//! The ledger's vocabulary: a hold's state and record (what is persisted), the settings, the
//! limits, and the ways a check or a settlement can fail.

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
        matches!(
            self,
            HoldState::Done | HoldState::Cancelled | HoldState::Expired
        )
    }
}

/// A shared, immutable string: an idempotency key, a tenant or a replica id. Made once (when a
/// key is generated or first seen) and shared by the ledger's maps, the records it hands out,
/// the queued job and its decision, so that an admission copies no string.
pub type Shared = std::sync::Arc<str>;

/// One key's latest hold, as persisted (one row per key in the embedded store).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldRecord {
    /// The idempotency key (client-sent, or generated).
    pub key: Shared,
    /// Hashed tenant, if known.
    pub tenant: Option<Shared>,
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
    /// Tokens spent by this key's earlier holds (a key retried after a cancel or expiry).
    #[serde(default)]
    pub prior_spent: u64,
    /// Tokens wasted by this key's earlier holds.
    #[serde(default)]
    pub prior_wasted: u64,
    /// Placed through the reservation API (a worker calls the model itself and settles the
    /// hold), rather than by a proxied request whose connection settles it.
    #[serde(default)]
    pub reservation: bool,
    /// The gate replica that placed the hold (cluster mode; `None` on a gate alone). A
    /// proxied hold is settled by its request's connection, which lives in that process: a
    /// replica taking a cluster's ledger over expires the proxied holds of replicas that are
    /// gone, and keeps those of replicas still running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<Shared>,
    /// Where and when the hold's request was sent upstream (cluster mode; `None` while it
    /// queues, and on a gate alone). A replica taking a cluster over counts such a request as
    /// occupying its slot until its estimate (plus a grace) has run out, whoever placed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatched: Option<Dispatched>,
}

/// A held request's dispatch, as its hold records it (see [`HoldRecord::dispatched`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dispatched {
    /// The pool's name.
    pub pool: String,
    /// The endpoint's name within it.
    pub endpoint: String,
    /// When it was sent (epoch ms).
    pub at_ms: Millis,
    /// Its estimated service time then (ms).
    pub est_ms: u64,
}

impl Dispatched {
    /// Until when it occupies its slot, with `grace_ms` beyond its estimate.
    pub fn until(&self, grace_ms: u64) -> Millis {
        self.at_ms
            .saturating_add(self.est_ms)
            .saturating_add(grace_ms)
    }
}

/// Ledger settings (`[ledger]` in the config file).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LedgerConfig {
    /// How long an unsettled hold lives before it expires and its tokens count as wasted.
    /// Must exceed the longest request you serve (default 15 min).
    pub hold_ttl_ms: u64,
    /// Highest attempt number accepted for a key (`X-Attempt` / `x-stainless-retry-count`);
    /// beyond it: `reject_retry_cap`. The default matches the OpenAI SDKs' two retries.
    pub retry_cap: u32,
    /// How long settled client keys are remembered in memory to answer duplicates.
    pub retention_ms: u64,
    /// Token grant of a tenant not listed in `grants`; `None`: unlimited.
    pub default_grant_tokens: Option<u64>,
    /// Token grants by tenant id (as logged: `k:<hash of the API key>` or `t:<hash>`).
    pub grants: std::collections::BTreeMap<String, u64>,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig {
            hold_ttl_ms: 900_000,
            retry_cap: 2,
            retention_ms: 86_400_000,
            default_grant_tokens: None,
            grants: std::collections::BTreeMap::new(),
        }
    }
}

/// `expires_at_ms` of a hold that does not expire on a timer (a live proxied request's):
/// the largest value a SQLite integer column holds.
pub const NEVER: Millis = i64::MAX as Millis;

/// Prefix of the idempotency keys the gate generates for requests that bring none (the
/// gateway appends its start time and the job id). Spelled here once: the gateway refuses
/// client keys with it, the ledger treats such keys as never replayable, and the pruner may
/// delete their settled rows at once.
pub const GENERATED_KEY_PREFIX: &str = "gen-";

/// Longest idempotency key accepted.
pub const MAX_KEY_LEN: usize = 256;
/// Largest token count accepted anywhere in the ledger (a unit mistake beyond this).
pub const MAX_TOKENS: u64 = 1 << 40;

/// Why the ledger refuses a reservation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LedgerReject {
    /// The key's latest hold is held or done: a replay must not reserve or spend again.
    Duplicate {
        /// `held` or `done`.
        state: HoldState,
        /// Tokens the existing hold reserves.
        tokens_held: u64,
    },
    /// The attempt number is over the retry cap.
    RetryCap {
        /// The attempt asked for.
        attempt: u32,
        /// The cap.
        retry_cap: u32,
    },
    /// The tenant's grant cannot cover the hold.
    BudgetExhausted {
        /// Tokens left in the grant.
        remaining: u64,
        /// Tokens the hold needs.
        requested: u64,
    },
}

/// How a hold settles (see [`Ledger::settle_as`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settlement {
    /// `done`: the upstream used `spent` tokens.
    Done { spent: u64 },
    /// `cancelled`: `wasted` tokens were generated for nobody.
    Cancelled { wasted: u64 },
}

/// How [`Ledger::reserve_shared`] places a hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placing {
    /// Past the retry cap and the tenant grant (the `admit_always` rollback), as
    /// [`Ledger::reserve_unchecked`]; a held or done key is still a duplicate.
    pub unchecked: bool,
    /// With no TTL ([`NEVER`]): a proxied request's live connection settles it (it always
    /// ends, one way or another), and a restart expires it.
    pub untimed: bool,
}

/// Why a settlement (commit or cancel) could not apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SettleError {
    /// No hold under that key (or it was never reserved).
    MissingHold,
    /// The hold had already expired (now, or earlier: `record` says when).
    HoldExpired(Box<HoldRecord>),
    /// The key's latest hold is already settled (`done`, `cancelled`) or was rejected.
    NotHeld(HoldState),
    /// The hold belongs to a proxied request (settled by its own response), not to a
    /// reservation: the reservation API may not settle it.
    NotAReservation,
}

/// Totals for `/stats`, metrics and the decision log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LedgerStats {
    /// Holds currently `held`.
    pub held: u64,
    /// Tokens reserved by current holds.
    pub tokens_held: u64,
    /// Tokens spent by settled holds.
    pub tokens_spent: u64,
    /// Tokens wasted by cancelled and expired holds.
    pub tokens_wasted: u64,
    /// `(spent + wasted) / spent`: 1.0 means nothing was wasted; `None` before any spend.
    pub amplification: Option<f64>,
    /// Holds ended `done`, `cancelled`, `expired`, and reservations `rejected` (since start).
    pub done: u64,
    /// See `done`.
    pub cancelled: u64,
    /// See `done`.
    pub expired: u64,
    /// See `done`.
    pub rejected: u64,
}
