//! Getting bytes by URL: `http(s)://` through reqwest (rustls), `file://` from disk. One
//! request is one attempt; this module decides what an answer means — a body to read, a reason
//! to retry (network errors, 5xx), or a final error (4xx, a length that contradicts the
//! manifest) — and the callers own the retry loops. Responses are checked against the manifest
//! before their bodies are read, so a server announcing the wrong length fails at once.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use reqwest::blocking::Client;
use reqwest::header::{CONTENT_RANGE, RANGE};
use reqwest::Url;

use crate::manifest::MANIFEST_FILE;
use crate::retry::{retryable_status, RetryPolicy};
use crate::BundleError;

/// Where a manifest or an artifact lives.
#[derive(Debug, Clone)]
pub(crate) enum Location {
    Http(Url),
    File(PathBuf),
}

impl Location {
    /// The manifest of the bundle at `url`: a URL of `manifest.json` (any `*.json`) or of the
    /// directory holding it.
    pub fn manifest(url: &str) -> Result<Self, BundleError> {
        let bad = |reason: &str| BundleError::Url { url: url.to_string(), reason: reason.to_string() };
        let parsed = Url::parse(url).map_err(|e| bad(&e.to_string()))?;
        match parsed.scheme() {
            "http" | "https" => {
                if parsed.path().ends_with(".json") {
                    return Ok(Self::Http(parsed));
                }
                let mut dir = parsed.clone();
                if !dir.path().ends_with('/') {
                    dir.set_path(&format!("{}/", dir.path()));
                }
                Ok(Self::Http(dir.join(MANIFEST_FILE).map_err(|e| bad(&e.to_string()))?))
            }
            "file" => {
                let path = parsed.to_file_path().map_err(|()| bad("not a local file path"))?;
                Ok(Self::File(if path.is_dir() { path.join(MANIFEST_FILE) } else { path }))
            }
            other => Err(bad(&format!("scheme {other}: is not supported (http, https, file)"))),
        }
    }

    /// Refuses a URL this pull may not fetch (see [`crate::check_url`]), before any request.
    pub fn check(&self, original: &str, allow_http_loopback: bool) -> Result<(), BundleError> {
        match self {
            Self::Http(u) => crate::check_url(u, allow_http_loopback)
                .map_err(|reason| BundleError::Url { url: original.to_string(), reason }),
            Self::File(_) => Ok(()),
        }
    }

    /// The file `name` beside this one (an artifact beside its manifest).
    pub fn sibling(&self, name: &str) -> Self {
        match self {
            Self::Http(u) => Self::Http(u.join(name).expect("validated file names are relative URL paths")),
            Self::File(p) => Self::File(p.parent().unwrap_or(Path::new("/")).join(name)),
        }
    }

    pub fn is_remote(&self) -> bool {
        matches!(self, Self::Http(_))
    }

    pub fn display(&self) -> String {
        match self {
            Self::Http(u) => u.to_string(),
            Self::File(p) => format!("file://{}", p.display()),
        }
    }
}

/// Why an attempt may succeed when repeated.
#[derive(Debug)]
pub(crate) enum Transient {
    Status(u16),
    Network(String),
}

impl std::fmt::Display for Transient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Status(s) => write!(f, "HTTP {s}"),
            Self::Network(m) => f.write_str(m),
        }
    }
}

impl Transient {
    /// The final error once retries are used up.
    pub fn give_up(self, what: &str, loc: &Location, attempts: u32) -> BundleError {
        match self {
            Self::Status(status) => BundleError::Http {
                what: what.to_string(),
                url: loc.display(),
                status,
                note: ", still failing after retries",
            },
            Self::Network(message) => {
                BundleError::Network { what: what.to_string(), url: loc.display(), attempts, message }
            }
        }
    }
}

pub(crate) enum Failure {
    Retry(Transient),
    Fatal(BundleError),
}

/// A response body positioned at the requested offset once `skip` bytes are discarded (a server
/// that ignores Range answers with the whole body).
pub(crate) struct Opened {
    pub body: Box<dyn Read + Send>,
    pub skip: u64,
}

/// The error and its causes on one line: reqwest's own message alone ("error sending request")
/// rarely says what happened.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

/// Where bundles may come from, beyond the rules every URL obeys: the system policy's
/// `bundle_sources`. Held to the URL asked for by the caller, and here to every redirect,
/// before the redirect's target is contacted: a source the administrator allows cannot hand the
/// download to one they do not.
#[derive(Clone)]
pub struct SourceCheck(pub std::sync::Arc<SourceRule>);

/// Whether a URL may serve a bundle; `Err` says why not.
pub type SourceRule = dyn Fn(&str) -> Result<(), String> + Send + Sync;

impl std::fmt::Debug for SourceCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SourceCheck")
    }
}

pub(crate) struct Fetcher {
    client: OnceLock<Result<Client, String>>,
    idle_timeout: Duration,
    allow_http_loopback: bool,
    sources: Option<SourceCheck>,
    pub retry: RetryPolicy,
}

impl Fetcher {
    pub fn new(
        retry: RetryPolicy,
        idle_timeout: Duration,
        allow_http_loopback: bool,
        sources: Option<SourceCheck>,
    ) -> Self {
        Self { client: OnceLock::new(), idle_timeout, allow_http_loopback, sources, retry }
    }

    /// Built on first use: a blocking client owns a runtime thread that `file://` never needs.
    fn client(&self, loc: &Location) -> Result<&Client, BundleError> {
        let built = self.client.get_or_init(|| {
            // reqwest is built without a default crypto provider; ring is ours. Installing fails
            // harmlessly when the process already chose one.
            let _ = rustls::crypto::ring::default_provider().install_default();
            let allow = self.allow_http_loopback;
            let sources = self.sources.clone();
            // A redirect is held to the same rules as the URL: an https:// server cannot send
            // the download to http://, nor an allowed source to another (decided before the
            // new target is contacted).
            let redirects = reqwest::redirect::Policy::custom(move |attempt| {
                if attempt.previous().len() >= 10 {
                    return attempt.error("more than 10 redirects");
                }
                let checked = crate::sign::check_redirect(attempt.url(), allow)
                    .and_then(|()| sources.as_ref().map_or(Ok(()), |check| (check.0)(attempt.url().as_str())));
                match checked {
                    Ok(()) => attempt.follow(),
                    Err(reason) => {
                        let to = attempt.url().to_string();
                        attempt.error(format!("redirect to {to} refused: {reason}"))
                    }
                }
            });
            Client::builder()
                .redirect(redirects)
                // For the blocking client this bounds each wait (connect, headers, one read), not
                // the whole transfer: a slow download goes on, a silent connection does not.
                .timeout(self.idle_timeout)
                .connect_timeout(Duration::from_secs(15))
                .user_agent(concat!("umbra/", env!("CARGO_PKG_VERSION")))
                .build()
                .map_err(|e| chain(&e))
        });
        built.as_ref().map_err(|reason| BundleError::Url { url: loc.display(), reason: reason.clone() })
    }

    /// One attempt at the bytes of `loc` from `offset` on. `expected` is the whole length the
    /// manifest declares, checked against what the server announces.
    pub fn open(&self, loc: &Location, what: &str, offset: u64, expected: Option<u64>) -> Result<Opened, Failure> {
        match loc {
            Location::File(p) => open_file(p, offset).map_err(Failure::Fatal),
            Location::Http(url) => self.open_http(loc, url, what, offset, expected),
        }
    }

    fn open_http(
        &self,
        loc: &Location,
        url: &Url,
        what: &str,
        offset: u64,
        expected: Option<u64>,
    ) -> Result<Opened, Failure> {
        let client = self.client(loc).map_err(Failure::Fatal)?;
        let mut req = client.get(url.clone());
        if offset > 0 {
            req = req.header(RANGE, format!("bytes={offset}-"));
        }
        let resp = req.send().map_err(|e| {
            if e.is_redirect() {
                // A refused redirect is the server's answer, not a network hiccup.
                Failure::Fatal(BundleError::Url { url: loc.display(), reason: chain(&e) })
            } else {
                Failure::Retry(Transient::Network(chain(&e)))
            }
        })?;
        let status = resp.status().as_u16();
        let protocol = |reason: String| {
            Failure::Fatal(BundleError::Protocol { what: what.to_string(), url: loc.display(), reason })
        };
        // What the server says the whole file measures, against what the manifest says.
        let announced = |kind: &'static str, len: u64| match expected {
            Some(exp) if len != exp => Err(Failure::Fatal(BundleError::SizeMismatch {
                artifact: what.trim_start_matches("artifact ").to_string(),
                file: loc.display(),
                kind,
                expected: exp,
                actual: len,
            })),
            _ => Ok(()),
        };
        match status {
            200 => {
                if let Some(len) = resp.content_length() {
                    announced("announced (Content-Length)", len)?;
                }
                // A 200 to a Range request is the whole body: skip what we already have.
                Ok(Opened { body: Box::new(resp), skip: offset })
            }
            206 if offset > 0 => {
                let range = resp.headers().get(CONTENT_RANGE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                let (start, total) = parse_content_range(&range)
                    .ok_or_else(|| protocol(format!("206 with an unreadable Content-Range {range:?}")))?;
                if start != offset {
                    return Err(protocol(format!("asked for bytes={offset}-, got Content-Range {range:?}")));
                }
                if let Some(total) = total {
                    announced("announced (Content-Range total)", total)?;
                }
                if let Some(len) = resp.content_length() {
                    let end = offset.checked_add(len).ok_or_else(|| {
                        protocol(format!("Content-Length {len} after byte {offset} is past any file size"))
                    })?;
                    announced("announced (Range start + Content-Length)", end)?;
                }
                Ok(Opened { body: Box::new(resp), skip: 0 })
            }
            s if retryable_status(s) => Err(Failure::Retry(Transient::Status(s))),
            s => Err(Failure::Fatal(BundleError::Http {
                what: what.to_string(),
                url: loc.display(),
                status: s,
                note: if (400..500).contains(&s) { ", not retried (client error)" } else { ", unexpected" },
            })),
        }
    }

    /// A small file (the manifest) in full, with retries.
    pub fn fetch_small(&self, loc: &Location, what: &str, limit: u64) -> Result<Vec<u8>, BundleError> {
        let mut failures = 0;
        loop {
            let attempt = self.open(loc, what, 0, None).and_then(|mut o| {
                let mut buf = Vec::new();
                (&mut o.body)
                    .take(limit + 1)
                    .read_to_end(&mut buf)
                    .map_err(|e| Failure::Retry(Transient::Network(chain(&e))))?;
                if buf.len() as u64 > limit {
                    return Err(Failure::Fatal(BundleError::Protocol {
                        what: what.to_string(),
                        url: loc.display(),
                        reason: format!("larger than {limit} bytes"),
                    }));
                }
                Ok(buf)
            });
            match attempt {
                Ok(buf) => return Ok(buf),
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Retry(t)) => {
                    failures += 1;
                    match self.retry.delay(failures) {
                        Some(d) => std::thread::sleep(d),
                        None => return Err(t.give_up(what, loc, failures)),
                    }
                }
            }
        }
    }
}

fn open_file(path: &Path, offset: u64) -> Result<Opened, BundleError> {
    let mut f = File::open(path).map_err(crate::io_err("cannot open", path))?;
    f.seek(SeekFrom::Start(offset)).map_err(crate::io_err("cannot seek", path))?;
    Ok(Opened { body: Box::new(f), skip: 0 })
}

/// `bytes START-END/TOTAL` → (START, TOTAL), TOTAL None for `*`.
fn parse_content_range(v: &str) -> Option<(u64, Option<u64>)> {
    let rest = v.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (start, _end) = range.split_once('-')?;
    let total = if total == "*" { None } else { Some(total.parse().ok()?) };
    Some((start.parse().ok()?, total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_urls_and_siblings() {
        let m = Location::manifest("http://h:1/b/v1").unwrap();
        assert_eq!(m.display(), "http://h:1/b/v1/manifest.json");
        assert_eq!(m.sibling("kernel.zst").display(), "http://h:1/b/v1/kernel.zst");
        let m = Location::manifest("https://h/x/m.json").unwrap();
        assert_eq!(m.sibling("a.zst").display(), "https://h/x/a.zst");
        assert!(Location::manifest("ftp://h/x").unwrap_err().to_string().contains("not supported"));
        assert!(Location::manifest("not a url").is_err());
        let f = Location::manifest("file:///nonexistent/b/manifest.json").unwrap();
        assert_eq!(f.sibling("k.zst").display(), "file:///nonexistent/b/k.zst");
    }

    #[test]
    fn content_range() {
        assert_eq!(parse_content_range("bytes 100-199/200"), Some((100, Some(200))));
        assert_eq!(parse_content_range("bytes 5-9/*"), Some((5, None)));
        assert_eq!(parse_content_range("items 1-2/3"), None);
    }
}
