//! The faults of a run (the "nemesis", as Jepsen calls it): a schedule drawn from the seed
//! before the run starts, then applied one fault at a time, each undone before the next.
//! Which replica "the leader" is gets resolved when the fault starts (that depends on the
//! run, not on the seed); everything else (kinds, order, durations, amounts) is the seed's.

use super::checker::Fault;
use super::load::{unix_ms, Switches};
use super::rng::Rng;
use crate::common::proxy::{Mode, Proxy};
use crate::common::{signal, stats, Cluster, Res};
use std::path::PathBuf;
use std::time::Duration;

/// What a fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    ReplicaKill,
    RedisKillAof,
    RedisKillEmpty,
    LeaderStop,
    ProxyDelay,
    ProxyReset,
    ProxyBlackhole,
    ClockStepReplica,
    ClockStepRedis,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::ReplicaKill => "replica_kill9_restart",
            Kind::RedisKillAof => "redis_kill9_restart_aof",
            Kind::RedisKillEmpty => "redis_kill9_restart_empty",
            Kind::LeaderStop => "leader_sigstop_past_lease",
            Kind::ProxyDelay => "proxy_delay",
            Kind::ProxyReset => "proxy_reset",
            Kind::ProxyBlackhole => "proxy_blackhole",
            Kind::ClockStepReplica => "clock_step_replica",
            Kind::ClockStepRedis => "clock_step_redis",
        }
    }

    const ALL: [Kind; 9] = [
        Kind::ReplicaKill,
        Kind::RedisKillAof,
        Kind::RedisKillEmpty,
        Kind::LeaderStop,
        Kind::ProxyDelay,
        Kind::ProxyReset,
        Kind::ProxyBlackhole,
        Kind::ClockStepReplica,
        Kind::ClockStepRedis,
    ];
}

/// One fault of the schedule.
#[derive(Clone, Debug)]
pub struct Planned {
    pub kind: Kind,
    /// Quiet time before it.
    pub gap_ms: u64,
    /// How long it lasts (a process down, a proxy slowed, a clock off).
    pub hold_ms: u64,
    /// The leader (true) or replica `pick % 3`.
    pub at_leader: bool,
    pub pick: usize,
    /// Proxy delay in ms, or clock step in seconds (signed).
    pub amount: i64,
}

/// Which wall clocks a run can step (libfaketime found; Redis runs under it).
#[derive(Clone, Copy, Debug)]
pub struct Clocks {
    pub replica: bool,
    pub redis: bool,
}

/// The whole schedule of a run of `run_ms`, from `seed`; the clock steps `clocks` cannot make
/// are left out.
pub fn plan(seed: u64, run_ms: u64, ttl_ms: u64, clocks: Clocks) -> Vec<Planned> {
    let mut rng = Rng::fork(seed, 1);
    let kinds: Vec<Kind> = Kind::ALL
        .into_iter()
        .filter(|k| clocks.replica || *k != Kind::ClockStepReplica)
        .filter(|k| clocks.redis || *k != Kind::ClockStepRedis)
        .collect();
    let mut out = Vec::new();
    let mut total = 0;
    loop {
        let Some(&kind) = rng.pick(&kinds) else {
            return out;
        };
        let gap_ms = rng.range(300, 1500);
        let hold_ms = match kind {
            Kind::LeaderStop => rng.range(ttl_ms * 3 / 2, ttl_ms * 3),
            Kind::ReplicaKill | Kind::RedisKillAof | Kind::RedisKillEmpty => rng.range(0, 1500),
            Kind::ProxyReset => 0,
            _ => rng.range(1000, 3000),
        };
        let at_leader = rng.chance(50);
        let pick = rng.range(0, 2) as usize;
        let size = rng.range(2, 60) as i64;
        let amount = match kind {
            Kind::ProxyDelay => rng.range(50, 400) as i64,
            _ if rng.chance(50) => size,
            _ => -size,
        };
        total += gap_ms + hold_ms;
        if total > run_ms {
            return out;
        }
        out.push(Planned {
            kind,
            gap_ms,
            hold_ms,
            at_leader,
            pick,
            amount,
        });
    }
}

/// A libfaketime control file: the offset it holds is the process's wall clock's, read again
/// at most every second (`FAKETIME_CACHE_DURATION=1`); the monotonic clock is left alone.
pub struct Clock {
    file: PathBuf,
}

impl Clock {
    /// A clock at `+0` and the environment that puts a process under it.
    pub fn new(lib: &std::path::Path, file: PathBuf) -> Res<(Clock, Vec<(String, String)>)> {
        let clock = Clock { file };
        clock.set(0)?;
        let env = vec![
            ("LD_PRELOAD".to_owned(), lib.display().to_string()),
            (
                "FAKETIME_TIMESTAMP_FILE".to_owned(),
                clock.file.display().to_string(),
            ),
            ("FAKETIME_CACHE_DURATION".to_owned(), "1".to_owned()),
            ("DONT_FAKE_MONOTONIC".to_owned(), "1".to_owned()),
        ];
        Ok((clock, env))
    }

    /// Step the wall clock to `offset_s` seconds off the real one.
    pub fn set(&self, offset_s: i64) -> Res {
        std::fs::write(&self.file, format!("{offset_s:+}s\n"))?;
        Ok(())
    }
}

/// What the nemesis acts on.
pub struct Targets<'a> {
    pub cluster: &'a mut Cluster,
    pub proxies: &'a [Proxy],
    pub switches: &'a Switches,
    /// The clock of replica [`CLOCK_REPLICA`], when libfaketime is there.
    pub replica_clock: Option<Clock>,
    /// Redis's clock, when Redis runs under libfaketime.
    pub redis_clock: Option<Clock>,
}

/// The replica that runs under libfaketime.
pub const CLOCK_REPLICA: usize = 2;

impl Targets<'_> {
    /// The replica that says it leads (those up only, each asked for at most 500 ms).
    pub async fn leader(&self) -> Option<usize> {
        for (i, r) in self.cluster.replicas.iter().enumerate() {
            if self.switches.down[i].load(std::sync::atomic::Ordering::SeqCst) {
                continue;
            }
            let view = tokio::time::timeout(Duration::from_millis(500), stats(r.addr)).await;
            if let Ok(Ok(v)) = view {
                if v["cluster"]["role"] == "leader" {
                    return Some(i);
                }
            }
        }
        None
    }

    /// Apply `p`, wait out its hold, undo it; returns what was done, for the report.
    pub async fn apply(&mut self, p: &Planned) -> Res<Fault> {
        let target = match (p.at_leader, self.leader().await) {
            (true, Some(l)) => l,
            _ => p.pick % self.cluster.replicas.len(),
        };
        let hold = Duration::from_millis(p.hold_ms);
        let start_unix_ms = unix_ms();
        let (what, replica_down) = match p.kind {
            Kind::ReplicaKill => {
                self.switches.set_down(target, true);
                self.cluster.replicas[target].proc.kill9();
                tokio::time::sleep(hold).await;
                tokio::task::block_in_place(|| self.cluster.replicas[target].kill9_and_restart())?;
                self.switches.set_down(target, false);
                (format!("r{target}"), Some(target))
            }
            Kind::RedisKillAof | Kind::RedisKillEmpty => {
                self.cluster.redis.stop();
                tokio::time::sleep(hold).await;
                let redis = &mut self.cluster.redis;
                if p.kind == Kind::RedisKillAof {
                    tokio::task::block_in_place(|| redis.restart())?;
                } else {
                    tokio::task::block_in_place(|| redis.restart_empty())?;
                }
                ("redis".to_owned(), None)
            }
            Kind::LeaderStop => {
                let pid = self.cluster.replicas[target].proc.pid();
                self.switches.set_down(target, true);
                signal(pid, "STOP")?;
                tokio::time::sleep(hold).await;
                signal(pid, "CONT")?;
                self.switches.set_down(target, false);
                (format!("r{target}"), Some(target))
            }
            Kind::ProxyDelay => {
                let d = Duration::from_millis(p.amount.unsigned_abs());
                self.proxies[target].set(Mode::Delay(d));
                tokio::time::sleep(hold).await;
                self.proxies[target].set(Mode::Pass);
                (format!("proxy r{target} {} ms", p.amount), None)
            }
            Kind::ProxyReset => {
                self.proxies[target].reset_connections();
                (format!("proxy r{target}"), None)
            }
            Kind::ProxyBlackhole => {
                self.proxies[target].set(Mode::Blackhole);
                tokio::time::sleep(hold).await;
                self.proxies[target].set(Mode::Pass);
                // A connection blackholed mid-reply would stay out of step: start afresh.
                self.proxies[target].reset_connections();
                (format!("proxy r{target}"), None)
            }
            Kind::ClockStepReplica | Kind::ClockStepRedis => {
                let (clock, name) = if p.kind == Kind::ClockStepReplica {
                    (&self.replica_clock, format!("r{CLOCK_REPLICA}"))
                } else {
                    (&self.redis_clock, "redis".to_owned())
                };
                let Some(clock) = clock else {
                    return Err(format!("a step of {name}'s clock was planned without one").into());
                };
                clock.set(p.amount)?;
                tokio::time::sleep(hold).await;
                clock.set(0)?;
                (format!("{name} {:+} s", p.amount), None)
            }
        };
        Ok(Fault {
            kind: p.kind.as_str(),
            target: what,
            replica_down,
            start_unix_ms,
            end_unix_ms: unix_ms(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_one_schedule_that_fits_the_run() {
        let all = Clocks {
            replica: true,
            redis: true,
        };
        let a = plan(11, 60_000, 1000, all);
        let b = plan(11, 60_000, 1000, all);
        let show = |p: &[Planned]| format!("{p:?}");
        assert_eq!(show(&a), show(&b));
        assert_ne!(show(&a), show(&plan(12, 60_000, 1000, all)));
        let total: u64 = a.iter().map(|p| p.gap_ms + p.hold_ms).sum();
        assert!(
            total <= 60_000 && a.len() > 10,
            "{total} ms, {} faults",
            a.len()
        );
        for p in &a {
            if p.kind == Kind::LeaderStop {
                assert!(p.hold_ms > 1000, "stopped past its lease: {p:?}");
            }
        }
        let replica_only = Clocks {
            replica: true,
            redis: false,
        };
        let kinds: Vec<Kind> = plan(11, 600_000, 1000, replica_only)
            .iter()
            .map(|p| p.kind)
            .collect();
        assert!(kinds.contains(&Kind::ClockStepReplica));
        assert!(!kinds.contains(&Kind::ClockStepRedis));
    }
}
