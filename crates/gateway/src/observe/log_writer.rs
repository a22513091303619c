//! The decision log's writer: one dedicated thread, `decision-log`, that owns the sink (a
//! plain file or stdout) and writes with blocking calls.
//!
//! Why a thread rather than a tokio task: tokio has no non-blocking file I/O, so a
//! `tokio::fs::File` (or `tokio::io::stdout`) hands every `write_all` and `flush` to the
//! blocking pool and waits for the answer: thread hand-offs on every batch, which showed as a
//! few percent of the worker threads' time in profiles of the proxy under load (issue 28).
//! This thread blocks in `write` itself; lines reach it over the same bounded channel as
//! before, so the request path still only ever `try_send`s (a full channel drops and counts
//! the line) and a stalled sink (a pipe nobody reads, a hung disk) stalls this thread alone.
//!
//! The loop: block for the first message; take whatever else is queued and, when the first
//! was a line, what arrives within [`LINGER`] (up to [`BATCH_BYTES`]; a reopen ends the
//! batch); write it with one `write_all`; rotate if the file passed `max_bytes`; then answer
//! the reopens and flushes of the batch: a flush is answered only once every line queued
//! before it has been written. When every handle is dropped the channel still yields what
//! was queued; the thread writes it and ends.

use super::telemetry::LogCounters;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// The thread's name (as `top -H` and a debugger show it).
pub const THREAD_NAME: &str = "decision-log";

/// The most bytes one write takes: a longer queue is written in several.
pub const BATCH_BYTES: usize = 1024 * 1024;

/// How long the thread lets lines gather after the first of a batch, before it writes.
/// While it sleeps the request path's sends wake nobody, and a busy gate's lines go out in
/// one `write` per few milliseconds instead of one per line (a syscall and a wake-up each,
/// about 8% of the process's samples under load before this). It looks at the queue every
/// [`LINGER_SLICE`] and stops gathering at a flush or reopen, at [`BATCH_BYTES`], or once the
/// queue is a quarter full; a queue shorter than [`LINGER_MIN_CAPACITY`] never lingers (it
/// has no room to gather in). The cost: a line reaches the file up to this much later.
pub const LINGER: Duration = Duration::from_millis(5);

/// How often a lingering writer looks at its queue.
pub const LINGER_SLICE: Duration = Duration::from_millis(1);

/// Queues (`log.channel_capacity`) shorter than this are written as lines come, unlingered.
pub const LINGER_MIN_CAPACITY: usize = 4096;

/// Where the lines go: a file, stdout, or (in tests) anything that can be written to.
pub(super) type Sink = Box<dyn Write + Send>;

/// What the handles send the writer.
pub(super) enum Msg {
    /// One serialized line, its newline included.
    Line(String),
    /// Answer once everything queued before is written.
    Flush(oneshot::Sender<()>),
    /// Reopen the file by its path; answer whether it worked.
    Reopen(oneshot::Sender<std::io::Result<()>>),
}

/// The log file the writer appends to, for rotation.
pub(super) struct LogFile {
    path: PathBuf,
    /// Bytes in the file now (as far as this process knows).
    size: u64,
    /// Rotate past this size; 0: never.
    max_bytes: u64,
}

impl LogFile {
    /// Open `path` for appending (creating it), to rotate to `<path>.1` past `max_bytes`
    /// (0: never): the sink and what the writer needs to know to rotate it.
    pub(super) fn open(path: &Path, max_bytes: u64) -> std::io::Result<(Sink, LogFile)> {
        let (f, size) = open_append(path)?;
        let file = LogFile {
            path: path.to_owned(),
            size,
            max_bytes,
        };
        Ok((Box::new(f), file))
    }
}

/// Open `path` for appending, creating it; with its current size.
fn open_append(path: &Path) -> std::io::Result<(std::fs::File, u64)> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let size = f.metadata().map(|m| m.len()).unwrap_or(0);
    Ok((f, size))
}

/// Start the writer thread on `rx`. Its handle is only for tests: the gate never joins it
/// (it flushes the log at shutdown instead, see `server.rs`), because a sink that is stuck
/// would hang the join.
pub(super) fn spawn(
    rx: mpsc::Receiver<Msg>,
    sink: Sink,
    file: Option<LogFile>,
    counters: Arc<LogCounters>,
) -> std::io::Result<JoinHandle<()>> {
    let writer = Writer {
        sink,
        file,
        counters,
        buf: Vec::with_capacity(64 * 1024),
    };
    std::thread::Builder::new()
        .name(THREAD_NAME.to_owned())
        .spawn(move || writer.run(rx))
}

/// The thread's state.
struct Writer {
    sink: Sink,
    file: Option<LogFile>,
    counters: Arc<LogCounters>,
    /// The batch being written; kept between batches for its allocation.
    buf: Vec<u8>,
}

/// What one batch asks besides its lines.
#[derive(Default)]
struct Batch {
    /// Lines in the buffer.
    lines: u64,
    flushes: Vec<oneshot::Sender<()>>,
    /// A reopen ends its batch, so there is at most one.
    reopen: Option<oneshot::Sender<std::io::Result<()>>>,
}

impl Writer {
    /// The thread's body: batches until every handle is dropped and the queue is empty.
    fn run(mut self, mut rx: mpsc::Receiver<Msg>) {
        // `blocking_recv` parks this thread (it is not a runtime thread, so it may).
        let linger = rx.max_capacity() >= LINGER_MIN_CAPACITY;
        while let Some(first) = rx.blocking_recv() {
            let lines_only = matches!(first, Msg::Line(_));
            let mut batch = Batch::default();
            self.take(first, &mut rx, &mut batch);
            if linger && lines_only {
                self.gather(&mut rx, &mut batch);
            }
            self.write(batch.lines);
            self.rotate_if_full();
            if let Some(ack) = batch.reopen {
                let _ = ack.send(self.reopen());
            }
            for ack in batch.flushes {
                let _ = ack.send(());
            }
        }
        let _ = self.sink.flush();
    }

    /// Add to `batch` what arrives within [`LINGER`] (see there), looking every
    /// [`LINGER_SLICE`].
    fn gather(&mut self, rx: &mut mpsc::Receiver<Msg>, batch: &mut Batch) {
        let until = Instant::now() + LINGER;
        let full_enough = rx.max_capacity() / 4;
        loop {
            let done = batch.reopen.is_some()
                || !batch.flushes.is_empty()
                || self.buf.len() >= BATCH_BYTES
                || rx.len() >= full_enough;
            let left = until.saturating_duration_since(Instant::now());
            if done || left.is_zero() {
                return;
            }
            std::thread::sleep(left.min(LINGER_SLICE));
            match rx.try_recv() {
                Ok(m) => self.take(m, rx, batch),
                Err(mpsc::error::TryRecvError::Empty) => {}
                Err(mpsc::error::TryRecvError::Disconnected) => return,
            }
        }
    }

    /// Add `first` and whatever else is already queued to `batch`, up to [`BATCH_BYTES`] or a
    /// reopen (so the lines queued before a reopen go to the old file and the ones after to
    /// the new).
    fn take(&mut self, first: Msg, rx: &mut mpsc::Receiver<Msg>, batch: &mut Batch) {
        let mut next = Some(first);
        while let Some(m) = next.take() {
            match m {
                Msg::Line(s) => {
                    self.buf.extend_from_slice(s.as_bytes());
                    batch.lines += 1;
                }
                Msg::Flush(ack) => batch.flushes.push(ack),
                Msg::Reopen(ack) => {
                    batch.reopen = Some(ack);
                    break;
                }
            }
            if self.buf.len() >= BATCH_BYTES {
                break;
            }
            next = rx.try_recv().ok();
        }
    }

    /// Write the buffer in one `write_all`. A line counts as written only once the write
    /// succeeded; a failed batch (closed pipe, full disk) counts as dropped only, so the two
    /// counters never overlap.
    fn write(&mut self, lines: u64) {
        if self.buf.is_empty() {
            return;
        }
        let sink = &mut self.sink;
        if sink
            .write_all(&self.buf)
            .and_then(|()| sink.flush())
            .is_ok()
        {
            self.counters.written.fetch_add(lines, Ordering::Relaxed);
            if let Some(f) = self.file.as_mut() {
                f.size += self.buf.len() as u64;
            }
        } else {
            self.counters.dropped.fetch_add(lines, Ordering::Relaxed);
        }
        self.buf.clear();
    }

    /// Past `max_bytes`, rename the file to `<path>.1` (replacing an older one) and start a
    /// new one; on failure keep writing where we are and try again after the next batch.
    fn rotate_if_full(&mut self) {
        let Some(f) = self.file.as_mut() else {
            return;
        };
        if f.max_bytes == 0 || f.size < f.max_bytes {
            return;
        }
        match reopen_file(&mut self.sink, f, true) {
            Ok(()) => {
                self.counters.rotations.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => tracing::error!("cannot rotate the decision log {}: {e}", f.path.display()),
        }
    }

    /// Reopen the file by its path (logrotate renamed it); stdout has nothing to reopen.
    fn reopen(&mut self) -> std::io::Result<()> {
        let Some(f) = self.file.as_mut() else {
            return Ok(());
        };
        reopen_file(&mut self.sink, f, false)?;
        self.counters.rotations.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The log file after a reopen (or a rotation, when `rotate`): the new sink, or the error
/// (the old sink is kept then, so lines still go somewhere).
fn reopen_file(sink: &mut Sink, file: &mut LogFile, rotate: bool) -> std::io::Result<()> {
    let _ = sink.flush();
    if rotate {
        let mut old = file.path.clone().into_os_string();
        old.push(".1");
        std::fs::rename(&file.path, &old)?;
    }
    let (f, size) = open_append(&file.path)?;
    *sink = Box::new(f);
    file.size = size;
    Ok(())
}

#[cfg(test)]
#[path = "log_writer_tests.rs"]
mod tests;
