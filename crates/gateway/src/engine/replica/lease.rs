//! The lease thread: every third of `lease_ttl_ms` one Lua script, one round trip, checks this
//! replica in to the registry, takes the gate's lease if nobody holds it (or renews it if this
//! replica does), and reads back the holder, the lease's epoch, the cluster's secret and the
//! replicas seen. A blocking Redis client on its own thread keeps all of this off the request
//! path: requests only read the view it leaves (`Cluster::route`).
//!
//! Safety of the lease: the leader counts its lease from *before* it sent the renewal, and
//! gives it up a tenth of the TTL early, so it stops deciding before Redis lets the key
//! expire and any other replica can take it. Redis keeps, beside the lease, the time (its own
//! clock) until which the last lease holds: a replica that finds the lease free earlier than
//! that (the key vanished: a failover to a replica that had not seen it, an eviction, a
//! `DEL`) waits until then before deciding, and one that finds no record of any lease at all
//! (Redis came back empty, or a new cluster) waits a whole TTL. A lease given up on purpose
//! (shutdown) is free at once. A replica that takes the lease loads the shared ledger before
//! it decides anything ([`slackgate_core::Gate::adopt_ledger`]).
//!
//! The lease's value names the replica, its URL and a random token per process, so two
//! processes given the same `replica_id` never both count as its holder.

use super::{lock, Cluster, Leader, Replica};
use crate::engine::state::Shared;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// One heartbeat. KEYS: lease, epoch, registry, secret, flags, flags version, lease
/// deadline, incarnation, lease sequence. ARGV: me (`id|url|token`), ttl ms, this replica's clock (ms; informational:
/// the registry is kept on Redis's clock), how long a replica stays in the registry without checking in (ms), a
/// secret candidate, `take` | `yield` (give the lease up, stay registered) | `release` (give
/// it up and leave), flags to publish (JSON; empty: none), an incarnation candidate.
/// Returns the holder, the epoch, the secret, the registry, the flags and their version, the
/// incarnation (a new one means Redis lost its data), and how long a lease just taken must be
/// waited out (ms).
const BEAT: &str = r"
if ARGV[7] ~= '' then
  redis.call('SET', KEYS[5], ARGV[7])
  redis.call('INCR', KEYS[6])
end
redis.call('SET', KEYS[4], ARGV[5], 'NX')
local secret = redis.call('GET', KEYS[4])
redis.call('SET', KEYS[8], ARGV[8], 'NX')
local incarnation = redis.call('GET', KEYS[8])
local stale = tonumber(ARGV[4])
local ttl = tonumber(ARGV[2])
local t = redis.call('TIME')
local rnow = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[3], rnow, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', rnow - stale)
local cur = redis.call('GET', KEYS[1])
local wait = 0
if ARGV[6] == 'release' or ARGV[6] == 'yield' then
  if cur == ARGV[1] then
    redis.call('DEL', KEYS[1])
    redis.call('SET', KEYS[7], rnow)
    cur = false
  end
  if ARGV[6] == 'release' then
    redis.call('ZREM', KEYS[3], ARGV[1])
  end
elseif not cur then
  local deadline = tonumber(redis.call('GET', KEYS[7]) or '')
  if deadline and deadline > rnow then
    wait = deadline - rnow
  elseif not redis.call('GET', KEYS[2]) then
    wait = ttl
  end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
  redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[7], rnow + ttl)
  redis.call('INCR', KEYS[9])
  cur = ARGV[1]
elseif cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('SET', KEYS[7], rnow + ttl)
  redis.call('INCR', KEYS[9])
end
local seq = redis.call('GET', KEYS[9]) or '0'
local epoch = redis.call('GET', KEYS[2]) or '0'
local members = redis.call('ZRANGEBYSCORE', KEYS[3], rnow - stale, '+inf', 'WITHSCORES')
local flags = redis.call('GET', KEYS[5]) or ''
local flags_version = redis.call('GET', KEYS[6]) or '0'
return {cur or '', epoch, secret, members, flags, flags_version, incarnation, tostring(wait),
  seq, tostring(rnow)}
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
    incarnation: String,
    wait_ms: u64,
    /// Renewals and takes of the lease so far: it only goes up unless Redis went back in time.
    seq: u64,
    /// Redis's clock (the registry's scores are on it).
    redis_now_ms: u64,
}

/// The owner a member's holds carry: `id|token` (see `Cluster::owner`).
fn member_owner(m: &str) -> String {
    let id = m.split('|').next().unwrap_or_default();
    let token = m.rsplit('|').next().unwrap_or_default();
    format!("{id}|{token}")
}

/// A registry member or lease value, `id|url|token`: (id, url).
fn split_member(m: &str) -> (String, String) {
    let (id, rest) = m.split_once('|').unwrap_or((m, ""));
    let url = rest.rsplit_once('|').map_or(rest, |(url, _)| url);
    (id.to_string(), url.to_string())
}

fn random_hex() -> String {
    crate::support::tenant::key_hex(&crate::support::tenant::random_key())
}

struct Conn {
    client: redis::Client,
    conn: Option<redis::Connection>,
    timeout: Duration,
}

impl Conn {
    fn call(&mut self, keys: &[String], args: [String; 8]) -> Result<Beat, String> {
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
        let r: Result<redis::Value, _> = cmd.query(conn);
        let reply = r.and_then(|v| {
            redis::from_redis_value::<(
                String,
                String,
                String,
                Vec<String>,
                String,
                String,
                String,
                String,
                String,
                String,
            )>(&v)
        });
        match reply {
            Ok((
                holder,
                epoch,
                secret,
                flat,
                flags,
                flags_version,
                incarnation,
                wait,
                seq,
                rnow,
            )) => {
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
                    incarnation,
                    wait_ms: wait.parse().unwrap_or(0),
                    seq: seq.parse().unwrap_or(0),
                    redis_now_ms: rnow.parse().unwrap_or(0),
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

/// What the lease thread remembers between heartbeats.
#[derive(Default)]
struct Lease {
    /// This replica leads (it took the lease and adopted the ledger).
    leading: bool,
    /// A lease just taken is waited out until then before this replica decides.
    standby_until: Option<Instant>,
    /// The ledger could not be loaded: give the lease up at the next heartbeat.
    yield_next: bool,
    /// The incarnation of Redis's data last seen (a new one: Redis lost its data).
    incarnation: Option<String>,
    /// Redis lost its data (came back empty, or went back in time: restored from a
    /// snapshot) since this replica last adopted the ledger, and when that was seen.
    lost_data: bool,
    lost_at: Option<Instant>,
    /// The highest lease sequence seen (renewals and takes): one below it means Redis went
    /// back in time.
    max_seq: u64,
    /// Whether Redis answered the last heartbeat (events on a change only).
    redis_up: Option<bool>,
    /// A duplicate replica id was reported.
    duplicate_reported: bool,
    beats: u64,
}

fn run(shared: Weak<Shared>, cluster: Arc<Cluster>, client: redis::Client) {
    let ttl = cluster.cfg.lease_ttl_ms;
    let timeout = Duration::from_millis(cluster.cfg.redis_timeout_ms);
    let mut conn = Conn {
        client,
        conn: None,
        timeout,
    };
    // `id|url|token`: the token is the one in this process's holds' owner (`id|token`).
    let token = cluster
        .owner
        .rsplit('|')
        .next()
        .unwrap_or_default()
        .to_string();
    let me = format!("{}|{}|{token}", cluster.replica_id, cluster.advertise);
    let keys: Vec<String> = [
        "lease",
        "lease_epoch",
        "replicas",
        "secret",
        "flags",
        "flags_version",
        "lease_deadline",
        "incarnation",
        "lease_seq",
    ]
    .iter()
    .map(|k| format!("{}:{k}", cluster.prefix))
    .collect();
    let secret_candidate = random_hex();
    let mut st = Lease::default();
    loop {
        let stopping = cluster.stopping.load(Ordering::SeqCst);
        let Some(gate) = shared.upgrade() else {
            return;
        };
        let flags_out = lock(&cluster.view).flags_out.clone();
        let sent = Instant::now();
        let now_ms = crate::support::clock::epoch_ms();
        let mode = if stopping {
            "release"
        } else if st.yield_next {
            "yield"
        } else {
            "take"
        };
        let args = [
            me.clone(),
            ttl.to_string(),
            now_ms.to_string(),
            ttl.saturating_mul(3).to_string(),
            secret_candidate.clone(),
            mode.to_string(),
            flags_out.clone().unwrap_or_default(),
            // Fresh each time: after Redis lost its data, the first heartbeat to reach it
            // sets a value no replica has seen before.
            random_hex(),
        ];
        match conn.call(&keys, args) {
            Ok(beat) => beat_ok(
                &gate,
                &cluster,
                &mut st,
                &me,
                beat,
                sent,
                flags_out.as_ref(),
            ),
            Err(e) => beat_failed(&gate, &cluster, &mut st, &e, sent),
        }
        gate.set_share(cluster.share_parts());
        if stopping {
            return;
        }
        drop(gate);
        // Sleep a third of the TTL, or until woken (a failed forward, flags to publish,
        // shutdown); a leader wakes when its lease runs out (to give its slots up at once),
        // a replica waiting a lease out when the wait ends.
        let mut wait = Duration::from_millis(ttl / 3);
        let now = Instant::now();
        let wake_at = {
            let view = lock(&cluster.view);
            [view.lead_until, st.standby_until]
                .into_iter()
                .flatten()
                .filter(|t| *t > now)
                .min()
        };
        if let Some(t) = wake_at {
            wait = wait.min(t.duration_since(now) + Duration::from_millis(1));
        }
        let (m, cv) = &cluster.wake;
        let mut woken = lock(m);
        if !*woken {
            woken = cv
                .wait_timeout(woken, wait)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        *woken = false;
    }
}

#[allow(clippy::too_many_arguments)]
fn beat_ok(
    gate: &Shared,
    cluster: &Cluster,
    st: &mut Lease,
    me: &str,
    beat: Beat,
    sent: Instant,
    flags_out: Option<&String>,
) {
    let ttl = cluster.cfg.lease_ttl_ms;
    // Flags: ours are in Redis now (unless set again meanwhile); another replica's newer
    // ones apply here.
    let apply = {
        let mut view = lock(&cluster.view);
        if view.flags_out.as_ref() == flags_out {
            view.flags_out = None;
        }
        let newer = beat.flags_version != view.flags_version;
        view.flags_version = beat.flags_version;
        (newer && !beat.flags.is_empty() && flags_out.is_none())
            .then(|| serde_json::from_str::<crate::engine::controls::Overrides>(&beat.flags).ok())
            .flatten()
    };
    if let Some(o) = apply {
        gate.apply_cluster_overrides(&o);
    }
    if st.redis_up != Some(true) {
        gate.cluster_event("redis_up", None);
    }
    st.redis_up = Some(true);
    let emptied = st
        .incarnation
        .as_ref()
        .is_some_and(|seen| *seen != beat.incarnation);
    let rolled_back = beat.seq < st.max_seq;
    if emptied || rolled_back {
        st.lost_data = true;
        st.lost_at = Some(Instant::now());
        // Every replica writes back the holds it placed (a leader, below, everything it
        // knows), so that settled keys still answer duplicates whoever leads next.
        let n = gate.republish_own_records();
        let what = if emptied {
            "came back without its data"
        } else {
            "went back in time (restored from a snapshot)"
        };
        gate.cluster_event(
            "redis_data_lost",
            Some(format!(
                "Redis {what}: {n} records this replica placed written back"
            )),
        );
    }
    st.incarnation = Some(beat.incarnation.clone());
    st.max_seq = if rolled_back {
        beat.seq
    } else {
        st.max_seq.max(beat.seq)
    };
    // A replica that does not lead forgets the loss once the next leader had time to write
    // back what it knows: a much later takeover must not write back a stale copy.
    if !st.leading
        && st
            .lost_at
            .is_some_and(|t| t.elapsed() > Duration::from_millis(ttl.saturating_mul(3)))
    {
        st.lost_data = false;
        st.lost_at = None;
    }
    st.yield_next = false;
    // The other replicas that checked in within a TTL: still running, so their proxied holds
    // are theirs to settle. A dead leader has not: its lease had to lapse (a TTL without a
    // renewal) before this one could be taken.
    // Processes, not replica ids: a restarted pod keeps its name, and its dead predecessor's
    // holds must expire. Ages on Redis's clock (the registry's scores are on it).
    let recent: Vec<&String> = beat
        .members
        .iter()
        .filter(|(m, seen)| m != me && beat.redis_now_ms.saturating_sub(*seen) < ttl)
        .map(|(m, _)| m)
        .collect();
    let alive: std::collections::HashSet<String> = recent.iter().map(|m| member_owner(m)).collect();
    if !st.duplicate_reported
        && recent
            .iter()
            .any(|m| split_member(m).0 == cluster.replica_id)
    {
        st.duplicate_reported = true;
        gate.cluster_event(
            "duplicate_replica_id",
            Some(format!(
                "another process checks in as {:?}: give every replica its own cluster.replica_id",
                cluster.replica_id
            )),
        );
    }
    let mine = beat.holder == me;
    if !mine {
        st.standby_until = None;
    } else if !st.leading && st.standby_until.is_none() {
        // Counted from the answer (Redis measured the wait when it ran the script, at most
        // this long ago); a Redis that lost its data may have lost the deadline too: a TTL.
        let wait = if st.lost_data {
            beat.wait_ms.max(ttl)
        } else {
            beat.wait_ms
        };
        st.standby_until = Some(Instant::now() + Duration::from_millis(wait));
    }
    let waited = st.standby_until.is_some_and(|t| t <= Instant::now());
    if mine && !st.leading && waited {
        st.standby_until = None;
        // Take over the shared ledger before deciding anything as leader.
        match gate.adopt_shared_ledger(&alive, st.lost_data) {
            Ok(n) => {
                st.leading = true;
                st.lost_data = false;
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
                // Holding the lease without leading would leave the cluster with no leader:
                // give it up at once (another replica, or this one again, takes it next).
                st.yield_next = true;
                cluster.wake_lease();
                gate.cluster_event(
                    "leader_adopt_failed",
                    Some(format!("cannot load the shared ledger: {e}")),
                );
            }
        }
    } else if mine && st.leading && st.lost_data {
        // Redis came back empty under this leader: write back the ledger it knows, so that
        // the next leader finds it there.
        match gate.adopt_shared_ledger(&alive, true) {
            Ok(_) => st.lost_data = false,
            Err(e) => gate.cluster_event(
                "leader_adopt_failed",
                Some(format!("cannot write the ledger back to Redis: {e}")),
            ),
        }
    } else if mine && st.leading {
        // About once a TTL: holds of replicas that stopped checking in expire.
        st.beats += 1;
        if st.beats.is_multiple_of(3) {
            let n = gate.expire_orphans(&alive);
            if n > 0 {
                gate.cluster_event(
                    "orphans_expired",
                    Some(format!(
                        "{n} proxied holds of replicas no longer checking in expired"
                    )),
                );
            }
        }
    } else if !mine && st.leading {
        st.leading = false;
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
    view.last_attempt = Some(sent);
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
    // Counted from before the renewal was sent, a tenth early: this replica stops deciding
    // before Redis can hand the lease to another.
    view.lead_until = (st.leading && mine).then(|| sent + Duration::from_millis(ttl - ttl / 10));
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
                seen_ms_ago: beat.redis_now_ms.saturating_sub(*seen),
            }
        })
        .collect();
}

fn beat_failed(gate: &Shared, cluster: &Cluster, st: &mut Lease, e: &str, sent: Instant) {
    cluster
        .counters
        .redis_errors
        .fetch_add(1, Ordering::Relaxed);
    let reason = format!("{}: {e}", crate::ledger_store::redact(&cluster.cfg.redis));
    if st.redis_up != Some(false) {
        gate.cluster_event("redis_down", Some(reason.clone()));
    }
    st.redis_up = Some(false);
    let mut view = lock(&cluster.view);
    view.redis_up = false;
    view.last_attempt = Some(sent);
    view.last_error = Some(reason);
    if st.leading && view.lead_until.is_none_or(|t| t <= Instant::now()) {
        st.leading = false;
        view.lead_until = None;
        drop(view);
        cluster.counters.leader_lost.fetch_add(1, Ordering::Relaxed);
        gate.cluster_event(
            "leader_lost",
            Some("the lease could not be renewed in time (Redis out of reach)".into()),
        );
    }
}
