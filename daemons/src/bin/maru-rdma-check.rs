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
    #[command(flatten)]
    rdma: maru_daemons::common::RdmaArgs,
}

#[cfg(feature = "verbs")]
fn main() {
    use maru::transport::verbs::check;
    let settings = Args::parse().rdma.settings();
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
