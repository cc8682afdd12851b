//! Classify a flow from its first bytes: a TLS ClientHello (which may span
//! several TCP segments and several TLS records), an HTTP/1.x request head,
//! or opaque bytes. Reads are bounded in bytes and time; the bytes read are
//! handed back so the chosen path can replay them.

use std::time::Duration;

use tls_parser::{
    parse_tls_client_hello_extension, parse_tls_message_handshake, SNIType, TlsExtension,
    TlsMessage, TlsMessageHandshake,
};
use tokio::io::{AsyncRead, AsyncReadExt};

/// What the first bytes showed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Classified {
    Tls(ClientHello),
    Http { host: Option<String> },
    Opaque,
}

/// The parts of a ClientHello the gateway uses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientHello {
    /// The `host_name` server name, as sent (unvalidated).
    pub sni: Option<String>,
    /// The client offers TLS 1.3 0-RTT data.
    pub early_data: bool,
}

/// Why a flow could not be classified: it is dropped.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PeekError {
    #[error("no bytes within the peek timeout")]
    Timeout,
    #[error("closed before it could be classified")]
    Closed,
    #[error("TLS ClientHello larger than the peek limit")]
    TooLarge,
    #[error("malformed TLS ClientHello: {0}")]
    Malformed(&'static str),
    #[error("read error: {0}")]
    Io(String),
}

enum Step {
    NeedMore,
    Done(Classified),
}

/// The HTTP methods a request line may start with.
const METHODS: &[&[u8]] = &[
    b"GET ",
    b"POST ",
    b"PUT ",
    b"DELETE ",
    b"HEAD ",
    b"OPTIONS ",
    b"PATCH ",
    b"CONNECT ",
    b"TRACE ",
];
/// TLS handshake record content type.
const HANDSHAKE: u8 = 0x16;
/// Largest TLS plaintext record (RFC 8446 §5.1).
const MAX_RECORD: usize = 16_384;

/// Reads from `io` until the flow is classified, at most `max` bytes, within `limit`.
pub async fn peek<R: AsyncRead + Unpin>(
    io: &mut R,
    max: usize,
    limit: Duration,
) -> Result<(Classified, Vec<u8>), PeekError> {
    let mut buf = Vec::with_capacity(1024);
    let read = async {
        loop {
            let mut chunk = [0u8; 2048];
            let want = chunk.len().min(max.saturating_sub(buf.len()).max(1));
            let n = io
                .read(&mut chunk[..want])
                .await
                .map_err(|e| PeekError::Io(e.to_string()))?;
            if n == 0 {
                return finish_at_eof(&buf);
            }
            buf.extend_from_slice(&chunk[..n]);
            match classify(&buf)? {
                Step::Done(c) => return Ok(c),
                Step::NeedMore if buf.len() >= max => return finish_at_limit(&buf),
                Step::NeedMore => {}
            }
        }
    };
    let classified = tokio::time::timeout(limit, read)
        .await
        .map_err(|_| PeekError::Timeout)??;
    Ok((classified, buf))
}

/// Classifies a buffer: `Ok(None)` while more bytes are needed.
pub fn classify_bytes(buf: &[u8]) -> Result<Option<Classified>, PeekError> {
    classify(buf).map(|step| match step {
        Step::Done(c) => Some(c),
        Step::NeedMore => None,
    })
}

/// Classifies what has been read so far.
fn classify(buf: &[u8]) -> Result<Step, PeekError> {
    let Some(&first) = buf.first() else {
        return Ok(Step::NeedMore);
    };
    if first == HANDSHAKE {
        return client_hello(buf)
            .map(|c| c.map_or(Step::NeedMore, |c| Step::Done(Classified::Tls(c))));
    }
    let could_be_http = METHODS
        .iter()
        .any(|m| buf.starts_with(m) || m.starts_with(&buf[..buf.len().min(m.len())]));
    if !could_be_http {
        return Ok(Step::Done(Classified::Opaque));
    }
    if !METHODS.iter().any(|m| buf.starts_with(m)) {
        return Ok(Step::NeedMore);
    }
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => Ok(Step::NeedMore),
        Ok(httparse::Status::Complete(_)) => Ok(Step::Done(Classified::Http {
            host: host_of(req.headers),
        })),
        // Not HTTP after all (or HTTP the gateway will not read a Host from):
        // no name evidence, policy decides on the address and attribution.
        Err(_) => Ok(Step::Done(Classified::Http { host: None })),
    }
}

fn host_of(headers: &[httparse::Header<'_>]) -> Option<String> {
    let h = headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("host"))?;
    let value = std::str::from_utf8(h.value).ok()?.trim();
    Some(strip_port(value).to_owned())
}

/// `example.test:8080` → `example.test`; `[2001:db8::1]:443` → `2001:db8::1`.
pub fn strip_port(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) && !host.contains(':') => {
            host
        }
        _ => authority,
    }
}

/// Reassembles the ClientHello from handshake records; `None` while incomplete.
///
/// The common case — the whole message in the first record — is parsed in
/// place; only a ClientHello spread over records is copied together.
fn client_hello(buf: &[u8]) -> Result<Option<ClientHello>, PeekError> {
    let mut handshake: Vec<u8> = Vec::new();
    let mut off = 0;
    loop {
        let Some(header) = buf.get(off..off + 5) else {
            return Ok(None);
        };
        if header[0] != HANDSHAKE {
            return Err(PeekError::Malformed(
                "a non-handshake record before the ClientHello ended",
            ));
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 || len > MAX_RECORD {
            return Err(PeekError::Malformed("bad record length"));
        }
        let Some(payload) = buf.get(off + 5..off + 5 + len) else {
            return Ok(None);
        };
        off += 5 + len;
        let first = handshake.is_empty();
        if !first {
            handshake.extend_from_slice(payload);
        }
        let msg: &[u8] = if first { payload } else { &handshake };
        match hello_length(msg)? {
            Some(total) if msg.len() >= total => {
                return parse_client_hello(&msg[..total]).map(Some)
            }
            Some(total) if first => {
                handshake.reserve_exact(total);
                handshake.extend_from_slice(payload);
            }
            None if first => handshake.extend_from_slice(payload),
            _ => {}
        }
    }
}

/// The length of the handshake message starting `msg` (header included) when
/// its header is complete; an error when it is not a ClientHello.
fn hello_length(msg: &[u8]) -> Result<Option<usize>, PeekError> {
    let Some(h) = msg.get(..4) else {
        return Ok(None);
    };
    if h[0] != 1 {
        return Err(PeekError::Malformed(
            "the first handshake message is not a ClientHello",
        ));
    }
    let body = (usize::from(h[1]) << 16) | (usize::from(h[2]) << 8) | usize::from(h[3]);
    Ok(Some(4 + body))
}

fn parse_client_hello(msg: &[u8]) -> Result<ClientHello, PeekError> {
    let Ok((_, TlsMessage::Handshake(TlsMessageHandshake::ClientHello(ch)))) =
        parse_tls_message_handshake(msg)
    else {
        return Err(PeekError::Malformed("the ClientHello does not parse"));
    };
    let mut out = ClientHello::default();
    let Some(mut rest) = ch.ext else {
        return Ok(out);
    };
    // One extension at a time, nothing collected; like tls-parser's
    // `parse_tls_client_hello_extensions`, the first that does not parse
    // ends the list (what follows it is not evidence of anything).
    while let Ok((next, e)) = parse_tls_client_hello_extension(rest) {
        match e {
            TlsExtension::SNI(names) => {
                out.sni = names
                    .iter()
                    .find(|(t, _)| *t == SNIType::HostName)
                    .and_then(|(_, n)| std::str::from_utf8(n).ok())
                    .map(str::to_owned);
            }
            TlsExtension::EarlyData(_) => out.early_data = true,
            _ => {}
        }
        if next.len() >= rest.len() {
            break;
        }
        rest = next;
    }
    Ok(out)
}

fn finish_at_eof(buf: &[u8]) -> Result<Classified, PeekError> {
    match buf.first() {
        None => Err(PeekError::Closed),
        Some(&HANDSHAKE) => Err(PeekError::Closed),
        Some(_) if METHODS.iter().any(|m| buf.starts_with(m)) => {
            Ok(Classified::Http { host: None })
        }
        Some(_) => Ok(Classified::Opaque),
    }
}

fn finish_at_limit(buf: &[u8]) -> Result<Classified, PeekError> {
    match buf.first() {
        Some(&HANDSHAKE) => Err(PeekError::TooLarge),
        // A request head longer than the limit: no Host evidence.
        _ => Ok(Classified::Http { host: None }),
    }
}

#[doc(hidden)]
pub mod fixture;

#[cfg(test)]
mod tests;
