//! The front door: accepts connections for the API's router, at most
//! `max_connections` open at once (more wait in the kernel's backlog
//! until one closes), each given `header_read_timeout` to send a
//! request's headers before it is closed. Without them a few hundred
//! sockets that send half a request held the service's file descriptors,
//! which the database and the guests' outbound calls also need. (The
//! request timeout, a layer of the router, bounds the rest.)

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

/// Listener settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct ListenerConfig {
    /// How long a client has to send a request's headers, counted from
    /// when the connection is idle or the request begins; then the
    /// connection is closed. Default: 10 s.
    pub header_read_timeout: Duration,
    /// Most client connections open at once (event streams included).
    /// Default: 512.
    pub max_connections: usize,
}

impl Default for ListenerConfig {
    fn default() -> Self {
        ListenerConfig { header_read_timeout: Duration::from_secs(10), max_connections: 512 }
    }
}

/// Serves `router` on `listener` until `stop` turns true, then stops
/// accepting and waits for the open connections to finish (event streams
/// end on the same signal).
pub async fn serve(listener: TcpListener, router: Router, config: ListenerConfig, mut stop: watch::Receiver<bool>) {
    let slots = Arc::new(Semaphore::new(config.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut full_logged = false;
    loop {
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if !full_logged {
                    tracing::warn!(max = config.max_connections, "at the connection cap; new connections wait until one closes");
                    full_logged = true;
                }
                tokio::select! {
                    p = slots.clone().acquire_owned() => p.expect("the connection semaphore is never closed"),
                    _ = stopped(&mut stop) => break,
                }
            }
        };
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, most likely: wait rather than spin.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stopped(&mut stop) => break,
        };
        full_logged = false;
        let _ = stream.set_nodelay(true);
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(config.header_read_timeout)
            .serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            // An error is the client's (a reset, a timeout, bad framing).
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "connection ended");
            }
            drop(permit);
        });
    }
    graceful.shutdown().await;
}

/// Returns once `stop` is true (its guard dropped here, not held in a select).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
