//! A line the shell parser takes seconds on (found by the approval_command fuzz target) gets a
//! decision within the budget — a person decides — and never stalls the caller. Its own test
//! binary: the slow parse keeps running on a blocking thread, holding the parser.

use std::time::{Duration, Instant};

use umbra_policy::approval::{evaluate_bounded, ApprovalMode, ApprovalSettings, CommandRequest, Reason, Verdict};

#[test]
fn a_slow_line_is_decided_within_the_budget_and_later_lines_fail_closed() {
    let slow = String::from_utf8(include_bytes!("slow-line.bin").to_vec()).expect("the fuzzer feeds UTF-8");
    let settings = ApprovalSettings { mode: ApprovalMode::RunEverything, ..Default::default() };
    let request = |command: &str| CommandRequest {
        command: command.into(),
        cwd: "/w".into(),
        workspace: vec!["/w".into()],
        session: None,
        env: Default::default(),
        writable: Vec::new(),
        contained: None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let budget = Duration::from_millis(500);
        let started = Instant::now();
        let d = evaluate_bounded(&settings, &request(&slow), budget).await;
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
        assert_eq!(d.verdict, Verdict::Ask);
        assert!(matches!(&d.reason, Reason::Unparseable { error } if error.contains("within 0.5 s")), "{d:?}");
        // The slow parse still holds the parser: the next line cannot be checked in time, and
        // so is not allowed either (even in run-everything).
        let d = evaluate_bounded(&settings, &request("ls"), budget).await;
        assert_eq!(d.verdict, Verdict::Ask, "{d:?}");
    });
    // Do not wait for the slow parse.
    rt.shutdown_background();
}
