//! The accept loop every listener of the guest's network stack runs.

use std::future::Future;
use std::time::Duration;

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
