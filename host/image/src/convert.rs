//! An image's layers, applied in order, become a bundle: the base bundle's kernel, the
//! layers' tree written as a read-only erofs root with the base's agent placed as init, and the
//! config's defaults in the manifest.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};
use umbra_bundle::{ArtifactRole, ExtractedBundle, Manifest, PackInput, PackOptions};

use crate::cache::sha256_hex;
use crate::config::Config;
use crate::layers::{components, resolve, Applied, Applier, Limits};
use crate::tree::{Kind, Meta, Node, Tree, ROOT};
use crate::{erofs, ImageError, Source};

/// Bump when the conversion's output changes for the same input: a different version name.
const CONVERTER: &str = "umbra-image-1";
/// Where the agent goes (as in the standard image): the kernel runs it as init.
pub const AGENT_PATH: &str = "sbin/umbra-agent";
pub const CMDLINE: &str = "root=/dev/vda rootfstype=erofs ro init=/sbin/umbra-agent";

/// A conversion's result: the packed bundle directory, and what it took.
#[derive(Debug)]
pub struct Converted {
    pub dir: PathBuf,
    pub manifest: Manifest,
    pub applied: Applied,
    pub erofs: erofs::Stats,
    pub seconds: f64,
}

/// The bundle version a conversion of `digest` over `base` gets: the same image on the same
/// base is the same bundle, found again without converting.
pub fn version_for(digest: &str, base: &Manifest) -> Result<String, ImageError> {
    let hex = sha256_hex(digest)?;
    let mut h = Sha256::new();
    for part in [CONVERTER, hex, &base.bundle_version, base.arch.as_str()] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    Ok(format!("image-{}", &hex::encode(h.finalize())[..16]))
}

/// Converts `source` with `base`'s kernel and agent into a packed, unsigned bundle at
/// `out_dir`, using `work` for scratch.
pub fn convert(source: &Source, base: &ExtractedBundle, work: &Path, out_dir: &Path) -> Result<Converted, ImageError> {
    let started = Instant::now();
    let arch = base.manifest.arch;
    let agent = base.path(ArtifactRole::Agent).ok_or_else(|| {
        ImageError::Invalid(format!(
            "bundle {} carries no agent to put in the image (it was built before images were supported): \
             build or install a newer one",
            base.manifest.bundle_version
        ))
    })?;
    let config = Config::parse(&source.config, arch)?;
    if config.diff_ids.len() != source.layers.len() {
        return Err(ImageError::Invalid(format!(
            "the manifest has {} layers and the config {} diff_ids",
            source.layers.len(),
            config.diff_ids.len()
        )));
    }
    std::fs::create_dir_all(work).map_err(|e| ImageError::io("create", work, e))?;
    let spill = tempfile::tempfile_in(work).map_err(|e| ImageError::io("create a temporary file in", work, e))?;
    let mut tree = Tree::new(spill);
    let mut applier = Applier::new(&mut tree, Limits::default());
    for (i, layer) in source.layers.iter().enumerate() {
        let file = File::open(&layer.path).map_err(|e| ImageError::io("open", &layer.path, e))?;
        applier.apply(i, std::io::BufReader::with_capacity(1 << 20, file), Some(&config.diff_ids[i]))?;
    }
    let applied = applier.applied().clone();
    let info = config.info(&source.reference, &source.digest, &tree)?;
    prepare_root(&mut tree, &agent)?;

    let version = version_for(&source.digest, &base.manifest)?;
    let image_path = work.join(format!("{version}.erofs"));
    let image = File::create(&image_path).map_err(|e| ImageError::io("create", &image_path, e))?;
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&Sha256::digest(version.as_bytes())[..16]);
    let opts = erofs::Options { uuid, volume_name: "umbra-image".into(), build_time: 0 };
    let stats =
        erofs::write(&tree, &image, &opts).map_err(|e| ImageError::io("write the erofs image", &image_path, e))?;
    drop(image);
    drop(tree);

    let inputs = [
        PackInput {
            name: "kernel".into(),
            role: ArtifactRole::Kernel,
            format: kernel_format(base),
            path: base.kernel(),
        },
        PackInput {
            name: "rootfs".into(),
            role: ArtifactRole::Rootfs,
            format: "erofs".into(),
            path: image_path.clone(),
        },
        PackInput { name: "agent".into(), role: ArtifactRole::Agent, format: "elf-static".into(), path: agent },
    ];
    let pack_opts = PackOptions {
        flavor: "image",
        arch,
        cmdline: CMDLINE,
        min_host_version: env!("CARGO_PKG_VERSION"),
        version: Some(version),
        // The erofs image is uncompressed: a fast level gets most of zstd's gain.
        zstd_level: 3,
        image: Some(info),
    };
    let packed = umbra_bundle::pack(&inputs, &pack_opts, out_dir);
    let _ = std::fs::remove_file(&image_path);
    let manifest = packed?;
    Ok(Converted {
        dir: out_dir.to_path_buf(),
        manifest,
        applied,
        erofs: stats,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn kernel_format(base: &ExtractedBundle) -> String {
    base.manifest.artifact(ArtifactRole::Kernel).map(|a| a.format.clone()).unwrap_or_default()
}

/// What the agent needs of the root before it can make it writable: itself at
/// [`AGENT_PATH`] (through the image's own `/sbin` symlink, if it has one), an empty `/umbra`
/// to assemble the overlay on, and the mount points of a running Linux.
fn prepare_root(tree: &mut Tree, agent: &Path) -> Result<(), ImageError> {
    for (name, mode) in
        [("umbra", 0o755), ("proc", 0o555), ("sys", 0o555), ("dev", 0o755), ("tmp", 0o1777), ("run", 0o755)]
    {
        let existing = tree.entries(ROOT).and_then(|e| e.get(name.as_bytes())).copied();
        let keep = existing.is_some_and(|id| tree.entries(id).is_some()) && name != "umbra";
        if !keep {
            let dir = tree.add(Node { meta: Meta::new(mode, 0, 0, 0), kind: Kind::Dir(BTreeMap::new()) });
            tree.entries_mut(ROOT).expect("the root is a directory").insert(name.as_bytes().to_vec(), dir);
        }
    }
    let parts = components(AGENT_PATH.as_bytes()).map_err(ImageError::Invalid)?;
    let (file_name, dirs) = parts.split_last().expect("a file name");
    let dir = match resolve(tree, dirs, true) {
        Ok(id) => id,
        // No such directory (or a symlink to nothing): a real one.
        Err(_) => {
            let id = tree.add(Node { meta: Meta::new(0o755, 0, 0, 0), kind: Kind::Dir(BTreeMap::new()) });
            tree.entries_mut(ROOT).expect("the root is a directory").insert(dirs[0].clone(), id);
            id
        }
    };
    let mut file = File::open(agent).map_err(|e| ImageError::io("open", agent, e))?;
    let len = file.metadata().map_err(|e| ImageError::io("stat", agent, e))?.len();
    let extent = tree.append_content(&mut file, len).map_err(|e| ImageError::io("read", agent, e))?;
    let id = tree.add(Node { meta: Meta::new(0o755, 0, 0, 0), kind: Kind::File(extent) });
    tree.entries_mut(dir)
        .ok_or_else(|| ImageError::Invalid("the agent's directory is not one".into()))?
        .insert(file_name.clone(), id);
    Ok(())
}
