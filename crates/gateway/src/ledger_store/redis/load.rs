//! Reading the whole ledger back at startup: the holds hash in `HSCAN` steps (so Redis is
//! never blocked by one huge reply), each entry checked before it is believed.

use super::super::{Counters, StoreError};
use super::link::Link;
use super::shared::Shared;
use slackgate_core::ledger::HoldRecord;

/// A stored value longer than this is not a record of ours: skipped at load without parsing.
pub const MAX_RECORD_BYTES: usize = 64 * 1024;
/// Keys scanned per `HSCAN` call at load.
const SCAN_COUNT: usize = 1_000;

/// Every readable record in the holds hash, one per key (the newest if `HSCAN` returned a
/// key twice). Unreadable entries are skipped, counted and the first one logged.
pub(super) fn scan_all(link: &mut Link, shared: &Shared) -> Result<Vec<HoldRecord>, StoreError> {
    let mut out = Vec::new();
    let mut skipped = 0u64;
    let mut first_bad: Option<String> = None;
    let mut cursor = String::from("0");
    loop {
        let mut cmd = redis::cmd("HSCAN");
        cmd.arg(&shared.keys.holds)
            .arg(&cursor)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        let (next, flat): (String, Vec<Vec<u8>>) = match link.query(&cmd) {
            Ok(v) => {
                shared.saw(true);
                v
            }
            Err(e) => {
                shared.saw(false);
                return Err(shared.unavailable(format!("load: {e}")));
            }
        };
        for pair in flat.chunks(2) {
            let parsed = match pair {
                [field, value] => parse_entry(field, value),
                _ => Err("a field without a value".to_owned()),
            };
            match parsed {
                Ok(r) => out.push(r),
                Err(why) => {
                    skipped += 1;
                    first_bad.get_or_insert(why);
                }
            }
        }
        if next == "0" {
            break;
        }
        cursor = next;
    }
    if let Some(why) = first_bad {
        Counters::add(&shared.counters.rows_skipped, skipped);
        tracing::warn!(
            "ledger store {}: skipped {skipped} unreadable entries of {} at \
             load (first: {why})",
            shared.shown,
            shared.keys.holds
        );
    }
    // HSCAN may return an entry twice (if the hash was resized mid-scan).
    out.sort_by(|a, b| a.key.cmp(&b.key).then(b.version.cmp(&a.version)));
    out.dedup_by(|a, b| a.key == b.key);
    Ok(out)
}

/// The records of `keys` (one `HMGET`); absent and unreadable ones are left out.
pub(super) fn read_keys(
    link: &mut Link,
    shared: &Shared,
    keys: &[String],
) -> Result<Vec<HoldRecord>, StoreError> {
    if keys.is_empty() {
        return Ok(Vec::new());
    }
    let mut cmd = redis::cmd("HMGET");
    cmd.arg(&shared.keys.holds);
    for k in keys {
        cmd.arg(k);
    }
    let values: Vec<Option<Vec<u8>>> = match link.query(&cmd) {
        Ok(v) => {
            shared.saw(true);
            v
        }
        Err(e) => {
            shared.saw(false);
            return Err(shared.unavailable(format!("read: {e}")));
        }
    };
    Ok(keys
        .iter()
        .zip(values)
        .filter_map(|(k, v)| parse_entry(k.as_bytes(), &v?).ok())
        .collect())
}

/// One hash entry back into a record, or why it cannot be (hand edits, another program).
fn parse_entry(field: &[u8], value: &[u8]) -> Result<HoldRecord, String> {
    let field = String::from_utf8_lossy(field);
    let shown: String = field.chars().take(80).collect();
    if value.len() > MAX_RECORD_BYTES {
        return Err(format!(
            "key {shown:?}: value of {} bytes, more than a record can be",
            value.len()
        ));
    }
    let r: HoldRecord = serde_json::from_slice(value)
        .map_err(|e| format!("key {shown:?}: not a ledger record: {e}"))?;
    if *r.key != *field {
        return Err(format!(
            "key {shown:?}: the record inside names another key"
        ));
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::super::put::tests::rec;
    use super::*;
    use slackgate_core::ledger::HoldState;

    #[test]
    fn hostile_entries_are_refused_with_a_reason() {
        let good = rec("k", 0, 1, HoldState::Done, 2);
        let json = serde_json::to_vec(&good).unwrap_or_default();
        assert_eq!(parse_entry(b"k", &json).ok(), Some(good));
        assert!(parse_entry(b"other", &json)
            .err()
            .is_some_and(|e| e.contains("another key")));
        assert!(parse_entry(b"k", b"{not json").is_err());
        assert!(parse_entry(b"k", b"[1,2,3]").is_err());
        assert!(parse_entry(b"k", b"\xff\xfe").is_err());
        let wrong_types = br#"{"key":"k","tenant":5,"state":"done","attempt":-1}"#;
        assert!(parse_entry(b"k", wrong_types).is_err());
        let huge = vec![b'x'; MAX_RECORD_BYTES + 1];
        assert!(parse_entry(b"k", &huge)
            .err()
            .is_some_and(|e| e.contains("bytes")));
        // A huge field name is shown shortened, never whole.
        let long = vec![b'f'; 10_000];
        assert!(parse_entry(&long, b"x")
            .err()
            .is_some_and(|e| e.len() < 300));
    }
}
