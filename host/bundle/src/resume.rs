//! The compressed bytes of one artifact as a `Read` that survives dropped connections.
//!
//! The verifying pipeline (hash, zstd, hash, write) reads from this and never sees a failure it
//! could survive: a dropped connection or a 5xx is retried here with backoff and resumed with
//! `Range: bytes=<received>-`, and the pipeline's decompressor simply continues with the next
//! byte — no pass is restarted within a process. A server that ignores Range answers 200 with
//! the whole body, and the bytes already received are skipped.
//!
//! Received bytes are also appended to a `.part` file, so a pull killed halfway resumes in the
//! next process: the `.part` prefix is replayed from disk through the same pipeline first (it is
//! not trusted — it is hashed with the rest), then the network continues from its end.
//!
//! A failure that is final is kept in `error` and reported as an opaque I/O error through the
//! pipeline; the caller takes the real one back from here.

use std::fs::File;
use std::io::{Read, Write};
use std::path::PathBuf;

use crate::fetch::{chain, Failure, Fetcher, Location, Transient};
use crate::progress::{Meter, Phase};
use crate::BundleError;

pub(crate) struct Resuming<'f, 'm, 'a> {
    fetcher: &'f Fetcher,
    loc: Location,
    what: String,
    expected: u64,
    /// Bytes from an earlier process's `.part`, replayed before the network.
    prefix: Option<File>,
    /// Where received bytes are appended, for the next process.
    part: Option<(File, PathBuf)>,
    body: Option<Box<dyn Read + Send>>,
    skip: u64,
    /// Bytes handed to the pipeline so far: the offset of the next request.
    delivered: u64,
    finished: bool,
    failures: u32,
    meter: &'m mut Meter<'a>,
    pub error: Option<BundleError>,
}

impl<'f, 'm, 'a> Resuming<'f, 'm, 'a> {
    pub fn new(
        fetcher: &'f Fetcher,
        loc: Location,
        what: String,
        expected: u64,
        prefix: Option<File>,
        part: Option<(File, PathBuf)>,
        meter: &'m mut Meter<'a>,
    ) -> Self {
        Self {
            fetcher,
            loc,
            what,
            expected,
            prefix,
            part,
            body: None,
            skip: 0,
            delivered: 0,
            finished: false,
            failures: 0,
            meter,
            error: None,
        }
    }

    fn fail(&mut self, e: BundleError) -> std::io::Error {
        let msg = e.to_string();
        self.error = Some(e);
        std::io::Error::other(msg)
    }

    /// Backs off before the next attempt, or gives up.
    fn wait(&mut self, why: Transient) -> std::io::Result<()> {
        self.body = None;
        self.failures += 1;
        match self.fetcher.retry.delay(self.failures) {
            Some(d) => {
                let msg =
                    format!("{why}; retry {} in {} ms from byte {}", self.failures, d.as_millis(), self.delivered);
                self.meter.emit(Phase::Retry, Some(msg));
                std::thread::sleep(d);
                Ok(())
            }
            None => {
                let e = why.give_up(&self.what, &self.loc, self.failures);
                Err(self.fail(e))
            }
        }
    }

    fn received(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if let Some((f, path)) = &mut self.part {
            if let Err(e) = f.write_all(bytes) {
                let e = match e.raw_os_error() {
                    Some(libc::ENOSPC) | Some(libc::EDQUOT) => BundleError::DiskFull {
                        artifact: self.what.trim_start_matches("artifact ").to_string(),
                        file: self.loc.display(),
                        path: path.display().to_string(),
                    },
                    _ => crate::io_err("cannot write", path)(e),
                };
                return Err(self.fail(e));
            }
        }
        self.delivered += bytes.len() as u64;
        self.failures = 0;
        self.meter.add(bytes.len() as u64);
        Ok(())
    }
}

impl Read for Resuming<'_, '_, '_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.error.is_some() {
            return Err(std::io::Error::other("the download already failed"));
        }
        if buf.is_empty() {
            return Ok(0);
        }
        if let Some(p) = &mut self.prefix {
            let n = p.read(buf)?;
            if n > 0 {
                self.delivered += n as u64;
                return Ok(n);
            }
            self.prefix = None;
        }
        loop {
            if self.finished || (self.body.is_none() && self.delivered >= self.expected) {
                // Either the server ended the body cleanly, or everything declared is here and a
                // request for more would only earn a 416. The pipeline checks the length.
                return Ok(0);
            }
            let Some(body) = &mut self.body else {
                match self.fetcher.open(&self.loc, &self.what, self.delivered, Some(self.expected)) {
                    Ok(o) => {
                        self.body = Some(o.body);
                        self.skip = o.skip;
                    }
                    Err(Failure::Fatal(e)) => return Err(self.fail(e)),
                    Err(Failure::Retry(why)) => self.wait(why)?,
                }
                continue;
            };
            if self.skip > 0 {
                let mut scratch = [0u8; 64 * 1024];
                let want = scratch.len().min(self.skip as usize);
                match body.read(&mut scratch[..want]) {
                    Ok(0) => {
                        let reason =
                            format!("ignored Range and sent fewer than the {} bytes already received", self.delivered);
                        let e = BundleError::Protocol { what: self.what.clone(), url: self.loc.display(), reason };
                        return Err(self.fail(e));
                    }
                    Ok(n) => self.skip -= n as u64,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => self.wait(Transient::Network(chain(&e)))?,
                }
                continue;
            }
            match body.read(buf) {
                Ok(0) => {
                    self.finished = true;
                    self.body = None;
                    return Ok(0);
                }
                Ok(n) => {
                    self.received(&buf[..n])?;
                    return Ok(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => self.wait(Transient::Network(chain(&e)))?,
            }
        }
    }
}
