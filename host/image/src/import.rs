//! Images from files: an OCI image layout directory (`oci-layout`, `index.json`, `blobs/`), or
//! a `docker save` archive (its `manifest.json`, or the OCI layout newer Dockers write beside
//! it). Every blob read is checked against its digest; an archive's files are copied out by
//! name into a private directory (regular files only: nothing in it can point elsewhere).

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use oci_client::manifest::{OciImageIndex, OciImageManifest};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use umbra_bundle::Arch;

use crate::cache::sha256_hex;
use crate::config::oci_arch;
use crate::layers::components;
use crate::registry::check_layer_type;
use crate::{ImageError, Layer, Source};

const MAX_JSON: u64 = 4 << 20;

/// An imported image and the scratch directory its blobs are in (removed when dropped).
pub struct Imported {
    pub source: Source,
    pub scratch: Option<tempfile::TempDir>,
}

/// Imports `path` for `arch`; an archive is unpacked under `work`.
pub fn import(path: &Path, arch: Arch, work: &Path) -> Result<Imported, ImageError> {
    let meta = std::fs::metadata(path).map_err(|e| ImageError::io("read", path, e))?;
    let reference = path.display().to_string();
    if meta.is_dir() {
        let source = from_dir(path, &reference, arch)?;
        return Ok(Imported { source, scratch: None });
    }
    std::fs::create_dir_all(work).map_err(|e| ImageError::io("create", work, e))?;
    let scratch = tempfile::Builder::new()
        .prefix("import-")
        .tempdir_in(work)
        .map_err(|e| ImageError::io("create a directory in", work, e))?;
    unpack(path, scratch.path())?;
    let source = from_dir(scratch.path(), &reference, arch)?;
    Ok(Imported { source, scratch: Some(scratch) })
}

/// An OCI layout if there is an `index.json`, else a `docker save` `manifest.json`.
fn from_dir(dir: &Path, reference: &str, arch: Arch) -> Result<Source, ImageError> {
    if dir.join("index.json").is_file() {
        return from_layout(dir, reference, arch);
    }
    if dir.join("manifest.json").is_file() {
        return from_docker(dir, reference);
    }
    Err(ImageError::Invalid(format!(
        "{reference} is neither an OCI image layout (no index.json) nor a `docker save` archive (no manifest.json)"
    )))
}

fn read_json_file(path: &Path) -> Result<Vec<u8>, ImageError> {
    let file = File::open(path).map_err(|e| ImageError::io("open", path, e))?;
    let mut bytes = Vec::new();
    file.take(MAX_JSON + 1).read_to_end(&mut bytes).map_err(|e| ImageError::io("read", path, e))?;
    if bytes.len() as u64 > MAX_JSON {
        return Err(ImageError::Invalid(format!("{} is over {MAX_JSON} bytes", path.display())));
    }
    Ok(bytes)
}

/// sha256 (hex) of a file.
fn hash_file(path: &Path) -> Result<String, ImageError> {
    let mut file = File::open(path).map_err(|e| ImageError::io("open", path, e))?;
    let mut h = Sha256::new();
    std::io::copy(&mut file, &mut h).map_err(|e| ImageError::io("read", path, e))?;
    Ok(hex::encode(h.finalize()))
}

/// The layout's blob for `digest`, its bytes checked.
fn blob(dir: &Path, digest: &str) -> Result<PathBuf, ImageError> {
    let hex = sha256_hex(digest)?;
    let path = dir.join("blobs").join("sha256").join(hex);
    let actual = hash_file(&path)?;
    if actual != hex {
        return Err(ImageError::Invalid(format!("blob {digest} has digest sha256:{actual}: it was altered")));
    }
    Ok(path)
}

fn parse<T: for<'de> Deserialize<'de>>(bytes: &[u8], what: &str) -> Result<T, ImageError> {
    serde_json::from_slice(bytes).map_err(|e| ImageError::Invalid(format!("{what} is not valid: {e}")))
}

fn from_layout(dir: &Path, reference: &str, arch: Arch) -> Result<Source, ImageError> {
    let index: OciImageIndex = parse(&read_json_file(&dir.join("index.json"))?, "index.json")?;
    let mut entries = index.manifests;
    // An index may name another index (the multi-arch image itself): one level is followed.
    for _ in 0..2 {
        let manifest = pick_entry(&entries, arch, reference)?;
        let path = blob(dir, &manifest.digest)?;
        let bytes = read_json_file(&path)?;
        let kind: serde_json::Value = parse(&bytes, "a manifest")?;
        if kind.get("manifests").is_some() {
            entries = parse::<OciImageIndex>(&bytes, "an index")?.manifests;
            continue;
        }
        let image: OciImageManifest = parse(&bytes, "the image manifest")?;
        let config = read_json_file(&blob(dir, &image.config.digest)?)?;
        let mut layers = Vec::new();
        for (i, desc) in image.layers.iter().enumerate() {
            check_layer_type(i, &desc.media_type)?;
            layers.push(Layer { digest: desc.digest.clone(), path: blob(dir, &desc.digest)? });
        }
        return Ok(Source { reference: reference.to_string(), digest: manifest.digest.clone(), config, layers });
    }
    Err(ImageError::Invalid(format!("{reference}: indexes nested deeper than two levels")))
}

fn pick_entry<'a>(
    entries: &'a [oci_client::manifest::ImageIndexEntry],
    arch: Arch,
    reference: &str,
) -> Result<&'a oci_client::manifest::ImageIndexEntry, ImageError> {
    let want = oci_arch(arch);
    let matching = entries
        .iter()
        .find(|e| e.platform.as_ref().is_some_and(|p| p.os == oci_spec::image::Os::Linux && p.architecture == want));
    match (matching, entries) {
        (Some(e), _) => Ok(e),
        // One image without a platform: the config says which, and is checked.
        (None, [one]) if one.platform.is_none() => Ok(one),
        _ => Err(ImageError::Invalid(format!("{reference} has no image for linux/{}", arch.debian_name()))),
    }
}

#[derive(Deserialize)]
struct DockerManifest {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

/// A file named inside the archive's directory (no `..`, no absolute path).
fn inside(dir: &Path, name: &str) -> Result<PathBuf, ImageError> {
    let parts = components(name.as_bytes()).map_err(|e| ImageError::Invalid(format!("{name:?}: {e}")))?;
    let mut path = dir.to_path_buf();
    for p in parts {
        path.push(String::from_utf8_lossy(&p).as_ref());
    }
    Ok(path)
}

fn from_docker(dir: &Path, reference: &str) -> Result<Source, ImageError> {
    let manifests: Vec<DockerManifest> = parse(&read_json_file(&dir.join("manifest.json"))?, "manifest.json")?;
    let [m] = manifests.as_slice() else {
        return Err(ImageError::Invalid(format!("{reference} holds {} images; import one at a time", manifests.len())));
    };
    let config_path = inside(dir, &m.config)?;
    let config = read_json_file(&config_path)?;
    // Without a manifest digest the image is named by its config's, as Docker's image ID is.
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(&config)));
    let layers = m
        .layers
        .iter()
        .map(|name| {
            let path = inside(dir, name)?;
            // The config's diff_ids check each layer's bytes as it is applied.
            Ok(Layer { digest: format!("sha256:{}", hash_file(&path)?), path })
        })
        .collect::<Result<Vec<_>, ImageError>>()?;
    Ok(Source { reference: reference.to_string(), digest, config, layers })
}

/// Copies an archive's regular files out under `dir` by their names; everything else
/// (symlinks, devices, hard links) is skipped: an image archive needs only files.
fn unpack(archive: &Path, dir: &Path) -> Result<(), ImageError> {
    let file = File::open(archive).map_err(|e| ImageError::io("open", archive, e))?;
    let mut tar = tar::Archive::new(std::io::BufReader::new(file));
    let bad =
        |e: std::io::Error| ImageError::Invalid(format!("{} is not a readable tar archive: {e}", archive.display()));
    for entry in tar.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let name = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let path = inside(dir, &name)?;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(|e| ImageError::io("create", parent, e))?;
        }
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| ImageError::io("create", &path, e))?;
        std::io::copy(&mut entry, &mut out).map_err(|e| ImageError::io("write", &path, e))?;
    }
    Ok(())
}
