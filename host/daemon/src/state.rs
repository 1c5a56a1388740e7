//! What every connection of the daemon shares: the session manager, how it serves, and the
//! bundle downloads in progress. Below the socket code and the handlers, which both use it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use umbra_bundle::Progress;
use umbra_runtime::session::SessionManager;

/// How the daemon serves.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub socket: PathBuf,
    /// Serve root as well as the daemon's own uid.
    pub allow_root: bool,
    pub max_clients: usize,
    /// Longest request line, in bytes.
    pub max_request_bytes: usize,
    pub config_path: PathBuf,
    /// Bundle downloads may use `http://` to a loopback address (tests against a local server).
    pub allow_http_loopback: bool,
}

/// What every connection shares.
pub struct Daemon {
    pub manager: SessionManager,
    pub options: ServerOptions,
    /// The latest progress of each bundle download in progress, by URL (`bundles.rs`).
    pub downloads: Mutex<BTreeMap<String, Progress>>,
    pub uid: u32,
    next_connection: AtomicU64,
}

impl Daemon {
    pub fn new(manager: SessionManager, options: ServerOptions) -> Self {
        // SAFETY: getuid cannot fail and has no memory effects.
        let uid = unsafe { libc::getuid() };
        Self { manager, options, downloads: Mutex::default(), uid, next_connection: AtomicU64::new(1) }
    }

    /// A number for the next client's log lines.
    pub fn next_connection_id(&self) -> u64 {
        self.next_connection.fetch_add(1, Ordering::Relaxed)
    }

    pub fn allowed(&self, uid: u32) -> bool {
        uid == self.uid || (uid == 0 && self.options.allow_root)
    }
}
