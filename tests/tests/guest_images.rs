//! The guest image recipes: the kernel fragment check and reproducible bundles.

use std::path::{Path, PathBuf};
use std::process::Command;

use umbra_tests::{workspace_bin, TempDir};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn a_fragment_option_that_does_not_stick_fails_the_kernel_build_by_name() {
    let dir = TempDir::new("fragment");
    let fragment = std::fs::read_to_string(repo().join("rootfs/kernel/umbra-microvm.config")).unwrap();
    assert!(fragment.contains("CONFIG_VIRTIO_VSOCKETS=y\n"));
    // Dropping the vsock core leaves the virtio transport asked for but unbuildable.
    let broken: String =
        fragment.lines().filter(|l| !l.starts_with("CONFIG_VSOCKETS=")).map(|l| format!("{l}\n")).collect();
    let path = dir.0.join("broken.config");
    std::fs::write(&path, broken).unwrap();
    let out = Command::new(repo().join("scripts/build-kernel"))
        .arg("--check")
        .env("UMBRA_KERNEL_FRAGMENT", &path)
        .output()
        .expect("run scripts/build-kernel");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the build must fail; stderr:\n{stderr}");
    assert!(stderr.contains("CONFIG_VIRTIO_VSOCKETS"), "names the option that dropped out:\n{stderr}");
    assert!(out.stdout.is_empty(), "no vmlinux path printed");

    // The unmodified fragment passes the same check.
    let ok = Command::new(repo().join("scripts/build-kernel")).arg("--check").output().unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
}

#[test]
fn two_builds_of_the_minimal_bundle_are_identical() {
    let dir = TempDir::new("repro");
    let build = |out: &Path| {
        let st = Command::new(workspace_bin("vmctl"))
            .args(["bundle", "build", "--flavor", "minimal", "--level", "3", "--out"])
            .arg(out)
            .status()
            .expect("run vmctl");
        assert!(st.success());
        std::fs::read_to_string(out.join("manifest.json")).unwrap()
    };
    let (a, b) = (build(&dir.0.join("a")), build(&dir.0.join("b")));
    assert_eq!(a, b, "same inputs, same manifest");
    for f in ["kernel.zst", "initramfs.zst"] {
        assert_eq!(
            std::fs::read(dir.0.join("a").join(f)).unwrap(),
            std::fs::read(dir.0.join("b").join(f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn an_unknown_architecture_is_refused_before_anything_is_built() {
    let out = Command::new(workspace_bin("vmctl"))
        .args(["bundle", "build", "--flavor", "minimal", "--arch", "riscv64", "--out", "/nonexistent/b"])
        .output()
        .expect("run vmctl");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("riscv64") && stderr.contains("x86_64 or aarch64"), "{stderr}");
    assert!(!stderr.contains("build-kernel"), "nothing ran: {stderr}");
}

#[test]
fn the_arm64_bundle_says_its_architecture_and_kernel_format() {
    let dir =
        umbra_tests::test_bundle(&umbra_runtime::paths::built_bundle_name("minimal", umbra_bundle::Arch::Aarch64));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["arch"], "aarch64");
    let kernel = manifest["artifacts"].as_array().unwrap().iter().find(|a| a["role"] == "kernel").unwrap();
    assert_eq!(kernel["format"], "arm64-image");
}
