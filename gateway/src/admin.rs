//! The admin listener: health and readiness today; the control API and
//! metrics join it with the control issue.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use crate::gateway::Shared;

/// Serves the admin API on `listener` until the task is dropped.
pub(crate) async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, std::convert::Infallible>(route(&req, &shared)) }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn route(req: &Request<Incoming>, shared: &Shared) -> Response<Full<Bytes>> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => reply(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") if shared.ready.load(Ordering::Acquire) => {
            reply(StatusCode::OK, "ready\n")
        }
        (&Method::GET, "/readyz") => reply(StatusCode::SERVICE_UNAVAILABLE, "not ready\n"),
        _ => reply(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn reply(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *r.status_mut() = status;
    r
}
