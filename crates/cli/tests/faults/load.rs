//! The clients of a fault run: a few workers, each with its own stream of the run's seed,
//! sending chat requests to the replicas that are up, half of a `closed` class and half of an
//! `open` one, each with a deadline (`x-deadline-ms`) and an idempotency key, one in five a
//! retry of a key the worker already sent (same key, same class). Each request also carries
//! its key as `x-stub-request-id`, so the stub's own record says which keys reached it, when.

use super::checker::Attempt;
use super::rng::Rng;
use crate::common::post_chat;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The load's shared switches: which replicas may be sent to, and when to stop.
#[derive(Clone)]
pub struct Switches {
    /// `down[i]`: replica `i` is killed or stopped; send it nothing new.
    pub down: Arc<Vec<AtomicBool>>,
    pub stop: Arc<AtomicBool>,
}

impl Switches {
    pub fn new(replicas: usize) -> Switches {
        Switches {
            down: Arc::new((0..replicas).map(|_| AtomicBool::new(false)).collect()),
            stop: Arc::new(AtomicBool::new(false)),
        }
    }

    pub fn set_down(&self, i: usize, down: bool) {
        if let Some(d) = self.down.get(i) {
            d.store(down, Ordering::SeqCst);
        }
    }
}

/// The wall clock now, epoch ms (the harness's own clock: no fault touches it).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Start `workers` clients; each returns its attempts once `switches.stop` is set.
pub fn start(
    seed: u64,
    workers: u64,
    addrs: Vec<SocketAddr>,
    switches: &Switches,
) -> Vec<tokio::task::JoinHandle<Vec<Attempt>>> {
    (0..workers)
        .map(|w| {
            let addrs = addrs.clone();
            let switches = switches.clone();
            tokio::spawn(worker(Rng::fork(seed, 100 + w), w, addrs, switches))
        })
        .collect()
}

async fn worker(mut rng: Rng, w: u64, addrs: Vec<SocketAddr>, sw: Switches) -> Vec<Attempt> {
    let mut out = Vec::new();
    let mut sent: Vec<(String, &'static str)> = Vec::new();
    let mut n = 0u64;
    while !sw.stop.load(Ordering::SeqCst) {
        // The draws come first, whatever is up, so a replay draws the same sequence.
        let first = rng.range(0, addrs.len() as u64 - 1) as usize;
        let class: &'static str = if rng.chance(50) { "closed" } else { "open" };
        let retry = rng.chance(20);
        let reuse = rng.next_u64();
        let deadline_ms = rng.range(800, 3000);
        let pause = rng.range(0, 150);
        let live = (0..addrs.len())
            .map(|k| (first + k) % addrs.len())
            .find(|&i| !sw.down[i].load(Ordering::SeqCst));
        let Some(replica) = live else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (key, class) = match (retry, sent.len()) {
            (true, len) if len > 0 => sent[(reuse % len as u64) as usize].clone(),
            _ => {
                n += 1;
                let key = format!("w{w}-{n}-{class}");
                sent.push((key.clone(), class));
                (key, class)
            }
        };
        let deadline = deadline_ms.to_string();
        let sent_unix_ms = unix_ms();
        let t0 = Instant::now();
        let headers = [
            ("x-deadline-ms", deadline.as_str()),
            ("x-stub-request-id", key.as_str()),
        ];
        let r = post_chat(addrs[replica], &key, class, &headers).await;
        let took_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
        let (status, reason, error) = match r {
            Ok(r) => (Some(r.status), r.reason().to_owned(), String::new()),
            Err(e) => (None, String::new(), e.to_string()),
        };
        out.push(Attempt {
            key,
            class,
            replica,
            deadline_ms,
            sent_unix_ms,
            took_ms,
            status,
            reason,
            error,
        });
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    out
}
