//! The accept loop: hyper's HTTP/1 connections under a cap on open connections and three
//! timeouts, so slow or idle clients cannot hold the server's sockets (issue 55 item 6).
//! `axum::serve` has none of these: 1,100 half-sent headers exhausted a 1,024-file limit.
//!
//! A connection is *idle* from its accept, or from the end of its last response, until a request's
//! headers are read. While idle it may stay silent for `idle`, and once a byte arrives the headers
//! must be complete within `header`. While a request is in flight (headers read, response body not
//! yet all written) no connection timeout runs: generation may be slow; the body's own deadline
//! is in `limits::read_body`.
//!
//! At the cap, a new connection takes the place of the one idle longest (a silent one, or one
//! still sending its headers); only where every open connection has a request in flight is the
//! new one closed at once. Why: with the cap alone, 1,100 half-sent headers from one client kept
//! every other client out (`/health` refused) until the header timeout freed their slots; now
//! such a flood only ever displaces itself, and a client that sends its request at once is
//! served. A request in flight is never cut.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::collections::HashMap;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

use tokio::sync::{watch, Notify, Semaphore};
use tokio::time::Instant;
use tower::ServiceExt;

use crate::limits::ConnLimits;

/// Serves `app` on `listener` until `shutdown` resolves, then lets open requests finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let open = Arc::new(Open::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                // Out of file descriptors and the like: back off instead of spinning.
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // At the cap the longest-idle connection gives way; where every one is busy, the new
        // connection is closed at once and the open ones keep being served.
        let slot = match slots.clone().try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) if open.evict_longest_idle() => {
                match tokio::time::timeout(EVICTION_WAIT, slots.clone().acquire_owned()).await {
                    Ok(Ok(slot)) => slot,
                    _ => continue,
                }
            }
            Err(_) => {
                tracing::debug!(
                    "refusing {peer}: {} connections open, each with a request in flight",
                    limits.max_connections
                );
                drop(stream);
                continue;
            }
        };
        let (app, stop, open) = (app.clone(), stop_rx.clone(), open.clone());
        tokio::spawn(async move {
            let (id, state, evict) = open.add();
            connection(stream, app, limits, stop, (state, evict)).await;
            open.remove(id);
            drop(slot);
        });
    }
    let _ = stop_tx.send(true);
    // Every connection holds a slot until it ends: holding them all means all have ended.
    let all = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let _ = slots.acquire_many(all).await;
    Ok(())
}

/// How long an accept waits for the slot of the connection it evicted (its task ending).
const EVICTION_WAIT: Duration = Duration::from_secs(1);

/// The open connections' states, so the accept loop can pick the one idle longest.
#[derive(Default)]
struct Open {
    conns: Mutex<HashMap<u64, (Arc<ConnState>, Arc<Notify>)>>,
    next: std::sync::atomic::AtomicU64,
}

impl Open {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (Arc<ConnState>, Arc<Notify>)>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new connection's id, state and eviction signal.
    fn add(&self) -> (u64, Arc<ConnState>, Arc<Notify>) {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (state, evict) = (Arc::new(ConnState::new()), Arc::new(Notify::new()));
        self.lock().insert(id, (state.clone(), evict.clone()));
        (id, state, evict)
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// Signals the connection idle longest (no request in flight) to close, and forgets it so
    /// the next accept picks another; false where every open connection has a request in
    /// flight.
    fn evict_longest_idle(&self) -> bool {
        let mut conns = self.lock();
        let idle = conns
            .iter()
            .filter_map(|(&id, (s, _))| {
                let p = s.phase();
                (p.in_flight == 0).then_some((p.idle_since, id))
            })
            .min();
        match idle.and_then(|(_, id)| conns.remove(&id)) {
            Some((_, evict)) => {
                evict.notify_one();
                true
            }
            None => false,
        }
    }
}

async fn connection(
    stream: TcpStream,
    app: Router,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
    (state, evict): (Arc<ConnState>, Arc<Notify>),
) {
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(Tracked {
        inner: stream,
        state: state.clone(),
    });
    let svc_state = state.clone();
    let svc = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let (app, guard) = (app.clone(), InFlight::start(svc_state.clone()));
        async move {
            let res = app
                .oneshot(req.map(Body::new))
                .await
                .unwrap_or_else(|e| match e {});
            // The guard lives in the body, so the request counts until its last byte is written.
            Ok::<_, Infallible>(res.map(|b| {
                Body::new(b.map_frame(move |f| {
                    let _ = &guard;
                    f
                }))
            }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(None)
        .serve_connection(io, svc);
    tokio::pin!(conn);
    let mut stopping = *stop.borrow();
    if stopping {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            () = state.expired(&limits) => return,
            // Evicted for a new connection at the cap; re-checked, as a request may have
            // started since the accept loop chose this one.
            () = evict.notified() => {
                if state.phase().in_flight == 0 {
                    return;
                }
            }
            r = stop.changed(), if !stopping => {
                stopping = true;
                if r.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// What a connection's timeouts are measured from.
struct ConnState {
    inner: Mutex<Phase>,
    changed: Notify,
}

#[derive(Clone, Copy)]
struct Phase {
    in_flight: usize,
    idle_since: Instant,
    /// The first byte received while idle: the headers are under way.
    first_byte: Option<Instant>,
}

impl ConnState {
    fn new() -> Self {
        ConnState {
            inner: Mutex::new(Phase {
                in_flight: 0,
                idle_since: Instant::now(),
                first_byte: None,
            }),
            changed: Notify::new(),
        }
    }

    fn update(&self, f: impl FnOnce(&mut Phase)) {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()));
        self.changed.notify_one();
    }

    fn phase(&self) -> Phase {
        *self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn on_bytes(&self) {
        let p = self.phase();
        if p.in_flight == 0 && p.first_byte.is_none() {
            self.update(|p| p.first_byte = Some(Instant::now()));
        }
    }

    /// Resolves when the connection has been idle, or sending its headers, for too long.
    async fn expired(&self, limits: &ConnLimits) {
        loop {
            let p = self.phase();
            let deadline = match (p.in_flight, p.first_byte) {
                (0, Some(t)) => Some(t + limits.header_timeout),
                (0, None) => Some(p.idle_since + limits.idle_timeout),
                _ => None,
            };
            let changed = self.changed.notified();
            match deadline {
                Some(d) => tokio::select! {
                    () = tokio::time::sleep_until(d) => {
                        // Re-checked: a request may have started as the timer fired.
                        if self.phase().in_flight == 0 {
                            return;
                        }
                    }
                    () = changed => {}
                },
                None => changed.await,
            }
        }
    }
}

/// Counts a request from its headers to its response's last byte.
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn start(state: Arc<ConnState>) -> Self {
        state.update(|p| {
            p.in_flight += 1;
            p.first_byte = None;
        });
        InFlight(state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.update(|p| {
            p.in_flight = p.in_flight.saturating_sub(1);
            if p.in_flight == 0 {
                p.idle_since = Instant::now();
                p.first_byte = None;
            }
        });
    }
}

/// The socket, reporting received bytes to its [`ConnState`].
struct Tracked {
    inner: TcpStream,
    state: Arc<ConnState>,
}

impl AsyncRead for Tracked {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.state.on_bytes();
        }
        r
    }
}

impl AsyncWrite for Tracked {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
