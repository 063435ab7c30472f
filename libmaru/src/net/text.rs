//! Text a peer sent, made safe for a log line or an error message: at most
//! [`CLIP_BYTES`] bytes, control characters and quotes escaped. A peer may send a
//! megabyte-long client id or a hello full of newlines; logging it whole lets anyone
//! who can connect fill the disk (or forge log lines) before any key proof.

/// Most bytes of peer text kept (before the note of how much was cut).
pub const CLIP_BYTES: usize = 128;

/// `s` escaped (as Rust's `escape_debug`) and cut to [`CLIP_BYTES`] bytes, with the
/// original length noted when it was cut.
pub fn clip(s: &str) -> String {
    let mut out = String::with_capacity(s.len().min(CLIP_BYTES) + 24);
    let mut cut = false;
    for c in s.chars() {
        let esc: String = c.escape_debug().collect();
        if out.len() + esc.len() > CLIP_BYTES {
            cut = true;
            break;
        }
        out.push_str(&esc);
    }
    if cut {
        out.push_str(&format!("…({} bytes)", s.len()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_text_is_cut_and_control_characters_escaped() {
        let long = "a".repeat(1 << 20);
        let c = clip(&long);
        assert!(c.len() <= CLIP_BYTES + 24, "{}", c.len());
        assert!(c.ends_with("(1048576 bytes)"));
        assert_eq!(clip("x\ny\u{1b}[31m\""), "x\\ny\\u{1b}[31m\\\"");
        assert_eq!(clip("plain"), "plain");
    }
}
