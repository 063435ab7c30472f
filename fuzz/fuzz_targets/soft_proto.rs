//! The soft NIC's binary headers: request headers as the target decodes them, the
//! target's key and range check on each, and completions as the worker decodes them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::transport::soft::proto::{self, Completion, Request, CPL_LEN, REQ_LEN};

fuzz_target!(|data: &[u8]| {
    for chunk in data.chunks(REQ_LEN) {
        let mut b = [0u8; REQ_LEN];
        b[..chunk.len()].copy_from_slice(chunk);
        if let Ok(r) = Request::decode(&b) {
            assert!(r.len <= proto::MAX_OP_LEN);
            assert_eq!(r.encode(), b, "a decoded header re-encodes byte for byte");
            // The check every operation passes before it touches memory: an accepted
            // range lies inside the registration, whatever the numbers.
            let (base, len) = (r.seq, r.rkey >> 1);
            if proto::op_status(base, len, true, &r) == proto::ST_OK {
                assert!(r.addr >= base);
                assert!((r.addr as u128 + r.len as u128) <= base as u128 + len as u128);
            }
        }
    }
    for chunk in data.chunks(CPL_LEN) {
        let mut b = [0u8; CPL_LEN];
        b[..chunk.len()].copy_from_slice(chunk);
        let c = Completion::decode(&b);
        let _ = c.encode();
    }
});
