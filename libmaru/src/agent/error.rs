//! Why an agent core could not be built.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    /// No boot id: without it a worker could not tell a reboot of this node (which
    /// loses the writes its CPU caches held) from a restart of the agent.
    #[error(
        "the node has no boot id (read from /proc/sys/kernel/random/boot_id): the agent \
         refuses to start, since workers could not tell a reboot of this node from a \
         restart of the agent"
    )]
    NoBootId,
    /// No node name: holds at the RM are recorded under it.
    #[error(
        "the agent has no node name: set one (it names this node's holds at the \
         resource manager)"
    )]
    NoNodeName,
}
