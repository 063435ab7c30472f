//! The soft NIC's binary data-plane format, after the handshake.
//!
//! Request (40 bytes, little-endian): `u8 op` (1 READ, 2 WRITE, 3 BIND), 7 zero bytes,
//! `u64 seq`, `u64 remote_addr`, `u64 rkey`, `u64 len`; a WRITE is followed by `len`
//! payload bytes. Completion (24 bytes): `u64 seq`, `u32 status`, `u32 0`, `u64 len`;
//! a successful READ is followed by `len` payload bytes. Completions come in request
//! order.
//!
//! BIND is a connection's first request: `remote_addr` and `rkey` carry the high and
//! low halves of the binding secret of the owner (agent connection) whose keys this
//! data connection uses (the `bind` field of the transport metadata). Until it
//! succeeds every key is refused; keys of other owners are refused always, and so is a
//! BIND to another owner (`ST_BAD_KEY`). A BIND beyond the owner's cap of data
//! connections completes with `ST_LIMIT`.

pub const REQ_LEN: usize = 40;
pub const CPL_LEN: usize = 24;
/// Largest single operation (bytes).
pub const MAX_OP_LEN: u64 = 1 << 30;
/// Service name of the data connection's handshake.
pub const SERVICE: &str = "maru-soft-nic";

pub const OP_READ: u8 = 1;
pub const OP_WRITE: u8 = 2;
pub const OP_BIND: u8 = 3;

/// Completion status values.
pub const ST_OK: u32 = 0;
pub const ST_BAD_KEY: u32 = 1;
pub const ST_RANGE: u32 = 2;
pub const ST_READ_ONLY: u32 = 3;
/// A BIND refused because the owner has as many data connections as the responder
/// allows one owner (`target::MAX_PER_OWNER`).
pub const ST_LIMIT: u32 = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub op: u8,
    pub seq: u64,
    pub addr: u64,
    pub rkey: u64,
    pub len: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    pub seq: u64,
    pub status: u32,
    pub len: u64,
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

impl Request {
    pub fn encode(&self) -> [u8; REQ_LEN] {
        let mut b = [0u8; REQ_LEN];
        b[0] = self.op;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.rkey.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes a request header; `Err` names what is wrong (the connection is closed).
    pub fn decode(b: &[u8; REQ_LEN]) -> Result<Request, String> {
        let r = Request {
            op: b[0],
            seq: u64_at(b, 8),
            addr: u64_at(b, 16),
            rkey: u64_at(b, 24),
            len: u64_at(b, 32),
        };
        if r.op != OP_READ && r.op != OP_WRITE && r.op != OP_BIND {
            return Err(format!("unknown operation {}", r.op));
        }
        if b[1..8].iter().any(|&x| x != 0) {
            return Err("non-zero padding in a request header".into());
        }
        if r.len > MAX_OP_LEN {
            return Err(format!(
                "operation of {} bytes exceeds the maximum of {MAX_OP_LEN}",
                r.len
            ));
        }
        Ok(r)
    }
}

/// The status an operation gets from a live registration of `reg_len` bytes at
/// `reg_base`: the whole range `[addr, addr + len)` must lie inside it (no overflow
/// wraps around), and a WRITE needs a writable registration.
pub fn op_status(reg_base: u64, reg_len: u64, writable: bool, req: &Request) -> u32 {
    let end = req.addr as u128 + req.len as u128;
    let reg_end = reg_base as u128 + reg_len as u128;
    if req.addr < reg_base || end > reg_end {
        ST_RANGE
    } else if req.op == OP_WRITE && !writable {
        ST_READ_ONLY
    } else {
        ST_OK
    }
}

impl Completion {
    pub fn encode(&self) -> [u8; CPL_LEN] {
        let mut b = [0u8; CPL_LEN];
        b[0..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.status.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; CPL_LEN]) -> Completion {
        let mut st = [0u8; 4];
        st.copy_from_slice(&b[8..12]);
        Completion {
            seq: u64_at(b, 0),
            status: u32::from_le_bytes(st),
            len: u64_at(b, 16),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn range_check_refuses_wrap_around_and_read_only_writes() {
        let req = |op, addr, len| Request {
            op,
            seq: 1,
            addr,
            rkey: 1,
            len,
        };
        let base = 0x1000;
        assert_eq!(
            op_status(base, 0x100, true, &req(OP_WRITE, base, 0x100)),
            ST_OK
        );
        assert_eq!(
            op_status(base, 0x100, true, &req(OP_READ, base, 0x101)),
            ST_RANGE
        );
        assert_eq!(
            op_status(base, 0x100, true, &req(OP_READ, base - 1, 1)),
            ST_RANGE
        );
        // An end past u64::MAX never wraps into the registration.
        assert_eq!(
            op_status(
                u64::MAX - 0xff,
                0x100,
                true,
                &req(OP_READ, u64::MAX - 0xff, 0x101)
            ),
            ST_RANGE
        );
        assert_eq!(
            op_status(base, 0x100, false, &req(OP_WRITE, base, 1)),
            ST_READ_ONLY
        );
        assert_eq!(op_status(base, 0x100, false, &req(OP_READ, base, 1)), ST_OK);
    }

    #[test]
    fn round_trips() {
        let r = Request {
            op: OP_WRITE,
            seq: 7,
            addr: 0x1000,
            rkey: 42,
            len: 4096,
        };
        assert_eq!(Request::decode(&r.encode()), Ok(r));
        let c = Completion {
            seq: 7,
            status: ST_BAD_KEY,
            len: 0,
        };
        assert_eq!(Completion::decode(&c.encode()), c);
    }

    proptest! {
        /// Any 40 bytes decode to a valid request or a clear error, never a panic, and
        /// an accepted request never exceeds the size limit.
        #[test]
        fn request_decoder_total(b in proptest::array::uniform32(any::<u8>()), tail in any::<u64>()) {
            let mut h = [0u8; REQ_LEN];
            h[..32].copy_from_slice(&b);
            h[32..].copy_from_slice(&tail.to_le_bytes());
            if let Ok(r) = Request::decode(&h) {
                prop_assert!(r.len <= MAX_OP_LEN);
                prop_assert!(r.op == OP_READ || r.op == OP_WRITE || r.op == OP_BIND);
            }
        }
    }
}
