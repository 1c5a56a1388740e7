//! Byte counting and sha256 on the fly, as Read/Write adapters, so each artifact is hashed in
//! the same single pass that compresses or decompresses it.

use std::io::{Read, Write};

use sha2::{Digest, Sha256};

pub struct Hashing<T> {
    inner: T,
    hasher: Sha256,
    bytes: u64,
}

impl<T> Hashing<T> {
    pub fn new(inner: T) -> Self {
        Self { inner, hasher: Sha256::new(), bytes: 0 }
    }

    pub fn get_ref(&self) -> &T {
        &self.inner
    }

    /// (byte count, lowercase hex sha256, inner)
    pub fn finish(self) -> (u64, String, T) {
        (self.bytes, hex::encode(self.hasher.finalize()), self.inner)
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_digest() {
        let mut h = Hashing::new(Vec::new());
        h.write_all(b"abc").unwrap();
        let (n, digest, out) = h.finish();
        assert_eq!((n, out.as_slice()), (3, &b"abc"[..]));
        assert_eq!(digest, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
