//! Verified extraction: one streaming pass per artifact that hashes the compressed bytes,
//! decompresses, hashes the output and writes a temp file beside the destination (the last
//! two on a second thread, which also starts the disk writes a window at a time); then fsync,
//! verify sizes and digests, and rename. Output beyond the declared size stops the pass (no
//! zip bomb fills the disk); any mismatch removes the temp file and leaves what was installed.

use std::fs::{self, File};
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};

use crate::digest::Hashing;
use crate::manifest::{Artifact, ArtifactRole, Manifest, MANIFEST_FILE};
use crate::{io_err, BundleError};

/// Decompressed bytes move between the two stages in chunks of this size, at most POOL of
/// them in flight.
const CHUNK: usize = 1 << 20;
const POOL: usize = 4;

/// Marker written last into an extracted bundle directory: its presence means every artifact
/// was verified. It holds the manifest, so a different bundle under the same name is noticed.
pub(crate) const COMPLETE_MARKER: &str = ".complete";

/// Extracts one artifact from its compressed stream into `dest_dir/<name>`.
pub fn extract_artifact(compressed: impl Read, artifact: &Artifact, dest_dir: &Path) -> Result<PathBuf, BundleError> {
    extract_into(compressed, artifact, &artifact.file, dest_dir)
}

/// [`extract_artifact`] with errors naming `source` (the bundle file, or the URL it streams from).
pub(crate) fn extract_into(
    compressed: impl Read,
    artifact: &Artifact,
    source: &str,
    dest_dir: &Path,
) -> Result<PathBuf, BundleError> {
    let dst = dest_dir.join(&artifact.name);
    let tmp = dest_dir.join(format!(".{}.partial", artifact.name));
    let result = extract_to(compressed, artifact, source, &tmp);
    match result {
        Ok(()) => {
            // Never written again, and read by helpers that run as another user (a jailed QEMU
            // is `nobody`): read-only for everyone, whatever the umask.
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&tmp, fs::Permissions::from_mode(0o444))
                .map_err(io_err("cannot set the mode of", &tmp))?;
            fs::rename(&tmp, &dst).map_err(io_err("cannot rename into", &dst))?;
            Ok(dst)
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

fn extract_to(compressed: impl Read, a: &Artifact, source: &str, tmp: &Path) -> Result<(), BundleError> {
    let mismatch_size = |kind, expected, actual| BundleError::SizeMismatch {
        artifact: a.name.clone(),
        file: source.to_string(),
        kind,
        expected,
        actual,
    };
    // A full disk is the one write error users can act on, so it gets its own message.
    let write_err = |e: std::io::Error| match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => BundleError::DiskFull {
            artifact: a.name.clone(),
            file: source.to_string(),
            path: tmp.display().to_string(),
        },
        _ => io_err("cannot write", tmp)(e),
    };
    // One byte more than declared is enough to prove a mismatch.
    let mut input = Hashing::new(compressed.take(a.compressed_size.saturating_add(1)));
    let file = File::create(tmp).map_err(write_err)?;
    // Two stages on two threads, as `curl | zstd -dc | openssl sha256` runs on two cores:
    // this one reads, hashes the compressed bytes and decompresses into pooled 1 MiB chunks;
    // the other hashes the output and writes it. A full pool stalls the decompressor.
    let (written, produced, corrupt) = std::thread::scope(|scope| {
        let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(POOL);
        let (empty_tx, empty_rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(POOL);
        for _ in 0..POOL {
            let _ = empty_tx.send(vec![0u8; CHUNK]);
        }
        let writer = scope.spawn(move || -> std::io::Result<Hashing<File>> {
            let mut out = Hashing::new(file);
            let mut writeback = Writeback::default();
            for chunk in full_rx {
                out.write_all(&chunk)?;
                writeback.wrote(out.get_ref(), chunk.len() as u64);
                let _ = empty_tx.send(chunk);
            }
            Ok(out)
        });
        let mut produced = 0u64;
        let mut corrupt = None;
        match zstd::stream::read::Decoder::new(&mut input) {
            Err(e) => corrupt = Some(e),
            Ok(mut dec) => {
                // The writer ends early (a write error) by dropping its side of the pool.
                while let Ok(mut chunk) = empty_rx.recv() {
                    chunk.resize(CHUNK, 0);
                    let mut filled = 0;
                    while filled < CHUNK {
                        match dec.read(&mut chunk[filled..]) {
                            Ok(0) => break,
                            Ok(n) => filled += n,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                            Err(e) => {
                                corrupt = Some(e);
                                break;
                            }
                        }
                    }
                    chunk.truncate(filled);
                    produced += filled as u64;
                    let last = filled < CHUNK || corrupt.is_some() || produced > a.size;
                    if filled > 0 && full_tx.send(chunk).is_err() {
                        break;
                    }
                    if last {
                        break;
                    }
                }
            }
        }
        drop(full_tx);
        let written = writer.join().unwrap_or_else(|_| Err(std::io::Error::other("the writer thread panicked")));
        (written, produced, corrupt)
    });
    let out = written.map_err(write_err)?;
    if produced > a.size {
        return Err(mismatch_size("uncompressed", a.size, produced));
    }
    // Trailing bytes after the zstd frame count toward the compressed size and digest. After a
    // decompression error the rest is read too (at most the declared size): a wrong compressed
    // digest is the cause worth naming, with both values, and it needs every byte.
    let drained = std::io::copy(&mut input, &mut std::io::sink());
    let (csize, csha, _) = input.finish();
    let (size, sha, file) = out.finish();
    if let Err(e) = drained {
        return Err(BundleError::Decompress {
            artifact: a.name.clone(),
            file: source.to_string(),
            source: corrupt.unwrap_or(e),
        });
    }
    let digest = |kind, expected: &str, actual: String| BundleError::DigestMismatch {
        artifact: a.name.clone(),
        file: source.to_string(),
        kind,
        expected: expected.to_string(),
        actual,
    };
    if csize != a.compressed_size {
        return Err(mismatch_size("compressed", a.compressed_size, csize));
    }
    if csha != a.compressed_sha256 {
        return Err(digest("compressed", &a.compressed_sha256, csha));
    }
    if let Some(e) = corrupt {
        return Err(BundleError::Decompress { artifact: a.name.clone(), file: source.to_string(), source: e });
    }
    file.sync_all().map_err(write_err)?;
    if size != a.size {
        return Err(mismatch_size("uncompressed", a.size, size));
    }
    if sha != a.sha256 {
        return Err(digest("uncompressed", &a.sha256, sha));
    }
    Ok(())
}

/// Starts the disk writes of what was written so far, a window at a time, so that the final
/// fsync finds little left to do: without it the whole file is written back after the last
/// byte, serially, while here it overlaps the decompression.
#[derive(Default)]
struct Writeback {
    written: u64,
    started: u64,
}

impl Writeback {
    const WINDOW: u64 = 8 << 20;

    fn wrote(&mut self, file: &File, n: u64) {
        self.written += n;
        if self.written - self.started < Self::WINDOW {
            return;
        }
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let len = self.written - self.started;
            // SAFETY: sync_file_range only reads its integer arguments; a failure (a filesystem
            // without it) just leaves the work to the final fsync.
            unsafe {
                libc::sync_file_range(
                    file.as_raw_fd(),
                    self.started as libc::off64_t,
                    len as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            };
        }
        #[cfg(not(target_os = "linux"))]
        let _ = file;
        self.started = self.written;
    }
}

/// An extracted bundle whose artifacts were all verified.
#[derive(Debug, Clone)]
pub struct ExtractedBundle {
    pub manifest: Manifest,
    pub dir: PathBuf,
}

/// One extracted artifact's path.
pub type Extracted = PathBuf;

impl ExtractedBundle {
    /// Extracts the bundle in directory `bundle_dir` into `cache_root/<bundle_version>/`, or
    /// reuses a complete earlier extraction of the same manifest.
    pub fn from_dir(bundle_dir: &Path, cache_root: &Path, host_version: &str) -> Result<Self, BundleError> {
        let mpath = bundle_dir.join(MANIFEST_FILE);
        let json = fs::read(&mpath).map_err(io_err("cannot read", &mpath))?;
        let manifest = Manifest::parse(&json, host_version)?;
        let dir = cache_root.join(&manifest.bundle_version);
        let marker = dir.join(COMPLETE_MARKER);
        let is_complete = || fs::read(&marker).ok().as_deref() == Some(manifest.to_json().as_bytes());
        if is_complete() {
            return Ok(Self { manifest, dir });
        }
        // Concurrent extractions of one version: one does the work, the others then reuse it.
        fs::create_dir_all(cache_root).map_err(io_err("cannot create", cache_root))?;
        let _lock = crate::lock::exclusive(&cache_root.join(format!(".{}.lock", manifest.bundle_version)))?;
        if is_complete() {
            return Ok(Self { manifest, dir });
        }
        fs::create_dir_all(&dir).map_err(io_err("cannot create", &dir))?;
        let _ = fs::remove_file(&marker);
        let extracted = manifest.artifacts.iter().try_for_each(|a| {
            let src = bundle_dir.join(&a.file);
            let f = File::open(&src).map_err(io_err("cannot open", &src))?;
            extract_artifact(BufReader::new(f), a, &dir).map(|_| ())
        });
        if let Err(e) = extracted {
            // A bundle that fails verification leaves nothing in the cache.
            let _ = fs::remove_dir_all(&dir);
            return Err(e);
        }
        fs::write(&marker, manifest.to_json()).map_err(io_err("cannot write", &marker))?;
        Ok(Self { manifest, dir })
    }

    pub fn path(&self, role: ArtifactRole) -> Option<PathBuf> {
        self.manifest.artifact(role).map(|a| self.dir.join(&a.name))
    }

    pub fn kernel(&self) -> PathBuf {
        self.path(ArtifactRole::Kernel).expect("validated manifests have a kernel")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::{pack, PackInput, PackOptions};

    fn build(dir: &Path) -> Manifest {
        let k = dir.join("vmlinux");
        let i = dir.join("init.cpio");
        fs::write(&k, vec![7u8; 300_000]).unwrap();
        fs::write(&i, b"initramfs bytes".repeat(1000)).unwrap();
        let inputs = [
            PackInput { name: "kernel".into(), role: ArtifactRole::Kernel, format: "elf-vmlinux".into(), path: k },
            PackInput {
                name: "initramfs".into(),
                role: ArtifactRole::Initrd,
                format: "cpio-newc-zstd".into(),
                path: i,
            },
        ];
        let opts = PackOptions {
            flavor: "minimal",
            arch: crate::Arch::X86_64,
            cmdline: "quiet",
            min_host_version: "0.1.0",
            version: None,
            zstd_level: 3,
            image: None,
        };
        pack(&inputs, &opts, &dir.join("bundle")).unwrap()
    }

    #[test]
    fn pack_is_reproducible_and_extracts_verified() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let (ma, mb) = (build(a.path()), build(b.path()));
        assert_eq!(ma, mb, "same inputs, same manifest (digests and version)");
        assert!(ma.bundle_version.starts_with("minimal-"));
        let cache = a.path().join("cache");
        let x = ExtractedBundle::from_dir(&a.path().join("bundle"), &cache, "0.1.0").unwrap();
        assert_eq!(fs::read(x.kernel()).unwrap(), vec![7u8; 300_000]);
        // Later and concurrent calls reuse the verified extraction instead of racing on it.
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (bundle, cache) = (a.path().join("bundle"), cache.clone());
                std::thread::spawn(move || ExtractedBundle::from_dir(&bundle, &cache, "0.1.0").map(|b| b.dir))
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap().unwrap(), x.dir);
        }
    }

    #[test]
    fn corruption_is_named_and_leaves_no_partial_file() {
        let d = tempfile::tempdir().unwrap();
        let m = build(d.path());
        let kernel = m.artifact(ArtifactRole::Kernel).unwrap();
        let mut bytes = fs::read(d.path().join("bundle").join(&kernel.file)).unwrap();
        let dest = d.path().join("out");
        fs::create_dir_all(&dest).unwrap();

        // A flipped byte in the middle: zstd or the digest notices, and it says which artifact.
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        let e = extract_artifact(&bytes[..], kernel, &dest).unwrap_err();
        assert!(e.to_string().contains("artifact kernel (kernel.zst)"), "{e}");
        bytes[mid] ^= 0xff;
        // Truncated.
        let e = extract_artifact(&bytes[..bytes.len() - 10], kernel, &dest).unwrap_err();
        assert!(e.to_string().contains("kernel"), "{e}");
        // Trailing bytes: zstd reads them as a bad next frame, or the size check catches them.
        let mut longer = bytes.clone();
        longer.extend_from_slice(b"junk");
        let e = extract_artifact(&longer[..], kernel, &dest).unwrap_err();
        assert!(e.to_string().contains("artifact kernel (kernel.zst)"), "{e}");
        // A manifest that under-declares the size stops the pass early.
        let mut small = kernel.clone();
        small.size = 1000;
        let e = extract_artifact(&bytes[..], &small, &dest).unwrap_err();
        assert!(matches!(e, BundleError::SizeMismatch { kind: "uncompressed", expected: 1000, .. }), "{e}");
        assert_eq!(fs::read_dir(&dest).unwrap().count(), 0, "no partial files left behind");
        // And the intact stream still extracts.
        extract_artifact(&bytes[..], kernel, &dest).unwrap();
    }
}
