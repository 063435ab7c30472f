//! Work-completion statuses → [`TransportError`].

use crate::transport::{Op, OpKind, TransportError};
use rdma_mummy_sys::ibv_wc_status as s;

/// rdma-core's name for a completion status (without calling into rdma-core).
pub fn text(status: u32) -> &'static str {
    match status {
        s::IBV_WC_SUCCESS => "success",
        s::IBV_WC_LOC_LEN_ERR => "local length error",
        s::IBV_WC_LOC_QP_OP_ERR => "local QP operation error",
        s::IBV_WC_LOC_EEC_OP_ERR => "local EE context operation error",
        s::IBV_WC_LOC_PROT_ERR => "local protection error",
        s::IBV_WC_WR_FLUSH_ERR => "work request flushed (queue pair in error state)",
        s::IBV_WC_MW_BIND_ERR => "memory window bind error",
        s::IBV_WC_BAD_RESP_ERR => "bad response",
        s::IBV_WC_LOC_ACCESS_ERR => "local access error",
        s::IBV_WC_REM_INV_REQ_ERR => "remote invalid request",
        s::IBV_WC_REM_ACCESS_ERR => {
            "remote access error (key, range or permission refused by the NIC)"
        }
        s::IBV_WC_REM_OP_ERR => "remote operation error",
        s::IBV_WC_RETRY_EXC_ERR => "transport retry counter exceeded (peer unreachable)",
        s::IBV_WC_RNR_RETRY_EXC_ERR => "receiver-not-ready retry counter exceeded",
        s::IBV_WC_LOC_RDD_VIOL_ERR => "local RD domain violation",
        s::IBV_WC_REM_INV_RD_REQ_ERR => "remote invalid RD request",
        s::IBV_WC_REM_ABORT_ERR => "remote aborted",
        s::IBV_WC_INV_EECN_ERR => "invalid EE context number",
        s::IBV_WC_INV_EEC_STATE_ERR => "invalid EE context state",
        s::IBV_WC_FATAL_ERR => "fatal error",
        s::IBV_WC_RESP_TIMEOUT_ERR => "response timeout",
        s::IBV_WC_GENERAL_ERR => "general error",
        _ => "unknown completion status",
    }
}

pub fn describe_op(op: &Op) -> String {
    let kind = match op.kind {
        OpKind::Read => "READ",
        OpKind::Write => "WRITE",
    };
    format!(
        "RDMA {kind} of {} bytes at {:#x} (key {:#x})",
        op.len, op.remote_addr, op.rkey
    )
}

/// The error of one failed operation. `earlier`: the first failure of the queue pair,
/// when this one is only its consequence (a flush).
pub fn op_error(
    status: u32,
    vendor_err: u32,
    op: &Op,
    peer: &str,
    earlier: Option<&str>,
) -> TransportError {
    match status {
        // The NIC refused the key, the range or the permission: nothing was read or
        // written. The three are one status on the wire.
        s::IBV_WC_REM_ACCESS_ERR => TransportError::BadKey { rkey: op.rkey },
        s::IBV_WC_LOC_PROT_ERR | s::IBV_WC_LOC_ACCESS_ERR | s::IBV_WC_LOC_LEN_ERR => {
            TransportError::LocalRange {
                offset: op.local_offset,
                len: op.len,
            }
        }
        s::IBV_WC_WR_FLUSH_ERR => TransportError::PeerLost {
            peer: peer.to_string(),
            message: match earlier {
                Some(e) => format!("{} flushed after an earlier failure: {e}", describe_op(op)),
                None => format!(
                    "{} flushed: the queue pair entered the error state",
                    describe_op(op)
                ),
            },
        },
        other => TransportError::PeerLost {
            peer: peer.to_string(),
            message: format!(
                "{} failed: {} (status {other}, vendor error {vendor_err:#x})",
                describe_op(op),
                text(other)
            ),
        },
    }
}
