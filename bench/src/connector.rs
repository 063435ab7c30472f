//! The vLLM connector's row (part `connector`): what `maru.vllm`'s worker does between
//! Maru and a paged KV cache in vLLM's CPU layout, outside vLLM
//! (bench/python/connector_row.py: the connector's own handler settings, copies and
//! load paths), on both backends, 32 x 2 MiB a batch. It is judged by the same run's
//! batch load of the same chunk size on the same backend (part `maru`).

use crate::harness::BATCH;
use crate::in_place::PyFig;
use crate::procs::{stack, Scratch};
use crate::report::{f2, Table};
use serde::{Deserialize, Serialize};

/// Chunk size of the row: the size the raw batch load it is judged by is measured at.
pub const CHUNK: usize = 2 << 20;
const REGION: usize = 256 << 20;

/// What connector_row.py prints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// Loads of 32 chunks into the cache's blocks (read in place on cxl, through the
    /// load slots in two halves on remote_cxl, then one copy per layer).
    pub load: PyFig,
    /// Stores of the chunks out of the cache's blocks, until published.
    pub store: PyFig,
}

#[derive(Debug, Clone, Serialize)]
pub struct ConnectorResult {
    pub backend: &'static str,
    pub row: Result<Row, String>,
}

/// Runs the row on a fresh stack of each backend.
pub fn run(s: &Scratch, secs: f64) -> Vec<ConnectorResult> {
    ["cxl", "remote_cxl"]
        .into_iter()
        .map(|backend| {
            let row = stack(
                s,
                backend == "remote_cxl",
                &REGION.to_string(),
                &CHUNK.to_string(),
            )
            .and_then(|st| {
                let cfg = crate::maru_io::handler_config(&st.server, backend, "bench-connector", s);
                let args = [
                    "--config".to_string(),
                    cfg,
                    "--chunk".into(),
                    CHUNK.to_string(),
                    "--batch".into(),
                    BATCH.to_string(),
                    "--secs".into(),
                    format!("{:.1}", 2.0 * secs),
                ];
                crate::python_row::run("connector_row.py", &args, 2.0 * secs)
            });
            ConnectorResult { backend, row }
        })
        .collect()
}

/// The rows beside the raw batch load of each backend (`raw(backend)`, GB/s).
pub fn table(rows: &[ConnectorResult], raw: &dyn Fn(&str) -> Option<f64>) -> Table {
    let mut t = Table::new(
        "vLLM connector (maru.vllm's worker, Python) between Maru and a paged KV cache, 32 x 2 MiB",
        &[
            "backend",
            "op",
            "GB/s",
            "libmaru call GB/s",
            "p50 us",
            "x batch load",
        ],
    );
    for r in rows {
        match &r.row {
            Ok(row) => {
                let x = raw(r.backend)
                    .filter(|b| *b > 0.0)
                    .map(|b| format!("{:.2} x", row.load.gbs / b))
                    .unwrap_or_else(|| "-".into());
                t.row(vec![
                    r.backend.into(),
                    "load into the blocks".into(),
                    f2(row.load.gbs),
                    row.load.copy_gbs.map(f2).unwrap_or_else(|| "-".into()),
                    f2(row.load.p50_us),
                    x,
                ]);
                t.row(vec![
                    r.backend.into(),
                    "store out of the blocks".into(),
                    f2(row.store.gbs),
                    "-".into(),
                    f2(row.store.p50_us),
                    "-".into(),
                ]);
            }
            Err(e) => t.row(vec![
                r.backend.into(),
                format!("not measured: {e}"),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]),
        }
    }
    t
}
