//! The frame decoder of every connection: arbitrary bytes, pushed in arbitrary
//! pieces, give frames or an error, never a panic, and never a frame over the limit;
//! `frame_ready` and `next_len` (what the event loop reads by) agree with
//! `next_frame`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use maru::wire::{frame, FrameDecoder, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    // The first byte picks the limit and the size of the pieces fed in.
    let Some((&ctl, rest)) = data.split_first() else {
        return;
    };
    let max_body = 1 + (ctl as usize & 0x0f) * 64;
    let piece = 1 + (ctl as usize >> 4);
    let mut dec = FrameDecoder::new(max_body);
    let mut frames = Vec::new();
    'outer: for chunk in rest.chunks(piece) {
        dec.push(chunk);
        loop {
            // What the event loop reads by: frame_ready (next_frame has a frame or the
            // error for it) and next_len (the frame's size, header included).
            let (ready, len) = (dec.frame_ready(), dec.next_len());
            match dec.next_frame() {
                Ok(Some(f)) => {
                    assert!(ready, "a frame came though frame_ready said no");
                    assert_eq!(len, Some(f.body.len() + HEADER_LEN));
                    assert!(f.body.len() <= max_body, "frame over the limit");
                    frames.push(f);
                }
                Ok(None) => {
                    assert!(!ready, "frame_ready said yes and nothing came");
                    break;
                }
                Err(_) => {
                    assert!(ready, "an error came though frame_ready said no");
                    break 'outer;
                }
            }
        }
    }
    // What decoded re-encodes to a prefix of the input, byte for byte.
    let mut again = Vec::new();
    for f in &frames {
        frame::encode_into(f.kind, &f.body, &mut again);
    }
    assert!(again.len() <= rest.len());
    assert_eq!(&again[..], &rest[..again.len()]);
    assert!(frames.len() * HEADER_LEN <= again.len());
});
