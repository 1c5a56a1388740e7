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
use crate::store::hash_file;
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
    /// What an OCI image's conversion records (see [`crate::ImageInfo`]).
    pub image: Option<crate::ImageInfo>,
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

/// The manifest of the bundle already in `out_dir` when [`pack`] would write the same one: the
/// same options (the zstd level aside, which the manifest does not record), and for each input
/// the same name, role, format, size and sha256, its compressed file present with the size and
/// sha256 the manifest gives. Both sides are hashed in full, so a rebuild is skipped only when
/// its bytes would decompress to exactly the same artifacts; anything else is `None`.
pub fn current(inputs: &[PackInput], opts: &PackOptions, out_dir: &Path) -> Option<Manifest> {
    let json = fs::read(out_dir.join(MANIFEST_FILE)).ok()?;
    let manifest = Manifest::parse(&json, opts.min_host_version).ok()?;
    let same_options = manifest.schema_version == SCHEMA_VERSION
        && manifest.flavor == opts.flavor
        && manifest.arch == opts.arch
        && manifest.min_host_version == opts.min_host_version
        && manifest.boot.cmdline == opts.cmdline
        && manifest.image == opts.image
        && manifest.artifacts.len() == inputs.len();
    if !same_options {
        return None;
    }
    for (input, a) in inputs.iter().zip(&manifest.artifacts) {
        if a.name != input.name || a.role != input.role || a.format != input.format {
            return None;
        }
        if hash_file(&input.path).ok()? != (a.size, a.sha256.clone()) {
            return None;
        }
        if hash_file(&out_dir.join(&a.file)).ok()? != (a.compressed_size, a.compressed_sha256.clone()) {
            return None;
        }
    }
    let version = opts.version.clone().unwrap_or_else(|| derived_version(&manifest.artifacts, opts));
    (manifest.bundle_version == version).then_some(manifest)
}

/// `<flavor>-<first 12 hex digits of a digest over the artifacts and cmdline>`.
fn derived_version(artifacts: &[Artifact], opts: &PackOptions) -> String {
    let mut h = Sha256::new();
    for a in artifacts {
        h.update(a.name.as_bytes());
        h.update(a.sha256.as_bytes());
    }
    h.update(opts.cmdline.as_bytes());
    format!("{}-{}", opts.flavor, &hex::encode(h.finalize())[..12])
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
        let version = opts.version.clone().unwrap_or_else(|| derived_version(&artifacts, opts));
        let manifest = Manifest {
            schema_version: SCHEMA_VERSION,
            bundle_version: version,
            flavor: opts.flavor.to_string(),
            arch: opts.arch,
            min_host_version: opts.min_host_version.to_string(),
            boot: Boot { cmdline: opts.cmdline.to_string() },
            artifacts,
            image: opts.image.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(dir: &Path, kernel: &[u8]) -> Vec<PackInput> {
        fs::write(dir.join("vmlinux"), kernel).unwrap();
        fs::write(dir.join("initrd"), b"an initramfs").unwrap();
        vec![
            PackInput {
                name: "kernel".into(),
                role: ArtifactRole::Kernel,
                format: "elf-vmlinux".into(),
                path: dir.join("vmlinux"),
            },
            PackInput {
                name: "initramfs".into(),
                role: ArtifactRole::Initrd,
                format: "cpio-newc-zstd".into(),
                path: dir.join("initrd"),
            },
        ]
    }

    fn opts(cmdline: &str) -> PackOptions<'_> {
        PackOptions {
            flavor: "minimal",
            arch: Arch::X86_64,
            cmdline,
            min_host_version: "0.1.0",
            version: None,
            zstd_level: 3,
            image: None,
        }
    }

    /// A bundle packed from these inputs is current for them, and for nothing else: another
    /// input byte, another option, a damaged compressed file or a missing one.
    #[test]
    fn a_bundle_is_current_only_for_the_same_inputs_and_intact_files() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("bundle");
        assert!(current(&inputs(dir.path(), b"kernel one"), &opts(""), &out).is_none(), "nothing there yet");
        let packed = pack(&inputs(dir.path(), b"kernel one"), &opts(""), &out).unwrap();
        let again = current(&inputs(dir.path(), b"kernel one"), &opts(""), &out).expect("current");
        assert_eq!(again.bundle_version, packed.bundle_version);

        assert!(current(&inputs(dir.path(), b"kernel two"), &opts(""), &out).is_none(), "another kernel");
        let ins = inputs(dir.path(), b"kernel one");
        assert!(current(&ins, &opts("quiet"), &out).is_none(), "another command line");
        let named = PackOptions { version: Some("v9".into()), ..opts("") };
        assert!(current(&ins, &named, &out).is_none(), "another version");
        let mut renamed = inputs(dir.path(), b"kernel one");
        renamed[1].format = "cpio-newc".into();
        assert!(current(&renamed, &opts(""), &out).is_none(), "another format");

        let zst = out.join(&packed.artifacts[0].file);
        let mut bytes = fs::read(&zst).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        fs::write(&zst, &bytes).unwrap();
        assert!(current(&ins, &opts(""), &out).is_none(), "a damaged compressed file");
        fs::remove_file(&zst).unwrap();
        assert!(current(&ins, &opts(""), &out).is_none(), "a missing compressed file");
        pack(&ins, &opts(""), &out).unwrap();
        assert!(current(&ins, &opts(""), &out).is_some(), "packed again, current again");
    }
}
