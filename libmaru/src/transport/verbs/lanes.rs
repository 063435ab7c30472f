//! Several queue pairs to one agent (worker side, `rdma_qps_per_agent`): the peer a
//! worker sees is a group of *lanes*, each an engine peer with a queue pair of its
//! own. Each batch goes whole to one lane (its operations stay in order), lanes taken
//! in turn, so transfers spread over the lanes (and, on a routed fabric, over their
//! ECMP paths). An error on one lane moves only that queue pair to ERR: the batches
//! on it fail, the other lanes' batches complete, and later batches skip the failed
//! lane. A fence of the group fences every lane and succeeds only when each did.

use super::engine::{Engine, LocalReg};
use crate::transport::{BatchId, Op, PeerId, TransportError};
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

/// Groups remembered before the fully fenced ones are forgotten.
pub(crate) const FENCED_MEMORY: usize = 4096;

struct Group {
    /// The `verbs` metadata it was connected with (one group per agent).
    key: serde_json::Value,
    lanes: Vec<PeerId>,
    /// The lane the next batch tries first.
    next: usize,
}

/// The lane groups of a transport, by the id the worker holds.
#[derive(Default)]
pub(crate) struct Lanes {
    groups: Mutex<HashMap<PeerId, Group>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn usable(engine: &Engine, lane: PeerId) -> bool {
    engine.peer(lane).is_some_and(|p| p.usable())
}

impl Lanes {
    /// Records group `id` of `lanes` (engine peers already added). Groups whose
    /// every lane was fenced are remembered (their fence succeeds again) up to
    /// [`FENCED_MEMORY`] groups, then forgotten.
    pub fn add(&self, engine: &Engine, id: PeerId, key: serde_json::Value, lanes: Vec<PeerId>) {
        let mut groups = lock(&self.groups);
        if groups.len() >= FENCED_MEMORY {
            groups.retain(|_, g| g.lanes.iter().any(|&l| engine.knows(l)));
        }
        groups.insert(
            id,
            Group {
                key,
                lanes,
                next: 0,
            },
        );
    }

    /// A group connected with this metadata whose every lane is still usable.
    pub fn find_usable(&self, engine: &Engine, key: &serde_json::Value) -> Option<PeerId> {
        lock(&self.groups)
            .iter()
            .find(|(_, g)| g.key == *key && g.lanes.iter().all(|&l| usable(engine, l)))
            .map(|(id, _)| *id)
    }

    /// The lanes of group `id` (`None`: not a group).
    pub fn lanes(&self, id: PeerId) -> Option<Vec<PeerId>> {
        lock(&self.groups).get(&id).map(|g| g.lanes.clone())
    }

    /// Posts a batch on the next usable lane of group `id`. With none usable it goes
    /// to the first lane, whose failure the engine reports.
    pub fn post(
        &self,
        engine: &Engine,
        id: PeerId,
        ops: &[Op],
        local: &LocalReg,
        now: Instant,
    ) -> Result<BatchId, TransportError> {
        let lane = {
            let mut groups = lock(&self.groups);
            let g = groups.get_mut(&id).ok_or(TransportError::NoPeer(id))?;
            let n = g.lanes.len();
            let pick = (0..n)
                .map(|i| (g.next + i) % n)
                .find(|&i| usable(engine, g.lanes[i]))
                .unwrap_or(0);
            g.next = (pick + 1) % n;
            g.lanes[pick]
        };
        engine.post(lane, ops, local, now)
    }

    /// Fences every lane of group `id`; `Ok` only when every lane's fence succeeded.
    /// A lane the engine no longer knows was fenced already (the engine forgets a
    /// peer only when its fence proved it quiet), so a group fenced once succeeds
    /// again. Every lane is tried even after one failed.
    pub fn fence(&self, engine: &Engine, id: PeerId) -> Result<(), TransportError> {
        let lanes = self.lanes(id).ok_or(TransportError::NoPeer(id))?;
        let mut first_err = None;
        for lane in lanes {
            match engine.fence(lane) {
                Ok(()) | Err(TransportError::NoPeer(_)) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::verbs::engine::EngineConfig;
    use crate::transport::verbs::fake::{staging, FakeQp};
    use crate::transport::{BatchState, OpKind};
    use std::sync::Arc;
    use std::time::Duration;

    struct Rig {
        engine: Engine,
        lanes: Lanes,
        qps: Vec<Arc<FakeQp>>,
        local: LocalReg,
        _buf: Vec<u8>,
    }

    const GROUP: PeerId = PeerId(100);

    fn rig(n: usize) -> Rig {
        let engine = Engine::new(EngineConfig {
            fence_timeout: Duration::from_millis(200),
            sq_wait: Duration::from_secs(10),
        });
        let key = serde_json::json!({"device": "mlx5_0"});
        let mut qps = Vec::new();
        let mut ids = Vec::new();
        for i in 0..n {
            let qp = Arc::new(FakeQp::new(10 + i as u32));
            engine.add_peer(
                PeerId(1 + i as u64),
                format!("lane {i}"),
                key.clone(),
                qp.clone(),
                64,
                0x11,
            );
            qps.push(qp);
            ids.push(PeerId(1 + i as u64));
        }
        let lanes = Lanes::default();
        lanes.add(&engine, GROUP, key, ids);
        let (local, buf) = staging();
        Rig {
            engine,
            lanes,
            qps,
            local,
            _buf: buf,
        }
    }

    fn write() -> Vec<Op> {
        vec![Op {
            kind: OpKind::Write,
            local_offset: 0,
            remote_addr: 0x1000,
            rkey: 5,
            len: 4096,
        }]
    }

    impl Rig {
        /// Posts [`write`] to the group.
        fn post(&self, now: Instant) -> BatchId {
            self.lanes
                .post(&self.engine, GROUP, &write(), &self.local, now)
                .unwrap()
        }
    }

    fn settle(r: &Rig) {
        for (i, qp) in r.qps.iter().enumerate() {
            qp.complete(usize::MAX);
            r.engine.service(PeerId(1 + i as u64), Instant::now());
        }
    }

    #[test]
    fn batches_spread_over_the_lanes() {
        let r = rig(3);
        let now = Instant::now();
        let b: Vec<BatchId> = (0..6).map(|_| r.post(now)).collect();
        assert_eq!(
            r.qps.iter().map(|q| q.state().posted).collect::<Vec<_>>(),
            vec![2, 2, 2]
        );
        settle(&r);
        for b in b {
            assert_eq!(r.engine.batches.state(b), BatchState::Done);
        }
    }

    #[test]
    fn an_error_on_one_lane_fails_only_its_batches_and_later_ones_avoid_it() {
        let r = rig(2);
        let now = Instant::now();
        // The first request of lane 0 fails with a remote access error.
        r.qps[0].state().fail_at = Some(0);
        let on0 = r.post(now);
        let on1 = r.post(now);
        settle(&r);
        assert!(matches!(r.engine.batches.state(on0), BatchState::Failed(_)));
        assert_eq!(r.engine.batches.state(on1), BatchState::Done);
        // Lane 0 is failed: the next batches all go to lane 1.
        let later: Vec<BatchId> = (0..3).map(|_| r.post(now)).collect();
        assert_eq!(r.qps[0].state().posted, 1);
        assert_eq!(r.qps[1].state().posted, 4);
        settle(&r);
        for b in later {
            assert_eq!(r.engine.batches.state(b), BatchState::Done);
        }
        assert!(
            r.lanes
                .find_usable(&r.engine, &serde_json::json!({"device": "mlx5_0"}))
                .is_none(),
            "a group with a failed lane is connected afresh"
        );
    }

    #[test]
    fn a_fence_of_the_group_fences_every_lane() {
        let r = rig(2);
        let now = Instant::now();
        let b0 = r.post(now);
        let b1 = r.post(now);
        // Lane 1's destroy fails once: the group's fence fails, lane 0 is still fenced.
        r.qps[1].state().destroy_failures = 1;
        r.qps[1].state().withhold_flushes = true;
        assert!(r.lanes.fence(&r.engine, GROUP).is_err());
        assert!(r.qps[0].state().destroyed || r.qps[0].state().error);
        assert!(matches!(r.engine.batches.state(b0), BatchState::Failed(_)));
        // The retry destroys lane 1; now the group is quiet.
        r.lanes.fence(&r.engine, GROUP).unwrap();
        assert!(r.qps[1].state().destroyed);
        assert!(matches!(r.engine.batches.state(b1), BatchState::Failed(_)));
        r.lanes
            .fence(&r.engine, GROUP)
            .expect("a fenced group stays fenced");
        assert!(matches!(
            r.lanes.fence(&r.engine, PeerId(999)),
            Err(TransportError::NoPeer(_))
        ));
    }
}
