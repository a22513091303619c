//! Per-request accounting: how long each tagged request waited for a slot and how long it held
//! one, however it ended. This is what lets a live drill measure exactly how much upstream time
//! each request consumed, including requests whose client gave up mid-way.
//!
//! A request opts in with `x-stub-request-id`; untagged requests cost nothing here. Records are
//! written by the slot and queue guards' `Drop` (see `state.rs`), never by a handler's happy path,
//! so a client that vanishes at any `.await` is still recorded, exactly once.
//!
//! The book is bounded: a drill that forgets to clear it must not make the stub eat all memory,
//! so past [`MAX_REQUEST_RECORDS`] new records are counted in `dropped` instead of kept.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Most records the stub keeps between clears; later ones are only counted as `dropped`.
pub const MAX_REQUEST_RECORDS: usize = 1_000_000;

/// Longest accepted `x-stub-request-id`, in bytes (all visible ASCII, so also in characters).
pub(crate) const MAX_REQUEST_ID_LEN: usize = 128;

/// How a request ended; decides which counter its release bumps and what its record says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// The whole response was delivered.
    Served,
    /// The stub ended it on purpose (injected fault).
    Faulted,
    /// The client went away first, while queued or while holding a slot. This is what a slot
    /// guard starts with, so any path that forgets to settle it, i.e. a dropped future or body,
    /// is counted as a cancellation.
    Cancelled,
}

impl Outcome {
    /// The stable name used in `/stub/requests`: `served`, `faulted` or `cancelled`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Served => "served",
            Outcome::Faulted => "faulted",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// What the stub recorded about one request that carried `x-stub-request-id`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// The request's `x-stub-request-id`.
    pub id: String,
    /// Milliseconds spent waiting for a slot, until it got one or its client went away.
    pub queued_ms: u64,
    /// Milliseconds it held a slot, from acquiring it until releasing it (0 if it never got one).
    pub busy_ms: u64,
    /// How it ended: `served`, `faulted` or `cancelled`.
    pub outcome: Outcome,
    /// Output tokens planned for the response (all delivered when `outcome` is `served`; 0 for
    /// embeddings).
    pub output_tokens: u32,
    /// Whether the response was streamed.
    pub stream: bool,
    /// Wall-clock time the request got its slot, epoch milliseconds (0 if it never got one).
    /// With `busy_ms` it places the request on a timeline, so a checker can tell which requests
    /// ran upstream at the same moment (the fault harness, `crates/cli/tests/faults.rs`).
    #[serde(default)]
    pub slot_unix_ms: u64,
}

/// Every record kept so far, as served by `GET /stub/requests`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestLog {
    /// Records in completion order.
    pub requests: Vec<RequestRecord>,
    /// Records not kept because the log was full ([`MAX_REQUEST_RECORDS`]).
    pub dropped: u64,
}

/// The parts of a record known before the request queues; carried by its guards until it ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tag {
    /// The validated `x-stub-request-id`.
    pub id: String,
    /// Output tokens planned for the response.
    pub output_tokens: u32,
    /// Whether the response is streamed.
    pub stream: bool,
}

impl Tag {
    /// The finished record for this request; `slot_unix_ms` is when it got its slot (0: never).
    pub fn into_record(
        self,
        queued: Duration,
        busy: Duration,
        outcome: Outcome,
        slot_unix_ms: u64,
    ) -> RequestRecord {
        RequestRecord {
            id: self.id,
            queued_ms: whole_ms(queued),
            busy_ms: whole_ms(busy),
            outcome,
            output_tokens: self.output_tokens,
            stream: self.stream,
            slot_unix_ms,
        }
    }
}

/// The wall clock now, epoch milliseconds (0 before 1970: a broken clock, not a panic).
pub(crate) fn unix_ms_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, whole_ms)
}

/// Whole milliseconds of `d`, rounded down.
fn whole_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Why an `x-stub-request-id` value was refused.
pub(crate) fn check_request_id(id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err("the id is empty; expected 1 to 128 visible ASCII characters".to_owned());
    }
    if id.len() > MAX_REQUEST_ID_LEN {
        return Err(format!(
            "the id is {} bytes long; at most {MAX_REQUEST_ID_LEN} are allowed",
            id.len()
        ));
    }
    if let Some(bad) = id.bytes().find(|b| !b.is_ascii_graphic()) {
        return Err(format!(
            "byte 0x{bad:02x} is not visible ASCII (spaces and control characters are refused)"
        ));
    }
    Ok(())
}

/// The bounded list of finished records behind `/stub/requests`.
#[derive(Debug)]
pub(crate) struct Records {
    log: RequestLog,
    cap: usize,
}

impl Records {
    /// An empty book keeping at most `cap` records between clears.
    pub fn with_cap(cap: usize) -> Self {
        Records {
            log: RequestLog::default(),
            cap,
        }
    }

    /// Appends `record`, or counts it as dropped if the book is full.
    pub fn push(&mut self, record: RequestRecord) {
        if self.log.requests.len() < self.cap {
            self.log.requests.push(record);
        } else {
            self.log.dropped = self.log.dropped.saturating_add(1);
        }
    }

    /// The records kept so far.
    pub fn list(&self) -> &[RequestRecord] {
        &self.log.requests
    }

    /// Everything so far, without clearing.
    pub fn log(&self) -> &RequestLog {
        &self.log
    }

    /// Everything so far, leaving the book empty (and `dropped` at 0).
    pub fn take(&mut self) -> RequestLog {
        std::mem::take(&mut self.log)
    }
}

#[cfg(test)]
#[path = "records_tests.rs"]
mod tests;
