//! maru-rm-ctl: inspect and operate a maru-resource-manager.
//!
//! Exit status: 0 done; 1 the RM answered with an error; 3 the RM refused
//! definitively (bad token, unknown or draining region); 2 bad usage or the RM
//! could not be reached.

use clap::{Parser, Subcommand};
use maru::auth::{keyfile::write_new_key_file, SharedKey};
use maru::net::{default_client_id, Client, ClientError, ClientOptions};
use maru::wire::rm::{Handle, RmReply, RmRequest, SERVICE};
use maru_daemons::rm_tables;
use std::path::PathBuf;
use std::process::exit;

#[derive(Parser, Debug)]
#[command(
    name = "maru-rm-ctl",
    version,
    about = "Inspect and operate a Maru resource manager"
)]
struct Args {
    /// Resource manager address.
    #[arg(
        long,
        default_value = "127.0.0.1:9850",
        env = "MARU_RM_ADDRESS",
        global = true
    )]
    rm: String,
    /// Client id to present (the owner of regions this command allocates).
    #[arg(long, env = "MARU_CLIENT_ID", global = true)]
    client_id: Option<String>,
    /// Key file, when the RM requires a key proof.
    #[arg(long, env = "MARU_RM_KEY_FILE", global = true)]
    key_file: Option<PathBuf>,
    /// Print replies as JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// List the pools: path, UUID, size, free, draining.
    Pools,
    /// List regions (all, or one owner's).
    Regions {
        #[arg(long)]
        owner: Option<String>,
    },
    /// List holds (all, or one node's).
    Holds {
        #[arg(long)]
        node: Option<String>,
    },
    /// Drop every hold of NODE (a memory node gone for good). Its draining regions are freed.
    DropHolds {
        node: String,
        /// Required: dropping holds of a live agent lets its range be reused under it.
        #[arg(long)]
        confirm: bool,
    },
    /// Allocate a region of SIZE (bytes or K/M/G suffix); prints its handle as JSON.
    Alloc {
        size: String,
        /// Pool id, path or UUID.
        #[arg(long)]
        pool: Option<String>,
    },
    /// Free a region (only its owner may: pass the same --client-id as the alloc).
    Free {
        /// The handle JSON printed by `alloc`.
        #[arg(long)]
        handle: String,
    },
    /// Check a handle and print where its bytes are.
    GetAccess {
        #[arg(long)]
        handle: String,
    },
    /// Record a hold of the region by NODE at EPOCH (what an agent does before mapping).
    Hold {
        #[arg(long)]
        handle: String,
        #[arg(long)]
        node: String,
        #[arg(long, default_value_t = 1)]
        epoch: u64,
    },
    /// Drop NODE's hold of a region.
    Unhold {
        #[arg(long)]
        region: u64,
        #[arg(long)]
        node: String,
        #[arg(long, default_value_t = 1)]
        epoch: u64,
    },
    /// Drop NODE's holds from epochs before EPOCH.
    ResetHolds {
        #[arg(long)]
        node: String,
        #[arg(long)]
        epoch: u64,
    },
    /// Write a new random key file (mode 0600) for --key-file options.
    GenKey { path: PathBuf },
}

fn parse_handle(s: &str) -> Handle {
    // Accept either a bare handle or the whole alloc reply.
    let v: serde_json::Value =
        serde_json::from_str(s).unwrap_or_else(|e| usage(format!("--handle is not JSON: {e}")));
    let h = v.get("handle").cloned().unwrap_or(v);
    serde_json::from_value(h)
        .unwrap_or_else(|e| usage(format!("--handle is not a region handle: {e}")))
}

fn usage(msg: String) -> ! {
    eprintln!("error: {msg}");
    exit(2)
}

fn print_json(v: &impl serde::Serialize) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

fn show(reply: &RmReply, json: bool) {
    if json {
        return print_json(reply);
    }
    match reply {
        RmReply::Pools { pools } => print!("{}", rm_tables::pools(pools, None)),
        RmReply::Regions { regions } => print!("{}", rm_tables::regions(regions)),
        RmReply::Holds { holds } => print!("{}", rm_tables::holds(holds)),
        // Replies that scripts consume are always JSON.
        other => print_json(other),
    }
}

fn main() {
    let args = Args::parse();
    let req = match &args.cmd {
        Cmd::GenKey { path } => {
            let key = SharedKey::generate()
                .unwrap_or_else(|e| usage(format!("cannot draw random bytes: {e}")));
            write_new_key_file(path, &key).unwrap_or_else(|e| {
                usage(format!("cannot create key file {}: {e}", path.display()))
            });
            println!("wrote {} (mode 0600)", path.display());
            return;
        }
        Cmd::Pools => RmRequest::Pools,
        Cmd::Regions { owner } => RmRequest::Regions {
            owner: owner.clone(),
        },
        Cmd::Holds { node } => RmRequest::Holds { node: node.clone() },
        Cmd::DropHolds { node, confirm } => {
            if !confirm {
                usage(format!("drop-holds {node} frees ranges the agent on {node} may still have registered; pass --confirm if that node is gone for good"));
            }
            RmRequest::DropHolds {
                node: node.clone(),
                confirm: *confirm,
            }
        }
        Cmd::Alloc { size, pool } => {
            let size =
                maru::dax::parse_size(size).unwrap_or_else(|e| usage(format!("size {size}: {e}")));
            RmRequest::Alloc {
                size,
                pool: pool.clone(),
                request_id: 0,
            }
        }
        Cmd::Free { handle } => RmRequest::Free {
            handle: parse_handle(handle),
            request_id: 0,
        },
        Cmd::GetAccess { handle } => RmRequest::GetAccess {
            handle: parse_handle(handle),
        },
        Cmd::Hold {
            handle,
            node,
            epoch,
        } => RmRequest::Hold {
            handle: parse_handle(handle),
            node: node.clone(),
            epoch: *epoch,
        },
        Cmd::Unhold {
            region,
            node,
            epoch,
        } => RmRequest::Unhold {
            region_id: *region,
            node: node.clone(),
            epoch: *epoch,
        },
        Cmd::ResetHolds { node, epoch } => RmRequest::ResetHolds {
            node: node.clone(),
            epoch: *epoch,
        },
    };
    if matches!(args.cmd, Cmd::Alloc { .. }) && args.client_id.is_none() {
        usage(
            "alloc needs --client-id NAME (or MARU_CLIENT_ID): without one the region's owner \
             is this command's process, and the RM frees a local owner's regions as soon as it \
             exits; free it later with the same --client-id"
                .into(),
        );
    }
    let mut opts = ClientOptions::new(
        SERVICE,
        args.client_id
            .clone()
            .unwrap_or_else(|| default_client_id("rm-ctl@")),
    );
    if let Some(p) = &args.key_file {
        opts.key = Some(maru::auth::load_key_file(p).unwrap_or_else(|e| usage(e.to_string())));
    }
    let mut client = Client::connect(&args.rm, &opts).unwrap_or_else(|e| {
        eprintln!(
            "error: cannot reach the resource manager at {}: {e}",
            args.rm
        );
        exit(2)
    });
    match client.call::<_, RmReply>(&req) {
        Ok(reply) => show(&reply, args.json),
        Err(e @ ClientError::Remote(_)) => {
            eprintln!("error: {e}");
            exit(if e.is_refusal() { 3 } else { 1 })
        }
        Err(e) => {
            eprintln!("error: {e}");
            exit(2)
        }
    }
}
