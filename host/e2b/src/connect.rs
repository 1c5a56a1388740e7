//! The Connect protocol (connectrpc.com/docs/protocol) as envd speaks it to the E2B SDKs: the
//! JSON codec only (both SDKs use it), unary calls as plain JSON bodies, server streams as
//! enveloped messages ending with an end-of-stream message, over HTTP/1.1.

use std::convert::Infallible;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use serde::Serialize;
use tokio::sync::mpsc;

/// A response body. Its error aborts the response (a download that fails part way must not
/// look complete).
pub type Body = BoxBody<Bytes, std::io::Error>;

/// A whole body.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|never: Infallible| match never {}).boxed()
}

/// Largest message accepted in a request (a `SendInput` of a big paste, base64).
pub const MAX_MESSAGE: usize = 16 << 20;
/// Messages of one stream buffered ahead of a slow reader: past this, the sender waits (and a
/// process's output is not acknowledged to umbrad, which pauses the process).
const STREAM_QUEUE: usize = 16;

const FLAG_COMPRESSED: u8 = 0x01;
const FLAG_END: u8 = 0x02;

/// A Connect error: its code (`not_found`, …) and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectError {
    pub code: &'static str,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }

    /// The HTTP status of a unary call that fails with this code (the protocol's table).
    pub fn status(&self) -> StatusCode {
        match self.code {
            "canceled" => StatusCode::from_u16(499).expect("499 is a status"),
            "invalid_argument" | "out_of_range" => StatusCode::BAD_REQUEST,
            "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
            "not_found" => StatusCode::NOT_FOUND,
            "already_exists" | "aborted" => StatusCode::CONFLICT,
            "permission_denied" => StatusCode::FORBIDDEN,
            "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
            "failed_precondition" => StatusCode::PRECONDITION_FAILED,
            "unimplemented" => StatusCode::NOT_IMPLEMENTED,
            "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
            "unauthenticated" => StatusCode::UNAUTHORIZED,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code, "message": self.message })
    }
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

fn with_type(body: Body, status: StatusCode, content_type: &'static str) -> Response<Body> {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// A unary call's answer: the message, or the error with its status.
pub fn unary<T: Serialize>(result: Result<T, ConnectError>) -> Response<Body> {
    match result.and_then(|m| {
        serde_json::to_vec(&m).map_err(|e| ConnectError::new("internal", format!("cannot encode the answer: {e}")))
    }) {
        Ok(bytes) => with_type(full(bytes), StatusCode::OK, "application/json"),
        Err(e) => error_response(&e),
    }
}

/// A unary call's error (also what a stream call that fails before it starts gets).
pub fn error_response(e: &ConnectError) -> Response<Body> {
    let body = serde_json::to_vec(&e.json()).expect("an error serializes");
    with_type(full(body), e.status(), "application/json")
}

/// A server-stream call that fails before its stream starts: HTTP 200 and an end-of-stream
/// error, as the SDKs read stream errors (the JavaScript one ignores a stream's HTTP status).
pub fn stream_error(e: &ConnectError) -> Response<Body> {
    let end = serde_json::json!({ "error": e.json() });
    let body = envelope(FLAG_END, &serde_json::to_vec(&end).expect("serializes"));
    with_type(full(body), StatusCode::OK, "application/connect+json")
}

/// The message of a unary request: a JSON body (`application/json`).
pub fn unary_request<T: serde::de::DeserializeOwned>(content_type: &str, body: &[u8]) -> Result<T, ConnectError> {
    let codec = content_type.split(';').next().unwrap_or_default().trim();
    if codec != "application/json" {
        return Err(unsupported_codec(codec));
    }
    decode(body)
}

/// The single message of a server-stream request: one envelope (`application/connect+json`).
pub fn stream_request<T: serde::de::DeserializeOwned>(content_type: &str, body: &[u8]) -> Result<T, ConnectError> {
    let codec = content_type.split(';').next().unwrap_or_default().trim();
    if codec != "application/connect+json" {
        return Err(unsupported_codec(codec));
    }
    let mut envelopes = Envelopes::default();
    envelopes.push(body);
    match envelopes.next_message()? {
        Some((flags, message)) if flags & FLAG_END == 0 => decode(&message),
        _ => Err(ConnectError::new("invalid_argument", "the request has no message")),
    }
}

fn unsupported_codec(codec: &str) -> ConnectError {
    ConnectError::new(
        "unimplemented",
        format!("umbrad's envd speaks Connect with the JSON codec only, not {codec:?} (both E2B SDKs use JSON)"),
    )
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ConnectError> {
    // Connect's JSON: an empty body is the empty message.
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}".as_slice() } else { bytes };
    serde_json::from_slice(bytes)
        .map_err(|e| ConnectError::new("invalid_argument", format!("a malformed message: {e}")))
}

/// Envelopes read from a stream of bytes: `flags(1) | length(4, big-endian) | message`.
#[derive(Default)]
pub struct Envelopes {
    buf: BytesMut,
}

impl Envelopes {
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole envelope, if one has arrived.
    pub fn next_message(&mut self) -> Result<Option<(u8, Bytes)>, ConnectError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if flags & FLAG_COMPRESSED != 0 {
            return Err(ConnectError::new("unimplemented", "compressed messages are not accepted (send identity)"));
        }
        if len > MAX_MESSAGE {
            return Err(ConnectError::new(
                "resource_exhausted",
                format!("a message of {len} bytes (at most {MAX_MESSAGE})"),
            ));
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        Ok(Some((flags, self.buf.split_to(len).freeze())))
    }

    /// Bytes received that make no whole envelope.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

fn envelope(flags: u8, message: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + message.len());
    b.put_u8(flags);
    b.put_u32(message.len() as u32);
    b.put_slice(message);
    b.freeze()
}

/// The sending side of a server stream.
pub struct StreamTx {
    tx: mpsc::Sender<Bytes>,
}

impl StreamTx {
    /// Sends one message; `Err` when the client went away. Waits while the client is behind.
    pub async fn send<T: Serialize>(&self, message: &T) -> Result<(), Gone> {
        let bytes = serde_json::to_vec(message).expect("messages serialize");
        self.tx.send(envelope(0, &bytes)).await.map_err(|_| Gone)
    }

    /// Ends the stream: with `error`, a failed call (still HTTP 200: the SDKs read the code
    /// from here).
    pub async fn end(self, error: Option<ConnectError>) {
        let end = match error {
            Some(e) => serde_json::json!({ "error": e.json() }),
            None => serde_json::json!({}),
        };
        let _ = self.tx.send(envelope(FLAG_END, &serde_json::to_vec(&end).expect("serializes"))).await;
    }

    /// Resolves when the client has gone (the response body was dropped).
    pub async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// The answer of a client-stream call: its one message and the end of the stream, or the
/// end with the error.
pub fn unary_stream_answer<T: Serialize>(result: Result<T, ConnectError>) -> Response<Body> {
    let mut body = BytesMut::new();
    match result {
        Ok(m) => {
            body.extend_from_slice(&envelope(0, &serde_json::to_vec(&m).expect("messages serialize")));
            body.extend_from_slice(&envelope(FLAG_END, b"{}"));
        }
        Err(e) => {
            let end = serde_json::json!({ "error": e.json() });
            body.extend_from_slice(&envelope(FLAG_END, &serde_json::to_vec(&end).expect("serializes")));
        }
    }
    with_type(full(body.freeze()), StatusCode::OK, "application/connect+json")
}

/// The client went away.
#[derive(Debug)]
pub struct Gone;

/// A streaming response (`application/connect+json`, exactly: the Python SDK compares it) and
/// the sender its messages go to.
pub fn stream_response() -> (Response<Body>, StreamTx) {
    let (tx, rx) = mpsc::channel::<Bytes>(STREAM_QUEUE);
    let frames = tokio_stream::wrappers::ReceiverStream::new(rx);
    let body = StreamBody::new(futures_util::StreamExt::map(frames, |b| Ok::<_, std::io::Error>(Frame::data(b))));
    (with_type(BodyExt::boxed(body), StatusCode::OK, "application/connect+json"), StreamTx { tx })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_are_read_whole_across_pieces_and_bounded() {
        let mut e = Envelopes::default();
        let one = envelope(0, br#"{"a":1}"#);
        let end = envelope(FLAG_END, b"{}");
        let all = [one.as_ref(), end.as_ref()].concat();
        e.push(&all[..3]);
        assert_eq!(e.next_message().unwrap(), None);
        e.push(&all[3..9]);
        assert_eq!(e.next_message().unwrap(), None, "a partial message waits");
        e.push(&all[9..]);
        assert_eq!(e.next_message().unwrap(), Some((0, Bytes::from_static(br#"{"a":1}"#))));
        assert_eq!(e.next_message().unwrap(), Some((FLAG_END, Bytes::from_static(b"{}"))));
        assert_eq!((e.next_message().unwrap(), e.pending()), (None, 0));
        let mut big = Envelopes::default();
        big.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(big.next_message().unwrap_err().code, "resource_exhausted");
        let mut gz = Envelopes::default();
        gz.push(&envelope(FLAG_COMPRESSED, b"x"));
        assert_eq!(gz.next_message().unwrap_err().code, "unimplemented");
    }

    #[test]
    fn requests_need_the_json_codec() {
        #[derive(serde::Deserialize, Debug, PartialEq)]
        struct M {
            path: String,
        }
        let m: M = unary_request("application/json; charset=utf-8", br#"{"path":"/x"}"#).unwrap();
        assert_eq!(m.path, "/x");
        let e = unary_request::<M>("application/proto", b"").unwrap_err();
        assert_eq!((e.code, e.status()), ("unimplemented", StatusCode::NOT_IMPLEMENTED));
        let framed = envelope(0, br#"{"path":"/y"}"#);
        assert_eq!(stream_request::<M>("application/connect+json", &framed).unwrap().path, "/y");
        assert_eq!(stream_request::<M>("application/connect+json", b"").unwrap_err().code, "invalid_argument");
        assert_eq!(unary_request::<M>("application/json", b"{").unwrap_err().code, "invalid_argument");
        assert_eq!(ConnectError::new("not_found", "x").status(), StatusCode::NOT_FOUND);
    }
}
