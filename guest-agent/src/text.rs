//! Keeping error messages small. Messages name their input (a path, argv[0]), and the input is
//! the host's: echoed whole, a 2 MiB path would make a response too large to send.

/// Longest input shown in a message, in characters.
const SHOWN_CHARS: usize = 256;
/// Longest whole message, in bytes.
const MAX_MESSAGE: usize = 4096;

/// `s` quoted as `{:?}` would, cut to [`SHOWN_CHARS`] characters with a note of the full length.
pub fn shown(s: &str) -> String {
    match s.char_indices().nth(SHOWN_CHARS) {
        None => format!("{s:?}"),
        Some((cut, _)) => format!("{:?}… ({} bytes)", &s[..cut], s.len()),
    }
}

/// `message` cut to [`MAX_MESSAGE`] bytes, at a character boundary.
pub fn clip(mut message: String) -> String {
    if message.len() > MAX_MESSAGE {
        let mut cut = MAX_MESSAGE;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
        message.push('…');
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_inputs_and_messages_are_cut_at_char_boundaries() {
        assert_eq!(shown("/tmp/a"), "\"/tmp/a\"");
        let long = "é".repeat(100_000);
        let s = shown(&long);
        assert!(s.len() < 2 * SHOWN_CHARS + 32 && s.ends_with("(200000 bytes)"), "{s}");
        let m = clip(long);
        assert!(m.len() <= MAX_MESSAGE + 3 && m.ends_with('…'));
        assert_eq!(clip("short".into()), "short");
    }
}
