//! The accept loop `weft serve` runs instead of axum's own: a cap on open connections
//! below the descriptor limit (raised to the hard limit at start), a deadline for a
//! request's headers that also closes idle kept-alive connections, an answer at the cap
//! that is never a hang (`/health` still 200, anything else a JSON 503), and graceful
//! shutdown. Hand-written over hyper-util because axum's `serve` sets no timeouts and no cap.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// How `weft serve` bounds its connections.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once; more get an immediate answer and are closed.
    pub max_connections: usize,
    /// A request's headers must arrive within this, and a kept-alive connection that
    /// sends no next request within it is closed.
    pub header_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 4096,
            header_timeout: Duration::from_secs(15),
        }
    }
}

/// How long shutdown waits for open responses to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Answers over the cap in flight at once; past them a connection is closed unanswered.
const REFUSALS: usize = 64;

/// Descriptors kept free of connections: model files, logs, the batcher's channels.
const RESERVED_FDS: u64 = 256;

/// Raises the soft descriptor limit to the hard one and returns the connection cap that
/// fits under it (at most `wanted`).
pub fn fit_connections(wanted: usize) -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    let soft = unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return wanted.min(1024 - RESERVED_FDS as usize);
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
        lim.rlim_cur
    };
    let room = soft.saturating_sub(RESERVED_FDS).max(16);
    wanted.min(usize::try_from(room).unwrap_or(usize::MAX))
}

/// Serves `app` on `listener` until `shutdown` resolves, then lets open connections
/// finish their responses.
pub async fn serve_limited(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    // Answers over the cap hold a descriptor for up to two seconds each: bounded too, so a
    // flood cannot take the descriptors model files and logs need.
    let refusals = Arc::new(Semaphore::new(REFUSALS));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, _peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors or a reset handshake: not fatal; back off a moment.
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            if let Ok(r) = refusals.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    at_capacity(stream, limits).await;
                    drop(r);
                });
            }
            continue;
        };
        let service = TowerToHyperService::new(
            app.clone()
                .map_request(|req: Request<Incoming>| req.map(Body::new)),
        );
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let conn = builder
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades();
            let mut conn = pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = stop_requested(&mut stop) => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.as_mut().await;
                }
            }
            drop(slot);
        });
    }
    // No new connections while the open ones finish.
    drop(listener);
    let _ = stop_tx.send(true);
    // Every slot back: each open connection has finished; a client that stopped reading
    // its stream does not hold the exit up past the grace.
    let all = slots.acquire_many(limits.max_connections as u32);
    if tokio::time::timeout(SHUTDOWN_GRACE, all).await.is_err() {
        tracing::warn!(
            "{} connections still open after {} s; closing",
            limits.max_connections - slots.available_permits(),
            SHUTDOWN_GRACE.as_secs()
        );
    }
    Ok(())
}

/// Resolves once shutdown is asked for (never, if the loop is gone without asking).
async fn stop_requested(rx: &mut watch::Receiver<bool>) {
    loop {
        if *rx.borrow_and_update() {
            return;
        }
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A connection over the cap: `/health` still gets its 200 (a supervisor must not restart
/// a busy server), anything else a JSON 503; then it is closed.
async fn at_capacity(mut stream: TcpStream, limits: Limits) {
    let mut head = [0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(1), stream.read(&mut head))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(0);
    let health = head[..n].starts_with(b"GET /health ");
    // Read what else the client sent (briefly), so closing does not reset the connection
    // before it reads the answer.
    let mut rest = [0u8; 4096];
    for _ in 0..16 {
        match tokio::time::timeout(Duration::from_millis(20), stream.read(&mut rest)).await {
            Ok(Ok(n)) if n > 0 => continue,
            _ => break,
        }
    }
    let (status, body) = if health {
        (
            "200 OK",
            r#"{"status":"ok","at_connection_limit":true}"#.to_string(),
        )
    } else {
        (
            "503 Service Unavailable",
            crate::error::ApiError::unavailable(format!(
                "the server has {} connections open, its limit; try again",
                limits.max_connections
            ))
            .with_code("too_many_connections")
            .body()
            .to_string(),
        )
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\nretry-after: 1\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), stream.write_all(reply.as_bytes())).await;
    let _ = stream.shutdown().await;
}
