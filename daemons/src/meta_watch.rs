//! maru-server's watcher threads: its signals (to drain before it stops) and its
//! agents (reachable, agent key proved), each on a thread of its own.

use maru::net::{ClientOptions, Replier};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Watches SIGTERM and SIGINT on a thread of its own: the first sets `stop` and wakes
/// the loop, which answers what it was asked, flushes the durable directory and exits
/// (see `MetaService::drain`).
pub fn watch_signals(pipe: maru::net::SignalPipe, stop: Arc<AtomicBool>, waker: Replier) {
    let spawned = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || loop {
            let mut fds = [libc::pollfd {
                fd: pipe.fd(),
                events: libc::POLLIN,
                revents: 0,
            }];
            // SAFETY: one valid pollfd for the pipe this thread owns.
            unsafe { libc::poll(fds.as_mut_ptr(), 1, 1000) };
            if pipe.drain() {
                stop.store(true, Ordering::SeqCst);
                waker.wake();
            }
        });
    if let Err(e) = spawned {
        log::error!("cannot start the signal thread: {e}");
    }
}

/// How often maru-server checks its agents (reachable, key proof) after start.
pub const AGENT_CHECK_EVERY: Duration = Duration::from_secs(30);

/// Checks every agent at once and then every `every`, from a thread of its own: that
/// it answers and that the agent key proves (a wrong `--remote-cxl-agent-key-file`
/// would otherwise show only when the region keeper calls it). Logs each agent that
/// fails, naming why, and each one that comes back; says nothing while nothing changes.
pub fn watch_agents(agents: Vec<String>, opts: ClientOptions, every: Duration) {
    if agents.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("agent-check".into())
        .spawn(move || {
            let mut failing: HashMap<String, bool> = HashMap::new();
            loop {
                for a in &agents {
                    let r = maru::net::Client::connect(a, &opts);
                    let was = failing.get(a).copied();
                    match r {
                        Ok(c) if c.welcome().info.get("boot_id").is_some() => {
                            if was != Some(false) {
                                log::info!("agent {a}: reachable, agent key proved");
                            }
                            failing.insert(a.clone(), false);
                        }
                        Ok(_) => {
                            if was != Some(true) {
                                log::error!(
                                    "agent {a}: answers without a boot id (not a maru-remote-cxl-agent?); \
                                     its regions cannot be kept"
                                );
                            }
                            failing.insert(a.clone(), true);
                        }
                        Err(e) => {
                            if was != Some(true) {
                                let why = match &e {
                                    maru::net::ClientError::Auth { .. } => {
                                        " (the agent key file, --remote-cxl-agent-key-file, is not this agent's --key-file?)"
                                    }
                                    _ => "",
                                };
                                log::error!(
                                    "agent {a}: check failed: {}{why}; checked again every {} s",
                                    maru::net::clip(&e.to_string()),
                                    every.as_secs()
                                );
                            }
                            failing.insert(a.clone(), true);
                        }
                    }
                }
                std::thread::sleep(every);
            }
        });
    if let Err(e) = spawned {
        log::warn!("cannot start the agent check thread: {e}");
    }
}
