//! The worker data path over real RDMA (`--transport verbs` at the agent,
//! `"transport": "verbs"` in the worker config): two engines share checksummed chunks
//! through RM, agent and maru-server on loopback. Built with `--features verbs`; on a
//! host without a usable RDMA device (or rdma_rxe: `rdma link add rxe0 type rxe netdev
//! eth0`) it prints one `skipped:` line and passes. `MARU_RDMA_DEVICE` names the device.
#![cfg(feature = "verbs")]

mod support;

use maru::transport::TransportError;
use maru::worker::Handler;
use support::{Scratch, Stack};

fn device() -> Option<String> {
    std::env::var("MARU_RDMA_DEVICE").ok()
}

/// Whether a usable device exists here (prints the skip line when not).
fn rdma_here() -> bool {
    use maru::transport::verbs::{VerbsSettings, VerbsTransport};
    let here = VerbsSettings {
        device: device(),
        ..VerbsSettings::default()
    };
    match VerbsTransport::open_with(&here) {
        Ok(_) => true,
        Err(TransportError::Unavailable(m)) => {
            eprintln!("skipped: no usable RDMA device ({m})");
            false
        }
        Err(e) => panic!("opening the RDMA device failed: {e}"),
    }
}

fn stack() -> Stack {
    let server_args: Vec<String> = ["--region-size", "8M", "--chunk-size", "64K"]
        .iter()
        .map(|a| a.to_string())
        .collect();
    let verbs = |_: &Scratch| {
        let mut a = vec!["--transport".to_string(), "verbs".into()];
        if let Some(d) = device() {
            a.extend(["--rdma-device".into(), d]);
        }
        a
    };
    support::stack_with("verbs", "256M", true, verbs, &server_args)
}

fn config(st: &Stack, engine: &str) -> String {
    let mut c = st.handler_config("remote_cxl", engine, "verbs-test", (8, 16));
    c["transport"] = "verbs".into();
    // Batches spread over two queue pairs per agent.
    c["rdma_qps_per_agent"] = 2.into();
    if let Some(d) = device() {
        c["rdma_device"] = d.into();
    }
    c.to_string()
}

fn chunk(i: usize) -> Vec<u8> {
    let len = 1024 + (i * 977) % (63 * 1024);
    (0..len).map(|j| (i * 31 + j * 7) as u8).collect()
}

#[test]
fn engines_share_chunks_over_verbs() {
    if !rdma_here() {
        return;
    }
    let st = stack();
    let a = Handler::open(&config(&st, "engine-a")).expect("open engine A");
    let b = Handler::open(&config(&st, "engine-b")).expect("open engine B");
    let n = 256;
    let keys: Vec<String> = (0..n).map(|i| format!("prefix-{i:04}")).collect();
    let data: Vec<Vec<u8>> = (0..n).map(chunk).collect();
    support::store_all(&a, &keys, &data, "store over verbs");
    for (batch, idx) in keys.chunks(32).zip((0..n).collect::<Vec<_>>().chunks(32)) {
        let got = b.load_batch(batch, Some("route")).expect("load over verbs");
        for (g, &i) in got.into_iter().zip(idx) {
            assert_eq!(
                g.as_deref(),
                Some(data[i].as_slice()),
                "bytes of {}",
                keys[i]
            );
        }
    }
    a.close().unwrap();
    b.close().unwrap();
}
