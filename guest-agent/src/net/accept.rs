//! What every listener of the guest's network stack shares: the accept loop, and the last
//! message of a connection it refuses.

use std::future::Future;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Accepts forever, handling each connection on its own task. Accept errors (EMFILE) back off
/// and retry: they must never end the agent.
pub(crate) async fn accept_loop<F, Fut>(what: &'static str, listener: TcpListener, handle: F)
where
    F: Fn(TcpStream) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut delay: Option<Duration> = None;
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                delay = None;
                let _ = stream.set_nodelay(true);
                tokio::spawn(handle(stream));
            }
            Err(e) => {
                let d = match delay {
                    None => {
                        tracing::warn!("{what}: accept failed: {e}; retrying");
                        Duration::from_millis(10)
                    }
                    Some(d) => (d * 2).min(Duration::from_millis(100)),
                };
                delay = Some(d);
                tokio::time::sleep(d).await;
            }
        }
    }
}

/// Writes a last message, half-closes, and drains what the client still sends for a moment
/// (at most 64 KiB, 1 s): closing with unread data would reset the connection and could
/// destroy the message before the client reads it.
pub(crate) async fn write_and_close(stream: &mut TcpStream, message: &[u8]) {
    let _ = tokio::time::timeout(Duration::from_secs(2), stream.write_all(message)).await;
    let _ = stream.shutdown().await;
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        while drained < 64 * 1024 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    })
    .await;
}
