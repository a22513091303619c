//! Decision log rotation against real files: logrotate's rename then reopen (SIGHUP), and
//! the writer's own rotation at `log.max_bytes`. No line is lost across a reopen, none is
//! split across files.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use slackgate_gateway::config::LogTarget;
use slackgate_gateway::observe::telemetry::LogLine;
use slackgate_gateway::DecisionLog;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

fn temp_dir(name: &str) -> PathBuf {
    slackgate_testkit::temp_dir(&format!("logrot-{name}"))
}

fn line(seq: u64) -> LogLine {
    LogLine {
        seq,
        action: slackgate_core::Action::Admit.into(),
        reason: slackgate_core::Reason::WithinSlack.into(),
        ..LogLine::default()
    }
}

/// The `seq` of every line of a file; panics on a line that is not whole JSON.
fn seqs(path: &Path) -> Vec<u64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a whole JSON line");
            v["seq"].as_u64().unwrap()
        })
        .collect()
}

#[tokio::test]
async fn reopen_after_a_rename_starts_a_new_file_and_loses_nothing() {
    let dir = temp_dir("reopen");
    let path = dir.join("decisions.jsonl");
    let log = DecisionLog::start(LogTarget::File(path.clone()), 1024).unwrap();
    for i in 1..=50 {
        assert!(log.log(&line(i)));
    }
    log.flush().await;
    // logrotate: rename, then signal.
    let rotated = dir.join("decisions.jsonl.1");
    std::fs::rename(&path, &rotated).unwrap();
    for i in 51..=60 {
        assert!(log.log(&line(i))); // still to the renamed file: it is open
    }
    log.reopen().await.unwrap();
    for i in 61..=100 {
        assert!(log.log(&line(i)));
    }
    log.flush().await;
    let old = seqs(&rotated);
    let new = seqs(&path);
    assert_eq!(old, (1..=60).collect::<Vec<_>>());
    assert_eq!(new, (61..=100).collect::<Vec<_>>());
    assert_eq!(log.counters().rotations.load(Ordering::Relaxed), 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_writer_rotates_at_max_bytes() {
    let dir = temp_dir("size");
    let path = dir.join("decisions.jsonl");
    let max = 20_000u64;
    let log = DecisionLog::start_rotating(LogTarget::File(path.clone()), 1024, max).unwrap();
    let mut seq = 0;
    for _ in 0..40 {
        for _ in 0..20 {
            seq += 1;
            assert!(log.log(&line(seq)));
        }
        log.flush().await;
    }
    let rotations = log.counters().rotations.load(Ordering::Relaxed);
    // The writer rotates after a batch that took the file to `max` or past it, and a batch
    // holds at most one round's 20 lines (the flush ends it): every rotated file has between
    // `max` and `max` plus 20 lines. (The line length comes from the rotated file: the current
    // one may be empty, just rotated.)
    let rotated = dir.join("decisions.jsonl.1");
    let rotated_len = std::fs::metadata(&rotated).unwrap().len();
    let line_len = rotated_len / seqs(&rotated).len() as u64;
    assert!(
        rotated_len >= max && rotated_len < max + 20 * line_len,
        "rotated at {rotated_len} bytes"
    );
    let total = seq * line_len;
    let (fewest, most) = (total / (max + 20 * line_len), total / max);
    assert!(
        rotations >= 2 && rotations + 1 >= fewest && rotations <= most + 1,
        "{rotations} rotations for {total} bytes (expected {fewest} to {most})"
    );
    let current = std::fs::metadata(&path).unwrap().len();
    assert!(
        current < max + 20 * line_len + 1,
        "current file {current} bytes"
    );
    // The last rotated file and the current one hold the newest lines, in order, unsplit.
    let mut tail = seqs(&dir.join("decisions.jsonl.1"));
    tail.extend(seqs(&path));
    assert_eq!(*tail.last().unwrap(), seq);
    assert!(tail.windows(2).all(|w| w[1] == w[0] + 1), "contiguous");
    let _ = std::fs::remove_dir_all(&dir);
}
