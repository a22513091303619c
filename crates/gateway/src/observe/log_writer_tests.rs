//! Unit tests of the decision log's writer thread, through [`DecisionLog`] on real files and
//! on sinks the tests control: one that records each write, one whose writes wait for the
//! test's permission, one that fails.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::config::LogTarget;
use crate::observe::telemetry::{DecisionLog, LogLine};
use std::sync::{mpsc as std_mpsc, Mutex};
use std::time::Duration;

/// Long enough for anything that should happen to happen on a loaded CI machine.
const PATIENCE: Duration = Duration::from_secs(20);

fn line(seq: u64) -> LogLine {
    LogLine {
        seq,
        ..LogLine::default()
    }
}

/// The `seq` of every line of `text`; panics on a line that is not whole JSON.
fn seqs(text: &str) -> Vec<u64> {
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a whole JSON line");
            v["seq"].as_u64().unwrap()
        })
        .collect()
}

fn file_seqs(path: &Path) -> Vec<u64> {
    seqs(&std::fs::read_to_string(path).unwrap_or_default())
}

fn temp_dir(name: &str) -> PathBuf {
    slackgate_testkit::temp_dir(&format!("logwriter-{name}"))
}

fn written(log: &DecisionLog) -> u64 {
    log.counters().written.load(Ordering::Relaxed)
}

fn dropped(log: &DecisionLog) -> u64 {
    log.counters().dropped.load(Ordering::Relaxed)
}

/// A sink that keeps each write apart, shared with the test.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<Vec<u8>>>>);

impl Recorder {
    fn writes(&self) -> Vec<Vec<u8>> {
        self.0.lock().unwrap().clone()
    }

    fn text(&self) -> String {
        String::from_utf8(self.writes().concat()).unwrap()
    }
}

impl Write for Recorder {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().push(b.to_vec());
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A recorder whose every write first says it started (`entered`), then waits for a permit;
/// once the test drops the permits' sender, writes go through unhindered.
struct Gated {
    rec: Recorder,
    entered: std_mpsc::Sender<()>,
    permits: std_mpsc::Receiver<()>,
}

impl Write for Gated {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let _ = self.entered.send(());
        let _ = self.permits.recv();
        self.rec.write(b)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A log on a [`Gated`] sink: the log, its recorder, the `entered` signals, the permits.
struct GatedLog {
    log: DecisionLog,
    rec: Recorder,
    entered: std_mpsc::Receiver<()>,
    permits: Option<std_mpsc::Sender<()>>,
}

impl GatedLog {
    fn start(capacity: usize) -> GatedLog {
        let rec = Recorder::default();
        let (entered_tx, entered) = std_mpsc::channel();
        let (permits_tx, permits) = std_mpsc::channel();
        let sink = Gated {
            rec: rec.clone(),
            entered: entered_tx,
            permits,
        };
        let (log, _writer) = DecisionLog::start_writer(Box::new(sink), None, capacity).unwrap();
        GatedLog {
            log,
            rec,
            entered,
            permits: Some(permits_tx),
        }
    }

    /// Log `seq` and wait until the writer is inside the write of it (so it is stuck there).
    fn log_first(&self, seq: u64) {
        assert!(self.log.log(&line(seq)));
        self.entered.recv_timeout(PATIENCE).unwrap();
    }

    /// Let one more write through.
    fn permit(&self) {
        if let Some(p) = &self.permits {
            p.send(()).unwrap();
        }
    }

    /// Let every write through from now on.
    fn open(&mut self) {
        self.permits = None;
    }
}

/// A sink whose writes fail while its switch is on.
struct Failing(Arc<std::sync::atomic::AtomicBool>, Recorder);

impl Write for Failing {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.0.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("disk full (test)"));
        }
        self.1.write(b)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn the_writer_is_a_thread_of_its_own_named_decision_log() {
    let (log, writer) = DecisionLog::start_writer(Box::new(Recorder::default()), None, 4).unwrap();
    assert_eq!(writer.thread().name(), Some(THREAD_NAME));
    assert_eq!(THREAD_NAME, "decision-log");
    drop(log);
    writer.join().unwrap();
}

#[tokio::test]
async fn lines_are_written_in_order_across_many_batches() {
    let dir = temp_dir("order");
    let path = dir.join("decisions.jsonl");
    let log = DecisionLog::start(LogTarget::File(path.clone()), 8192).unwrap();
    let mut seq = 0;
    // Many small batches (a flush between rounds), then large ones the writer drains as they
    // come.
    for round in 0..200 {
        for _ in 0..(1 + round % 7) {
            seq += 1;
            assert!(log.log(&line(seq)));
        }
        log.flush().await;
    }
    for _ in 0..5_000 {
        seq += 1;
        assert!(log.log(&line(seq)));
    }
    log.flush().await;
    assert_eq!(file_seqs(&path), (1..=seq).collect::<Vec<_>>());
    assert_eq!((written(&log), dropped(&log)), (seq, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn lines_queued_during_a_write_go_out_together_in_the_next_one() {
    let mut g = GatedLog::start(1024);
    g.log_first(1);
    for seq in 2..=101 {
        assert!(g.log.log(&line(seq)));
    }
    g.open();
    g.log.flush().await;
    let writes = g.rec.writes();
    assert_eq!(
        writes.len(),
        2,
        "one write for the first line, one for the rest"
    );
    assert_eq!(seqs(&String::from_utf8(writes[0].clone()).unwrap()), [1]);
    assert_eq!(
        seqs(&String::from_utf8(writes[1].clone()).unwrap()),
        (2..=101).collect::<Vec<_>>()
    );
    assert_eq!(written(&g.log), 101);
}

#[tokio::test]
async fn a_long_queue_is_written_in_writes_of_at_most_a_mebibyte() {
    let one = serde_json::to_string(&line(1_000_000)).unwrap().len() + 1;
    let n = (3 * BATCH_BYTES / one + 10) as u64;
    let mut g = GatedLog::start(n as usize + 10);
    g.log_first(1);
    for seq in 1_000_000..1_000_000 + n {
        assert!(g.log.log(&line(seq)));
    }
    g.open();
    g.log.flush().await;
    let writes = g.rec.writes();
    // The first line alone, then at least four: three mebibytes and a few lines more.
    assert!(writes.len() >= 5, "{} writes", writes.len());
    for w in &writes {
        assert!(w.len() < BATCH_BYTES + one, "a write of {} bytes", w.len());
        assert!(w.ends_with(b"\n"), "a write ends with a whole line");
    }
    let mut want = vec![1];
    want.extend(1_000_000..1_000_000 + n);
    assert_eq!(seqs(&g.rec.text()), want);
}

#[tokio::test]
async fn a_flush_is_answered_only_once_the_lines_before_it_are_written() {
    let mut g = GatedLog::start(64);
    g.log_first(1);
    for seq in 2..=11 {
        assert!(g.log.log(&line(seq)));
    }
    let log = g.log.clone();
    let flush = tokio::spawn(async move { log.flush().await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Line 1 goes through; the writer takes lines 2 to 11 and the flush, and is stuck again
    // in the write of those lines.
    g.permit();
    g.entered.recv_timeout(PATIENCE).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!flush.is_finished(), "answered while its lines wait");
    assert_eq!(seqs(&g.rec.text()), [1]);
    g.open();
    tokio::time::timeout(PATIENCE, flush)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(seqs(&g.rec.text()), (1..=11).collect::<Vec<_>>());
}

#[tokio::test]
async fn after_a_flush_the_file_holds_every_line_queued_before_it() {
    let dir = temp_dir("flush");
    let path = dir.join("decisions.jsonl");
    let log = DecisionLog::start(LogTarget::File(path.clone()), 4096).unwrap();
    let mut seq = 0;
    for round in 0..100 {
        for _ in 0..(round % 13) * 10 {
            seq += 1;
            assert!(log.log(&line(seq)));
        }
        log.flush().await;
        let lines = std::fs::read(&path).unwrap_or_default();
        let lines = lines.iter().filter(|b| **b == b'\n').count() as u64;
        assert_eq!(lines, seq, "round {round}");
    }
    assert_eq!(file_seqs(&path), (1..=seq).collect::<Vec<_>>());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_failed_write_counts_its_lines_as_dropped_not_written() {
    let failing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let rec = Recorder::default();
    let sink = Failing(failing.clone(), rec.clone());
    let (log, _writer) = DecisionLog::start_writer(Box::new(sink), None, 64).unwrap();
    for seq in 1..=5 {
        assert!(log.log(&line(seq)), "queued: the failure comes later");
    }
    log.flush().await;
    assert_eq!((written(&log), dropped(&log)), (0, 5));
    // The writer goes on after a failure.
    failing.store(false, Ordering::SeqCst);
    for seq in 6..=8 {
        assert!(log.log(&line(seq)));
    }
    log.flush().await;
    assert_eq!((written(&log), dropped(&log)), (3, 5));
    assert_eq!(seqs(&rec.text()), [6, 7, 8]);
}

#[tokio::test]
async fn a_stalled_sink_stalls_only_its_thread_and_a_full_queue_drops_and_counts() {
    let capacity = 16;
    let mut g = GatedLog::start(capacity);
    g.log_first(1);
    // The writer is stuck in its write of line 1; the queue takes `capacity` more.
    let results: Vec<bool> = (2..=30).map(|seq| g.log.log(&line(seq))).collect();
    assert!(results[..capacity].iter().all(|ok| *ok));
    assert!(results[capacity..].iter().all(|ok| !*ok));
    assert_eq!(dropped(&g.log), 29 - capacity as u64);
    // This (single-threaded) runtime goes on meanwhile.
    tokio::time::timeout(PATIENCE, tokio::time::sleep(Duration::from_millis(10)))
        .await
        .unwrap();
    g.open();
    g.log.flush().await;
    assert_eq!(written(&g.log), 1 + capacity as u64);
    assert_eq!(
        seqs(&g.rec.text()),
        (1..=1 + capacity as u64).collect::<Vec<_>>()
    );
}

#[test]
fn dropping_every_handle_writes_what_was_queued_then_ends_the_thread() {
    let dir = temp_dir("shutdown");
    let path = dir.join("decisions.jsonl");
    let (sink, file) = LogFile::open(&path, 0).unwrap();
    let (log, writer) = DecisionLog::start_writer(sink, Some(file), 2048).unwrap();
    for seq in 1..=1_000 {
        assert!(log.log(&line(seq)));
    }
    drop(log);
    writer.join().unwrap();
    assert_eq!(file_seqs(&path), (1..=1_000).collect::<Vec<_>>());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_file_is_rotated_to_dot_1_once_past_max_bytes() {
    let dir = temp_dir("rotate");
    let path = dir.join("decisions.jsonl");
    // Every line the same length (three-digit seqs); ten lines reach the limit.
    let one = serde_json::to_string(&line(100)).unwrap().len() as u64 + 1;
    let log = DecisionLog::start_rotating(LogTarget::File(path.clone()), 64, 10 * one).unwrap();
    for seq in 100..125 {
        assert!(log.log(&line(seq)));
        log.flush().await;
    }
    assert_eq!(log.counters().rotations.load(Ordering::Relaxed), 2);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["decisions.jsonl", "decisions.jsonl.1"]);
    let rotated = dir.join("decisions.jsonl.1");
    assert_eq!(file_seqs(&rotated), (110..120).collect::<Vec<_>>());
    assert_eq!(file_seqs(&path), (120..125).collect::<Vec<_>>());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn lines_arriving_one_by_one_are_gathered_into_few_writes() {
    // 200 lines, one every 100 us or more (a busy gate's pace): the writer lets each batch
    // gather for LINGER, so they take a handful of writes, not one each.
    let rec = Recorder::default();
    let (log, _writer) = DecisionLog::start_writer(Box::new(rec.clone()), None, 8192).unwrap();
    let started = std::time::Instant::now();
    for seq in 1..=200 {
        assert!(log.log(&line(seq)));
        std::thread::sleep(Duration::from_micros(100));
    }
    log.flush().await;
    let spread = started.elapsed();
    let writes = rec.writes().len();
    assert_eq!(seqs(&rec.text()), (1..=200).collect::<Vec<_>>());
    // At most one write per LINGER of the time the lines took to arrive, and a couple more
    // for the edges (the flush's own batch).
    let bound = (spread.as_micros() / LINGER.as_micros()) as usize + 3;
    assert!(
        writes <= bound,
        "{writes} writes for 200 lines over {spread:?}"
    );
    assert!(
        writes < 100,
        "{writes} writes for 200 lines over {spread:?}"
    );
}

#[tokio::test]
async fn a_short_queue_is_written_as_lines_come_and_drops_nothing() {
    // A queue of 4 has no room to gather in: lines a millisecond apart are all written (a
    // writer lingering 5 ms would let the queue overflow and drop them).
    let rec = Recorder::default();
    let (log, _writer) = DecisionLog::start_writer(Box::new(rec.clone()), None, 4).unwrap();
    for seq in 1..=20 {
        assert!(log.log(&line(seq)), "line {seq} dropped");
        std::thread::sleep(Duration::from_millis(1));
    }
    log.flush().await;
    assert_eq!(seqs(&rec.text()), (1..=20).collect::<Vec<_>>());
    assert_eq!(dropped(&log), 0);
}
