//! Reserve+commit pairs per second through the ledger stores, SQLite against memory, in one
//! run (issue 3: the SQLite store must sustain at least 20,000 pairs/s with group commit).
//!
//! A pair is what the gate writes for one successful request: the `held` record at reserve,
//! the `done` record at commit (two writes). Each run writes N pairs as fast as the caller can
//! queue them, then flushes; the clock stops when the flush returns, so the figure is durable
//! pairs per second, not queued ones.
//!
//! Patterns:
//! - `adjacent`: each `done` right after its `held`. Both usually land in the same group
//!   commit and coalesce into one row write: the best case.
//! - `window`: each `done` is written 8,192 reservations after its `held` (many requests in
//!   flight), so the two are always in different batches: every record is a row write.
//! - `flush/pair`: a flush after every pair, i.e. no group commit at all (a disk sync per
//!   pair with `full`): the reference that shows what group commit buys.
//!
//! Run: `cargo bench -p slackgate-gateway --bench ledger_store` (N from
//! `SLACKGATE_BENCH_PAIRS`, default 200,000).

use slackgate_core::ledger::{HoldRecord, HoldState};
use slackgate_gateway::ledger_store::{
    LedgerStore, MemoryStore, SqliteOptions, SqliteStore, Synchronous,
};
use std::error::Error;
use std::path::PathBuf;
use std::time::Instant;

const WINDOW: usize = 8_192;

fn pair(i: usize) -> (HoldRecord, HoldRecord) {
    let now = 1_700_000_000_000 + i as u64;
    let held = HoldRecord {
        key: format!("bench-{i:08}").into(),
        tenant: Some("3f2a9c1e".into()),
        state: HoldState::Held,
        attempt: 0,
        tokens_held: 800,
        tokens_spent: 0,
        tokens_wasted: 0,
        created_at_ms: now,
        expires_at_ms: now + 20_000,
        updated_at_ms: now,
        version: 1,
        prior_spent: 0,
        prior_wasted: 0,
        reservation: false,
        owner: None,
        dispatched: None,
    };
    let done = HoldRecord {
        state: HoldState::Done,
        tokens_spent: 612,
        updated_at_ms: now + 12,
        version: 2,
        ..held.clone()
    };
    (held, done)
}

#[derive(Clone, Copy, PartialEq)]
enum Pattern {
    Adjacent,
    Window,
    FlushPerPair,
}

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::Adjacent => "adjacent",
            Pattern::Window => "window 8192",
            Pattern::FlushPerPair => "flush/pair",
        }
    }
}

/// Write `n` pairs in `pattern` and flush; pairs per second, durable.
fn run(store: &dyn LedgerStore, n: usize, pattern: Pattern) -> Result<f64, Box<dyn Error>> {
    // Records are built before the clock starts: the store is what is measured.
    let pairs: Vec<(HoldRecord, HoldRecord)> = (0..n).map(pair).collect();
    let start = Instant::now();
    match pattern {
        Pattern::Adjacent => {
            for (held, done) in pairs {
                store.write(vec![held]);
                store.write(vec![done]);
            }
        }
        Pattern::Window => {
            let mut dones = std::collections::VecDeque::with_capacity(WINDOW + 1);
            for (held, done) in pairs {
                store.write(vec![held]);
                dones.push_back(done);
                if dones.len() > WINDOW {
                    if let Some(d) = dones.pop_front() {
                        store.write(vec![d]);
                    }
                }
            }
            for d in dones {
                store.write(vec![d]);
            }
        }
        Pattern::FlushPerPair => {
            for (held, done) in pairs {
                store.write(vec![held]);
                store.write(vec![done]);
                store.flush()?;
            }
        }
    }
    store.flush()?;
    let secs = start.elapsed().as_secs_f64();
    if store.load()?.len() != n {
        return Err("store lost records".into());
    }
    Ok(n as f64 / secs)
}

struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Result<Scratch, Box<dyn Error>> {
        let dir =
            std::env::temp_dir().join(format!("slackgate-bench-ledger-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let n: usize = std::env::var("SLACKGATE_BENCH_PAIRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let began = Instant::now();
    let scratch = Scratch::new()?;
    let mut file = 0;
    let mut sqlite = |sync: Synchronous| -> Result<Box<dyn LedgerStore>, Box<dyn Error>> {
        file += 1;
        let path = scratch.0.join(format!("ledger-{file}.db"));
        let opts = SqliteOptions {
            synchronous: sync,
            ..SqliteOptions::default()
        };
        Ok(Box::new(SqliteStore::open(&path, opts)?))
    };

    println!(
        "ledger store: durable reserve+commit pairs per second (2 writes per pair, then flush)"
    );
    println!("temp dir: {}", scratch.0.display());
    println!();
    println!(
        "{:<14} {:<12} {:>8} {:>14} {:>10} {:>9}",
        "store", "pattern", "pairs", "pairs/s", "vs memory", "commits"
    );
    for pattern in [Pattern::Adjacent, Pattern::Window, Pattern::FlushPerPair] {
        // Without group commit a run is one commit per pair: keep it short.
        let count = match pattern {
            Pattern::FlushPerPair => (n / 100).max(100),
            _ => n,
        };
        let mut memory_rate = None;
        let stores: [(&str, Box<dyn LedgerStore>); 3] = [
            ("memory", Box::new(MemoryStore::new())),
            ("sqlite normal", sqlite(Synchronous::Normal)?),
            ("sqlite full", sqlite(Synchronous::Full)?),
        ];
        for (name, store) in stores {
            let rate = run(&*store, count, pattern)?;
            let base = *memory_rate.get_or_insert(rate);
            println!(
                "{:<14} {:<12} {:>8} {:>14.0} {:>10.4} {:>9}",
                name,
                pattern.name(),
                count,
                rate,
                rate / base,
                store.stats().batches_committed
            );
        }
    }
    // The request path: many requests at once, each waiting for its own hold to be durable
    // before it goes upstream (the proxy: one flush per pair) or before it answers (the
    // reservation API: a flush after reserve and after commit). Group commit lets concurrent
    // flushes share one transaction.
    println!();
    println!(
        "{:<14} {:<22} {:>8} {:>12} {:>16}",
        "store", "request path", "pairs", "pairs/s", "records/commit"
    );
    for (threads, flushes) in [(64usize, 1usize), (64, 2), (256, 1)] {
        for (name, sync) in [
            ("sqlite normal", Synchronous::Normal),
            ("sqlite full", Synchronous::Full),
        ] {
            let store: std::sync::Arc<dyn LedgerStore> = std::sync::Arc::from(sqlite(sync)?);
            let per = (n / 10 / threads).max(10);
            let start = Instant::now();
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let store = std::sync::Arc::clone(&store);
                    std::thread::spawn(move || -> Result<(), String> {
                        for j in 0..per {
                            let i = t * per + j;
                            let (held, done) = pair(i);
                            store.write(vec![held]);
                            store.flush().map_err(|e| e.to_string())?;
                            store.write(vec![done]);
                            if flushes >= 2 {
                                store.flush().map_err(|e| e.to_string())?;
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            for w in workers {
                w.join().map_err(|_| "worker panicked")??;
            }
            store.flush()?;
            let pairs = threads * per;
            let rate = pairs as f64 / start.elapsed().as_secs_f64();
            let commits = store.stats().batches_committed.max(1);
            println!(
                "{:<14} {:<22} {:>8} {:>12.0} {:>16.1}",
                name,
                format!("{threads} clients, {flushes} flush/pair"),
                pairs,
                rate,
                (2 * pairs) as f64 / commits as f64
            );
        }
    }
    println!();
    println!(
        "commits: SQLite transactions (memory: write calls); total {:.1} s",
        began.elapsed().as_secs_f64()
    );
    Ok(())
}
