//! One heartbeat's round trip to Redis: the script the lease thread runs ([`BEAT`]), the keys
//! and arguments it sends, the answer it reads back, and the connection it goes over. What
//! the thread makes of the answer is in `lease.rs`.

use super::Cluster;
use std::time::Duration;

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
pub(super) struct Beat {
    pub(super) holder: String,
    pub(super) epoch: u64,
    pub(super) secret: String,
    pub(super) members: Vec<(String, u64)>,
    pub(super) flags: String,
    pub(super) flags_version: u64,
    pub(super) incarnation: String,
    pub(super) wait_ms: u64,
    /// Renewals and takes of the lease so far: it only goes up unless Redis went back in time.
    pub(super) seq: u64,
    /// Redis's clock (the registry's scores are on it).
    pub(super) redis_now_ms: u64,
}

/// The owner a member's holds carry: `id|token` (see `Cluster::owner`).
pub(super) fn member_owner(m: &str) -> String {
    let id = m.split('|').next().unwrap_or_default();
    let token = m.rsplit('|').next().unwrap_or_default();
    format!("{id}|{token}")
}

/// A registry member or lease value, `id|url|token`: (id, url).
pub(super) fn split_member(m: &str) -> (String, String) {
    let (id, rest) = m.split_once('|').unwrap_or((m, ""));
    let url = rest.rsplit_once('|').map_or(rest, |(url, _)| url);
    (id.to_string(), url.to_string())
}

fn random_hex() -> String {
    crate::support::tenant::key_hex(&crate::support::tenant::random_key())
}

/// The script's answer, in its order (see [`BEAT`]).
type Reply = (
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
);

impl Beat {
    /// Read the script's answer.
    fn parse(v: &redis::Value) -> redis::RedisResult<Beat> {
        let (holder, epoch, secret, flat, flags, flags_version, incarnation, wait, seq, rnow) =
            redis::from_redis_value::<Reply>(v)?;
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
}

/// The lease thread's connection to Redis, opened on first use and after every failure.
pub(super) struct Conn {
    client: redis::Client,
    conn: Option<redis::Connection>,
    timeout: Duration,
}

impl Conn {
    /// Not connected yet: the first call connects, with `timeout` on every step.
    pub(super) fn new(client: redis::Client, timeout: Duration) -> Conn {
        Conn {
            client,
            conn: None,
            timeout,
        }
    }

    /// Run one heartbeat ([`BEAT`]) with `keys` and `args`.
    pub(super) fn call(&mut self, keys: &[String], args: [String; 8]) -> redis::RedisResult<Beat> {
        let mut conn = match self.conn.take() {
            Some(c) => c,
            None => self.connect()?,
        };
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(BEAT).arg(keys.len());
        for k in keys {
            cmd.arg(k);
        }
        for a in args {
            cmd.arg(a);
        }
        let reply = cmd
            .query::<redis::Value>(&mut conn)
            .and_then(|v| Beat::parse(&v));
        // Kept only after a good answer: a timed-out connection may deliver the late answer
        // to the next call, so after any error the next call starts again on a fresh one.
        if reply.is_ok() {
            self.conn = Some(conn);
        }
        reply
    }

    /// A new connection, with Redis's timeout on connecting, reading and writing.
    fn connect(&self) -> redis::RedisResult<redis::Connection> {
        let c = self.client.get_connection_with_timeout(self.timeout)?;
        c.set_read_timeout(Some(self.timeout))?;
        c.set_write_timeout(Some(self.timeout))?;
        Ok(c)
    }
}

/// What the lease thread knows for its whole life: who it is in Redis and under which keys.
pub(super) struct Identity {
    /// This process as the lease and the registry name it: `id|url|token`.
    pub(super) me: String,
    /// The heartbeat's KEYS (see [`BEAT`]).
    pub(super) keys: Vec<String>,
    /// Offered as the cluster's secret; Redis keeps the first one offered.
    secret_candidate: String,
}

impl Identity {
    pub(super) fn of(cluster: &Cluster) -> Identity {
        // `id|url|token`: the token is the one in this process's holds' owner (`id|token`).
        let token = cluster
            .owner
            .rsplit('|')
            .next()
            .unwrap_or_default()
            .to_string();
        let keys = [
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
        Identity {
            me: format!("{}|{}|{token}", cluster.replica_id, cluster.advertise),
            keys,
            secret_candidate: random_hex(),
        }
    }

    /// The heartbeat's ARGV (see [`BEAT`]).
    pub(super) fn args(&self, ttl: u64, mode: &str, flags_out: Option<String>) -> [String; 8] {
        [
            self.me.clone(),
            ttl.to_string(),
            crate::support::clock::epoch_ms().to_string(),
            ttl.saturating_mul(3).to_string(),
            self.secret_candidate.clone(),
            mode.to_string(),
            flags_out.unwrap_or_default(),
            // Fresh each time: after Redis lost its data, the first heartbeat to reach it
            // sets a value no replica has seen before.
            random_hex(),
        ]
    }
}
