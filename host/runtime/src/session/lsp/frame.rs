//! LSP's base protocol: `Content-Length: N\r\n` (and optional other headers), a blank line, then
//! N bytes of JSON. A language server runs in the guest, so its output is untrusted input: the
//! header and the body are bounded, and anything else is an error that ends the server.
//!
//! Hand-written because the framing is a dozen lines and the maintained crates that have it
//! (`lsp-server`, `async-lsp`) either read a blocking stream or bring a whole server framework.

use serde_json::Value;

/// Longest header block accepted (servers send one or two short lines).
pub const MAX_HEADER: usize = 4096;
/// Largest message accepted: a completion list or a workspace's symbols fit well within it
/// (parsed, JSON takes several times its text's size: this bounds that too).
pub const MAX_BODY: usize = 8 << 20;

/// Splits a server's output into messages.
#[derive(Debug, Default)]
pub struct Decoder {
    buf: Vec<u8>,
    /// The body length of the message being read, once its header is complete.
    body: Option<usize>,
}

impl Decoder {
    /// Adds output; returns the messages it completes, or why the stream is broken.
    pub fn push(&mut self, data: &[u8]) -> Result<Vec<Value>, String> {
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        // Messages are taken from `at` on; the buffer is shifted once, at the end.
        let mut at = 0;
        let result = loop {
            let rest = &self.buf[at..];
            let len = match self.body {
                Some(len) => len,
                None => {
                    let Some(end) = rest.windows(4).position(|w| w == b"\r\n\r\n") else {
                        if rest.len() > MAX_HEADER {
                            break Err(format!("a header longer than {MAX_HEADER} bytes"));
                        }
                        break Ok(());
                    };
                    if end > MAX_HEADER {
                        break Err(format!("a header longer than {MAX_HEADER} bytes"));
                    }
                    match content_length(&rest[..end]) {
                        Ok(len) => {
                            at += end + 4;
                            self.body = Some(len);
                            len
                        }
                        Err(e) => break Err(e),
                    }
                }
            };
            let rest = &self.buf[at..];
            if rest.len() < len {
                break Ok(());
            }
            let message: Value = match serde_json::from_slice(&rest[..len]) {
                Ok(m) => m,
                Err(e) => break Err(format!("a message that is not JSON: {e}")),
            };
            if !message.is_object() {
                break Err("a message that is not a JSON object".into());
            }
            at += len;
            self.body = None;
            out.push(message);
        };
        self.buf.drain(..at);
        result.map(|()| out)
    }
}

fn content_length(header: &[u8]) -> Result<usize, String> {
    let header = std::str::from_utf8(header).map_err(|_| "a header that is not UTF-8".to_string())?;
    let mut length = None;
    for line in header.split("\r\n") {
        let shown = |s: &str| format!("{:?}", s.chars().take(80).collect::<String>());
        let (name, value) =
            line.split_once(':').ok_or_else(|| format!("a header line without ':': {}", shown(line)))?;
        if name.trim().eq_ignore_ascii_case("content-length") {
            let n: usize =
                value.trim().parse().map_err(|_| format!("a Content-Length that is not a number: {}", shown(value)))?;
            if n > MAX_BODY {
                return Err(format!("a message of {n} bytes (at most {MAX_BODY})"));
            }
            length = Some(n);
        }
    }
    length.ok_or_else(|| "a header without Content-Length".to_string())
}

/// One message, framed.
pub fn encode(message: &Value) -> Vec<u8> {
    let body = message.to_string();
    let mut out = format!("Content-Length: {}\r\n\r\n", body.len()).into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn messages_split_anywhere_come_out_whole_and_in_order() {
        let a = json!({"jsonrpc": "2.0", "id": 1, "result": {"é": "ünïcode"}});
        let b = json!({"jsonrpc": "2.0", "method": "x", "params": [1, 2]});
        let mut stream = encode(&a);
        stream.extend(b"Content-Type: application/vscode-jsonrpc; charset=utf-8\r\n");
        stream.extend(encode(&b));
        for step in [1, 2, 7, stream.len()] {
            let mut d = Decoder::default();
            let mut got = Vec::new();
            for chunk in stream.chunks(step) {
                got.extend(d.push(chunk).unwrap());
            }
            assert_eq!(got, [a.clone(), b.clone()], "chunks of {step}");
        }
    }

    #[test]
    fn a_hostile_stream_is_an_error_not_a_hang_or_an_allocation() {
        let cases: [(&[u8], &str); 6] = [
            (b"Content-Length: 99999999999\r\n\r\n", "at most"),
            (b"Content-Length: -1\r\n\r\n", "not a number"),
            (b"X-Nothing: 1\r\n\r\n", "without Content-Length"),
            (b"garbage\r\n\r\n", "without ':'"),
            (b"Content-Length: 4\r\n\r\nnull", "not a JSON object"),
            (b"Content-Length: 3\r\n\r\n{x}", "not JSON"),
        ];
        for (input, want) in cases {
            let e = Decoder::default().push(input).unwrap_err();
            assert!(e.contains(want), "{input:?}: {e}");
        }
        // A header that never ends is refused once it passes the bound.
        let mut d = Decoder::default();
        assert!(d.push(&[b'a'; MAX_HEADER]).unwrap().is_empty());
        assert!(d.push(b"a").unwrap_err().contains("header longer"));
    }
}
