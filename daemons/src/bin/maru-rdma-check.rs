//! maru-rdma-check: the first bring-up check of the verbs transport on one host (see
//! docs/transports.md). Opens the RDMA device as the agent and a worker would, brings
//! a queue pair up over loopback, WRITEs and READs back a pattern, expects a late
//! WRITE with a released key to fail at the NIC, fences, and prints what it found.
//! Exit status: 0 all passed, 1 a check failed, 2 no usable device or no verbs build.

use clap::Parser;

#[derive(Parser, Debug)]
#[command(
    name = "maru-rdma-check",
    version,
    about = "Checks an RDMA device for maru's verbs transport (loopback WRITE/READ-back, released-key refusal, fence, queue-pair cleanup)"
)]
struct Args {
    /// RDMA device (default: the first one).
    #[arg(long, env = "MARU_RDMA_DEVICE")]
    rdma_device: Option<String>,
    /// Port of the RDMA device, from 1.
    #[arg(long, default_value_t = 1, env = "MARU_RDMA_PORT")]
    rdma_port: u8,
    /// GID index (default: 0 on InfiniBand, a RoCE v2 GID on Ethernet).
    #[arg(long, env = "MARU_RDMA_GID_INDEX")]
    rdma_gid_index: Option<u8>,
    /// GRH traffic class.
    #[arg(long, default_value_t = 0, env = "MARU_RDMA_TRAFFIC_CLASS")]
    rdma_traffic_class: u8,
    /// Service level, 0-15.
    #[arg(long, default_value_t = 0, env = "MARU_RDMA_SERVICE_LEVEL")]
    rdma_service_level: u8,
}

#[cfg(feature = "verbs")]
fn main() {
    use maru::transport::verbs::{check, VerbsSettings};
    let a = Args::parse();
    let settings = VerbsSettings {
        device: a.rdma_device,
        port: a.rdma_port,
        gid_index: a.rdma_gid_index,
        traffic_class: a.rdma_traffic_class,
        service_level: a.rdma_service_level,
        ..VerbsSettings::default()
    };
    match check::run(&settings) {
        Ok(lines) => {
            let mut ok = true;
            for l in &lines {
                ok &= l.ok;
                println!(
                    "{} {}: {}",
                    if l.ok { "ok  " } else { "FAIL" },
                    l.what,
                    l.detail
                );
            }
            std::process::exit(if ok { 0 } else { 1 });
        }
        Err(e) => {
            println!("FAIL {e}");
            std::process::exit(2);
        }
    }
}

#[cfg(not(feature = "verbs"))]
fn main() {
    let _ = Args::parse();
    println!("FAIL this build has no verbs support; rebuild with `cargo build --features maru-daemons/verbs`");
    std::process::exit(2);
}
