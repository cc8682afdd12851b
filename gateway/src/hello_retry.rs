//! A spliced TLS flow is judged on its ClientHello. TLS 1.3 lets a server
//! answer that hello with a HelloRetryRequest, and the client then sends a
//! second ClientHello, which the server reads afresh: OpenSSL takes the
//! server name from the second one. Spliced unread, a flow judged on
//! `exempt.example` could name a denied server in its second hello. So the
//! start of a spliced TLS flow is read before the bytes run unread: the
//! server's first handshake message, and, when it is a HelloRetryRequest,
//! the client's second ClientHello, which must name the same server (and
//! carry no encrypted ClientHello the first did not), or the flow is reset.
//! Every byte read is passed on, in order, before the splice takes over.
//! What the client sent after its first hello's last record (read with it
//! by the peek) goes on only after that: it is where the second hello
//! would start, framed as the server frames it, so no record cut across
//! the peek can make the gateway and the server read two different hellos.

use std::time::Duration;

use egress_policy::Hostname;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::peek::{second_client_hello, ClientHello, PeekError, MAX_HELLO_RECORDS};

/// The `random` of a ServerHello that is a HelloRetryRequest (RFC 8446 §4.1.3).
const HRR_RANDOM: [u8; 32] = [
    0xcf, 0x21, 0xad, 0x74, 0xe5, 0x9a, 0x61, 0x11, 0xbe, 0x1d, 0x8c, 0x02, 0x1e, 0x65, 0xb8, 0x91,
    0xc2, 0xa2, 0x11, 0x16, 0x7a, 0xbb, 0x8c, 0x5e, 0x07, 0x9e, 0x09, 0xe2, 0xc8, 0xa8, 0x33, 0x9c,
];

/// TLS record content types.
const HANDSHAKE: u8 = 0x16;
/// A handshake message's type: ServerHello (a HelloRetryRequest is one).
const SERVER_HELLO: u8 = 2;
/// The most of the server's first handshake message read (a retry request
/// with a cookie is a few hundred bytes).
const MAX_FIRST_MESSAGE: usize = 32 * 1024;

/// Why a spliced TLS flow was stopped at its start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RetryError {
    /// The server's side: silent, closed, or unreadable at its first message.
    #[error("the origin's first handshake message: {0}")]
    Origin(String),
    /// The client's second ClientHello is not one the first was judged for.
    #[error("after a HelloRetryRequest: {0}")]
    Client(String),
    /// The client could not be given the server's first message (it reset
    /// or went silent): no retry is involved.
    #[error("passing the server's first handshake message on: {0}")]
    ClientGone(std::io::Error),
    /// Passing the bytes on would cross the flow's byte budget: they were
    /// not passed (`down`: the server's bytes passed on before them).
    #[error("the flow's byte budget")]
    Budget { down: u64 },
}

/// What the first ClientHello was judged on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Judged<'a> {
    pub(crate) sni: Option<&'a Hostname>,
    pub(crate) ech: bool,
}

/// The bytes passed on while reading the start: to the origin, to the client.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Passed {
    pub(crate) up: u64,
    pub(crate) down: u64,
}

/// Reads the server's first handshake message from `origin` and passes it
/// on to `client`; after a HelloRetryRequest, reads the client's second
/// ClientHello (at most `max` bytes, starting with `after`: what the client
/// sent past its first hello's records) and passes it on only if it names
/// the server the first was judged for (`judged`). Without a retry, `after`
/// is passed on as it is. Each wait within `limit`. What each write passes
/// on that the peek did not read is first charged to `spend` (a byte
/// budget's meter, which was charged the peeked bytes when the flow was
/// let through; asked with 0 for a write of bytes paid already): a write it
/// refuses is not made.
pub(crate) async fn watch(
    (client, origin): (&mut TcpStream, &mut TcpStream),
    judged: Judged<'_>,
    after: Vec<u8>,
    (max, limit): (usize, Duration),
    spend: &(dyn Fn(usize) -> bool + Sync),
) -> Result<Passed, RetryError> {
    let charged = |n: usize, down: usize| {
        let down = down as u64;
        spend(n).then_some(()).ok_or(RetryError::Budget { down })
    };
    let (first, retry) = within(limit, server_first(origin))
        .await
        .map_err(|e| RetryError::Origin(e.to_string()))?;
    charged(first.len(), 0)?;
    within(limit, client.write_all(&first))
        .await
        .map_err(RetryError::ClientGone)?;
    let mut passed = Passed {
        up: 0,
        down: first.len() as u64,
    };
    // `after` was read by the peek, and charged with it before the flow
    // was let through: only what is read here is charged here.
    let paid = after.len();
    if !retry {
        // Paid already, but the write is asked for all the same: the flow
        // may have been cut while the server's answer was awaited.
        charged(0, first.len())?;
        within(limit, origin.write_all(&after))
            .await
            .map_err(|e| RetryError::Origin(format!("passing the client's bytes on: {e}")))?;
        passed.up = after.len() as u64;
        return Ok(passed);
    }
    let (bytes, second) = within(limit, client_second(client, after, max))
        .await
        .map_err(|e| RetryError::Client(e.to_string()))?;
    if second.sni.as_ref() != judged.sni {
        let named = second.sni.as_ref().map_or("no name", Hostname::as_str);
        let was = judged.sni.map_or("no name", Hostname::as_str);
        return Err(RetryError::Client(format!(
            "the second ClientHello names {named}, the first {was}"
        )));
    }
    if second.ech && !judged.ech {
        return Err(RetryError::Client(
            "the second ClientHello carries encrypted_client_hello, the first did not".into(),
        ));
    }
    // `bytes` starts with `after`.
    charged(bytes.len().saturating_sub(paid), first.len())?;
    within(limit, origin.write_all(&bytes))
        .await
        .map_err(|e| RetryError::Origin(format!("passing the second ClientHello on: {e}")))?;
    passed.up = bytes.len() as u64;
    Ok(passed)
}

async fn within<T>(
    limit: Duration,
    f: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    tokio::time::timeout(limit, f)
        .await
        .unwrap_or_else(|_| Err(std::io::Error::other(format!("nothing within {limit:?}"))))
}

/// The origin's bytes up to the end of its first handshake message (or as
/// far as shows it is no ServerHello), and whether it is a
/// HelloRetryRequest.
async fn server_first(origin: &mut TcpStream) -> std::io::Result<(Vec<u8>, bool)> {
    let mut buf = Vec::with_capacity(1024);
    // Read again only when a record's header or a record is whole: an
    // origin sending a byte at a time costs a reading per record.
    let mut records = crate::peek::Records::default();
    loop {
        let first = match records.advanced(&buf) {
            true => first_message(&buf),
            false => First::NeedMore,
        };
        match first {
            First::Other => return Ok((buf, false)),
            First::Malformed(why) => return Err(std::io::Error::other(why)),
            // A ServerHello: the flow goes on as it is.
            First::Hello { retry: false, .. } => return Ok((buf, false)),
            // The whole retry request, which the client must have to answer.
            First::Hello {
                retry: true,
                whole: Some(_),
            } => return Ok((buf, true)),
            First::NeedMore | First::Hello { .. } => {}
        }
        if buf.len() >= MAX_FIRST_MESSAGE {
            return Err(std::io::Error::other("longer than 32 KiB"));
        }
        let mut chunk = [0u8; 4096];
        let n = origin.read(&mut chunk).await?;
        if n == 0 {
            // Closed: nothing more is coming for the client to answer.
            return Ok((buf, false));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// What the start of the server's stream shows.
#[derive(Debug, PartialEq, Eq)]
enum First {
    NeedMore,
    /// Not a ServerHello first (an alert, say, or not TLS): nothing to watch.
    Other,
    /// Handshake records no TLS peer sends (empty ones, or more than
    /// [`MAX_HELLO_RECORDS`] for one message): the flow is reset, not let
    /// go unwatched, and not read again from the start at every read.
    Malformed(&'static str),
    /// A ServerHello, a retry request or not; `whole`: the stream's length
    /// up to the end of the record that completes the message, once read.
    Hello {
        retry: bool,
        whole: Option<usize>,
    },
}

/// Reads the first handshake message across the handshake records it is
/// cut into: its type, then its version and random, then its end.
fn first_message(buf: &[u8]) -> First {
    let mut message: Vec<u8> = Vec::new();
    let mut off = 0;
    let mut retry = None;
    for _ in 0..MAX_HELLO_RECORDS {
        let Some(header) = buf.get(off..off + 5) else {
            return retry.map_or(First::NeedMore, |retry| First::Hello { retry, whole: None });
        };
        if header[0] != HANDSHAKE {
            return match retry {
                // A record of another kind inside the message: it is not
                // read past; the client answers what it makes of it.
                Some(retry) => First::Hello {
                    retry,
                    whole: Some(off),
                },
                None => First::Other,
            };
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 {
            // RFC 8446 §5.1: no empty handshake record.
            return First::Malformed("an empty handshake record from the origin");
        }
        let payload = &buf[off + 5..buf.len().min(off + 5 + len)];
        message.extend_from_slice(payload);
        if message.first().is_some_and(|&kind| kind != SERVER_HELLO) {
            return First::Other;
        }
        // Type, length, legacy version, random.
        if retry.is_none() && message.len() >= 4 + 2 + 32 {
            retry = Some(message[6..38] == HRR_RANDOM);
        }
        if payload.len() < len {
            return retry.map_or(First::NeedMore, |retry| First::Hello { retry, whole: None });
        }
        off += 5 + len;
        if let Some(retry) = retry {
            let body = (usize::from(message[1]) << 16)
                | (usize::from(message[2]) << 8)
                | usize::from(message[3]);
            if message.len() >= 4 + body {
                return First::Hello {
                    retry,
                    whole: Some(off),
                };
            }
        }
    }
    First::Malformed("the origin's first handshake message in more than 64 records")
}

/// The client's bytes up to the end of its second ClientHello (change
/// cipher spec and early data records before it are passed over), and the
/// hello, read as the first was.
async fn client_second(
    client: &mut TcpStream,
    mut buf: Vec<u8>,
    max: usize,
) -> std::io::Result<(Vec<u8>, ClientHello)> {
    // Read again only when a record's header or a record is whole.
    let mut records = crate::peek::Records::default();
    loop {
        if records.advanced(&buf) {
            match second_client_hello(&buf) {
                Ok(Some(hello)) => return Ok((buf, hello)),
                Ok(None) => {}
                Err(e) => return Err(std::io::Error::other(peek_error(&e))),
            }
        }
        if buf.len() >= max {
            return Err(std::io::Error::other(format!(
                "the second ClientHello is longer than {max} bytes"
            )));
        }
        let mut chunk = [0u8; 4096];
        let want = chunk.len().min(max.saturating_sub(buf.len()));
        let n = client.read(&mut chunk[..want]).await?;
        if n == 0 {
            return Err(std::io::Error::other(
                "closed before its second ClientHello",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn peek_error(e: &PeekError) -> String {
    match e {
        PeekError::Malformed(why) => format!("the second ClientHello: {why}"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests;
