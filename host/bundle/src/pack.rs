//! Packing a bundle from built artifacts: one pass per artifact that hashes the raw bytes,
//! compresses them with zstd and hashes the compressed output. Single-threaded zstd at a fixed
//! level is deterministic, and the manifest holds no timestamps, so the same inputs give the
//! same bundle, byte for byte.

use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::digest::Hashing;
use crate::manifest::{Arch, Artifact, ArtifactRole, Boot, Manifest, MANIFEST_FILE, SCHEMA_VERSION};
use crate::{io_err, BundleError};

pub struct PackInput {
    pub name: String,
    pub role: ArtifactRole,
    pub format: String,
    pub path: PathBuf,
}

pub struct PackOptions<'a> {
    pub flavor: &'a str,
    pub arch: Arch,
    pub cmdline: &'a str,
    pub min_host_version: &'a str,
    /// Defaults to `<flavor>-<first 12 hex digits of a digest over the artifacts and cmdline>`.
    pub version: Option<String>,
    pub zstd_level: i32,
}

fn compress(input: &PackInput, level: i32, out: &Path) -> Result<Artifact, BundleError> {
    let file = format!("{}.zst", input.name);
    let dst = out.join(&file);
    let src = File::open(&input.path).map_err(io_err("cannot open artifact", &input.path))?;
    let mut raw = Hashing::new(BufReader::new(src));
    let writer = Hashing::new(BufWriter::new(File::create(&dst).map_err(io_err("cannot create", &dst))?));
    let mut enc = zstd::stream::Encoder::new(writer, level).map_err(io_err("zstd init for", &dst))?;
    std::io::copy(&mut raw, &mut enc).map_err(io_err("cannot compress", &input.path))?;
    let mut writer = enc.finish().map_err(io_err("cannot finish", &dst))?;
    writer.flush().map_err(io_err("cannot write", &dst))?;
    let (compressed_size, compressed_sha256, _) = writer.finish();
    let (size, sha256, _) = raw.finish();
    Ok(Artifact {
        name: input.name.clone(),
        role: input.role,
        format: input.format.clone(),
        size,
        sha256,
        file,
        compressed_size,
        compressed_sha256,
    })
}

/// Writes a bundle into `out_dir`, replacing what was there only once the new one is complete.
pub fn pack(inputs: &[PackInput], opts: &PackOptions, out_dir: &Path) -> Result<Manifest, BundleError> {
    let parent = out_dir.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(parent).map_err(io_err("cannot create", parent))?;
    let tmp = parent.join(format!(
        ".{}.partial-{}",
        out_dir.file_name().and_then(|n| n.to_str()).unwrap_or("bundle"),
        std::process::id()
    ));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(io_err("cannot create", &tmp))?;
    let result = (|| {
        let artifacts = inputs.iter().map(|i| compress(i, opts.zstd_level, &tmp)).collect::<Result<Vec<_>, _>>()?;
        let version = opts.version.clone().unwrap_or_else(|| {
            let mut h = Sha256::new();
            for a in &artifacts {
                h.update(a.name.as_bytes());
                h.update(a.sha256.as_bytes());
            }
            h.update(opts.cmdline.as_bytes());
            format!("{}-{}", opts.flavor, &hex::encode(h.finalize())[..12])
        });
        let manifest = Manifest {
            schema_version: SCHEMA_VERSION,
            bundle_version: version,
            flavor: opts.flavor.to_string(),
            arch: opts.arch,
            min_host_version: opts.min_host_version.to_string(),
            boot: Boot { cmdline: opts.cmdline.to_string() },
            artifacts,
        };
        manifest.validate(opts.min_host_version)?;
        let mpath = tmp.join(MANIFEST_FILE);
        fs::write(&mpath, manifest.to_json()).map_err(io_err("cannot write", &mpath))?;
        Ok(manifest)
    })();
    let manifest = match result {
        Ok(m) => m,
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    let old = parent.join(format!(
        ".{}.old-{}",
        out_dir.file_name().and_then(|n| n.to_str()).unwrap_or("bundle"),
        std::process::id()
    ));
    if out_dir.exists() {
        fs::rename(out_dir, &old).map_err(io_err("cannot move aside", out_dir))?;
    }
    fs::rename(&tmp, out_dir).map_err(io_err("cannot rename into", out_dir))?;
    let _ = fs::remove_dir_all(&old);
    Ok(manifest)
}
