//! `manifest.json`: the schema and its validation. Validation happens before any artifact byte
//! is read, so a hostile manifest cannot steer file names outside the bundle directory.

use serde::{Deserialize, Serialize};

pub const MANIFEST_FILE: &str = "manifest.json";
pub const SCHEMA_VERSION: u32 = 1;
/// Largest size (compressed or not) accepted for one artifact: far above any real guest, far
/// below where sums and offsets over a few artifacts could overflow.
pub const MAX_ARTIFACT_SIZE: u64 = 64 << 30;
/// Largest accepted sum of the artifacts' sizes (compressed, and uncompressed, each).
pub const MAX_BUNDLE_SIZE: u64 = 256 << 30;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub schema_version: u32,
    /// Unique name of this build, e.g. `minimal-3f2a9c01b7d4`; also its install directory name.
    pub bundle_version: String,
    /// `minimal` or `standard`.
    pub flavor: String,
    /// The guest's architecture: `x86_64` or `aarch64`.
    pub arch: Arch,
    /// Oldest Umbra host (semver) that can run this bundle.
    pub min_host_version: String,
    pub boot: Boot,
    pub artifacts: Vec<Artifact>,
    /// For a bundle converted from an OCI image: where it came from and the defaults its
    /// config sets for the processes a session runs. Absent in other bundles (and then not
    /// written, so their manifests and signatures are unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<ImageInfo>,
}

/// An OCI image's identity and the defaults of its config (`Env`, `WorkingDir`, `User`,
/// `Entrypoint`, `Cmd`), as a converted bundle's manifest keeps them.
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageInfo {
    /// The reference it was pulled or imported as (`registry/repository:tag`, or a path).
    pub reference: String,
    /// The image manifest's digest (`sha256:…`), for this architecture.
    pub digest: String,
    /// `KEY=VALUE` entries, applied under a process's own environment.
    #[serde(default)]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    /// `User` as the config wrote it (`name`, `uid`, `name:group`, `uid:gid`)…
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// …and resolved against the image's own `/etc/passwd` and `/etc/group`.
    #[serde(default)]
    pub uid: u32,
    #[serde(default)]
    pub gid: u32,
    #[serde(default)]
    pub entrypoint: Vec<String>,
    #[serde(default)]
    pub cmd: Vec<String>,
}

/// Bounds on what an image config can put in a manifest.
const MAX_IMAGE_STRINGS: usize = 4096;
const MAX_IMAGE_STRING: usize = 64 << 10;

/// A guest architecture, spelled as `uname -m` prints it. Backends refuse a bundle for an
/// architecture they cannot run (KVM and Virtualization.framework run only the host's; QEMU
/// emulates the other).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Arch {
    X86_64,
    Aarch64,
}

impl Arch {
    pub const ALL: [Arch; 2] = [Arch::X86_64, Arch::Aarch64];

    /// The architecture this program was built for.
    pub const fn host() -> Arch {
        if cfg!(target_arch = "aarch64") {
            Arch::Aarch64
        } else {
            Arch::X86_64
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Aarch64 => "aarch64",
        }
    }

    /// `uname -m` names, plus the Debian/Docker spellings `amd64` and `arm64`.
    pub fn parse(name: &str) -> Option<Arch> {
        match name {
            "x86_64" | "amd64" => Some(Arch::X86_64),
            "aarch64" | "arm64" => Some(Arch::Aarch64),
            _ => None,
        }
    }

    /// The name the kernel build and Debian use (`scripts/build-kernel --arch`).
    pub fn debian_name(self) -> &'static str {
        match self {
            Arch::X86_64 => "amd64",
            Arch::Aarch64 => "arm64",
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl TryFrom<String> for Arch {
    type Error = String;
    fn try_from(name: String) -> Result<Self, String> {
        Arch::parse(&name).ok_or_else(|| format!("arch {name:?} is not supported (x86_64 or aarch64)"))
    }
}

impl From<Arch> for String {
    fn from(a: Arch) -> String {
        a.as_str().to_string()
    }
}

/// How to boot the artifacts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Boot {
    /// Kernel arguments the image needs (root device, init). Backends add console and device
    /// arguments of their own.
    pub cmdline: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactRole {
    /// The kernel: an ELF `vmlinux` with a PVH entry note (x86_64), or an arm64 `Image`.
    Kernel,
    /// An initramfs the kernel unpacks as its root.
    Initrd,
    /// A read-only root filesystem image attached as the first virtio-blk disk.
    Rootfs,
    /// The guest agent as a static executable, for images made from this bundle's kernel
    /// (OCI images get it as their init).
    Agent,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifact {
    pub name: String,
    pub role: ArtifactRole,
    /// Format of the uncompressed bytes: `elf-vmlinux`, `arm64-image`, `cpio-newc-zstd`,
    /// `erofs`, `ext4`.
    pub format: String,
    /// Uncompressed size and sha256 (lowercase hex).
    pub size: u64,
    pub sha256: String,
    /// The zstd-compressed file in the bundle, its size and sha256.
    pub file: String,
    pub compressed_size: u64,
    pub compressed_sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("manifest is not valid JSON for schema {SCHEMA_VERSION}: {0}")]
    Parse(String),
    #[error("manifest schema {found} is not supported (this host reads schema {SCHEMA_VERSION}); update Umbra")]
    Schema { found: u32 },
    #[error("bundle {version} needs Umbra {needed} or newer; this host is {host}")]
    HostTooOld { version: String, needed: String, host: String },
    #[error("manifest field {field}: {reason}")]
    Invalid { field: String, reason: String },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ManifestError {
    ManifestError::Invalid { field: field.into(), reason: reason.into() }
}

/// `text` with control characters escaped: what a server sent may reach a terminal.
pub(crate) fn printable(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

/// A name usable as one path component: no separators, no dot-dot, nothing hidden or empty.
pub(crate) fn safe_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && !s.starts_with('.')
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b))
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// (major, minor, patch) of a plain `X.Y.Z` version.
fn semver(s: &str) -> Option<(u64, u64, u64)> {
    let mut it = s.split('.').map(|p| p.parse::<u64>().ok());
    let v = (it.next()??, it.next()??, it.next()??);
    it.next().is_none().then_some(v)
}

impl Manifest {
    /// Parses and validates; `host_version` is this host's semver.
    pub fn parse(json: &[u8], host_version: &str) -> Result<Self, ManifestError> {
        #[derive(Deserialize)]
        struct SchemaOnly {
            schema_version: u32,
        }
        // Escaped: the server's bytes reach a terminal through these messages.
        let parse = |e: serde_json::Error| ManifestError::Parse(printable(&e.to_string()));
        let schema: SchemaOnly = serde_json::from_slice(json).map_err(parse)?;
        if schema.schema_version != SCHEMA_VERSION {
            return Err(ManifestError::Schema { found: schema.schema_version });
        }
        let m: Manifest = serde_json::from_slice(json).map_err(parse)?;
        m.validate(host_version)?;
        Ok(m)
    }

    pub fn validate(&self, host_version: &str) -> Result<(), ManifestError> {
        if !safe_name(&self.bundle_version) {
            return Err(invalid("bundle_version", format!("{:?} is not a safe directory name", self.bundle_version)));
        }
        let needed = semver(&self.min_host_version)
            .ok_or_else(|| invalid("min_host_version", format!("{:?} is not X.Y.Z", self.min_host_version)))?;
        let host = semver(host_version).ok_or_else(|| invalid("host version", host_version.to_string()))?;
        if needed > host {
            return Err(ManifestError::HostTooOld {
                version: self.bundle_version.clone(),
                needed: self.min_host_version.clone(),
                host: host_version.to_string(),
            });
        }
        let mut names = std::collections::HashSet::new();
        for (i, a) in self.artifacts.iter().enumerate() {
            let f = |field: &str| format!("artifacts[{i}].{field}");
            if !safe_name(&a.name) || !names.insert(a.name.as_str()) {
                return Err(invalid(f("name"), format!("{:?} is unsafe or repeated", a.name)));
            }
            if !safe_name(&a.file) || a.file == MANIFEST_FILE {
                return Err(invalid(f("file"), format!("{:?} is not a safe file name", a.file)));
            }
            if !is_sha256_hex(&a.sha256) || !is_sha256_hex(&a.compressed_sha256) {
                return Err(invalid(f("sha256"), "digests must be 64 lowercase hex characters"));
            }
            for (field, size) in [("size", a.size), ("compressed_size", a.compressed_size)] {
                if size > MAX_ARTIFACT_SIZE {
                    return Err(invalid(
                        f(field),
                        format!("{size} bytes is more than the {MAX_ARTIFACT_SIZE} allowed"),
                    ));
                }
            }
        }
        let total = |size: fn(&Artifact) -> u64| self.artifacts.iter().try_fold(0u64, |n, a| n.checked_add(size(a)));
        for (field, total) in [("size", total(|a| a.size)), ("compressed_size", total(|a| a.compressed_size))] {
            if total.is_none_or(|t| t > MAX_BUNDLE_SIZE) {
                return Err(invalid(
                    format!("artifacts[].{field}"),
                    format!("the sum is more than the {MAX_BUNDLE_SIZE} bytes allowed"),
                ));
            }
        }
        let count = |role| self.artifacts.iter().filter(|a| a.role == role).count();
        if count(ArtifactRole::Kernel) != 1 {
            return Err(invalid("artifacts", "exactly one kernel is required"));
        }
        if count(ArtifactRole::Initrd) > 1 || count(ArtifactRole::Rootfs) > 1 || count(ArtifactRole::Agent) > 1 {
            return Err(invalid("artifacts", "at most one initrd, one rootfs and one agent"));
        }
        if count(ArtifactRole::Initrd) + count(ArtifactRole::Rootfs) == 0 {
            return Err(invalid("artifacts", "an initrd or a rootfs is required"));
        }
        if let Some(image) = &self.image {
            let strings = [&image.reference, &image.digest]
                .into_iter()
                .chain(image.working_dir.as_ref())
                .chain(image.user.as_ref())
                .chain(&image.env)
                .chain(&image.entrypoint)
                .chain(&image.cmd);
            let (mut count, mut longest) = (0, 0);
            for s in strings {
                count += 1;
                longest = longest.max(s.len());
            }
            if count > MAX_IMAGE_STRINGS || longest > MAX_IMAGE_STRING {
                return Err(invalid("image", "more strings, or longer ones, than an image config may set"));
            }
        }
        Ok(())
    }

    /// Sum of the uncompressed sizes (bounded by validation).
    pub fn size_total(&self) -> u64 {
        self.artifacts.iter().fold(0, |n, a| n.saturating_add(a.size))
    }

    /// Sum of the compressed sizes (bounded by validation).
    pub fn compressed_total(&self) -> u64 {
        self.artifacts.iter().fold(0, |n, a| n.saturating_add(a.compressed_size))
    }

    pub fn artifact(&self, role: ArtifactRole) -> Option<&Artifact> {
        self.artifacts.iter().find(|a| a.role == role)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("manifest serializes") + "\n"
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A well-formed artifact entry for tests that only care about the manifest's bookkeeping.
    pub(crate) fn test_artifact(name: &str, role: ArtifactRole) -> Artifact {
        Artifact {
            name: name.into(),
            role,
            format: "x".into(),
            size: 1,
            sha256: "a".repeat(64),
            file: format!("{name}.zst"),
            compressed_size: 1,
            compressed_sha256: "b".repeat(64),
        }
    }

    pub(crate) fn good() -> Manifest {
        let art = test_artifact;
        Manifest {
            schema_version: 1,
            bundle_version: "minimal-0123".into(),
            flavor: "minimal".into(),
            arch: Arch::X86_64,
            min_host_version: "0.1.0".into(),
            boot: Boot { cmdline: String::new() },
            artifacts: vec![art("kernel", ArtifactRole::Kernel), art("initramfs", ArtifactRole::Initrd)],
            image: None,
        }
    }

    #[test]
    fn round_trips_and_validates() {
        let m = good();
        assert_eq!(Manifest::parse(m.to_json().as_bytes(), "0.1.0").unwrap(), m);
    }

    #[test]
    fn hostile_or_incompatible_manifests_are_refused() {
        let mut m = good();
        m.artifacts[0].file = "../../etc/passwd".into();
        assert!(matches!(m.validate("0.1.0"), Err(ManifestError::Invalid { .. })));
        let mut m = good();
        m.bundle_version = "..".into();
        assert!(m.validate("0.1.0").is_err());
        let mut m = good();
        m.min_host_version = "9.0.0".into();
        let e = m.validate("0.1.0").unwrap_err();
        assert!(e.to_string().contains("needs Umbra 9.0.0 or newer; this host is 0.1.0"), "{e}");
        let mut m = good();
        m.artifacts.remove(0);
        assert!(m.validate("0.1.0").unwrap_err().to_string().contains("exactly one kernel"));
        let mut m = good();
        m.artifacts[1].sha256 = "XYZ".into();
        assert!(m.validate("0.1.0").is_err());
        let e = Manifest::parse(br#"{"schema_version": 2}"#, "0.1.0").unwrap_err();
        assert_eq!(e, ManifestError::Schema { found: 2 });
        assert!(matches!(Manifest::parse(b"{", "0.1.0"), Err(ManifestError::Parse(_))));
        // A JSON escape decodes to a raw ESC, which serde quotes in its message.
        let hostile = good().to_json().replacen(r#""role": "kernel""#, r#""role": "\u001b[2J""#, 1);
        let e = Manifest::parse(hostile.as_bytes(), "0.1.0").unwrap_err().to_string();
        assert!(!e.contains('\x1b') && e.contains("\\u{1b}[2J"), "control characters are escaped: {e}");
        let riscv = good().to_json().replace(r#""arch": "x86_64""#, r#""arch": "riscv64""#);
        assert_ne!(riscv, good().to_json(), "the replacement hit");
        let e = Manifest::parse(riscv.as_bytes(), "0.1.0").unwrap_err().to_string();
        assert!(e.contains(r#"arch "riscv64" is not supported (x86_64 or aarch64)"#), "{e}");
    }

    #[test]
    fn both_architectures_round_trip_under_their_uname_names() {
        let mut m = good();
        m.arch = Arch::Aarch64;
        assert!(m.to_json().contains(r#""arch": "aarch64""#));
        assert_eq!(Manifest::parse(m.to_json().as_bytes(), "0.1.0").unwrap().arch, Arch::Aarch64);
        assert_eq!(Arch::parse("arm64"), Some(Arch::Aarch64));
        assert_eq!(Arch::parse("amd64"), Some(Arch::X86_64));
        assert_eq!(Arch::parse("i686"), None);
    }

    #[test]
    fn absurd_sizes_are_refused_before_any_arithmetic() {
        // Sizes whose sums or `+ 1` would overflow a u64.
        for (i, field) in [(0, "size"), (1, "compressed_size")] {
            let mut m = good();
            let a = &mut m.artifacts[i];
            *if field == "size" { &mut a.size } else { &mut a.compressed_size } = u64::MAX - 1;
            let e = Manifest::parse(m.to_json().as_bytes(), "0.1.0").unwrap_err();
            assert!(
                matches!(&e, ManifestError::Invalid { field: f, .. } if *f == format!("artifacts[{i}].{field}")),
                "{e}"
            );
            assert!(e.to_string().contains("more than the 68719476736 allowed"), "{e}");
        }
        // Three at the limit are fine; the sum is checked too (before the roles are counted).
        let mut m = good();
        for (i, role) in [(2, ArtifactRole::Rootfs), (3, ArtifactRole::Kernel), (4, ArtifactRole::Kernel)] {
            let a = &m.artifacts[0];
            m.artifacts.push(Artifact { name: format!("a{i}"), file: format!("a{i}.zst"), role, ..a.clone() });
        }
        m.artifacts.iter_mut().for_each(|a| a.size = MAX_ARTIFACT_SIZE);
        let e = m.validate("0.1.0").unwrap_err();
        assert!(matches!(&e, ManifestError::Invalid { field, .. } if field == "artifacts[].size"), "{e}");
        m.artifacts.truncate(3);
        m.artifacts.iter_mut().for_each(|a| a.compressed_size = MAX_ARTIFACT_SIZE);
        m.validate("0.1.0").unwrap();
    }
}
