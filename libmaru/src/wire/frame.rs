//! Length-prefixed frames: `u32` little-endian length of what follows, `u8` kind, body.
//!
//! The decoder is incremental and sans-I/O: feed it whatever bytes arrived and take
//! out whole frames. It never allocates more than the configured maximum for one
//! frame, so a hostile length prefix cannot make a daemon reserve gigabytes.

/// Bytes of the header: u32 length + u8 kind.
pub const HEADER_LEN: usize = 5;

/// Default largest body a control connection accepts (1 MiB).
pub const DEFAULT_MAX_FRAME: usize = 1 << 20;

/// What a frame carries. Values are stable on the wire and never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Handshake message (JSON): hello, welcome, proof, auth result.
    Handshake = 1,
    /// A control request (JSON).
    Request = 2,
    /// The reply to one request (JSON).
    Reply = 3,
    /// A protocol error the peer sends before it may close (JSON).
    Error = 4,
    /// A binary data-plane operation (soft transport).
    Data = 16,
    /// The completion of a data-plane operation (soft transport).
    DataCompletion = 17,
}

impl FrameKind {
    pub fn from_u8(v: u8) -> Option<FrameKind> {
        Some(match v {
            1 => FrameKind::Handshake,
            2 => FrameKind::Request,
            3 => FrameKind::Reply,
            4 => FrameKind::Error,
            16 => FrameKind::Data,
            17 => FrameKind::DataCompletion,
            _ => return None,
        })
    }
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub body: Vec<u8>,
}

impl Frame {
    pub fn new(kind: FrameKind, body: Vec<u8>) -> Frame {
        Frame { kind, body }
    }
}

/// Why a byte stream is not a valid frame sequence. After any of these the stream
/// cannot be resynchronised, so the connection must be closed (after an error reply).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length prefix says more than the connection's maximum.
    #[error("frame of {len} bytes exceeds the maximum of {max} bytes for this connection")]
    TooLarge { len: usize, max: usize },
    /// The length prefix is 0: there is not even a kind byte.
    #[error("frame with length 0 (no kind byte)")]
    Empty,
    /// A kind byte this version does not know.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
}

/// Writes the header for a frame whose body is `body_len` bytes.
pub fn encode_header(kind: FrameKind, body_len: usize) -> [u8; HEADER_LEN] {
    let len = (body_len + 1) as u32;
    let l = len.to_le_bytes();
    [l[0], l[1], l[2], l[3], kind as u8]
}

/// Appends one whole frame to `out`.
pub fn encode_into(kind: FrameKind, body: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&encode_header(kind, body.len()));
    out.extend_from_slice(body);
}

/// Encodes `value` as JSON into `out` (cleared first) as one whole frame, with no
/// buffer of its own: a caller that keeps `out` allocates nothing once it has grown
/// to its frames' size. The bytes are those of `encode(kind, &encode_json(value))`.
pub fn encode_json_frame<T: serde::Serialize>(
    kind: FrameKind,
    value: &T,
    out: &mut Vec<u8>,
) -> Result<(), serde_json::Error> {
    out.clear();
    out.extend_from_slice(&[0; HEADER_LEN]);
    let r = serde_json::to_writer(&mut *out, value);
    if let Err(e) = r {
        out.clear();
        return Err(e);
    }
    let header = encode_header(kind, out.len() - HEADER_LEN);
    out[..HEADER_LEN].copy_from_slice(&header);
    Ok(())
}

/// Encodes one whole frame.
pub fn encode(kind: FrameKind, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    encode_into(kind, body, &mut out);
    out
}

/// Room a decoder keeps between frames; a bigger buffer (left by a big frame) goes
/// back once it is empty.
const KEEP_CAPACITY: usize = 16 << 10;

/// Incremental frame decoder.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    start: usize,
    max_body: usize,
    failed: Option<FrameError>,
}

/// What the bytes buffered say about the next frame.
enum Peek {
    /// Its length prefix has not arrived yet.
    Unknown,
    /// It takes this many bytes, header included.
    Len(usize),
    /// The stream is broken here.
    Bad(FrameError),
}

impl FrameDecoder {
    /// A decoder that accepts bodies up to `max_body` bytes.
    pub fn new(max_body: usize) -> FrameDecoder {
        FrameDecoder {
            buf: Vec::new(),
            start: 0,
            max_body,
            failed: None,
        }
    }

    pub fn max_body(&self) -> usize {
        self.max_body
    }

    /// Changes the largest body accepted from now on (a connection accepts only small
    /// frames before its peer proved the key, and the full size after).
    pub fn set_max_body(&mut self, max_body: usize) {
        self.max_body = max_body;
    }

    /// Adds bytes read from the peer. The buffer grows to what the frame under way
    /// needs, not to the next power of two: a reader that bounds what it pushes
    /// bounds what the decoder holds.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.failed.is_some() {
            return;
        }
        self.compact();
        let need = match self.peek() {
            Peek::Len(n) => n.max(self.buf.len() + bytes.len()),
            _ => self.buf.len() + bytes.len(),
        };
        self.buf.reserve_exact(need.saturating_sub(self.buf.len()));
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received but not yet part of a returned frame.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Bytes it may still take before it holds as much as one frame of the largest
    /// size needs. A reader that never reads more than this (and takes the frames out
    /// before reading on) keeps at most one largest frame buffered: the bound on what
    /// a peer that proved nothing yet can make a daemon hold.
    pub fn room(&self) -> usize {
        (self.max_body + HEADER_LEN).saturating_sub(self.buffered())
    }

    /// The bytes the next frame takes, header included, once its length prefix has
    /// arrived (whether or not the frame is valid: [`next_frame`](Self::next_frame)
    /// says that).
    pub fn next_len(&self) -> Option<usize> {
        let avail = &self.buf[self.start..];
        (avail.len() >= 4)
            .then(|| u32::from_le_bytes([avail[0], avail[1], avail[2], avail[3]]) as usize + 4)
    }

    /// Whether [`next_frame`](Self::next_frame) has something to return now: a whole
    /// frame, or the error that ends the stream.
    pub fn frame_ready(&self) -> bool {
        match self.peek() {
            Peek::Unknown => false,
            Peek::Len(n) => self.buffered() >= n,
            Peek::Bad(_) => true,
        }
    }

    fn peek(&self) -> Peek {
        if let Some(e) = &self.failed {
            return Peek::Bad(e.clone());
        }
        let avail = &self.buf[self.start..];
        let Some(n) = self.next_len() else {
            return Peek::Unknown;
        };
        let len = n - 4;
        if len == 0 {
            Peek::Bad(FrameError::Empty)
        } else if len - 1 > self.max_body {
            Peek::Bad(FrameError::TooLarge {
                len: len - 1,
                max: self.max_body,
            })
        } else if avail.len() > 4 && FrameKind::from_u8(avail[4]).is_none() {
            Peek::Bad(FrameError::UnknownKind(avail[4]))
        } else {
            Peek::Len(n)
        }
    }

    /// The next whole frame, `Ok(None)` when more bytes are needed. Once it returned
    /// an error it keeps returning it: the stream is out of sync for good.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        let n = match self.peek() {
            Peek::Unknown => {
                self.compact();
                return Ok(None);
            }
            Peek::Bad(e) => {
                self.failed = Some(e.clone());
                self.buf = Vec::new();
                self.start = 0;
                return Err(e);
            }
            Peek::Len(n) if self.buffered() < n => {
                self.compact();
                return Ok(None);
            }
            Peek::Len(n) => n,
        };
        let avail = &self.buf[self.start..];
        // Checked by peek: the kind byte is known.
        let kind = FrameKind::from_u8(avail[4]).ok_or(FrameError::UnknownKind(avail[4]))?;
        let body = avail[HEADER_LEN..n].to_vec();
        self.start += n;
        if self.start == self.buf.len() {
            self.start = 0;
            if self.buf.capacity() > KEEP_CAPACITY {
                // A big frame passed: its room goes back, so an idle connection that
                // once sent one does not keep it.
                self.buf = Vec::new();
            } else {
                self.buf.clear();
            }
        }
        Ok(Some(Frame { kind, body }))
    }

    /// The bytes received after the last returned frame (for a connection that leaves
    /// framing after its handshake, as the soft transport's data connection does).
    pub fn into_rest(self) -> Vec<u8> {
        self.buf[self.start..].to_vec()
    }

    fn compact(&mut self) {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A frame encoded in place is the frame of the JSON encoded apart, and the
    /// buffer is reused: a second, shorter request leaves nothing of the first.
    #[test]
    fn a_json_frame_encoded_in_place_is_the_same_frame() {
        let long = serde_json::json!({"id": 7, "op": "exists", "keys": ["a", "b\"c", "é"]});
        let short = serde_json::json!({"id": 8});
        let mut out = Vec::new();
        for v in [&long, &short, &long] {
            encode_json_frame(FrameKind::Request, v, &mut out).expect("encodable");
            assert_eq!(
                out,
                encode(FrameKind::Request, &serde_json::to_vec(v).expect("json"))
            );
            let mut d = FrameDecoder::new(1024);
            d.push(&out);
            let f = d.next_frame().expect("valid").expect("whole");
            assert_eq!(f.kind, FrameKind::Request);
            assert_eq!(
                serde_json::from_slice::<serde_json::Value>(&f.body).expect("json"),
                *v
            );
        }
    }

    /// Once the buffer holds a frame of the size, encoding another allocates nothing.
    #[test]
    fn a_kept_buffer_encodes_without_allocating() {
        let keys: Vec<String> = (0..32).map(|i| format!("engine/layer/{i:08}")).collect();
        let req = serde_json::json!({"id": 1, "op": "exists", "keys": keys});
        let mut out = Vec::new();
        encode_json_frame(FrameKind::Request, &req, &mut out).expect("encodable");
        let (r, n) = crate::test_alloc::allocations_in(|| {
            encode_json_frame(FrameKind::Request, &req, &mut out)
        });
        r.expect("encodable");
        assert_eq!(n, 0);
    }

    #[test]
    fn round_trip_in_pieces() {
        let mut bytes = encode(FrameKind::Request, b"{\"a\":1}");
        bytes.extend(encode(FrameKind::Reply, b""));
        let mut d = FrameDecoder::new(64);
        let mut got = Vec::new();
        for b in &bytes {
            d.push(std::slice::from_ref(b));
            while let Some(f) = d.next_frame().unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[0],
            Frame::new(FrameKind::Request, b"{\"a\":1}".to_vec())
        );
        assert_eq!(got[1], Frame::new(FrameKind::Reply, vec![]));
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn room_is_what_one_largest_frame_still_needs() {
        let mut d = FrameDecoder::new(16);
        assert_eq!(d.room(), 16 + HEADER_LEN);
        d.push(&encode_header(FrameKind::Handshake, 16));
        d.push(&[0; 10]);
        assert_eq!(d.room(), 6);
        d.push(&[0; 6]);
        assert_eq!(
            d.room(),
            0,
            "a whole largest frame is held: take it out first"
        );
        assert!(d.next_frame().unwrap().is_some());
        assert_eq!(d.room(), 16 + HEADER_LEN);
    }

    #[test]
    fn a_big_frame_leaves_no_big_buffer_behind() {
        let mut d = FrameDecoder::new(4 << 20);
        d.push(&encode(FrameKind::Request, &vec![7u8; 2 << 20]));
        assert_eq!(d.next_frame().unwrap().unwrap().body.len(), 2 << 20);
        assert!(d.buf.capacity() <= KEEP_CAPACITY, "{}", d.buf.capacity());
        d.push(&encode(FrameKind::Request, b"small"));
        assert_eq!(d.next_frame().unwrap().unwrap().body, b"small");
        assert!(d.buf.capacity() <= KEEP_CAPACITY);
    }

    #[test]
    fn the_next_frames_size_is_known_from_its_prefix_and_held_exactly() {
        let mut d = FrameDecoder::new(1 << 20);
        assert_eq!(d.next_len(), None);
        d.push(&encode_header(FrameKind::Request, 300_000));
        assert_eq!(d.next_len(), Some(300_000 + HEADER_LEN));
        assert!(!d.frame_ready());
        for _ in 0..10 {
            d.push(&[b' '; 30_000]);
        }
        assert!(d.frame_ready());
        assert_eq!(
            d.buf.capacity(),
            300_000 + HEADER_LEN,
            "the frame's size, not the next power of two"
        );
        assert_eq!(d.next_frame().unwrap().unwrap().body.len(), 300_000);
        // A broken prefix is something next_frame returns (an error) at once.
        d.push(&encode_header(FrameKind::Request, 2 << 20));
        assert!(d.frame_ready());
        assert!(d.next_frame().is_err());
    }

    #[test]
    fn oversized_is_refused_before_the_body_arrives() {
        let mut d = FrameDecoder::new(16);
        d.push(&encode_header(FrameKind::Request, 17));
        assert_eq!(
            d.next_frame(),
            Err(FrameError::TooLarge { len: 17, max: 16 })
        );
        // Sticky: the stream is out of sync.
        d.push(b"more");
        assert!(d.next_frame().is_err());
    }

    #[test]
    fn zero_length_and_unknown_kind_are_errors() {
        let mut d = FrameDecoder::new(16);
        d.push(&[0, 0, 0, 0]);
        assert_eq!(d.next_frame(), Err(FrameError::Empty));
        let mut d = FrameDecoder::new(16);
        d.push(&[2, 0, 0, 0, 99, 0]);
        assert_eq!(d.next_frame(), Err(FrameError::UnknownKind(99)));
    }

    proptest! {
        /// Any byte soup either yields frames, asks for more, or fails cleanly; it never
        /// panics and never yields a body over the maximum.
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512),
                                       max in 0usize..64) {
            let mut d = FrameDecoder::new(max);
            d.push(&data);
            for _ in 0..600 {
                match d.next_frame() {
                    Ok(Some(f)) => prop_assert!(f.body.len() <= max),
                    Ok(None) | Err(_) => break,
                }
            }
        }

        /// What the event loop reads by agrees with what the decoder returns:
        /// `frame_ready` says whether `next_frame` has a frame or an error, `next_len`
        /// is that frame's size; and the buffer never grows past the frame under way
        /// or what was pushed, whichever is larger (no power-of-two slack).
        #[test]
        fn ready_and_len_agree_with_next_frame(
            data in proptest::collection::vec(any::<u8>(), 0..2048),
            max in 0usize..512,
            piece in 1usize..300,
        ) {
            let mut d = FrameDecoder::new(max);
            'outer: for chunk in data.chunks(piece) {
                d.push(chunk);
                let bound = d.next_len().unwrap_or(0).max(d.buffered()).max(KEEP_CAPACITY);
                prop_assert!(d.buf.capacity() <= bound, "{} > {}", d.buf.capacity(), bound);
                loop {
                    let (ready, len) = (d.frame_ready(), d.next_len());
                    match d.next_frame() {
                        Ok(Some(f)) => {
                            prop_assert!(ready);
                            prop_assert_eq!(len, Some(f.body.len() + HEADER_LEN));
                        }
                        Ok(None) => { prop_assert!(!ready); break; }
                        Err(_) => { prop_assert!(ready); break 'outer; }
                    }
                }
            }
        }

        /// Encoded frames decode to themselves whatever the split points.
        #[test]
        fn encode_decode_round_trip(bodies in proptest::collection::vec(
                                        proptest::collection::vec(any::<u8>(), 0..100), 0..8),
                                    split in 1usize..50) {
            let mut bytes = Vec::new();
            for b in &bodies { encode_into(FrameKind::Data, b, &mut bytes); }
            let mut d = FrameDecoder::new(100);
            let mut got = Vec::new();
            for chunk in bytes.chunks(split) {
                d.push(chunk);
                while let Some(f) = d.next_frame().unwrap() { got.push(f.body); }
            }
            prop_assert_eq!(got, bodies);
        }
    }
}
