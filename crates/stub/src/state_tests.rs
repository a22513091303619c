//! Unit tests for the guards' accounting: every request that queued is recorded once, whichever
//! way it ends, and busy time is summed for tagged and untagged requests alike.

use std::time::Duration;

use super::*;

fn one_slot(cap: usize) -> std::io::Result<Arc<Shared>> {
    let cfg = StubConfig {
        slots: 1,
        ..StubConfig::default()
    };
    Shared::with_record_cap(cfg, cap)
}

fn tag(id: &str) -> Option<Tag> {
    Some(Tag {
        id: id.to_owned(),
        output_tokens: 5,
        stream: false,
    })
}

// On tokio's paused clock (the stub's accounting reads it): the 30 ms each slot is held pass at
// once and exactly.
#[tokio::test(start_paused = true)]
async fn a_slot_guard_records_its_outcome_and_busy_time() -> Result<(), Box<dyn std::error::Error>>
{
    let shared = one_slot(10)?;
    let mut slot = shared.acquire_slot(tag("a")).await.ok_or("no slot")?;
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(
        shared.requests().is_empty(),
        "nothing is recorded before the end"
    );
    slot.settle(Outcome::Faulted);
    drop(slot);

    // An untagged request adds to the busy total but leaves no record.
    let slot = shared.acquire_slot(None).await.ok_or("no slot")?;
    tokio::time::sleep(Duration::from_millis(30)).await;
    drop(slot);

    let records = shared.requests();
    assert_eq!(records.len(), 1);
    let r = &records[0];
    assert_eq!((r.id.as_str(), r.outcome), ("a", Outcome::Faulted));
    assert!((30..2000).contains(&r.busy_ms), "{r:?}");
    let s = shared.stats();
    assert!(s.busy_ms_total >= 60, "{s:?}");
    assert!(s.busy_ms_total >= r.busy_ms + 30, "{s:?}");
    // The faulted one counts in neither; the unsettled untagged one is a cancellation.
    assert_eq!((s.in_flight, s.served, s.cancelled), (0, 0, 1));
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn giving_up_in_the_queue_records_a_cancellation_without_busy_time(
) -> Result<(), Box<dyn std::error::Error>> {
    let shared = one_slot(10)?;
    let first = shared.acquire_slot(tag("first")).await.ok_or("no slot")?;
    // The second request waits behind the first, then its future is dropped (client gone).
    let waited = tokio::time::timeout(
        Duration::from_millis(40),
        shared.acquire_slot(tag("second")),
    );
    assert!(waited.await.is_err(), "the only slot is taken");
    assert_eq!(shared.stats().queued, 0);
    drop(first);

    let records = shared.requests();
    let ids: Vec<&str> = records.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids, ["second", "first"], "completion order");
    let gave_up = &records[0];
    assert_eq!((gave_up.outcome, gave_up.busy_ms), (Outcome::Cancelled, 0));
    assert!(gave_up.queued_ms >= 40, "{gave_up:?}");
    // An unsettled slot guard is a cancellation too; it only counts in `cancelled` if it held a
    // slot.
    assert_eq!(records[1].outcome, Outcome::Cancelled);
    assert_eq!(shared.stats().cancelled, 1);
    Ok(())
}

#[tokio::test]
async fn the_cap_applies_to_guards_and_clearing_resets_it() -> Result<(), Box<dyn std::error::Error>>
{
    let shared = one_slot(2)?;
    for id in ["a", "b", "c"] {
        let mut slot = shared.acquire_slot(tag(id)).await.ok_or("no slot")?;
        slot.settle(Outcome::Served);
    }
    let log = shared.take_requests();
    let ids: Vec<&str> = log.requests.iter().map(|r| r.id.as_str()).collect();
    assert_eq!((ids, log.dropped), (vec!["a", "b"], 1));
    assert_eq!(shared.stats().served, 3, "dropped records still count");
    let mut slot = shared.acquire_slot(tag("d")).await.ok_or("no slot")?;
    slot.settle(Outcome::Served);
    drop(slot);
    assert_eq!(shared.take_requests().requests.len(), 1);
    Ok(())
}

// Real time here: `slot_unix_ms` is read from the wall clock when the slot is taken, so two
// requests that ran one after the other sit on the timeline in that order, and one that never
// got a slot has none.
#[tokio::test]
async fn records_say_when_each_request_got_its_slot() -> Result<(), Box<dyn std::error::Error>> {
    let shared = one_slot(10)?;
    let before = crate::records::unix_ms_now();
    let first = shared.acquire_slot(tag("first")).await.ok_or("no slot")?;
    let waited = tokio::time::timeout(
        Duration::from_millis(20),
        shared.acquire_slot(tag("gave-up")),
    );
    assert!(waited.await.is_err(), "the only slot is taken");
    tokio::time::sleep(Duration::from_millis(30)).await;
    drop(first);
    let second = shared.acquire_slot(tag("second")).await.ok_or("no slot")?;
    drop(second);
    let after = crate::records::unix_ms_now();

    let records = shared.requests();
    let at = |id: &str| records.iter().find(|r| r.id == id).map(|r| r.slot_unix_ms);
    let (first, second) = (at("first").ok_or("first")?, at("second").ok_or("second")?);
    assert!(before <= first && first <= after, "{records:?}");
    assert!(second >= first + 30 && second <= after, "{records:?}");
    assert_eq!(at("gave-up"), Some(0), "never had a slot: {records:?}");
    Ok(())
}
