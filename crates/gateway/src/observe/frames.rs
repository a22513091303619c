//! Frames of the gate's state for the live page (`/live`): one sampler per gate writes a
//! frame about once a second (see `ops::live::sampler`), every subscriber reads the same one.
//!
//! A frame is the `/stats` document of one moment, numbered (`snapshot`) and serialized
//! once. The store keeps the last few minutes of them, so a page that opens draws the recent
//! past at once, and `GET /stats?snapshot=N` answers with exactly the figures frame N
//! carried: what a browser drew can be checked against what the gate said.

use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// Frames kept: three minutes at the default rate of one a second.
pub const FRAMES_KEPT: usize = 180;

/// One frame: the `/stats` document at snapshot `seq`, as JSON.
#[derive(Debug)]
pub struct Frame {
    /// The snapshot's number (from 1, one more per frame).
    pub seq: u64,
    /// The `/stats` document of that snapshot, serialized (one line, no newline).
    pub json: Bytes,
}

/// The frames of one gate: the newest on a watch channel, the recent ones in a ring.
#[derive(Debug)]
pub struct FrameStore {
    latest: watch::Sender<Option<Arc<Frame>>>,
    recent: Mutex<VecDeque<Arc<Frame>>>,
}

impl Default for FrameStore {
    fn default() -> FrameStore {
        FrameStore {
            latest: watch::channel(None).0,
            recent: Mutex::new(VecDeque::with_capacity(FRAMES_KEPT)),
        }
    }
}

impl FrameStore {
    /// Publish a frame: kept in the ring (the oldest leaves past [`FRAMES_KEPT`]) and sent to
    /// every subscriber.
    pub fn publish(&self, frame: Frame) {
        let frame = Arc::new(frame);
        if let Ok(mut recent) = self.recent.lock() {
            if recent.len() == FRAMES_KEPT {
                recent.pop_front();
            }
            recent.push_back(Arc::clone(&frame));
        }
        self.latest.send_replace(Some(frame));
    }

    /// A receiver of the frames to come.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<Frame>>> {
        self.latest.subscribe()
    }

    /// The frames kept, oldest first.
    pub fn recent(&self) -> Vec<Arc<Frame>> {
        self.recent
            .lock()
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Frame `seq`, while it is kept.
    pub fn get(&self, seq: u64) -> Option<Arc<Frame>> {
        let recent = self.recent.lock().ok()?;
        recent.iter().find(|f| f.seq == seq).cloned()
    }

    /// The newest frame's number (0: none yet).
    pub fn latest_seq(&self) -> u64 {
        self.latest.borrow().as_ref().map_or(0, |f| f.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(seq: u64) -> Frame {
        Frame {
            seq,
            json: Bytes::from(format!("{{\"snapshot\":{seq}}}")),
        }
    }

    #[test]
    fn the_ring_keeps_the_last_frames_and_finds_them_by_number() {
        let store = FrameStore::default();
        assert_eq!(store.latest_seq(), 0);
        let mut rx = store.subscribe();
        for seq in 1..=(FRAMES_KEPT as u64 + 5) {
            store.publish(frame(seq));
        }
        assert_eq!(store.latest_seq(), FRAMES_KEPT as u64 + 5);
        assert!(store.get(5).is_none(), "the oldest frames left the ring");
        assert_eq!(store.get(6).map(|f| f.seq), Some(6));
        let recent = store.recent();
        assert_eq!(recent.len(), FRAMES_KEPT);
        assert_eq!(recent.first().map(|f| f.seq), Some(6));
        assert!(rx.has_changed().unwrap_or(false));
        assert_eq!(
            rx.borrow_and_update().as_ref().map(|f| f.seq),
            Some(FRAMES_KEPT as u64 + 5)
        );
    }
}
