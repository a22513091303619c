//! The `action` and `reason` of a decision-log line as types: the core's [`Action`] and
//! [`Reason`] for what happened to a request, and the gateway's own events (an operator's
//! flag, a reload, an endpoint or the cluster changing state). Each writes itself as the
//! stable code docs/reference.md lists; nothing compares these codes as strings.

use serde::{Serialize, Serializer};
use slackgate_core::{Action, Reason};

/// What a line records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineAction {
    /// Something that happened to a request (`admit`, `reject`, `dispatch`, ...).
    Job(Action),
    /// An operator changed a control, or the gate flagged an endpoint or cluster event.
    Flag,
    /// A configuration reload, applied or refused.
    Reload,
    /// The gate began to shut down.
    Shutdown,
}

impl LineAction {
    /// The code written in the log.
    pub fn as_str(self) -> &'static str {
        match self {
            LineAction::Job(a) => a.as_str(),
            LineAction::Flag => "flag",
            LineAction::Reload => "reload",
            LineAction::Shutdown => "shutdown",
        }
    }

    /// A line where tokens are settled (`complete`, `cancel`, `drop`).
    pub fn settles(self) -> bool {
        matches!(
            self,
            LineAction::Job(Action::Complete | Action::Cancel | Action::Drop)
        )
    }

    /// A line of an admission decision (`admit`, `reject`, `shadow_reject`).
    pub fn decides(self) -> bool {
        matches!(
            self,
            LineAction::Job(Action::Admit | Action::Reject | Action::ShadowReject)
        )
    }
}

impl Default for LineAction {
    /// `error`: a line whose kind was not set says so rather than pass for a decision.
    fn default() -> LineAction {
        LineAction::Job(Action::Error)
    }
}

impl From<Action> for LineAction {
    fn from(a: Action) -> LineAction {
        LineAction::Job(a)
    }
}

/// Why: a core reason, the gateway's one request reason of its own, or an event's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LineReason {
    /// A core reason code.
    Gate(Reason),
    /// The request's body did not arrive within `server.body_read_timeout_ms`.
    BodyReadTimeout,
    /// An admin request without the admin token (counted in `/metrics`, never logged).
    Unauthorized,
    /// The ledger store failed (counted in `/metrics`; the error goes to stderr).
    LedgerStoreError,
    /// The name of an operator, endpoint or cluster event.
    Event(Event),
}

impl LineReason {
    /// The code written in the log.
    pub fn as_str(self) -> &'static str {
        match self {
            LineReason::Gate(r) => r.as_str(),
            LineReason::BodyReadTimeout => crate::wire::response::BODY_READ_TIMEOUT,
            LineReason::Unauthorized => "unauthorized",
            LineReason::LedgerStoreError => "ledger_store_error",
            LineReason::Event(e) => e.as_str(),
        }
    }
}

impl Default for LineReason {
    /// `invalid_request`, for the same reason as [`LineAction`]'s default.
    fn default() -> LineReason {
        LineReason::Gate(Reason::InvalidRequest)
    }
}

impl From<Reason> for LineReason {
    fn from(r: Reason) -> LineReason {
        LineReason::Gate(r)
    }
}

impl From<Event> for LineReason {
    fn from(e: Event) -> LineReason {
        LineReason::Event(e)
    }
}

/// The events the gateway logs besides requests (`flag`, `reload` lines), by the name each
/// line's `reason` carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// `admit_always` set or cleared.
    AdmitAlways,
    /// `shadow` set or cleared.
    Shadow,
    /// A class enabled or disabled.
    Enabled,
    /// The gate drained.
    Drain,
    /// The drain ended.
    Undrain,
    /// A drain found nothing left running.
    DrainIdle,
    /// A new configuration was refused.
    ConfigRejected,
    /// A new configuration is in force.
    ConfigReloaded,
    /// An endpoint was ejected after failures.
    EndpointEjected,
    /// An ejected endpoint is back.
    EndpointReadmitted,
    /// An endpoint's provider answered 429.
    UpstreamThrottled,
    /// An operator drained an endpoint.
    EndpointDrain,
    /// An operator undrained an endpoint.
    EndpointUndrain,
    /// Redis answers again.
    RedisUp,
    /// Redis is out of reach.
    RedisDown,
    /// Redis lost the cluster's data.
    RedisDataLost,
    /// Another replica uses this replica's id.
    DuplicateReplicaId,
    /// This replica took the lease.
    LeaderAcquired,
    /// This replica took the lease but could not take the ledger over.
    LeaderAdoptFailed,
    /// Holds of replicas gone were expired.
    OrphansExpired,
    /// This replica lost the lease.
    LeaderLost,
}

impl Event {
    /// The name written in the log.
    pub fn as_str(self) -> &'static str {
        match self {
            Event::AdmitAlways => "admit_always",
            Event::Shadow => "shadow",
            Event::Enabled => "enabled",
            Event::Drain => "drain",
            Event::Undrain => "undrain",
            Event::DrainIdle => "drain_idle",
            Event::ConfigRejected => "config_rejected",
            Event::ConfigReloaded => "config_reloaded",
            Event::EndpointEjected => "endpoint_ejected",
            Event::EndpointReadmitted => "endpoint_readmitted",
            Event::UpstreamThrottled => "upstream_throttled",
            Event::EndpointDrain => "endpoint_drain",
            Event::EndpointUndrain => "endpoint_undrain",
            Event::RedisUp => "redis_up",
            Event::RedisDown => "redis_down",
            Event::RedisDataLost => "redis_data_lost",
            Event::DuplicateReplicaId => "duplicate_replica_id",
            Event::LeaderAcquired => "leader_acquired",
            Event::LeaderAdoptFailed => "leader_adopt_failed",
            Event::OrphansExpired => "orphans_expired",
            Event::LeaderLost => "leader_lost",
        }
    }
}

impl Serialize for LineAction {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl Serialize for LineReason {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json<T: Serialize>(v: T) -> String {
        serde_json::to_string(&v).unwrap_or_default()
    }

    #[test]
    fn codes_serialize_as_the_strings_the_log_always_had() {
        assert_eq!(
            json(LineAction::Job(Action::ShadowReject)),
            "\"shadow_reject\""
        );
        assert_eq!(json(LineAction::Flag), "\"flag\"");
        assert_eq!(
            json(LineReason::Gate(Reason::ProjectedWaitExceedsSlack)),
            "\"projected_wait_exceeds_slack\""
        );
        assert_eq!(json(LineReason::BodyReadTimeout), "\"body_read_timeout\"");
        assert_eq!(
            json(LineReason::Event(Event::LeaderAdoptFailed)),
            "\"leader_adopt_failed\""
        );
    }

    #[test]
    fn settling_and_deciding_lines_are_told_apart() {
        assert!(LineAction::Job(Action::Drop).settles());
        assert!(!LineAction::Job(Action::Dispatch).settles());
        assert!(LineAction::Job(Action::ShadowReject).decides());
        assert!(!LineAction::Flag.decides() && !LineAction::Flag.settles());
    }
}
