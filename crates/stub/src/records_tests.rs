//! Unit tests for the request records: the cap, clearing, id validation and the JSON shape.

use super::*;

fn record(id: &str) -> RequestRecord {
    RequestRecord {
        id: id.to_owned(),
        queued_ms: 1,
        busy_ms: 2,
        outcome: Outcome::Served,
        output_tokens: 3,
        stream: false,
        slot_unix_ms: 4,
    }
}

#[test]
fn keeps_at_most_cap_records_and_counts_the_rest() {
    let mut book = Records::with_cap(3);
    for i in 0..5 {
        book.push(record(&format!("r{i}")));
    }
    let ids: Vec<&str> = book.list().iter().map(|r| r.id.as_str()).collect();
    assert_eq!(
        ids,
        ["r0", "r1", "r2"],
        "the first records are kept, in order"
    );
    assert_eq!(book.log().dropped, 2);

    // Taking empties the book and resets `dropped`, so it fills again from scratch.
    let taken = book.take();
    assert_eq!((taken.requests.len(), taken.dropped), (3, 2));
    assert_eq!((book.list().len(), book.log().dropped), (0, 0));
    book.push(record("again"));
    assert_eq!(book.list().len(), 1);
}

#[test]
fn a_zero_cap_keeps_nothing() {
    let mut book = Records::with_cap(0);
    book.push(record("x"));
    assert!(book.list().is_empty());
    assert_eq!(book.log().dropped, 1);
}

#[test]
fn the_production_cap_is_a_million() {
    assert_eq!(MAX_REQUEST_RECORDS, 1_000_000);
}

#[test]
fn validates_request_ids() {
    let longest = "x".repeat(MAX_REQUEST_ID_LEN);
    for ok in ["a", "req-42", "A_b.c:d/e~!", longest.as_str()] {
        assert_eq!(check_request_id(ok), Ok(()), "{ok}");
    }
    let too_long = "x".repeat(MAX_REQUEST_ID_LEN + 1);
    for bad in [
        "",
        "has space",
        "tab\there",
        "nul\0",
        "caf\u{e9}",
        too_long.as_str(),
    ] {
        assert!(check_request_id(bad).is_err(), "{bad:?}");
    }
    assert!(check_request_id(&too_long).is_err_and(|why| why.contains("129")));
}

#[test]
fn records_round_down_to_whole_milliseconds() {
    let tag = Tag {
        id: "t".to_owned(),
        output_tokens: 9,
        stream: true,
    };
    let r = tag.into_record(
        Duration::from_micros(1_999),
        Duration::from_micros(200_700),
        Outcome::Cancelled,
        1_700_000_000_123,
    );
    assert_eq!((r.queued_ms, r.busy_ms), (1, 200));
    assert_eq!(r.slot_unix_ms, 1_700_000_000_123);
    assert_eq!((r.output_tokens, r.stream), (9, true));
}

#[test]
fn json_shape_is_stable_and_parses_back() -> serde_json::Result<()> {
    let mut book = Records::with_cap(1);
    book.push(RequestRecord {
        outcome: Outcome::Faulted,
        ..record("r1")
    });
    book.push(record("r2"));
    let text = serde_json::to_string(book.log())?;
    assert_eq!(
        text,
        r#"{"requests":[{"id":"r1","queued_ms":1,"busy_ms":2,"outcome":"faulted","output_tokens":3,"stream":false,"slot_unix_ms":4}],"dropped":1}"#
    );
    let back: RequestLog = serde_json::from_str(&text)?;
    assert_eq!(&back, book.log());
    // Records written before `slot_unix_ms` existed still parse (as 0).
    let old = r#"{"id":"o","queued_ms":0,"busy_ms":0,"outcome":"served","output_tokens":1,"stream":false}"#;
    assert_eq!(serde_json::from_str::<RequestRecord>(old)?.slot_unix_ms, 0);
    for o in [Outcome::Served, Outcome::Faulted, Outcome::Cancelled] {
        assert_eq!(serde_json::to_value(o)?, o.as_str());
    }
    Ok(())
}
