//! What a `maru-bench` run measured, part by part ([`Results`]), with the look-ups the
//! tables and targets use.

use crate::harness::Fig;
use crate::maru_io::{self, MIB};
use crate::report::f2;
use crate::{connector, hitrate, idle, in_place, meta, mooncake, pairs, redis};
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub(crate) struct MemcpyRow {
    pub(crate) chunk: usize,
    pub(crate) threads: usize,
    pub(crate) fig: Fig,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct TcpRow {
    pub(crate) chunk: usize,
    pub(crate) gbs: f64,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct SoftRow {
    pub(crate) chunk: usize,
    pub(crate) tcp_gbs: f64,
    pub(crate) read_gbs: f64,
    pub(crate) write_gbs: f64,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct TargetRow {
    pub(crate) target: String,
    pub(crate) measured: String,
    pub(crate) met: Option<bool>,
}

#[derive(Debug, Default, Serialize)]
pub(crate) struct Results {
    pub(crate) memcpy: Vec<MemcpyRow>,
    /// Streaming-store copies (no read for ownership): the machine's copy bandwidth.
    pub(crate) stream: Vec<MemcpyRow>,
    /// Reads only: the machine's read bandwidth.
    pub(crate) read: Vec<MemcpyRow>,
    pub(crate) tcp: Vec<TcpRow>,
    pub(crate) soft: Vec<SoftRow>,
    pub(crate) maru: Vec<maru_io::Result_>,
    /// One handler used by N threads against N handlers, interleaved on one stack.
    pub(crate) pairs: Vec<pairs::PairResult>,
    /// cxl, 2 MiB chunks, 1 client, on a pool of 4 KiB pages (when the main pool has
    /// 2 MiB pages).
    pub(crate) cxl_small_pages: Option<maru_io::Result_>,
    pub(crate) redis: Vec<redis::RedisResult>,
    pub(crate) meta: Vec<meta::Row>,
    /// A durable directory of `meta::RECOVERY_KEYS` keys, stopped and started again.
    pub(crate) meta_recovery: Option<meta::Recovery>,
    pub(crate) idle: Vec<idle::IdleCpu>,
    /// cxl writes in place (part `in_place`).
    pub(crate) in_place: Option<in_place::InPlaceResult>,
    /// The vLLM connector's worker, both backends (part `connector`).
    pub(crate) connector: Vec<connector::ConnectorResult>,
    /// Hit rate of a multi-turn chat trace replayed through maru-server's eviction
    /// (part `hitrate`).
    pub(crate) hitrate: Option<hitrate::HitRateResult>,
    /// Maru beside Mooncake Store, taking turns (part `mooncake`).
    pub(crate) mooncake: Option<mooncake::MooncakeResult>,
}

pub(crate) const CHUNKS: [usize; 2] = [256 * 1024, 2 * MIB];
pub(crate) const MANY: usize = 4;

impl Results {
    pub(crate) fn memcpy_of(&self, chunk: usize, threads: usize) -> Option<&Fig> {
        self.memcpy
            .iter()
            .find(|r| r.chunk == chunk && r.threads == threads)
            .map(|r| &r.fig)
    }
    pub(crate) fn stream_of(&self, chunk: usize, threads: usize) -> Option<f64> {
        self.stream
            .iter()
            .find(|r| r.chunk == chunk && r.threads == threads)
            .map(|r| r.fig.gbs)
    }
    pub(crate) fn read_of(&self, chunk: usize, threads: usize) -> Option<f64> {
        self.read
            .iter()
            .find(|r| r.chunk == chunk && r.threads == threads)
            .map(|r| r.fig.gbs)
    }
    pub(crate) fn tcp_of(&self, chunk: usize) -> Option<f64> {
        self.tcp.iter().find(|r| r.chunk == chunk).map(|r| r.gbs)
    }
    /// The batch load of one client of `backend` at `chunk` (GB/s), for the rows judged
    /// by it.
    pub(crate) fn batch_load(&self, backend: &str, chunk: usize) -> Option<f64> {
        self.maru_of(backend, chunk, 1, 1).map(|m| m.load_batch.gbs)
    }

    pub(crate) fn maru_of(
        &self,
        backend: &str,
        chunk: usize,
        handlers: usize,
        threads: usize,
    ) -> Option<&maru_io::Result_> {
        self.maru.iter().find(|r| {
            r.config.backend == backend
                && r.config.chunk == chunk
                && r.config.handlers == handlers
                && r.config.threads == threads
        })
    }
    pub(crate) fn redis_of(&self, chunk: usize, clients: usize) -> Option<&redis::RedisResult> {
        self.redis
            .iter()
            .find(|r| r.chunk == chunk && r.clients == clients)
    }
    pub(crate) fn pair_of(
        &self,
        backend: &str,
        chunk: usize,
        n: usize,
    ) -> Option<&pairs::PairResult> {
        self.pairs
            .iter()
            .find(|p| p.backend == backend && p.chunk == chunk && p.n == n)
    }
    pub(crate) fn meta_of(&self, op: &str, conns: usize) -> Option<&meta::Row> {
        self.meta.iter().find(|r| r.op == op && r.conns == conns)
    }
}

pub(crate) fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

pub(crate) fn opt(x: Option<f64>) -> String {
    x.map(f2).unwrap_or_else(|| "-".into())
}
