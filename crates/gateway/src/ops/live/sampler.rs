//! The live page's one sampler per gate: every `admin.live_frame_ms` it builds the `/stats`
//! document once (one short visit to the core, as a `/stats` request makes), numbers it and
//! publishes it to [`crate::observe::frames::FrameStore`]. Subscribers share that frame: a
//! hundred open pages cost the core nothing more than one.

use crate::engine::state::Shared;
use crate::observe::frames::Frame;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Publish one frame now, numbered `seq`.
pub fn sample(shared: &Shared, seq: u64) {
    let mut doc = crate::ops::stats::stats(shared);
    doc.snapshot = Some(seq);
    match serde_json::to_vec(&doc) {
        Ok(json) => shared.frames.publish(Frame {
            seq,
            json: Bytes::from(json),
        }),
        Err(e) => tracing::warn!("live page: cannot encode frame {seq}: {e}"),
    }
}

/// Sample every `every` until `stop` turns true (or its sender is gone).
pub async fn run(shared: Arc<Shared>, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(every);
    // A stalled runtime does not owe a burst of frames afterwards.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                seq += 1;
                sample(&shared, seq);
            }
            changed = stop.changed() => {
                if changed.is_err() || *stop.borrow() {
                    return;
                }
            }
        }
    }
}
