//! The `umbra-vmm` binary and scratch directories, for the lane-(b) process tests (included by
//! path, like `virtiofsd.rs`; each test file uses part of it).
#![allow(dead_code)]

use std::path::PathBuf;

/// `UMBRA_VMM_BIN` first: where the binary was built need not exist where the test runs (the
/// nested lane's L1 has the binaries at other paths).
pub fn vmm_bin() -> PathBuf {
    std::env::var_os("UMBRA_VMM_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_umbra-vmm")))
}

/// A fresh, empty `umbra-vmm-<suite>-<name>-<pid>` under the temporary directory.
pub fn scratch_dir(suite: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("umbra-vmm-{suite}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
