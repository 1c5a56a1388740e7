//! `vmctl session attach` and `vmctl session ps`: the terminals and detached processes a session
//! keeps when their client goes (docs/sessions.md, "Processes that outlive their client").

use std::io::Write;

use anyhow::bail;
use clap::Args;
use tokio::signal::unix::{signal, SignalKind};
use umbra_api::client::Client;
use umbra_api::kept::{InSession, TerminalAttachParams, TerminalOpenParams, TerminalResizeParams};
use umbra_api::methods::*;
use umbra_api::rpc::NOTIFY_PROCESS;
use umbra_api::{Data, EventKind, SessionEvent};
use umbra_proto::TtySize;

use crate::tty::RawTerminal;

/// The key that detaches from a terminal and leaves it running: Ctrl-] (as telnet and virsh
/// console use it).
const DETACH_KEY: u8 = 0x1d;

#[derive(Args, Debug)]
pub struct AttachArgs {
    name: String,
    /// The terminal to attach to (`vmctl session ps NAME` lists them); default: a new one.
    terminal: Option<u64>,
    /// For a new terminal: its shell (default a login shell).
    #[arg(long, num_args = 1.., value_name = "ARGV")]
    shell: Vec<String>,
}

#[derive(Args, Debug)]
pub struct PsArgs {
    name: String,
    #[arg(long)]
    json: bool,
}

/// Lists a session's processes and terminals.
pub async fn ps(args: PsArgs) -> Result<(), umbra_api::ApiError> {
    let (client, _notes) = Client::connect(None).await?;
    let list = client.call::<ProcessListMethod>(InSession { session: args.name }).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&list).expect("serializes"));
        return Ok(());
    }
    println!("{:<8} {:<8} {:<10} {:<16} COMMAND", "ID", "PID", "KIND", "STATE");
    for p in list.processes {
        let kind = if p.terminal {
            "terminal"
        } else if p.detached {
            "detached"
        } else {
            "attached"
        };
        let state = match &p.exit {
            None => "running".to_string(),
            Some(e) => format!("exited {}", e.shell_status()),
        };
        println!("{:<8} {:<8} {:<10} {:<16} {}", p.process, p.pid, kind, state, p.argv.join(" "));
    }
    Ok(())
}

/// Attaches the host terminal to a session's terminal (a new one unless named): raw mode, the
/// window size forwarded, Ctrl-] detaches and leaves it running. Exits with the shell's status
/// when it ends.
pub async fn attach(args: AttachArgs) -> i32 {
    match attach_inner(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("vmctl: error: {e:#}");
            umbra_api::event::EXIT_UMBRA_ERROR
        }
    }
}

async fn attach_inner(args: AttachArgs) -> anyhow::Result<i32> {
    let (client, mut notes) = Client::connect(None).await?;
    let size = crate::tty::size().unwrap_or(TtySize { rows: 24, cols: 80 });
    let session = args.name.clone();
    let terminal = match args.terminal {
        Some(terminal) => {
            client.call::<TerminalAttach>(TerminalAttachParams { session: session.clone(), terminal, from: 0 }).await?;
            let resize = TerminalResizeParams { session: session.clone(), terminal, rows: size.rows, cols: size.cols };
            client.call::<TerminalResize>(resize).await?;
            terminal
        }
        None => {
            let open = TerminalOpenParams {
                session: session.clone(),
                shell: args.shell,
                cwd: None,
                env: Default::default(),
                size,
            };
            client.call::<TerminalOpen>(open).await?.terminal
        }
    };
    eprint!("vmctl: attached to terminal {terminal} of session {session}; Ctrl-] detaches\r\n");
    let raw = RawTerminal::enable().ok();
    // Typing goes on its own task: a guest that stops reading its terminal holds that task,
    // never the output or Ctrl-].
    let (detached_tx, mut detached) = tokio::sync::oneshot::channel::<()>();
    let mut host_stdin = crate::run::host_stdin_reader();
    let (typing_client, typing_session) = (client.clone(), session.clone());
    let typing = tokio::spawn(async move {
        while let Some(Some(bytes)) = host_stdin.recv().await {
            let (typed, detach) = match bytes.iter().position(|&b| b == DETACH_KEY) {
                Some(at) => (&bytes[..at], true),
                None => (&bytes[..], false),
            };
            let p = StdinParams {
                session: typing_session.clone(),
                process: terminal,
                data: Data::from_bytes(typed),
                writer: None,
                offset: None,
            };
            if (!typed.is_empty() && typing_client.call::<ProcessStdin>(p).await.is_err()) || detach {
                break;
            }
        }
        // The host's input ended (or the terminal's): detach.
        let _ = detached_tx.send(());
    });
    let mut winch = signal(SignalKind::window_change())?;
    let code = loop {
        tokio::select! {
            _ = &mut detached => break None,
            n = notes.recv() => {
                let Some(n) = n else { bail!("umbrad closed the connection") };
                if n.method != NOTIFY_PROCESS {
                    continue;
                }
                let ev: SessionEvent = serde_json::from_value(n.params)?;
                match ev.kind {
                    EventKind::Stdout { process, data, .. } | EventKind::Stderr { process, data, .. } if process == terminal => {
                        // A terminal's output is all stdout (the pseudo-terminal merges stderr).
                        let bytes = data.to_bytes()?;
                        let mut out = std::io::stdout();
                        out.write_all(&bytes)?;
                        out.flush()?;
                        let ack = AckParams { session: session.clone(), process, stream: Stream::Stdout, bytes: bytes.len() as u64 };
                        client.notify::<ProcessAck>(ack).await?;
                    }
                    EventKind::Exit(e) if e.process == terminal => break Some(e.shell_status()),
                    _ => {}
                }
            }
            _ = winch.recv() => {
                if let Some(sz) = crate::tty::size() {
                    let p = TerminalResizeParams { session: session.clone(), terminal, rows: sz.rows, cols: sz.cols };
                    let _ = client.call::<TerminalResize>(p).await;
                }
            }
        }
    };
    typing.abort();
    drop(raw);
    match code {
        Some(code) => Ok(code),
        None => {
            eprintln!("\nvmctl: detached; terminal {terminal} runs on: vmctl session attach {session} {terminal}");
            Ok(0)
        }
    }
}
