//! A command line a client asks to run, through the approval rules: the shell parser
//! (brush-parser), the wrappers and shells looked through, rm and sudo protection, allow and deny
//! matching — in every mode. A hostile line must get a decision, never a crash or a hang.
#![no_main]

use libfuzzer_sys::fuzz_target;
use umbra_policy::approval::{evaluate, ApprovalMode, ApprovalSettings, CommandRequest, Verdict};

fuzz_target!(|data: &[u8]| {
    // brush-parser panics on some inputs (an I/O number past u32: `8033333333>|`); `split`
    // catches that and asks a person. libfuzzer-sys's panic hook would count even a caught
    // panic as a crash, so quiet it: a panic that escapes still aborts the target.
    static QUIET: std::sync::Once = std::sync::Once::new();
    QUIET.call_once(|| std::panic::set_hook(Box::new(|_| {})));
    let Ok(command) = std::str::from_utf8(data) else { return };
    let request = CommandRequest {
        command: command.to_string(),
        cwd: "/sessions/s/mnt/work".into(),
        workspace: vec!["/sessions/s/mnt/work".into()],
        session: None,
        env: Default::default(),
        writable: vec!["/sessions/s/mnt/work".into()],
        contained: None,
    };
    for mode in [ApprovalMode::AskEveryTime, ApprovalMode::Allowlist, ApprovalMode::Auto, ApprovalMode::RunEverything] {
        let settings = ApprovalSettings {
            mode,
            allow: vec!["ls".into(), "git status".into(), "sh -c".into()],
            deny: vec!["curl".into()],
            protect_dotfiles: true,
            ..Default::default()
        };
        let decision = evaluate(&settings, &request);
        // Deny wins: a line with a denied part is never allowed.
        if decision.parts.iter().any(|p| p.first().is_some_and(|w| w == "curl")) {
            assert_eq!(decision.verdict, Verdict::Deny, "{command:?}: {decision:?}");
        }
    }
});
