//! OCI images as sessions' roots, as a user gets them: layouts this test builds byte by byte
//! (layers with whiteouts, opaque directories, hard links, symlinks, owners, modes, xattrs; gzip,
//! zstd and plain; OCI and Docker media types; a multi-arch index), pushed with `skopeo` to
//! Debian's `docker-registry` on 127.0.0.1, then `vmctl image pull` and `vmctl run --image`
//! booting them under QEMU. A tampered blob, an altered manifest, a private repository without
//! its credentials, and a hostile layer are refused with what went wrong.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use umbra_tests::registry::{Registry, PASSWORD};
use umbra_tests::{test_bundle, workspace_bin, TempDir};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// An OCI image layout being written.
struct Layout {
    dir: PathBuf,
}

fn sha(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// One layer's entries, written as a tar.
#[derive(Default)]
struct LayerTar {
    builder: Option<tar::Builder<Vec<u8>>>,
}

impl LayerTar {
    fn new() -> Self {
        LayerTar { builder: Some(tar::Builder::new(Vec::new())) }
    }

    fn b(&mut self) -> &mut tar::Builder<Vec<u8>> {
        self.builder.as_mut().unwrap()
    }

    fn header(kind: tar::EntryType, mode: u32, uid: u64, gid: u64, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(uid);
        h.set_gid(gid);
        h.set_mtime(1_700_000_000);
        h.set_size(size);
        h
    }

    fn dir(mut self, path: &str, mode: u32) -> Self {
        let mut h = Self::header(tar::EntryType::Directory, mode, 0, 0, 0);
        self.b().append_data(&mut h, path, &[][..]).unwrap();
        self
    }

    fn file_owned(mut self, path: &str, mode: u32, uid: u64, gid: u64, data: &[u8]) -> Self {
        let mut h = Self::header(tar::EntryType::Regular, mode, uid, gid, data.len() as u64);
        self.b().append_data(&mut h, path, data).unwrap();
        self
    }

    fn file(self, path: &str, mode: u32, data: &[u8]) -> Self {
        self.file_owned(path, mode, 0, 0, data)
    }

    fn link(mut self, kind: tar::EntryType, path: &str, target: &str) -> Self {
        let mut h = Self::header(kind, 0o777, 0, 0, 0);
        self.b().append_link(&mut h, path, target).unwrap();
        self
    }

    fn device(mut self, path: &str, major: u32, minor: u32) -> Self {
        let mut h = Self::header(tar::EntryType::Char, 0o666, 0, 0, 0);
        h.set_device_major(major).unwrap();
        h.set_device_minor(minor).unwrap();
        self.b().append_data(&mut h, path, &[][..]).unwrap();
        self
    }

    fn xattr_file(mut self, path: &str, name: &str, value: &str, data: &[u8]) -> Self {
        let key = format!("SCHILY.xattr.{name}");
        self.b().append_pax_extensions([(key.as_str(), value.as_bytes())]).unwrap();
        let mut h = Self::header(tar::EntryType::Regular, 0o644, 0, 0, data.len() as u64);
        self.b().append_data(&mut h, path, data).unwrap();
        self
    }

    /// A raw entry whose name the tar crate would refuse to write (`..`).
    fn raw_name(mut self, name: &[u8], data: &[u8]) -> Self {
        let mut h = Self::header(tar::EntryType::Regular, 0o644, 0, 0, data.len() as u64);
        h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name);
        h.set_cksum();
        self.b().append(&h, data).unwrap();
        self
    }

    fn finish(mut self) -> Vec<u8> {
        self.builder.take().unwrap().into_inner().unwrap()
    }
}

#[derive(Clone, Copy)]
enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Layout {
    fn new(dir: PathBuf) -> Self {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Layout { dir }
    }

    fn blob(&self, bytes: &[u8]) -> (String, usize) {
        let digest = sha(bytes);
        std::fs::write(self.dir.join("blobs/sha256").join(digest.strip_prefix("sha256:").unwrap()), bytes).unwrap();
        (digest, bytes.len())
    }

    /// An image manifest: its layers (tar, compressed as given) and a config with `defaults`.
    fn image(&self, arch: &str, layers: Vec<(Vec<u8>, Compression)>, defaults: Value) -> Value {
        let mut descriptors = Vec::new();
        let mut diff_ids = Vec::new();
        for (tar, compression) in layers {
            diff_ids.push(sha(&tar));
            let (bytes, media_type) = match compression {
                Compression::None => (tar, "application/vnd.oci.image.layer.v1.tar"),
                Compression::Gzip => {
                    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                    e.write_all(&tar).unwrap();
                    (e.finish().unwrap(), "application/vnd.oci.image.layer.v1.tar+gzip")
                }
                Compression::Zstd => {
                    (zstd::encode_all(&tar[..], 3).unwrap(), "application/vnd.oci.image.layer.v1.tar+zstd")
                }
            };
            let (digest, size) = self.blob(&bytes);
            descriptors.push(json!({"mediaType": media_type, "digest": digest, "size": size}));
        }
        let config = json!({
            "architecture": arch, "os": "linux",
            "config": defaults,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        });
        let (digest, size) = self.blob(config.to_string().as_bytes());
        json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest, "size": size},
            "layers": descriptors,
        })
    }

    /// Writes `manifest` (an image manifest or an index) and names it `tag` in index.json.
    fn tag(&self, tag: &str, manifest: &Value, platform: Option<&str>) -> String {
        let bytes = manifest.to_string();
        let (digest, size) = self.blob(bytes.as_bytes());
        let path = self.dir.join("index.json");
        let mut index: Value = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_else(|| json!({"schemaVersion": 2, "manifests": []}));
        let mut entry = json!({
            "mediaType": manifest["mediaType"], "digest": digest, "size": size,
            "annotations": {"org.opencontainers.image.ref.name": tag},
        });
        if let Some(arch) = platform {
            entry["platform"] = json!({"architecture": arch, "os": "linux"});
        }
        index["manifests"].as_array_mut().unwrap().push(entry);
        std::fs::write(&path, index.to_string()).unwrap();
        digest
    }

    /// An index (a multi-arch image) over manifests written with [`Layout::blob`].
    fn index(&self, entries: &[(&str, &Value)]) -> Value {
        let manifests: Vec<Value> = entries
            .iter()
            .map(|(arch, m)| {
                let (digest, size) = self.blob(m.to_string().as_bytes());
                json!({"mediaType": m["mediaType"], "digest": digest, "size": size,
                       "platform": {"architecture": arch, "os": "linux"}})
            })
            .collect();
        json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests})
    }
}

fn busybox(arch: &str) -> Vec<u8> {
    if arch == "amd64" {
        return std::fs::read("/bin/busybox").expect("busybox-static (scripts/install-deps)");
    }
    // Fetched by the minimal arm64 image's build (rootfs/minimal/build).
    let cache = umbra_tests::cache_dir().join("busybox");
    let dir = std::fs::read_dir(&cache)
        .unwrap_or_else(|e| panic!("{}: {e}: build the minimal-aarch64 bundle first", cache.display()))
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("arm64-"))
        .expect("an arm64 busybox: build the minimal-aarch64 bundle first");
    std::fs::read(dir.path().join("bin/busybox")).unwrap()
}

/// The base layer every test image starts from: busybox, its shell, users.
fn base_layer(arch: &str) -> LayerTar {
    LayerTar::new()
        .dir("bin", 0o755)
        .file("bin/busybox", 0o755, &busybox(arch))
        .link(tar::EntryType::Symlink, "bin/sh", "busybox")
        .dir("etc", 0o755)
        .file("etc/passwd", 0o644, b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n")
        .file("etc/group", 0o644, b"root:x:0:\napp:x:1000:\n")
        .file("etc/arch", 0o644, arch.as_bytes())
}

/// vmctl with this test's store, caches and configuration, and no Docker config of the user's.
struct Env {
    dir: TempDir,
}

impl Env {
    fn new(tag: &str) -> Self {
        let env = Env { dir: TempDir::new(tag) };
        std::fs::create_dir_all(env.dir.0.join("docker")).unwrap();
        env
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(workspace_bin("vmctl"));
        c.env("UMBRA_DATA_DIR", self.dir.0.join("data"))
            .env("XDG_CONFIG_HOME", self.dir.0.join("config"))
            .env("UMBRA_CACHE_DIR", self.dir.0.join("cache"))
            .env("DOCKER_CONFIG", self.dir.0.join("docker"))
            .env("UMBRA_BOOT_TIMEOUT_SECS", umbra_tests::boot_timeout_secs().to_string());
        c
    }

    fn vmctl(&self, args: &[&str]) -> Output {
        self.cmd().args(args).stdin(Stdio::null()).output().unwrap()
    }

    fn pull(&self, reference: &str, extra: &[&str]) -> Output {
        let base = test_bundle("minimal");
        let mut args = vec!["image", "pull", "--json", "--allow-http-loopback", "--base", base.to_str().unwrap()];
        args.extend(extra);
        args.push(reference);
        self.vmctl(&args)
    }

    fn run(&self, reference: &str, extra: &[&str], command: &[&str]) -> Output {
        let base = test_bundle("minimal");
        let mut args = vec!["run", "--image", reference, "--allow-http-loopback", "--base", base.to_str().unwrap()];
        args.extend(extra);
        if !command.is_empty() {
            args.push("--");
            args.extend(command);
        }
        self.vmctl(&args)
    }

    /// Every file under the test's directory that is a device or setuid: an image's contents
    /// must never become these on the host.
    fn special_files(&self) -> Vec<PathBuf> {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        let mut found = Vec::new();
        let mut todo = vec![self.dir.0.clone()];
        while let Some(dir) = todo.pop() {
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let Ok(meta) = e.path().symlink_metadata() else { continue };
                let t = meta.file_type();
                if t.is_dir() {
                    todo.push(e.path());
                } else if t.is_char_device() || t.is_block_device() || meta.permissions().mode() & 0o6000 != 0 {
                    found.push(e.path());
                }
            }
        }
        found
    }
}

fn skopeo_push(layout: &Path, tag: &str, dest: &str, extra: &[&str]) {
    let out = Command::new("skopeo")
        .args(["copy", "--quiet", "--dest-tls-verify=false"])
        .args(extra)
        .arg(format!("oci:{}:{tag}", layout.display()))
        .arg(format!("docker://{dest}"))
        .output()
        .expect("skopeo (scripts/install-deps installs it)");
    assert!(out.status.success(), "skopeo copy to {dest}: {}", text(&out.stderr));
}

fn json_of(out: &Output) -> Value {
    assert!(out.status.success(), "vmctl failed: {}{}", text(&out.stdout), text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&out.stdout)))
}

/// The image most tests use: three layers (gzip, zstd, plain) that exercise every kind of
/// change, and a config with every default.
fn app_image(layout: &Layout) -> Value {
    let l0 = base_layer("amd64")
        .dir("data", 0o755)
        .file("data/old.txt", 0o644, b"v1")
        .file("data/gone.txt", 0o644, b"deleted by layer 1")
        .file_owned("data/suid", 0o4755, 0, 0, b"#!/bin/sh\n")
        .device("data/null", 1, 3)
        .dir("opq", 0o755)
        .file("opq/lower.txt", 0o644, b"hidden by the opaque marker")
        .finish();
    let l1 = LayerTar::new()
        .file("data/.wh.gone.txt", 0o644, b"")
        .dir("opq", 0o775)
        .file("opq/.wh..wh..opq", 0o644, b"")
        .file("opq/upper.txt", 0o644, b"from layer 1")
        .file("data/h1", 0o644, b"linked")
        .link(tar::EntryType::Link, "data/h2", "data/h1")
        .link(tar::EntryType::Symlink, "data/sym", "old.txt")
        .dir("home", 0o755)
        .dir("home/app", 0o700)
        .file_owned("home/app/secret", 0o640, 1000, 1000, b"only app reads this")
        .xattr_file("data/tagged", "user.umbra", "yes", b"x")
        .finish();
    // The home directory becomes app's.
    let l2 = {
        let mut t = LayerTar::new().file("data/old.txt", 0o644, b"v2").file("data/new.txt", 0o644, b"v3");
        let mut h = LayerTar::header(tar::EntryType::Directory, 0o700, 1000, 1000, 0);
        t.b().append_data(&mut h, "home/app", &[][..]).unwrap();
        t.finish()
    };
    layout.image(
        "amd64",
        vec![(l0, Compression::Gzip), (l1, Compression::Zstd), (l2, Compression::None)],
        json!({
            "Env": ["PATH=/bin", "GREETING=hello from the layers"],
            "WorkingDir": "/data",
            "User": "app",
            "Entrypoint": ["/bin/sh", "-c"],
            "Cmd": ["echo default command; echo $GREETING; id -u"],
        }),
    )
}

const PROBE: &str =
    "id -u; id -g; pwd; echo $GREETING; ls /data | tr '\\n' ' '; echo; ls /opq; stat -c %a /opq; cat /data/old.txt; \
                     echo; stat -c '%a %u %g' /data/suid /home/app /home/app/secret; stat -c '%h' /data/h1; \
                     [ $(stat -c %i /data/h1) = $(stat -c %i /data/h2) ] && echo same-inode; readlink /data/sym; \
                     stat -c '%F %t:%T' /data/null; cat /home/app/secret; echo; cat /etc/arch; echo; uname -m";

#[test]
fn images_from_a_registry_boot_with_their_layers_and_config() {
    let env = Env::new("images");
    let registry = Registry::start(&env.dir.0, "open", false);
    let layout = Layout::new(env.dir.0.join("layout"));
    let app = app_image(&layout);
    layout.tag("app", &app, None);
    skopeo_push(&layout.dir, "app", &format!("{}/test/app:1", registry.addr), &[]);
    let reference = format!("{}/test/app:1", registry.addr);

    // The first pull downloads every layer, the second none: the same bundle.
    let first = json_of(&env.pull(&reference, &[]));
    assert!(first["downloaded_bytes"].as_u64().unwrap() > 500_000, "{first}");
    assert_eq!(first["converted"], true);
    let second = json_of(&env.pull(&reference, &[]));
    assert_eq!(
        (second["downloaded_bytes"].as_u64(), second["converted"].as_bool()),
        (Some(0), Some(false)),
        "{second}"
    );
    assert_eq!(second["cached_bytes"], first["downloaded_bytes"]);
    assert_eq!(second["bundle"], first["bundle"]);
    let bundle = first["bundle"].as_str().unwrap().to_string();

    // The layers applied exactly, the config's user, directory and environment honoured.
    let out = env.run(&reference, &[], &[PROBE]);
    assert!(out.status.success(), "{}{}", text(&out.stdout), text(&out.stderr));
    let lines: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    let expected = [
        "1000",
        "1000",
        "/data",
        "hello from the layers",
        "h1 h2 new.txt null old.txt suid sym tagged ",
        "upper.txt",
        "775",
        "v2",
        "4755 0 0",
        "700 1000 1000",
        "640 1000 1000",
        "2",
        "same-inode",
        "old.txt",
        "character special file 1:3",
        "only app reads this",
        "amd64",
        "x86_64",
    ];
    assert_eq!(lines, expected, "stderr: {}", text(&out.stderr));

    // No command: the image's Entrypoint and Cmd.
    let out = env.run(&reference, &[], &[]);
    assert_eq!(text(&out.stdout), "default command\nhello from the layers\n1000\n", "{}", text(&out.stderr));

    // The converted image is a bundle like any other: listed, and bootable by its version.
    let ls = json_of(&env.vmctl(&["bundle", "ls", "--json"]));
    assert!(ls.as_array().unwrap().iter().any(|b| b["version"] == bundle.as_str() && b["current"] == false), "{ls}");
    let out = env.vmctl(&["run", "--bundle", &bundle, "--", "/bin/busybox", "cat", "/data/new.txt"]);
    assert_eq!(text(&out.stdout), "v3", "{}", text(&out.stderr));

    // Nothing of the image became a device or a setuid file on the host.
    assert_eq!(env.special_files(), Vec::<PathBuf>::new());
}

#[test]
fn docker_media_types_multi_arch_indexes_and_arm64() {
    let env = Env::new("images-arch");
    let registry = Registry::start(&env.dir.0, "open", false);
    let layout = Layout::new(env.dir.0.join("layout"));
    let defaults = json!({"Env": ["PATH=/bin"], "Cmd": ["/bin/sh", "-c", "cat /etc/arch; echo; uname -m"]});
    let amd = layout.image("amd64", vec![(base_layer("amd64").finish(), Compression::Gzip)], defaults.clone());
    let arm = layout.image("arm64", vec![(base_layer("arm64").finish(), Compression::Gzip)], defaults);
    let index = layout.index(&[("arm64", &arm), ("amd64", &amd)]);
    layout.tag("multi", &index, None);
    layout.tag("amd", &amd, Some("amd64"));
    skopeo_push(&layout.dir, "multi", &format!("{}/test/multi:1", registry.addr), &["--all"]);
    // Docker's own media types (schema 2, gzip layers).
    skopeo_push(&layout.dir, "amd", &format!("{}/test/docker:1", registry.addr), &["--format", "v2s2"]);
    let raw = Command::new("skopeo")
        .args(["inspect", "--raw", "--tls-verify=false", &format!("docker://{}/test/docker:1", registry.addr)])
        .output()
        .unwrap();
    let raw: Value = serde_json::from_slice(&raw.stdout).unwrap();
    assert_eq!(raw["mediaType"], "application/vnd.docker.distribution.manifest.v2+json");
    assert_eq!(raw["layers"][0]["mediaType"], "application/vnd.docker.image.rootfs.diff.tar.gzip");

    let out = env.run(&format!("{}/test/docker:1", registry.addr), &[], &[]);
    assert_eq!(text(&out.stdout), "amd64\nx86_64\n", "{}", text(&out.stderr));
    // The index resolves to this host's architecture…
    let out = env.run(&format!("{}/test/multi:1", registry.addr), &[], &[]);
    assert_eq!(text(&out.stdout), "amd64\nx86_64\n", "{}", text(&out.stderr));
    // …and to arm64 for an arm64 guest, which boots under qemu-system-aarch64.
    let base = test_bundle("minimal-aarch64");
    let out = env
        .cmd()
        .args(["run", "--image", &format!("{}/test/multi:1", registry.addr), "--allow-http-loopback", "--arch"])
        .args(["aarch64", "--base", base.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(text(&out.stdout), "arm64\naarch64\n", "{}", text(&out.stderr));
}

#[test]
fn tampered_blobs_altered_manifests_and_private_repositories() {
    let env = Env::new("images-refused");
    let registry = Registry::start(&env.dir.0, "open", false);
    let private = Registry::start(&env.dir.0, "private", true);
    let layout = Layout::new(env.dir.0.join("layout"));
    let manifest = layout.image("amd64", vec![(base_layer("amd64").finish(), Compression::Gzip)], json!({}));
    layout.tag("plain", &manifest, None);
    let manifest_digest = sha(manifest.to_string().as_bytes());
    for repo in ["test/tampered", "test/altered"] {
        skopeo_push(&layout.dir, "plain", &format!("{}/{repo}:1", registry.addr), &[]);
    }

    // A layer whose bytes changed on the server: refused by its digest, nothing installed.
    let layer = manifest["layers"][0]["digest"].as_str().unwrap();
    let file = registry.blob_file(layer);
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n / 2] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let out = env.pull(&format!("{}/test/tampered:1", registry.addr), &[]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("digest") && err.contains(layer.strip_prefix("sha256:").unwrap()), "{err}");
    let ls = json_of(&env.vmctl(&["bundle", "ls", "--json"]));
    assert_eq!(ls, json!([]), "nothing installed");
    bytes[n / 2] ^= 0xff;
    std::fs::write(&file, &bytes).unwrap();

    // A manifest whose bytes are not those of its digest.
    let file = registry.blob_file(&manifest_digest);
    let altered = std::fs::read_to_string(&file).unwrap().replacen("\"schemaVersion\":2", "\"schemaVersion\": 2", 1);
    std::fs::write(&file, altered).unwrap();
    let out = env.pull(&format!("{}/test/altered@{manifest_digest}", registry.addr), &[]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).to_lowercase().contains("digest"), "{}", text(&out.stderr));

    // A private registry: no credentials, refused; given ones, or the Docker config's, pulled.
    let reference = format!("{}/team/private:1", private.addr);
    skopeo_push(&layout.dir, "plain", &reference, &["--dest-creds", &format!("tester:{PASSWORD}")]);
    let out = env.pull(&reference, &[]);
    assert!(!out.status.success());
    let err = text(&out.stderr).to_lowercase();
    assert!(err.contains("not authorized (no credentials for this registry"), "{err}");
    let mut child = env
        .cmd()
        .args(["image", "pull", "--json", "--allow-http-loopback", "--base"])
        .arg(test_bundle("minimal"))
        .args(["--username", "tester", "--password-stdin", &reference])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(format!("{PASSWORD}\n").as_bytes()).unwrap();
    let given = json_of(&child.wait_with_output().unwrap());
    assert_eq!(given["converted"], true, "{given}");
    let auth = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, format!("tester:{PASSWORD}"));
    std::fs::write(
        env.dir.0.join("docker/config.json"),
        json!({"auths": {private.addr.clone(): {"auth": auth}}}).to_string(),
    )
    .unwrap();
    let from_config = json_of(&env.pull(&reference, &[]));
    assert_eq!(from_config["bundle"], given["bundle"]);
    assert_eq!(from_config["converted"], false);

    // A credential helper, as `docker login` with one configures it: `docker-credential-NAME
    // get` answers for the registry named on its stdin.
    let bin = env.dir.0.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let helper = bin.join("docker-credential-umbratest");
    std::fs::write(
        &helper,
        format!(
            "#!/bin/sh
[ \"$1\" = get ] || exit 1
read server
echo \"$server\" >> {}
             printf '{{\"ServerURL\":\"%s\",\"Username\":\"tester\",\"Secret\":\"{PASSWORD}\"}}' \"$server\"
",
            env.dir.0.join("asked").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&helper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::write(
        env.dir.0.join("docker/config.json"),
        json!({"credHelpers": {private.addr.clone(): "umbratest"}}).to_string(),
    )
    .unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let out = env
        .cmd()
        .env("PATH", path)
        .args(["image", "pull", "--json", "--allow-http-loopback", "--base"])
        .arg(test_bundle("minimal"))
        .arg(&reference)
        .output()
        .unwrap();
    assert_eq!(json_of(&out)["bundle"], given["bundle"]);
    let asked = std::fs::read_to_string(env.dir.0.join("asked")).unwrap();
    assert!(asked.contains(&private.addr), "the helper was asked for the registry: {asked:?}");

    // Wrong credentials are named as such.
    let mut child = env
        .cmd()
        .args(["image", "pull", "--allow-http-loopback", "--base"])
        .arg(test_bundle("minimal"))
        .args(["--username", "tester", "--password-stdin", &reference])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"not-the-password\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("the registry refused the credentials"), "{}", text(&out.stderr));
}

#[test]
fn archives_import_and_hostile_layers_stay_inside_the_image() {
    let env = Env::new("images-import");
    let base = test_bundle("minimal");
    let base = base.to_str().unwrap();

    // A `docker save` archive: manifest.json, the config, one layer.tar per layer.
    let layer = base_layer("amd64").file("etc/motd", 0o644, b"imported from an archive").finish();
    let config = json!({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": ["PATH=/bin"], "Cmd": ["cat", "/etc/motd"]},
        "rootfs": {"type": "layers", "diff_ids": [sha(&layer)]},
    })
    .to_string();
    let config_name = format!("{}.json", &sha(config.as_bytes())[7..]);
    let mut archive = tar::Builder::new(Vec::new());
    for (name, bytes) in [
        (
            "manifest.json",
            json!([{"Config": config_name, "RepoTags": ["saved:1"], "Layers": ["abc/layer.tar"]}])
                .to_string()
                .into_bytes(),
        ),
        (config_name.as_str(), config.into_bytes()),
        ("abc/layer.tar", layer),
    ] {
        let mut h = tar::Header::new_gnu();
        h.set_size(bytes.len() as u64);
        h.set_mode(0o644);
        archive.append_data(&mut h, name, &bytes[..]).unwrap();
    }
    let path = env.dir.0.join("saved.tar");
    std::fs::write(&path, archive.into_inner().unwrap()).unwrap();
    let imported = json_of(&env.vmctl(&["image", "import", "--json", "--base", base, path.to_str().unwrap()]));
    let out =
        env.vmctl(&["run", "--bundle", imported["bundle"].as_str().unwrap(), "--", "/bin/busybox", "cat", "/etc/motd"]);
    assert_eq!(text(&out.stdout), "imported from an archive", "{}", text(&out.stderr));

    // Hostile layers: a path that climbs is refused by name; a symlink to `/` and a file
    // through it land in the image's root, never the host's; devices and setuid files stay
    // records in the image.
    let layout = Layout::new(env.dir.0.join("hostile"));
    let climb = LayerTar::new().raw_name(b"../../../tmp/umbra-escaped", b"x").finish();
    let m = layout.image(
        "amd64",
        vec![(base_layer("amd64").finish(), Compression::Gzip), (climb, Compression::None)],
        json!({}),
    );
    layout.tag("climb", &m, None);
    let out = env.vmctl(&["image", "import", "--base", base, layout.dir.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("climbs out of the image"), "{}", text(&out.stderr));
    assert!(!Path::new("/tmp/umbra-escaped").exists());

    let layout = Layout::new(env.dir.0.join("through-symlink"));
    let marker = format!("umbra-escape-{}", std::process::id());
    let through = LayerTar::new()
        .link(tar::EntryType::Symlink, "host", "/")
        .link(tar::EntryType::Symlink, "up", "../../../..")
        .file(&format!("host/opt/{marker}"), 0o4755, b"through /")
        .file(&format!("up/opt/{marker}-2"), 0o644, b"through ..")
        .device("host/opt/mem", 1, 1)
        .finish();
    let m = layout.image(
        "amd64",
        vec![(base_layer("amd64").finish(), Compression::Gzip), (through, Compression::None)],
        json!({"Env": ["PATH=/bin"]}),
    );
    layout.tag("through", &m, None);
    let imported = json_of(&env.vmctl(&["image", "import", "--json", "--base", base, layout.dir.to_str().unwrap()]));
    assert!(!Path::new("/opt").join(&marker).exists() && !Path::new("/opt").join(format!("{marker}-2")).exists());
    let out = env.vmctl(&[
        "run",
        "--bundle",
        imported["bundle"].as_str().unwrap(),
        "--",
        "/bin/sh",
        "-c",
        &format!("stat -c '%a %F' /opt/{marker} /opt/{marker}-2 /opt/mem"),
    ]);
    assert_eq!(
        text(&out.stdout),
        "4755 regular file\n644 regular file\n666 character special file\n",
        "{}",
        text(&out.stderr)
    );
    assert_eq!(env.special_files(), Vec::<PathBuf>::new());
}
