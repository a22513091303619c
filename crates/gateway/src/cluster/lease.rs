//! The lease thread: every third of `lease_ttl_ms` one Lua script, one round trip, checks this
//! replica in to the registry, takes the gate's lease if nobody holds it (or renews it if this
//! replica does), and reads back the holder, the lease's epoch, the cluster's secret and the
//! replicas seen. A blocking Redis client on its own thread keeps all of this off the request
//! path: requests only read the view it leaves (`Cluster::route`).
//!
//! Safety of the lease: the leader counts its lease from *before* it sent the renewal, and
//! gives it up a tenth of the TTL early, so it stops deciding before Redis lets the key
//! expire and any other replica can take it. A replica that takes the lease loads the shared
//! ledger before it decides anything ([`slackgate_core::Gate::adopt_ledger`]).

use super::{lock, Cluster, Leader, Replica};
use crate::state::Shared;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// What went wrong talking to Redis (kept for `/stats`; the password never appears).
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Redis refused, timed out or answered something unexpected.
    #[error("redis {url}: {reason}")]
    Redis {
        /// The URL without its password.
        url: String,
        /// What happened.
        reason: String,
    },
}

/// One heartbeat. KEYS: lease, epoch, registry, secret, flags, flags version. ARGV: me
/// (`id|url`), ttl ms, now ms, how long a replica stays in the registry without checking in
/// (ms), a secret candidate, `take` | `yield` (give the lease up, stay registered) |
/// `release` (give it up and leave), flags to publish (JSON; empty: none).
const BEAT: &str = r"
if ARGV[7] ~= '' then
  redis.call('SET', KEYS[5], ARGV[7])
  redis.call('INCR', KEYS[6])
end
redis.call('SET', KEYS[4], ARGV[5], 'NX')
local secret = redis.call('GET', KEYS[4])
local now = tonumber(ARGV[3])
local stale = tonumber(ARGV[4])
redis.call('ZADD', KEYS[3], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - stale)
local cur = redis.call('GET', KEYS[1])
if ARGV[6] == 'release' then
  if cur == ARGV[1] then
    redis.call('DEL', KEYS[1])
    cur = false
  end
  redis.call('ZREM', KEYS[3], ARGV[1])
elseif ARGV[6] == 'yield' then
  if cur == ARGV[1] then
    redis.call('DEL', KEYS[1])
    cur = false
  end
elseif not cur then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('INCR', KEYS[2])
  cur = ARGV[1]
elseif cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
local epoch = redis.call('GET', KEYS[2]) or '0'
local members = redis.call('ZRANGEBYSCORE', KEYS[3], now - stale, '+inf', 'WITHSCORES')
local flags = redis.call('GET', KEYS[5]) or ''
local flags_version = redis.call('GET', KEYS[6]) or '0'
return {cur or '', epoch, secret, members, flags, flags_version}
";

/// What one heartbeat read back.
#[derive(Debug)]
struct Beat {
    holder: String,
    epoch: u64,
    secret: String,
    members: Vec<(String, u64)>,
    flags: String,
    flags_version: u64,
}

fn split_member(m: &str) -> (String, String) {
    match m.split_once('|') {
        Some((id, url)) => (id.to_string(), url.to_string()),
        None => (m.to_string(), String::new()),
    }
}

fn random_hex() -> String {
    use std::hash::{BuildHasher, Hasher};
    // Two SipHash outputs under the process's random keys, mixed with time and pid: only a
    // tie-breaker for the first replica to set the secret, read back by all the others.
    let mut out = String::new();
    for i in 0..2u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(i);
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out
}

struct Conn {
    client: redis::Client,
    conn: Option<redis::Connection>,
    timeout: Duration,
}

impl Conn {
    fn call(&mut self, keys: [&str; 6], args: [String; 7]) -> Result<Beat, String> {
        if self.conn.is_none() {
            let c = self
                .client
                .get_connection_with_timeout(self.timeout)
                .map_err(|e| e.to_string())?;
            c.set_read_timeout(Some(self.timeout))
                .map_err(|e| e.to_string())?;
            c.set_write_timeout(Some(self.timeout))
                .map_err(|e| e.to_string())?;
            self.conn = Some(c);
        }
        let Some(conn) = self.conn.as_mut() else {
            return Err("no connection".into());
        };
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(BEAT).arg(keys.len());
        for k in keys {
            cmd.arg(k);
        }
        for a in args {
            cmd.arg(a);
        }
        type Reply = (String, String, String, Vec<String>, String, String);
        let r: Result<Reply, _> = cmd.query(conn);
        match r {
            Ok((holder, epoch, secret, flat, flags, flags_version)) => {
                let members = flat
                    .chunks(2)
                    .filter_map(|c| match c {
                        [m, score] => Some((m.clone(), score.parse::<f64>().ok()? as u64)),
                        _ => None,
                    })
                    .collect();
                Ok(Beat {
                    holder,
                    epoch: epoch.parse().unwrap_or(0),
                    secret,
                    members,
                    flags,
                    flags_version: flags_version.parse().unwrap_or(0),
                })
            }
            Err(e) => {
                // A timed-out connection may deliver the late answer to the next call: start
                // again on a fresh one.
                self.conn = None;
                Err(e.to_string())
            }
        }
    }
}

/// Start the lease thread for `cluster`, a member of `shared` (held weakly: the thread ends
/// when the gate is dropped or [`Cluster::stop`] is called).
pub fn start(
    shared: &Arc<Shared>,
    cluster: Arc<Cluster>,
) -> Result<std::thread::JoinHandle<()>, String> {
    let client = redis::Client::open(cluster.cfg.redis.as_str()).map_err(|e| {
        format!(
            "cluster.redis {}: {e}",
            crate::ledger_store::redact(&cluster.cfg.redis)
        )
    })?;
    let weak = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name("slackgate-lease".into())
        .spawn(move || run(weak, cluster, client))
        .map_err(|e| format!("cluster: cannot start the lease thread: {e}"))
}

fn run(shared: Weak<Shared>, cluster: Arc<Cluster>, client: redis::Client) {
    let ttl = cluster.cfg.lease_ttl_ms;
    let timeout = Duration::from_millis(cluster.cfg.redis_timeout_ms);
    let mut conn = Conn {
        client,
        conn: None,
        timeout,
    };
    let me = format!("{}|{}", cluster.replica_id, cluster.advertise);
    let keys_owned = [
        format!("{}:lease", cluster.prefix),
        format!("{}:lease_epoch", cluster.prefix),
        format!("{}:replicas", cluster.prefix),
        format!("{}:secret", cluster.prefix),
        format!("{}:flags", cluster.prefix),
        format!("{}:flags_version", cluster.prefix),
    ];
    let secret_candidate = random_hex();
    let mut leading = false;
    let mut redis_was_up: Option<bool> = None;
    // The highest lease epoch seen: one at or below it means Redis lost its data.
    let mut max_epoch: u64 = 0;
    // A lease just taken that must be waited out before deciding (see below).
    let mut standby_until: Option<Instant> = None;
    // The ledger could not be loaded: give the lease up so that another replica can lead.
    let mut yield_next = false;
    loop {
        let stopping = cluster.stopping.load(Ordering::SeqCst);
        let Some(gate) = shared.upgrade() else {
            return;
        };
        let keys = [
            keys_owned[0].as_str(),
            keys_owned[1].as_str(),
            keys_owned[2].as_str(),
            keys_owned[3].as_str(),
            keys_owned[4].as_str(),
            keys_owned[5].as_str(),
        ];
        let flags_out = lock(&cluster.view).flags_out.clone();
        let sent = Instant::now();
        let now_ms = crate::telemetry::epoch_ms();
        let args = [
            me.clone(),
            ttl.to_string(),
            now_ms.to_string(),
            ttl.saturating_mul(3).to_string(),
            secret_candidate.clone(),
            if stopping {
                "release"
            } else if yield_next {
                "yield"
            } else {
                "take"
            }
            .to_string(),
            flags_out.clone().unwrap_or_default(),
        ];
        match conn.call(keys, args) {
            Ok(beat) => {
                // Flags: ours are in Redis now (unless set again meanwhile); another
                // replica's newer ones apply here.
                let apply = {
                    let mut view = lock(&cluster.view);
                    if view.flags_out == flags_out {
                        view.flags_out = None;
                    }
                    let newer = beat.flags_version != view.flags_version;
                    view.flags_version = beat.flags_version;
                    (newer && !beat.flags.is_empty() && flags_out.is_none())
                        .then(|| {
                            serde_json::from_str::<crate::control::Overrides>(&beat.flags).ok()
                        })
                        .flatten()
                };
                if let Some(o) = apply {
                    gate.apply_cluster_overrides(&o);
                }
                if redis_was_up != Some(true) {
                    gate.cluster_event("redis_up", None);
                }
                redis_was_up = Some(true);
                yield_next = false;
                let mine = beat.holder == me;
                if !mine {
                    standby_until = None;
                }
                if mine && !leading && standby_until.is_none() {
                    // A lease at epoch 1, or at one not above an epoch seen before, follows a
                    // Redis that lost its data (or a new cluster): the last leader may still
                    // count its lease as held in its own clock, for up to a TTL. Wait that out
                    // before deciding; an epoch that went up was released or expired in Redis.
                    if beat.epoch <= 1 || beat.epoch <= max_epoch {
                        standby_until = Some(sent + Duration::from_millis(ttl));
                    } else {
                        standby_until = Some(sent);
                    }
                }
                max_epoch = max_epoch.max(beat.epoch);
                let waited = standby_until.is_some_and(|t| t <= Instant::now());
                if mine && !leading && waited {
                    standby_until = None;
                    // Take over the shared ledger before deciding anything as leader.
                    match gate.adopt_shared_ledger() {
                        Ok(n) => {
                            leading = true;
                            cluster
                                .counters
                                .leader_acquired
                                .fetch_add(1, Ordering::Relaxed);
                            gate.cluster_event(
                                "leader_acquired",
                                Some(format!("epoch {}; {n} ledger records adopted", beat.epoch)),
                            );
                        }
                        Err(e) => {
                            // Holding the lease without leading would leave the cluster with
                            // no leader: give it up at once (another replica, or this one
                            // again, takes it at its next heartbeat).
                            yield_next = true;
                            cluster.wake_lease();
                            gate.cluster_event(
                                "leader_adopt_failed",
                                Some(format!("cannot load the shared ledger: {e}")),
                            );
                        }
                    }
                } else if !mine && leading {
                    leading = false;
                    cluster.counters.leader_lost.fetch_add(1, Ordering::Relaxed);
                    gate.cluster_event(
                        "leader_lost",
                        Some(format!(
                            "the lease is held by {:?}",
                            split_member(&beat.holder).0
                        )),
                    );
                }
                let mut view = lock(&cluster.view);
                view.redis_up = true;
                view.last_ok = Some(sent);
                view.last_error = None;
                view.secret = Some(beat.secret.clone());
                view.leader = (!beat.holder.is_empty()).then(|| {
                    let (id, url) = split_member(&beat.holder);
                    Leader {
                        id,
                        url,
                        epoch: beat.epoch,
                    }
                });
                // Counted from before the renewal was sent, a tenth early: this replica stops
                // deciding before Redis can hand the lease to another.
                view.lead_until =
                    (leading && mine).then(|| sent + Duration::from_millis(ttl - ttl / 10));
                if view.lead_until.is_some() {
                    view.leader_suspect_until = None;
                }
                view.replicas = beat
                    .members
                    .iter()
                    .map(|(m, seen)| {
                        let (id, url) = split_member(m);
                        Replica {
                            id,
                            url,
                            seen_ms_ago: now_ms.saturating_sub(*seen),
                        }
                    })
                    .collect();
            }
            Err(e) => {
                cluster
                    .counters
                    .redis_errors
                    .fetch_add(1, Ordering::Relaxed);
                let reason = format!("{}: {e}", crate::ledger_store::redact(&cluster.cfg.redis));
                if redis_was_up != Some(false) {
                    gate.cluster_event("redis_down", Some(reason.clone()));
                }
                redis_was_up = Some(false);
                let mut view = lock(&cluster.view);
                view.redis_up = false;
                view.last_error = Some(reason);
                if leading && view.lead_until.is_none_or(|t| t <= Instant::now()) {
                    leading = false;
                    view.lead_until = None;
                    drop(view);
                    cluster.counters.leader_lost.fetch_add(1, Ordering::Relaxed);
                    gate.cluster_event(
                        "leader_lost",
                        Some("the lease could not be renewed in time (Redis out of reach)".into()),
                    );
                }
            }
        }
        gate.set_share(cluster.share_parts());
        if stopping {
            return;
        }
        drop(gate);
        // Sleep a third of the TTL, or until woken (a failed forward, shutdown). While this
        // replica leads but Redis does not answer, wake up in time to step down promptly.
        let (m, cv) = &cluster.wake;
        let mut woken = lock(m);
        if !*woken {
            let wait = Duration::from_millis(ttl / 3);
            woken = cv
                .wait_timeout(woken, wait)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        *woken = false;
    }
}
