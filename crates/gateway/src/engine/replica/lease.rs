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

use super::beat::{member_owner, split_member, Beat, Conn, Identity};
use super::{lock, Cluster, Leader, Replica};
use crate::engine::state::Shared;
use crate::observe::codes::Event;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Why the lease thread could not start.
#[derive(Debug, thiserror::Error)]
pub enum LeaseStartError {
    /// `cluster.redis` is not a URL the Redis client accepts.
    #[error("cluster.redis {url}: {source}")]
    RedisUrl {
        /// The URL as configured, its password redacted.
        url: String,
        /// What the client said.
        source: redis::RedisError,
    },
    /// The system would not start the thread.
    #[error("cluster: cannot start the lease thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Start the lease thread for `cluster`, a member of `shared` (held weakly: the thread ends
/// when the gate is dropped or [`Cluster::stop`] is called).
pub fn start(
    shared: &Arc<Shared>,
    cluster: Arc<Cluster>,
) -> Result<std::thread::JoinHandle<()>, LeaseStartError> {
    let client = redis::Client::open(cluster.cfg.redis.as_str()).map_err(|source| {
        LeaseStartError::RedisUrl {
            url: crate::ledger_store::redact(&cluster.cfg.redis),
            source,
        }
    })?;
    let weak = Arc::downgrade(shared);
    std::thread::Builder::new()
        .name("slackgate-lease".into())
        .spawn(move || run(weak, cluster, client))
        .map_err(LeaseStartError::Thread)
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
    /// The share last given to the gate (set again only when it changes: the lease thread
    /// must not wait for the core's lock while a takeover's adoption holds it).
    share: Option<u32>,
    /// The lease epoch this replica leads under (while `leading`).
    epoch: u64,
    /// The shared ledger being read for a takeover (on its own thread, while this one goes
    /// on renewing the lease).
    adopting: Option<Loading>,
    beats: u64,
}

/// A takeover's adoption of the shared ledger: the records adopted, when done.
type Loading = std::sync::mpsc::Receiver<Result<usize, crate::ledger_store::StoreError>>;

/// What this heartbeat asks of the lease: give it up and leave (shutting down), give it up
/// (the ledger could not be loaded), or take or renew it.
fn mode(stopping: bool, st: &Lease) -> &'static str {
    if stopping {
        "release"
    } else if st.yield_next {
        "yield"
    } else {
        "take"
    }
}

/// The lease thread: one heartbeat, then sleep, until the gate is dropped or stopped.
fn run(shared: Weak<Shared>, cluster: Arc<Cluster>, client: redis::Client) {
    let ttl = cluster.cfg.lease_ttl_ms;
    let mut conn = Conn::new(client, Duration::from_millis(cluster.cfg.redis_timeout_ms));
    let id = Identity::of(&cluster);
    let mut st = Lease::default();
    if let Some(gate) = shared.upgrade() {
        gate.fence_store(0);
    }
    loop {
        let stopping = cluster.stopping.load(Ordering::SeqCst);
        let Some(gate) = shared.upgrade() else {
            return;
        };
        let flags_out = lock(&cluster.view).flags_out.clone();
        let sent = Instant::now();
        let args = id.args(ttl, mode(stopping, &st), flags_out.clone());
        match conn.call(&id.keys, args) {
            Ok(beat) => beat_ok(
                &gate,
                &cluster,
                &mut st,
                &id.me,
                beat,
                sent,
                flags_out.as_ref(),
            ),
            Err(e) => beat_failed(&gate, &cluster, &mut st, &e, sent),
        }
        let parts = cluster.share_parts();
        if st.share != Some(parts) {
            gate.set_share(parts);
            st.share = Some(parts);
        }
        if stopping {
            return;
        }
        drop(gate);
        sleep_until_next_beat(&cluster, &st);
    }
}

/// Sleep a third of the TTL, or until woken (a failed forward, flags to publish, shutdown);
/// a leader wakes when its lease runs out (to give its slots up at once), a replica waiting a
/// lease out when the wait ends.
fn sleep_until_next_beat(cluster: &Cluster, st: &Lease) {
    let mut wait = Duration::from_millis(cluster.cfg.lease_ttl_ms / 3);
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

/// Redis answered a heartbeat `sent` then: act on what it says, in this order.
fn beat_ok(
    gate: &Arc<Shared>,
    cluster: &Arc<Cluster>,
    st: &mut Lease,
    me: &str,
    beat: Beat,
    sent: Instant,
    flags_out: Option<&String>,
) {
    let ttl = cluster.cfg.lease_ttl_ms;
    exchange_flags(gate, cluster, &beat, flags_out);
    if st.redis_up != Some(true) {
        gate.cluster_event(Event::RedisUp, None);
    }
    st.redis_up = Some(true);
    notice_lost_data(gate, st, &beat);
    forget_old_loss(st, ttl);
    st.yield_next = false;
    let alive = others_alive(gate, cluster, st, &beat, me);
    let mine = beat.holder == me;
    wait_out_a_taken_lease(st, &beat, mine, ttl);
    let waited = st.standby_until.is_some_and(|t| t <= Instant::now());
    let was_leading = st.leading;
    match (mine, st.leading) {
        (true, false) if waited => take_over(gate, cluster, st, &alive, beat.epoch),
        // The lease lapsed and this replica took it again, under a new epoch: another may
        // have led meanwhile, and its writes are fenced on the old one. Lead afresh: step
        // down (its queue handed back), wait the lease out and take the ledger over again.
        (true, true) if beat.epoch != st.epoch => lead_afresh(gate, cluster, st, &beat),
        (true, true) if st.lost_data => write_ledger_back(gate, st, &alive),
        (true, true) => expire_orphans_once_a_ttl(gate, st, &alive),
        (false, true) => step_down(gate, cluster, st, &beat.holder),
        // Waiting a lease out, or following.
        _ => {}
    }
    update_view(cluster, &beat, st.leading && mine, sent);
    lock(&cluster.view).standby_until = st.standby_until.filter(|_| mine);
    if was_leading && !st.leading {
        hand_back(gate);
    }
}

/// This replica stopped leading: what it queued as leader goes to the new leader (or
/// follows its fail mode), unsent.
fn hand_back(gate: &Shared) {
    gate.fence_store(0);
    let n = gate.hand_back_deposed();
    if n > 0 {
        gate.cluster_event(
            Event::LeaderLost,
            Some(format!(
                "{n} queued requests admitted as leader handed back unsent"
            )),
        );
    }
}

/// Flags: ours are in Redis now (unless set again meanwhile); another replica's newer ones
/// apply here.
fn exchange_flags(gate: &Shared, cluster: &Cluster, beat: &Beat, flags_out: Option<&String>) {
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
}

/// Redis lost its data when its incarnation changed (it came back empty) or the lease's
/// sequence went down (restored from a snapshot): write back what this replica placed.
fn notice_lost_data(gate: &Shared, st: &mut Lease, beat: &Beat) {
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
            Event::RedisDataLost,
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
}

/// A replica that does not lead forgets the loss once the next leader had time to write back
/// what it knows: a much later takeover must not write back a stale copy.
fn forget_old_loss(st: &mut Lease, ttl: u64) {
    if !st.leading
        && st
            .lost_at
            .is_some_and(|t| t.elapsed() > Duration::from_millis(ttl.saturating_mul(3)))
    {
        st.lost_data = false;
        st.lost_at = None;
    }
}

/// The owners (`id|token`) of the other replicas that checked in within a TTL: still
/// running, so their proxied holds are theirs to settle. A dead leader has not: its lease had
/// to lapse (a TTL without a renewal) before this one could be taken. Reports, once, another
/// process checking in under this replica's id.
fn others_alive(
    gate: &Shared,
    cluster: &Cluster,
    st: &mut Lease,
    beat: &Beat,
    me: &str,
) -> HashSet<String> {
    let ttl = cluster.cfg.lease_ttl_ms;
    // Processes, not replica ids: a restarted pod keeps its name, and its dead predecessor's
    // holds must expire. Ages on Redis's clock (the registry's scores are on it).
    let recent: Vec<&String> = beat
        .members
        .iter()
        .filter(|(m, seen)| m != me && beat.redis_now_ms.saturating_sub(*seen) < ttl)
        .map(|(m, _)| m)
        .collect();
    let alive = recent.iter().map(|m| member_owner(m)).collect();
    if !st.duplicate_reported
        && recent
            .iter()
            .any(|m| split_member(m).0 == cluster.replica_id)
    {
        st.duplicate_reported = true;
        gate.cluster_event(
            Event::DuplicateReplicaId,
            Some(format!(
                "another process checks in as {:?}: give every replica its own cluster.replica_id",
                cluster.replica_id
            )),
        );
    }
    alive
}

/// A lease this replica holds but does not lead with yet is waited out first (see the
/// module's comment); one it does not hold is not waited for.
fn wait_out_a_taken_lease(st: &mut Lease, beat: &Beat, mine: bool, ttl: u64) {
    if !mine {
        st.standby_until = None;
        st.adopting = None;
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
}

/// The lease is this replica's and waited out: take over the shared ledger before deciding
/// anything as leader. The ledger is read on a thread of its own; each heartbeat meanwhile
/// renews the lease (a large ledger may take longer to read than a lease lasts) and looks
/// whether the records are ready. Requests wait meanwhile, as for a lease being waited out.
fn take_over(
    gate: &Arc<Shared>,
    cluster: &Arc<Cluster>,
    st: &mut Lease,
    alive: &HashSet<String>,
    epoch: u64,
) {
    let loading = match st.adopting.take() {
        Some(rx) => rx,
        None => {
            // The takeover's own writes (expiring a dead leader's holds) carry the epoch.
            gate.fence_store(epoch);
            let wake = Arc::downgrade(cluster);
            st.adopting = Some(
                gate.adopt_in_background(alive.clone(), st.lost_data, move || {
                    if let Some(c) = wake.upgrade() {
                        c.wake_lease();
                    }
                }),
            );
            return;
        }
    };
    let loaded = match loading.try_recv() {
        Ok(r) => r,
        Err(std::sync::mpsc::TryRecvError::Empty) => {
            st.adopting = Some(loading);
            return;
        }
        Err(std::sync::mpsc::TryRecvError::Disconnected) => {
            Err(crate::ledger_store::StoreError::WriterStopped)
        }
    };
    st.standby_until = None;
    match loaded {
        Ok(n) => {
            st.leading = true;
            st.epoch = epoch;
            st.lost_data = false;
            cluster
                .counters
                .leader_acquired
                .fetch_add(1, Ordering::Relaxed);
            gate.cluster_event(
                Event::LeaderAcquired,
                Some(format!("epoch {epoch}; {n} ledger records adopted")),
            );
        }
        Err(e) => {
            // Holding the lease without leading would leave the cluster with no leader:
            // give it up at once (another replica, or this one again, takes it next).
            st.yield_next = true;
            gate.fence_store(0);
            cluster.wake_lease();
            gate.cluster_event(
                Event::LeaderAdoptFailed,
                Some(format!("cannot load the shared ledger: {e}")),
            );
        }
    }
}

/// Redis came back empty under this leader: write back the ledger it knows, so that the next
/// leader finds it there.
fn write_ledger_back(gate: &Shared, st: &mut Lease, alive: &HashSet<String>) {
    match gate.adopt_shared_ledger(alive, true) {
        Ok(_) => st.lost_data = false,
        Err(e) => gate.cluster_event(
            Event::LeaderAdoptFailed,
            Some(format!("cannot write the ledger back to Redis: {e}")),
        ),
    }
}

/// About once a TTL (every third heartbeat): holds of replicas that stopped checking in
/// expire.
fn expire_orphans_once_a_ttl(gate: &Shared, st: &mut Lease, alive: &HashSet<String>) {
    st.beats += 1;
    if st.beats.is_multiple_of(3) {
        // Settlements of the holds kept for live replicas first: only those still held
        // after it can be orphans. A failed read is retried a TTL later.
        let _ = gate.learn_foreign_settlements();
        let n = gate.expire_orphans(alive);
        if n > 0 {
            gate.cluster_event(
                Event::OrphansExpired,
                Some(format!(
                    "{n} proxied holds of replicas no longer checking in expired"
                )),
            );
        }
    }
}

/// Another replica holds the lease this one led with.
fn step_down(gate: &Shared, cluster: &Cluster, st: &mut Lease, holder: &str) {
    st.leading = false;
    cluster.counters.leader_lost.fetch_add(1, Ordering::Relaxed);
    gate.cluster_event(
        Event::LeaderLost,
        Some(format!("the lease is held by {:?}", split_member(holder).0)),
    );
}

/// This replica leads, and finds it holds the lease under a new epoch: its lease lapsed and
/// it took it again (a pause past the lease that nobody else used, Redis restarted empty).
/// Another replica may have led meanwhile: stop leading (the queue is handed back), wait the
/// lease out (a whole TTL at least) and take the ledger over afresh.
fn lead_afresh(gate: &Shared, cluster: &Cluster, st: &mut Lease, beat: &Beat) {
    st.leading = false;
    let ttl = cluster.cfg.lease_ttl_ms;
    st.standby_until = Some(Instant::now() + Duration::from_millis(beat.wait_ms.max(ttl)));
    cluster.counters.leader_lost.fetch_add(1, Ordering::Relaxed);
    gate.cluster_event(
        Event::LeaderLost,
        Some(format!(
            "the lease lapsed and was taken again (epoch {} to {}): leading afresh",
            st.epoch, beat.epoch
        )),
    );
}

/// Leave what the heartbeat learnt where requests read it; `leads`: this replica holds the
/// lease and leads with it.
fn update_view(cluster: &Cluster, beat: &Beat, leads: bool, sent: Instant) {
    let ttl = cluster.cfg.lease_ttl_ms;
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
    view.lead_until = leads.then(|| sent + Duration::from_millis(ttl - ttl / 10));
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

/// Redis did not answer a heartbeat `sent` then (or not in time): a leader steps down once
/// its lease may have run out.
fn beat_failed(
    gate: &Shared,
    cluster: &Cluster,
    st: &mut Lease,
    e: &redis::RedisError,
    sent: Instant,
) {
    cluster
        .counters
        .redis_errors
        .fetch_add(1, Ordering::Relaxed);
    let reason = format!("{}: {e}", crate::ledger_store::redact(&cluster.cfg.redis));
    if st.redis_up != Some(false) {
        gate.cluster_event(Event::RedisDown, Some(reason.clone()));
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
            Event::LeaderLost,
            Some("the lease could not be renewed in time (Redis out of reach)".into()),
        );
        hand_back(gate);
    }
}
