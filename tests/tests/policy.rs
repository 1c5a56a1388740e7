//! The sandbox policy enforced in real guests (issue 15): workspace modes, extra paths, `.git`
//! read-only, `/tmp` read-only, hidden files — each still holding after the guest's root
//! remounts everything read-write, because the host enforces it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use umbra_api::methods::StartParams;
use umbra_api::session::{FolderSpec, SettingsPatch};
use umbra_policy::{PolicyType, SandboxPolicy};
use umbra_proto::ShareMode;
use umbra_runtime::session::{ExecRequest, Session};
use umbra_tests::TempDir;

fn sh(script: &str) -> ExecRequest {
    ExecRequest { argv: vec!["sh".into(), "-c".into(), script.into()], ..Default::default() }
}

async fn run(s: &std::sync::Arc<Session>, script: &str) -> String {
    let out = s.spawn(sh(script)).await.unwrap().output().await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    eprintln!("--- guest ran:\n{script}\n--- and said:\n{text}");
    text
}

/// Every file below `root` with its bytes (and every directory), to compare before and after.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            if path.is_dir() {
                out.insert(rel, Vec::new());
                stack.push(path);
            } else {
                out.insert(rel, std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

fn git(dir: &Path, args: &[&str]) {
    let st = Command::new("git")
        .args(["-c", "user.name=host", "-c", "user.email=host@example.invalid", "-c", "init.defaultBranch=main"])
        .args(args)
        .current_dir(dir)
        .status()
        .expect("git on the host");
    assert!(st.success(), "git {args:?}");
}

/// Remounts every mount in the guest read-write, as a guest root trying to undo the policy.
const REMOUNT_ALL_RW: &str =
    "awk '{print $2}' /proc/mounts | while read m; do mount -o remount,rw \"$m\" 2>/dev/null; done; echo REMOUNTED";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_tmp_and_ignored_files_are_enforced_by_the_host_even_against_guest_root() {
    let dir = TempDir::new("policy-git");
    let ws = dir.0.join("ws");
    std::fs::create_dir_all(ws.join("src")).unwrap();
    std::fs::create_dir_all(ws.join("config")).unwrap();
    std::fs::write(ws.join("src/main.rs"), "fn main() {}\n").unwrap();
    std::fs::write(ws.join(".env"), "API_KEY=host-secret-1\n").unwrap();
    std::fs::write(ws.join("config/server.pem"), "host-secret-2\n").unwrap();
    git(&ws, &["init", "-q"]);
    git(&ws, &["add", "src"]);
    git(&ws, &["commit", "-q", "-m", "first"]);
    let git_before = snapshot(&ws.join(".git"));

    let m = umbra_tests::session_manager_for(&dir, "standard", 512);
    let policy: SandboxPolicy = serde_json::from_str(
        r#"{"type": "workspace_readwrite", "block_git_writes": true, "disable_tmp_write": true,
            "ignore": [".env", "*.pem"]}"#,
    )
    .unwrap();
    let params = StartParams {
        name: "pol".into(),
        folders: vec![FolderSpec { path: ws.clone(), name: Some("ws".into()), mode: ShareMode::Rwd }],
        settings: SettingsPatch { policy: Some(policy), ..Default::default() },
        ..Default::default()
    };
    let s = m.start(params).await.unwrap();
    // umbra-fsd (which holds the fanotify group) runs under its seccomp filter, on every thread.
    let fsd = s
        .info()
        .vm
        .unwrap()
        .pids
        .into_iter()
        .find(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "umbra-fsd"));
    let fsd = fsd.expect("umbra-fsd among the VM's helpers");
    for task in std::fs::read_dir(format!("/proc/{fsd}/task")).unwrap() {
        let status = std::fs::read_to_string(task.unwrap().path().join("status")).unwrap();
        assert!(status.lines().any(|l| l == "Seccomp:\t2"), "an umbra-fsd thread is unfiltered:\n{status}");
    }
    let ws_info = s.info().folders.into_iter().find(|f| f.name == "ws").unwrap();
    assert_eq!(ws_info.mode, ShareMode::Rwd, "workspace_readwrite keeps the folder writable");

    // Created on the host after the share: hidden too.
    std::fs::create_dir_all(ws.join("late")).unwrap();
    std::fs::write(ws.join("late/.env"), "host-secret-3\n").unwrap();

    let attempts = r#"
cd /sessions/pol/mnt/ws || exit 1
git status --short >/dev/null && echo STATUS_OK
git log --format=%s | grep -qx first && echo LOG_OK
echo '// edited in the guest' >> src/main.rs && echo EDIT_OK
git -c user.name=g -c user.email=g@example.invalid commit -qam guest; echo COMMIT_RC=$?
touch .git/evil; echo GITWRITE_RC=$?
cat .env; echo ENV_RC=$?
cat config/server.pem; echo PEM_RC=$?
cat late/.env; echo LATE_RC=$?
mv .env stolen; echo MV_RC=$?
ln .env linked; echo LN_RC=$?
echo x > /tmp/f; echo TMP_RC=$?
grep ' /tmp ' /proc/mounts | awk '{print "TMP_MOUNT=" $4}'
"#;
    for round in ["before remount", "after remount"] {
        let script =
            if round == "before remount" { attempts.to_string() } else { format!("{REMOUNT_ALL_RW}\n{attempts}") };
        let out = run(&s, &script).await;
        for want in ["STATUS_OK", "LOG_OK", "EDIT_OK"] {
            assert!(out.contains(want), "{round}: {want} missing:\n{out}");
        }
        for rc in ["COMMIT_RC", "GITWRITE_RC", "ENV_RC", "PEM_RC", "LATE_RC", "MV_RC", "LN_RC", "TMP_RC"] {
            assert!(!out.contains(&format!("{rc}=0")), "{round}: {rc} succeeded:\n{out}");
            assert!(out.contains(&format!("{rc}=")), "{round}: {rc} did not run:\n{out}");
        }
        assert!(out.contains("Read-only file system"), "{round}: the commit says why it failed:\n{out}");
        for secret in ["host-secret-1", "host-secret-2", "host-secret-3"] {
            assert!(!out.contains(secret), "{round}: {secret} reached the guest:\n{out}");
        }
        if round == "after remount" {
            // The guest did undo its own side: /tmp is read-write in the guest, yet writes fail.
            assert!(out.contains("REMOUNTED") && out.contains("TMP_MOUNT=rw"), "{out}");
        }
    }

    assert_eq!(snapshot(&ws.join(".git")), git_before, "the host repository is byte-identical");
    let main = std::fs::read_to_string(ws.join("src/main.rs")).unwrap();
    assert_eq!(main.matches("// edited in the guest").count(), 2, "source edits land: {main:?}");
    assert_eq!(std::fs::read_to_string(ws.join(".env")).unwrap(), "API_KEY=host-secret-1\n");
    assert!(!ws.join("stolen").exists() && !ws.join("linked").exists());
    m.delete("pol").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspace_readonly_holds_against_guest_root_and_extra_paths_follow_their_lists() {
    let dir = TempDir::new("policy-ro");
    let (ws, cache, refs) = (dir.0.join("ws"), dir.0.join("cache"), dir.0.join("refs"));
    for d in [&ws, &cache, &refs] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(ws.join("file"), "original\n").unwrap();
    std::fs::write(refs.join("doc"), "reference\n").unwrap();
    let before = snapshot(&ws);

    let m = umbra_tests::session_manager(&dir);
    let policy = SandboxPolicy {
        kind: Some(PolicyType::WorkspaceReadonly),
        additional_readwrite_paths: Some(vec![cache.clone()]),
        additional_readonly_paths: Some(vec![refs.clone()]),
        ..Default::default()
    };
    let params = StartParams {
        name: "ro".into(),
        folders: vec![FolderSpec { path: ws.clone(), name: Some("ws".into()), mode: ShareMode::Rwd }],
        settings: SettingsPatch { policy: Some(policy), ..Default::default() },
        ..Default::default()
    };
    let s = m.start(params).await.unwrap();
    let folders = s.info().folders;
    let mode = |name: &str| folders.iter().find(|f| f.name == name).map(|f| f.mode);
    assert_eq!(mode("ws"), Some(ShareMode::Ro), "{folders:?}");
    assert_eq!(mode("cache"), Some(ShareMode::Rwd), "{folders:?}");
    assert_eq!(mode("refs"), Some(ShareMode::Ro), "{folders:?}");

    let script = format!(
        r#"
{REMOUNT_ALL_RW}
cd /sessions/ro/mnt
echo changed > ws/file; echo WRITE_RC=$?
rm ws/file; echo RM_RC=$?
echo new > ws/new; echo NEW_RC=$?
echo ref > refs/doc; echo REF_RC=$?
echo built > cache/out && echo CACHE_OK
cat refs/doc
"#
    );
    let out = run(&s, &script).await;
    for rc in ["WRITE_RC", "RM_RC", "NEW_RC", "REF_RC"] {
        assert!(out.contains(&format!("{rc}=")) && !out.contains(&format!("{rc}=0")), "{rc}:\n{out}");
    }
    assert!(out.contains("CACHE_OK") && out.contains("reference"), "{out}");
    assert_eq!(snapshot(&ws), before, "the workspace is unchanged on the host");
    assert_eq!(std::fs::read_to_string(cache.join("out")).unwrap(), "built\n");
    assert_eq!(std::fs::read_to_string(refs.join("doc")).unwrap(), "reference\n");
    m.delete("ro").await.unwrap();
}
