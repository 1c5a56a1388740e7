//! An image's config: the layers' uncompressed digests, the platform, and the defaults
//! (`Env`, `WorkingDir`, `User`, `Entrypoint`, `Cmd`) a converted bundle records.

use oci_spec::image::{Arch as OciArch, ImageConfiguration, Os};
use umbra_bundle::{Arch, ImageInfo};

use crate::layers::{components, resolve};
use crate::tree::{Kind, Tree};
use crate::ImageError;

/// Largest config accepted (real ones are a few KiB; history makes some a few hundred).
pub const MAX_CONFIG_BYTES: usize = 4 << 20;

/// The docker/OCI platform name of an architecture.
pub fn oci_arch(arch: Arch) -> OciArch {
    match arch {
        Arch::X86_64 => OciArch::Amd64,
        Arch::Aarch64 => OciArch::ARM64,
    }
}

/// A parsed config, checked against the architecture it must run on.
pub struct Config {
    pub diff_ids: Vec<String>,
    config: ImageConfiguration,
}

impl Config {
    pub fn parse(bytes: &[u8], arch: Arch) -> Result<Self, ImageError> {
        if bytes.len() > MAX_CONFIG_BYTES {
            return Err(ImageError::Invalid(format!("the image config is over {MAX_CONFIG_BYTES} bytes")));
        }
        let config = ImageConfiguration::from_reader(bytes)
            .map_err(|e| ImageError::Invalid(format!("the image config is not valid: {e}")))?;
        if *config.os() != Os::Linux {
            return Err(ImageError::Invalid(format!("the image is for {}, not linux", config.os())));
        }
        if *config.architecture() != oci_arch(arch) {
            return Err(ImageError::Invalid(format!(
                "the image is for {}, and this guest is {} ({})",
                config.architecture(),
                arch.debian_name(),
                arch
            )));
        }
        let rootfs = config.rootfs();
        if rootfs.typ() != "layers" {
            return Err(ImageError::Invalid(format!("rootfs type {:?} is not \"layers\"", rootfs.typ())));
        }
        let diff_ids = rootfs
            .diff_ids()
            .iter()
            .map(|d| {
                d.strip_prefix("sha256:")
                    .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
                    .map(str::to_ascii_lowercase)
                    .ok_or_else(|| ImageError::Invalid(format!("diff_id {d:?} is not a sha256 digest")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Config { diff_ids, config })
    }

    /// The defaults, `User` resolved against the finished tree's `/etc/passwd` and `/etc/group`
    /// as a runtime resolves it when the container starts.
    pub fn info(&self, reference: &str, digest: &str, tree: &Tree) -> Result<ImageInfo, ImageError> {
        let c = self.config.config().clone().unwrap_or_default();
        let user = c.user().clone().filter(|u| !u.is_empty());
        let (uid, gid) = match &user {
            Some(user) => resolve_user(tree, user)?,
            None => (0, 0),
        };
        Ok(ImageInfo {
            reference: reference.to_string(),
            digest: digest.to_string(),
            env: c.env().clone().unwrap_or_default(),
            working_dir: c.working_dir().clone().filter(|w| !w.is_empty()),
            user,
            uid,
            gid,
            entrypoint: c.entrypoint().clone().unwrap_or_default(),
            cmd: c.cmd().clone().unwrap_or_default(),
        })
    }
}

/// `name`, `uid`, `name:group`, `uid:gid` (and mixtures) → numbers. A number needs no entry
/// in the files; a name without one is an error, as `docker run` reports it.
pub fn resolve_user(tree: &Tree, user: &str) -> Result<(u32, u32), ImageError> {
    let (u, g) = match user.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (user, None),
    };
    let passwd = read_text(tree, "etc/passwd");
    let entry =
        |name: &str| passwd.lines().map(|l| l.split(':').collect::<Vec<_>>()).find(|f| f.len() >= 4 && f[0] == name);
    let (uid, primary) = match u.parse::<u32>() {
        Ok(uid) => {
            let primary = passwd
                .lines()
                .map(|l| l.split(':').collect::<Vec<_>>())
                .find(|f| f.len() >= 4 && f[2].parse() == Ok(uid))
                .and_then(|f| f[3].parse().ok());
            (uid, primary)
        }
        Err(_) => {
            let f = entry(u)
                .ok_or_else(|| ImageError::Invalid(format!("the image's user {u:?} is not in its /etc/passwd")))?;
            let uid = f[2].parse().map_err(|_| ImageError::Invalid(format!("/etc/passwd: {u:?} has no number")))?;
            (uid, f[3].parse().ok())
        }
    };
    let gid = match g {
        None => primary.unwrap_or(0),
        Some(g) => match g.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => read_text(tree, "etc/group")
                .lines()
                .map(|l| l.split(':').collect::<Vec<_>>())
                .find(|f| f.len() >= 3 && f[0] == g)
                .and_then(|f| f[2].parse().ok())
                .ok_or_else(|| ImageError::Invalid(format!("the image's group {g:?} is not in its /etc/group")))?,
        },
    };
    Ok((uid, gid))
}

/// A small text file of the tree (symlinks followed inside it), or "" when there is none.
fn read_text(tree: &Tree, path: &str) -> String {
    let Ok(parts) = components(path.as_bytes()) else { return String::new() };
    let Ok(id) = resolve(tree, &parts, false) else { return String::new() };
    let Kind::File(extent) = tree.node(id).kind else { return String::new() };
    if extent.len > 16 << 20 {
        return String::new();
    }
    let mut buf = vec![0u8; extent.len as usize];
    match tree.read_content(extent, 0, &mut buf) {
        Ok(()) => String::from_utf8_lossy(&buf).into_owned(),
        Err(_) => String::new(),
    }
}
