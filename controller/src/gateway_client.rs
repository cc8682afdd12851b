//! Talking to a worker's gateway over its admin API (JSON over HTTP/1.1,
//! bearer token), with a bound on every wait.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// Longest a gateway may take to answer one request.
const TIMEOUT: Duration = Duration::from_secs(5);

/// One request to the gateway at `admin_url` (`http://host:port`); the
/// status and the JSON body (`Null` when there is none).
pub async fn call(
    admin_url: &str,
    token: &str,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Result<(StatusCode, Value), String> {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let req = Outgoing {
        method,
        path,
        content_type: "application/json",
        body,
    };
    tokio::time::timeout(TIMEOUT, exchange(admin_url, token, req))
        .await
        .map_err(|_| format!("{admin_url}: no answer within {TIMEOUT:?}"))?
}

/// A full resync as NDJSON (one sandbox document per line), streamed by the
/// gateway, so it is not bound by the gateway's body cap. The wait scales
/// with the size.
pub async fn resync(
    admin_url: &str,
    token: &str,
    ndjson: String,
) -> Result<(StatusCode, Value), String> {
    let wait = TIMEOUT + Duration::from_secs(ndjson.len() as u64 >> 20);
    let req = Outgoing {
        method: Method::PUT,
        path: "/v1/sandboxes",
        content_type: "application/x-ndjson",
        body: ndjson,
    };
    tokio::time::timeout(wait, exchange(admin_url, token, req))
        .await
        .map_err(|_| format!("{admin_url}: no answer to the resync within {wait:?}"))?
}

struct Outgoing<'a> {
    method: Method,
    path: &'a str,
    content_type: &'static str,
    body: String,
}

async fn exchange(
    admin_url: &str,
    token: &str,
    out: Outgoing<'_>,
) -> Result<(StatusCode, Value), String> {
    let uri: http::Uri = admin_url
        .parse()
        .map_err(|e| format!("admin_url {admin_url:?}: {e}"))?;
    let authority = uri
        .authority()
        .ok_or_else(|| format!("admin_url {admin_url:?}: no host"))?
        .clone();
    let tcp = tokio::net::TcpStream::connect(authority.as_str())
        .await
        .map_err(|e| format!("{admin_url}: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(|e| format!("{admin_url}: {e}"))?;
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(out.method)
        .uri(out.path)
        .header(http::header::HOST, authority.as_str())
        .header(http::header::CONTENT_TYPE, out.content_type);
    if !token.is_empty() {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let req = req
        .body(Full::new(Bytes::from(out.body)))
        .map_err(|e| e.to_string())?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("{admin_url}: {e}"))?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{admin_url}: {e}"))?
        .to_bytes();
    let json = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    Ok((status, json))
}
