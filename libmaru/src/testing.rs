//! Peers for tests, in this crate and (feature `test-hooks`) in the daemons'
//! integration tests: the server side of a handshake, as a fake agent or a fake soft
//! NIC target serves it.

use crate::net::handshake::{ServerHandshake, Step};
use crate::wire::{FrameDecoder, DEFAULT_MAX_FRAME};
use std::io::{Read, Write};

/// Serves `hs` to the client at the other end of `s`, blocking. Once the handshake
/// succeeded (its last reply written): the decoder, holding whatever the client sent
/// after it. `None` when the handshake failed, the client went or sent no frame.
pub fn serve_handshake(
    s: &mut (impl Read + Write),
    mut hs: ServerHandshake,
) -> Option<FrameDecoder> {
    let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME);
    let mut buf = [0u8; 4096];
    loop {
        match dec.next_frame() {
            Ok(Some(f)) => match hs.on_frame(&f) {
                Step::Send(b) => {
                    let _ = s.write_all(&b);
                }
                Step::Ready { send, .. } => {
                    let _ = s.write_all(&send);
                    return Some(dec);
                }
                Step::Fail(_) => return None,
            },
            Ok(None) => match s.read(&mut buf) {
                Ok(0) | Err(_) => return None,
                Ok(n) => dec.push(&buf[..n]),
            },
            Err(_) => return None,
        }
    }
}
