//! What an operator chooses for the verbs transport, and the decisions taken at open
//! that do not need a device to be tested: which transport types are accepted, what
//! fork support must be in place before memory is registered, and what each async
//! event means.

use crate::transport::TransportError;

/// The verbs settings of a worker (`rdma_*` in its JSON configuration) or an agent
/// (`--rdma-*` flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsSettings {
    /// The RDMA device (`None`: the first one).
    pub device: Option<String>,
    /// The device port, from 1.
    pub port: u8,
    /// The GID to source packets from (`None`: 0 on InfiniBand, a RoCE v2 GID holding
    /// an IPv4 address on Ethernet).
    pub gid_index: Option<u8>,
    /// The GRH traffic class (RoCE: DSCP << 2 | ECN). On a lossless RoCE fabric this
    /// must map to the PFC-enabled priority.
    pub traffic_class: u8,
    /// The InfiniBand service level (0-15; on RoCE the priority when no DSCP mapping
    /// is used).
    pub service_level: u8,
    /// Worker side: queue pairs to each agent (1-8); batches are spread over them.
    pub qps_per_agent: u8,
}

/// Most queue pairs a worker brings up to one agent (the agent keeps at most 16 per
/// connection).
pub const MAX_QPS_PER_AGENT: u8 = 8;

impl Default for VerbsSettings {
    fn default() -> Self {
        VerbsSettings {
            device: None,
            port: 1,
            gid_index: None,
            traffic_class: 0,
            service_level: 0,
            qps_per_agent: 1,
        }
    }
}

impl VerbsSettings {
    /// Checks the ranges a device cannot be asked about.
    pub fn check(&self) -> Result<(), TransportError> {
        if self.port == 0 {
            return Err(TransportError::Setup(
                "RDMA port numbers start at 1 (port 0 given)".into(),
            ));
        }
        if self.qps_per_agent == 0 || self.qps_per_agent > MAX_QPS_PER_AGENT {
            return Err(TransportError::Setup(format!(
                "rdma_qps_per_agent is {}; it must be 1-{MAX_QPS_PER_AGENT}",
                self.qps_per_agent
            )));
        }
        if self.service_level > 15 {
            return Err(TransportError::Setup(format!(
                "rdma_service_level is {}; service levels are 0-15",
                self.service_level
            )));
        }
        Ok(())
    }
}

/// `ibv_transport_type` values.
pub(crate) const TRANSPORT_IB: i32 = 0;
pub(crate) const TRANSPORT_IWARP: i32 = 1;

/// Only InfiniBand-transport devices (InfiniBand and RoCE ports) are opened. iWARP
/// needs rdma_cm for connection set-up and gives the READ sink remote write access;
/// usNIC and others have no RC one-sided RDMA.
pub(crate) fn check_transport(device: &str, transport_type: i32) -> Result<(), TransportError> {
    match transport_type {
        TRANSPORT_IB => Ok(()),
        TRANSPORT_IWARP => Err(TransportError::Unavailable(format!(
            "RDMA device {device} is an iWARP device (siw, cxgb, irdma in iWARP mode); maru's verbs transport needs InfiniBand or RoCE (iWARP needs rdma_cm and remote write access to READ buffers); use --transport soft or another device"
        ))),
        other => Err(TransportError::Unavailable(format!(
            "RDMA device {device} has transport type {other}, not InfiniBand/RoCE; use --transport soft or another device"
        ))),
    }
}

/// `ibv_fork_status` values.
pub(crate) const FORK_DISABLED: u32 = 0;
pub(crate) const FORK_ENABLED: u32 = 1;
pub(crate) const FORK_UNNEEDED: u32 = 2;

/// Whether memory may be registered given the outcome of `ibv_fork_init()` (`init_rc`)
/// and `ibv_is_fork_initialized()` (`status`). Without fork support a `fork()` in the
/// process (Python `subprocess`, `multiprocessing`) can leave the NIC writing READ
/// data into pages the process no longer sees: stale KV, silently. So registering is
/// refused unless the kernel makes fork safe by itself (UNNEEDED) or rdma-core marks
/// registered ranges `MADV_DONTFORK` (ENABLED).
pub(crate) fn check_fork(init_rc: i32, status: u32) -> Result<(), TransportError> {
    match status {
        FORK_UNNEEDED | FORK_ENABLED => Ok(()),
        _ => Err(TransportError::Unavailable(format!(
            "RDMA fork protection is off (ibv_fork_init returned {}, fork status {}): a fork() in this process could leave the NIC writing into pages it no longer sees; refusing to register memory. Use a kernel with copy-on-fork for pinned pages (5.13+), or set RDMAV_FORK_SAFE=1 before the process starts",
            std::io::Error::from_raw_os_error(init_rc.abs()),
            match status {
                FORK_DISABLED => "disabled".to_string(),
                s => s.to_string(),
            }
        ))),
    }
}

/// What the transport does about an async event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventAction {
    /// One queue pair failed: fail its peer (its batches fail, it must be fenced).
    FailQp,
    /// The port or the device failed: fail every peer.
    FailAll,
    /// The port's addresses may have changed: read LID and GID again.
    RefreshAddress,
    /// Nothing to do (logged).
    Ignore,
}

/// `ibv_event_type` → action.
pub(crate) fn event_action(event_type: u32) -> EventAction {
    match event_type {
        // QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR, PATH_MIG_ERR
        1..=3 | 7 => EventAction::FailQp,
        // CQ_ERR (one CQ per QP: every peer is checked), DEVICE_FATAL, PORT_ERR
        0 | 8 | 10 => EventAction::FailAll,
        // PORT_ACTIVE, LID_CHANGE, PKEY_CHANGE, SM_CHANGE, CLIENT_REREGISTER,
        // GID_CHANGE
        9 | 11..=13 | 17 | 18 => EventAction::RefreshAddress,
        _ => EventAction::Ignore,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_infiniband_transport_devices_are_opened() {
        assert!(check_transport("mlx5_0", TRANSPORT_IB).is_ok());
        match check_transport("siw0", TRANSPORT_IWARP) {
            Err(TransportError::Unavailable(m)) => {
                assert!(m.contains("siw0") && m.contains("iWARP"), "{m}")
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            check_transport("usnic_0", 2),
            Err(TransportError::Unavailable(_))
        ));
        assert!(check_transport("x", -1).is_err());
    }

    #[test]
    fn memory_is_registered_only_with_fork_protection() {
        assert!(check_fork(0, FORK_ENABLED).is_ok());
        assert!(check_fork(libc::EINVAL, FORK_UNNEEDED).is_ok());
        match check_fork(libc::ENOSYS, FORK_DISABLED) {
            Err(TransportError::Unavailable(m)) => {
                assert!(m.contains("fork protection is off"), "{m}");
                assert!(m.contains("RDMAV_FORK_SAFE"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn async_events_map_to_actions() {
        assert_eq!(event_action(1), EventAction::FailQp);
        assert_eq!(event_action(3), EventAction::FailQp);
        assert_eq!(event_action(8), EventAction::FailAll);
        assert_eq!(event_action(10), EventAction::FailAll);
        assert_eq!(event_action(9), EventAction::RefreshAddress);
        assert_eq!(event_action(18), EventAction::RefreshAddress);
        assert_eq!(event_action(4), EventAction::Ignore);
        assert_eq!(event_action(999), EventAction::Ignore);
    }

    #[test]
    fn settings_are_checked() {
        assert!(VerbsSettings::default().check().is_ok());
        let s = VerbsSettings {
            port: 0,
            ..VerbsSettings::default()
        };
        assert!(s.check().is_err());
        let s = VerbsSettings {
            service_level: 16,
            ..VerbsSettings::default()
        };
        assert!(s.check().unwrap_err().to_string().contains("0-15"));
        for q in [0, MAX_QPS_PER_AGENT + 1] {
            let s = VerbsSettings {
                qps_per_agent: q,
                ..VerbsSettings::default()
            };
            assert!(s
                .check()
                .unwrap_err()
                .to_string()
                .contains("rdma_qps_per_agent"));
        }
    }
}
