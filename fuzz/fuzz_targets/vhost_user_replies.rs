//! What a vhost-user backend (virtiofsd) answers the virtio-fs frontend during negotiation:
//! GET_FEATURES, GET_PROTOCOL_FEATURES, GET_QUEUE_NUM and acks, as arbitrary bytes on the
//! socket. The frontend must refuse what it cannot use with an error — never panic, hang past
//! its deadline, or accept a backend without what virtio-fs needs.
#![no_main]

use std::io::Write;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use umbra_vmm::devices::virtio::fs::backend::Backend;

/// A backend that answers each connection with the next input, then hangs up.
fn backend() -> &'static (PathBuf, Mutex<SyncSender<Vec<u8>>>) {
    static BACKEND: OnceLock<(PathBuf, Mutex<SyncSender<Vec<u8>>>)> = OnceLock::new();
    BACKEND.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("umbra-fuzz-vhost-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let (tx, rx): (SyncSender<Vec<u8>>, Receiver<Vec<u8>>) = sync_channel(1);
        std::thread::spawn(move || {
            for (stream, reply) in listener.incoming().zip(rx) {
                let Ok(mut stream) = stream else { continue };
                let _ = stream.write_all(&reply);
                let _ = stream.shutdown(std::net::Shutdown::Write);
                // Keep reading until the frontend is done, so its writes never fail early.
                let _ = std::io::copy(&mut stream, &mut std::io::sink());
            }
        });
        (path, Mutex::new(tx))
    })
}

fuzz_target!(|data: &[u8]| {
    let (path, tx) = backend();
    tx.lock().unwrap().send(data.to_vec()).unwrap();
    if let Ok(backend) = Backend::connect_with_timeout(path, 2, Duration::from_millis(500)) {
        // Accepted: it must have offered virtio 1.
        assert!(backend.features() & (1 << 32) != 0, "accepted without VIRTIO_F_VERSION_1");
    }
});
