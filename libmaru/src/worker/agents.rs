//! What a worker reads from an agent's welcome: its boot id (required: without one
//! the agent is treated as unreachable) and its epoch (a new one every start).

use crate::net::Client;

/// A welcome check for links to agents: an agent that reports no boot id is treated as
/// unreachable (a worker could not tell a reboot of its memory node).
pub fn require_boot_id(c: &Client) -> Result<(), String> {
    match c.welcome().info.get("boot_id").and_then(|b| b.as_str()) {
        Some(b) if !b.is_empty() => Ok(()),
        _ => Err("the agent reported no boot id; treating it as unreachable".into()),
    }
}

/// The boot id and epoch an agent's welcome reports.
pub(crate) fn welcome_identity(c: &Client) -> (Option<String>, Option<u64>) {
    let info = &c.welcome().info;
    (
        info.get("boot_id")
            .and_then(|b| b.as_str())
            .map(str::to_string),
        info.get("epoch").and_then(|e| e.as_u64()),
    )
}
