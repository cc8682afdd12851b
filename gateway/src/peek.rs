//! Classify a flow from its first bytes: a TLS ClientHello (which may span
//! several TCP segments and several TLS records), an HTTP/1.x request head,
//! or opaque bytes, named where they admit one reading (an SSH
//! identification string, [`stream`]). Reads are bounded in bytes and time;
//! the bytes read are handed back so the chosen path can replay them.

use std::time::Duration;

use egress_policy::{Hostname, NameError, StreamProtocol};
use tls_parser::parse_tls_handshake_client_hello;

use crate::authority::{self, AuthorityError};
use tokio::io::{AsyncRead, AsyncReadExt};

/// What the first bytes showed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Classified {
    Tls(ClientHello),
    /// An HTTP/1.x request head; `host` is the one name all its authority
    /// claims agree on (`None`: no claim, or an IP literal).
    Http {
        host: Option<Hostname>,
    },
    /// Neither: a stream the gateway cannot read, with the protocol its
    /// first bytes name (`None`: unreadable, nothing it recognises).
    Opaque(Option<StreamProtocol>),
}

/// The parts of a ClientHello the gateway uses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientHello {
    /// The one `host_name` server name, validated; `None` when the hello has
    /// no `server_name` extension or names an IP literal. Any other
    /// irregularity in the name is a [`PeekError::Malformed`] hello.
    pub sni: Option<Hostname>,
    /// The client offers TLS 1.3 0-RTT data.
    pub early_data: bool,
    /// The hello carries an `encrypted_client_hello` extension. Its content
    /// is not read: a real ECH offer and GREASE ECH (which Chromium sends by
    /// default) look alike on the wire, so every form counts. The SNI is
    /// then the outer name, and the name the flow is for may be encrypted.
    pub ech: bool,
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
    /// A request head whose authority claims disagree or do not parse: answered with 400.
    #[error("malformed request: {0}")]
    MalformedRequest(AuthorityError),
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
/// The other TLS record types: change_cipher_spec, alert,
/// application_data, heartbeat.
const OTHER_RECORDS: [u8; 4] = [0x14, 0x15, 0x17, 0x18];
/// Largest TLS plaintext record (RFC 8446 §5.1).
const MAX_RECORD: usize = 16_384;
/// The `server_name` extension (RFC 6066 §3).
const EXT_SERVER_NAME: u16 = 0x0000;
/// The `early_data` extension (RFC 8446 §4.2.10).
const EXT_EARLY_DATA: u16 = 0x002a;
/// The `encrypted_client_hello` extension (draft-ietf-tls-esni §5).
const EXT_ENCRYPTED_CLIENT_HELLO: u16 = 0xfe0d;
/// Its earlier draft code points (drafts 8 to 12), and ESNI's
/// `encrypted_server_name`: a server that still takes one reads a name the
/// clear SNI does not show, as for the final one.
const EXT_ENCRYPTED_NAME_DRAFTS: std::ops::RangeInclusive<u16> = 0xfe08..=0xfe0c;
const EXT_ENCRYPTED_SERVER_NAME: u16 = 0xffce;
/// Extensions a ClientHello may carry (browsers send about 20).
const MAX_EXTENSIONS: usize = 64;
/// Records a ClientHello may span, and records a client may send before
/// its second one (change cipher spec, early data). Clients send a hello
/// in one record (OpenSSL with a 512-byte fragment length needs 32 for
/// 16 KiB); each read re-reads every record so far, so a hello in
/// thousands of tiny records would cost the square of its bytes.
pub const MAX_HELLO_RECORDS: usize = 64;
/// Bytes of a stream that is not TLS after which it is classified again
/// only when a line ends in what was read (and not while it is all line
/// ends, which nginx skips before a request line): an SSH line is decided
/// within 255 bytes, and an HTTP head cannot end without a line end. A
/// first line still undecided past it (a run of token characters) is
/// decided at its end, at the byte limit or at the end of the stream, the
/// verdict the same as when read at once.
const LINE_READ_AHEAD: usize = 512;

/// Reads from `io` until the flow is classified, at most `max` bytes, within `limit`.
pub async fn peek<R: AsyncRead + Unpin>(
    io: &mut R,
    max: usize,
    limit: Duration,
) -> Result<(Classified, Vec<u8>), PeekError> {
    let mut buf = Vec::with_capacity(1024);
    let mut records = Records::default();
    let mut lines = Lines::default();
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
            let news = match buf.first() {
                Some(&HANDSHAKE) => records.advanced(&buf),
                _ => lines.advanced(buf.len() - n, &chunk[..n]),
            };
            if news {
                if let Step::Done(c) = classify(&buf)? {
                    return Ok(c);
                }
            }
            if buf.len() >= max {
                return finish_at_limit(&buf);
            }
        }
    };
    let classified = tokio::time::timeout(limit, read)
        .await
        .map_err(|_| PeekError::Timeout)??;
    Ok((classified, buf))
}

/// How far the TLS records read so far are framed: what is read is
/// classified again only once a record's header or the record itself is
/// whole (nothing else can change the answer), so a sender's tiny
/// segments cost the peek no more than one reading per record.
#[derive(Debug, Default)]
pub struct Records {
    /// Where the next record not yet whole starts.
    next: usize,
    /// Whether that record's header was whole at the last look.
    header_seen: bool,
}

impl Records {
    /// Whether a record's header or a record became whole in `buf` since
    /// the last call.
    pub fn advanced(&mut self, buf: &[u8]) -> bool {
        let mut news = false;
        while let Some(header) = buf.get(self.next..self.next + 5) {
            if !self.header_seen {
                self.header_seen = true;
                news = true;
            }
            let end = self.next + 5 + usize::from(u16::from_be_bytes([header[3], header[4]]));
            if end > buf.len() {
                break;
            }
            self.next = end;
            self.header_seen = false;
            news = true;
        }
        news
    }
}

/// How far a stream that is not TLS has come ([`LINE_READ_AHEAD`]).
#[derive(Debug, Default)]
struct Lines {
    /// Whether a byte other than CR and LF has been read.
    text: bool,
}

impl Lines {
    /// Whether `read`, just read after `before` bytes, can change the
    /// answer: anything in the first bytes, then the first byte that is
    /// not a line end, then a line end after one.
    fn advanced(&mut self, before: usize, read: &[u8]) -> bool {
        let first_text = !self.text && read.iter().any(|b| !matches!(b, b'\r' | b'\n'));
        self.text |= first_text;
        before < LINE_READ_AHEAD || first_text || (self.text && read.contains(&b'\n'))
    }
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
            .map(|h| h.map(|(hello, _)| hello))
            .map(|c| c.map_or(Step::NeedMore, |c| Step::Done(Classified::Tls(c))));
    }
    if let Some(step) = other_record(buf) {
        return step;
    }
    match sslv2_hello(buf) {
        // TLS the peek cannot read a name from, which a server may still
        // take (OpenSSL does): not a stream to splice unread.
        Some(true) => return Err(PeekError::Malformed("an SSLv2-compatible ClientHello")),
        None => return Ok(Step::NeedMore),
        Some(false) => {}
    }
    match request_line(buf) {
        Line::Not => {
            return Ok(match stream::identify(buf) {
                Stream::NeedMore => Step::NeedMore,
                Stream::Done(kind) => Step::Done(Classified::Opaque(kind)),
            })
        }
        Line::Maybe => return Ok(Step::NeedMore),
        Line::Request => {}
    }
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => Ok(Step::NeedMore),
        Ok(httparse::Status::Complete(_)) => {
            let authority = authority::of_request_target(req.path.unwrap_or("/"))
                .and_then(|target| {
                    let hosts = req
                        .headers
                        .iter()
                        .filter(|h| h.name.eq_ignore_ascii_case("host"));
                    authority::judge(target.as_deref(), hosts.map(|h| h.value))
                })
                .and_then(|a| match a {
                    // RFC 9112 §3.2: HTTP/1.1 requires a Host; 1.0 may omit it.
                    None if req.version != Some(0) => Err(AuthorityError::Missing),
                    a => Ok(a),
                })
                .map_err(PeekError::MalformedRequest)?;
            Ok(Step::Done(Classified::Http {
                host: authority.and_then(|a| a.name().cloned()),
            }))
        }
        // Not HTTP after all (or HTTP the gateway will not read a Host from):
        // no name evidence, policy decides on the address and attribution;
        // the request-by-request server refuses what it cannot read.
        Err(_) => Ok(Step::Done(Classified::Http { host: None })),
    }
}

/// A TLS record of another type first (an alert, a change of cipher spec,
/// data, a heartbeat): a server may drop it and read a hello after it (Go's
/// crypto/tls drops a warning alert before the handshake), so it is TLS the
/// peek has not read a name from. `None`: not such a record.
fn other_record(buf: &[u8]) -> Option<Result<Step, PeekError>> {
    if !OTHER_RECORDS.contains(buf.first()?) {
        return None;
    }
    // Go takes any version below 0x1000 on a first record, OpenSSL any
    // with major 3: whatever a server may read as a record is one.
    match buf.get(1) {
        None => Some(Ok(Step::NeedMore)),
        Some(major) if *major < 0x10 => Some(Err(PeekError::Malformed(
            "a TLS record before the ClientHello",
        ))),
        Some(_) => None,
    }
}

/// What the first line of a stream that is not TLS shows so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Line {
    /// An HTTP request line: read as HTTP, request by request.
    Request,
    /// A prefix of one: read on.
    Maybe,
    /// Not a request line: an opaque stream.
    Not,
}

/// Whether `buf` starts an HTTP request line the way an HTTP server reads
/// one (httparse, hyper, nginx): after any empty lines, a known method and a
/// space, or another method, a target and `HTTP/` (`PRI * HTTP/2.0`, the
/// HTTP/2 preface, among them; see [`request_line_shape`]). Anything an origin could take for a request
/// is HTTP here, and its `Host` judged: read as opaque, it would pass on the
/// address's attribution whatever host it names.
fn request_line(buf: &[u8]) -> Line {
    // Any CR or LF before the method, one at a time, as nginx skips them:
    // a lone CR first is still a request to it (httparse refuses it, so
    // the request-by-request server answers 400).
    let mut line = buf;
    loop {
        line = match line {
            [b'\r' | b'\n', rest @ ..] => rest,
            [] => return Line::Maybe,
            _ => break,
        };
    }
    let strict = strict_line(line);
    if strict == Line::Request {
        return strict;
    }
    match lenient_line(line) {
        // Not a line with odd blanks: as strictly read.
        Line::Not => strict,
        lenient => lenient,
    }
}

/// A line that servers splitting on any whitespace (Python's `http.server`,
/// Twisted) take for a request: blanks before the method, tabs, runs of
/// blanks. HTTP here too, so hyper refuses it (`400`) rather than its bytes
/// passing on as an opaque stream with a `Host` nobody judged. `Not` for a
/// line without odd blanks.
fn lenient_line(line: &[u8]) -> Line {
    let end = line
        .iter()
        .position(|&b| b == b'\r' || b == b'\n')
        .unwrap_or(line.len());
    // What Python's `str.split()` splits on (its `http.server` reads the
    // line as Latin-1), which covers `bytes.split()`'s (Twisted).
    let blank = |b: &u8| matches!(*b, b' ' | b'\t' | 0x0b | 0x0c | 0x1c..=0x1f | 0x85 | 0xa0);
    let first = &line[..end];
    let odd = first.first().is_some_and(blank)
        || first.iter().any(|b| blank(b) && *b != b' ')
        || first.windows(2).any(|w| w == b"  ");
    if !odd {
        return Line::Not;
    }
    let mut collapsed = Vec::with_capacity(line.len());
    for &b in first.iter().skip_while(|b| blank(b)) {
        if !(blank(&b) && collapsed.last() == Some(&b' ')) {
            collapsed.push(if blank(&b) { b' ' } else { b });
        }
    }
    // A finished line is judged with its end, so it is a request or not,
    // never a prefix still waiting.
    collapsed.extend_from_slice(&line[end..]);
    strict_line(&collapsed)
}

/// [`request_line`] on a line without the empty lines before it.
fn strict_line(line: &[u8]) -> Line {
    // In any case: servers that upper-case a method (Django, Werkzeug) act
    // on `delete` as on `DELETE`.
    let known = METHODS.iter().find_map(|m| {
        let n = line.len().min(m.len());
        line[..n]
            .eq_ignore_ascii_case(&m[..n])
            .then_some(n == m.len())
    });
    match known {
        Some(true) => return Line::Request,
        Some(false) => return Line::Maybe,
        None => {}
    }
    request_line_shape(line)
}

/// `METHOD SP target SP HTTP/`, or a prefix of it, where the method is a
/// token without lower-case letters (what nginx takes for one, and the
/// punctuation Go's token allows) and the target is in origin form
/// (`/…`), asterisk form (`*`) or absolute form with any scheme (`x://…`,
/// which Go and nginx read the host of). Narrower than any token and any
/// target, so that a stream of words (`hello there`) is told from a
/// request at its first bytes, not left waiting for the end of a line.
/// Left out: a method outside the list in lower case, which servers as
/// permissive as Go's would still serve; `opaque_streams = "deny"` refuses
/// what stays opaque. (Odd blanks are [`lenient_line`]'s.)
fn request_line_shape(line: &[u8]) -> Line {
    const VERSION: &[u8] = b"HTTP/";
    let method_char =
        |b: u8| b.is_ascii_uppercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b);
    let method_len = line
        .iter()
        .position(|&b| !method_char(b))
        .unwrap_or(line.len());
    match line.get(method_len) {
        None => return Line::Maybe,
        Some(b' ') if method_len > 0 => {}
        Some(_) => return Line::Not,
    }
    let rest = &line[method_len + 1..];
    let target_len = rest
        .iter()
        .position(|&b| !matches!(b, 0x21..=0x7e | 0x80..=0xff))
        .unwrap_or(rest.len());
    match target_start(&rest[..target_len], target_len < rest.len()) {
        Line::Request => {}
        other => return other,
    }
    match &rest[target_len..] {
        [] => Line::Maybe,
        [b' ', version @ ..] => {
            let n = version.len().min(VERSION.len());
            match (version[..n] == VERSION[..n], n == VERSION.len()) {
                (true, true) => Line::Request,
                (true, false) => Line::Maybe,
                (false, _) => Line::Not,
            }
        }
        _ => Line::Not,
    }
}

/// Whether a request target starts as one in origin, asterisk or absolute
/// form (`Request`), could still (`Maybe`), or cannot (`Not`); `ended`:
/// the target is whole (something follows it).
fn target_start(target: &[u8], ended: bool) -> Line {
    match target.first() {
        None => return Line::Maybe,
        Some(b'/' | b'*') => return Line::Request,
        Some(b) if !b.is_ascii_alphabetic() => return Line::Not,
        Some(_) => {}
    }
    // A scheme (RFC 3986: a letter, then letters, digits, `+`, `-`, `.`)
    // and a colon: absolute form, whatever the scheme.
    let scheme_char = |b: &u8| b.is_ascii_alphanumeric() || b"+-.".contains(b);
    match target.iter().position(|b| !scheme_char(b)) {
        Some(at) if target[at] == b':' => Line::Request,
        Some(_) => Line::Not,
        None if ended => Line::Not,
        None => Line::Maybe,
    }
}

/// Whether `buf` is an SSLv2-compatible ClientHello (RFC 5246 Appendix
/// E.2): a two-byte length with the high bit set, message type 1 and a
/// version 3.x; `None` while a prefix of one.
fn sslv2_hello(buf: &[u8]) -> Option<bool> {
    match buf {
        [len, ..] if len & 0x80 == 0 => Some(false),
        [_, _, 1, 3, ..] => Some(true),
        [_] | [_, _] | [_, _, 1] => None,
        _ => Some(false),
    }
}

/// The ClientHello a client sends after a HelloRetryRequest, read as the
/// first is ([`client_hello`]), past the change_cipher_spec record a client
/// may send first (middlebox compatibility, RFC 8446 §D.4) and the early
/// data records it sent before the retry request came; `None` while
/// incomplete.
pub fn second_client_hello(buf: &[u8]) -> Result<Option<ClientHello>, PeekError> {
    Ok(second_client_hello_at(buf)?.map(|(hello, _)| hello))
}

/// [`second_client_hello`], and where its last record ends in `buf`.
pub fn second_client_hello_at(buf: &[u8]) -> Result<Option<(ClientHello, usize)>, PeekError> {
    let mut off = 0;
    for _ in 0..=MAX_HELLO_RECORDS {
        let Some(header) = buf.get(off..off + 5) else {
            return Ok(None);
        };
        match header[0] {
            // change_cipher_spec, application_data (0-RTT)
            0x14 | 0x17 => {}
            _ => {
                let hello = client_hello(&buf[off..])?;
                return Ok(hello.map(|(hello, end)| (hello, off + end)));
            }
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 || len > MAX_RECORD + 256 {
            return Err(PeekError::Malformed("bad record length"));
        }
        off += 5 + len;
    }
    Err(PeekError::Malformed(
        "more than 64 records before the second ClientHello",
    ))
}

/// Where the records of the ClientHello at the start of `buf` end: the
/// bytes after it are the client's next records, framed as the server
/// frames them. `None` when `buf` holds no whole ClientHello.
pub fn client_hello_end(buf: &[u8]) -> Option<usize> {
    client_hello(buf).ok().flatten().map(|(_, end)| end)
}

/// Reassembles the ClientHello from handshake records, and where its last
/// record ends; `None` while incomplete.
///
/// The common case — the whole message in the first record — is parsed in
/// place; only a ClientHello spread over records is copied together.
fn client_hello(buf: &[u8]) -> Result<Option<(ClientHello, usize)>, PeekError> {
    let mut handshake: Vec<u8> = Vec::new();
    let mut off = 0;
    for _ in 0..MAX_HELLO_RECORDS {
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
            // A message after the ClientHello in its record (a second hello
            // for after a retry request, say) would go to the server unread:
            // TLS 1.3 ends a ClientHello at a record boundary.
            Some(total) if msg.len() > total => {
                return Err(PeekError::Malformed(
                    "bytes after the ClientHello in its record",
                ))
            }
            Some(total) if msg.len() == total => {
                return parse_client_hello(&msg[..total]).map(|hello| Some((hello, off)))
            }
            Some(total) if first => {
                // The length is the client's word, up to 16 MiB: room for
                // no more than the bytes already read.
                handshake.reserve_exact(total.min(buf.len()));
                handshake.extend_from_slice(payload);
            }
            None if first => handshake.extend_from_slice(payload),
            _ => {}
        }
    }
    Err(PeekError::Malformed(
        "a ClientHello in more than 64 records",
    ))
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
    // `msg` is exactly one handshake message (its length came from its header).
    let body = msg.get(4..).unwrap_or_default();
    let Ok((rest, ch)) = parse_tls_handshake_client_hello(body) else {
        return Err(PeekError::Malformed("the ClientHello does not parse"));
    };
    // tls-parser reads an extension block whose length overruns the message
    // as "no extensions" and ignores what follows the block: both are bytes
    // another parser reads differently.
    if !rest.is_empty() {
        return Err(PeekError::Malformed(
            "the extension block's length does not match the ClientHello",
        ));
    }
    let mut out = ClientHello::default();
    let Some(mut exts) = ch.ext else {
        return Ok(out);
    };
    let mut seen = [0u16; MAX_EXTENSIONS];
    let mut count = 0;
    while !exts.is_empty() {
        let [t0, t1, l0, l1, ref tail @ ..] = *exts else {
            return Err(PeekError::Malformed("an extension header is cut short"));
        };
        let kind = u16::from_be_bytes([t0, t1]);
        let len = usize::from(u16::from_be_bytes([l0, l1]));
        let Some(data) = tail.get(..len) else {
            return Err(PeekError::Malformed(
                "an extension's length overruns the extension block",
            ));
        };
        exts = &tail[len..];
        // RFC 8446 §4.2: no two extensions of one type in a block.
        if seen[..count].contains(&kind) {
            return Err(PeekError::Malformed(if kind == EXT_SERVER_NAME {
                "two server_name extensions"
            } else {
                "an extension type appears twice"
            }));
        }
        let Some(slot) = seen.get_mut(count) else {
            return Err(PeekError::Malformed("more than 64 extensions"));
        };
        *slot = kind;
        count += 1;
        match kind {
            EXT_SERVER_NAME => out.sni = server_name(data)?,
            EXT_EARLY_DATA => out.early_data = true,
            EXT_ENCRYPTED_CLIENT_HELLO | EXT_ENCRYPTED_SERVER_NAME => out.ech = true,
            k if EXT_ENCRYPTED_NAME_DRAFTS.contains(&k) => out.ech = true,
            _ => {}
        }
    }
    Ok(out)
}

/// Reads a `server_name` extension (RFC 6066 §3) that only one reading fits:
/// exactly one `host_name` entry whose lengths fill the extension exactly,
/// naming a valid hostname (`Some`) or an IP literal (`None`, as if absent).
/// Anything else — several entries, another entry type, NUL, CR/LF or
/// non-ASCII bytes, an invalid or over-long name — is malformed: a server that
/// truncates at NUL or picks another entry would serve another name.
pub fn server_name(data: &[u8]) -> Result<Option<Hostname>, PeekError> {
    let malformed = |why| Err(PeekError::Malformed(why));
    let [l0, l1, ref list @ ..] = *data else {
        return malformed("the server_name extension is cut short");
    };
    if usize::from(u16::from_be_bytes([l0, l1])) != list.len() {
        return malformed("the server_name list length does not match the extension");
    }
    let [kind, n0, n1, ref entries @ ..] = *list else {
        return malformed("the server_name list is empty or cut short");
    };
    let Some(name) = entries.get(..usize::from(u16::from_be_bytes([n0, n1]))) else {
        return malformed("the server name's length overruns the list");
    };
    if entries.len() > name.len() {
        return malformed("more than one entry in the server_name list");
    }
    if kind != 0 {
        return malformed("a server_name entry that is not a host_name");
    }
    if name.contains(&0) {
        return malformed("a NUL byte in the server name");
    }
    if name.iter().any(|b| *b == b'\r' || *b == b'\n') {
        return malformed("CR or LF in the server name");
    }
    let Ok(name) = std::str::from_utf8(name) else {
        return malformed("non-ASCII bytes in the server name");
    };
    if !name.is_ascii() {
        return malformed("non-ASCII bytes in the server name");
    }
    match authority::server_name(name) {
        Ok(sni) => Ok(sni),
        Err(NameError::TooLong) => malformed("a server name over 253 characters"),
        Err(_) => malformed("a server name that is not a valid hostname"),
    }
}

fn finish_at_eof(buf: &[u8]) -> Result<Classified, PeekError> {
    match buf.first() {
        None => Err(PeekError::Closed),
        Some(&HANDSHAKE) => Err(PeekError::Closed),
        // A request line: HTTP. A prefix of one, cut short by the close,
        // is no request to any origin: unreadable, as other cut lines are.
        Some(_) if request_line(buf) == Line::Request => Ok(Classified::Http { host: None }),
        // Cut short before it could be named: unreadable.
        Some(_) => Ok(Classified::Opaque(None)),
    }
}

fn finish_at_limit(buf: &[u8]) -> Result<Classified, PeekError> {
    match buf.first() {
        Some(&HANDSHAKE) => Err(PeekError::TooLarge),
        // A request head, or a request line, longer than the limit: HTTP
        // without Host evidence (an origin would read on).
        Some(_) if request_line(buf) != Line::Not => Ok(Classified::Http { host: None }),
        // A stream line longer than the limit (never, with `limits.peek_bytes`
        // at 512 or more): unreadable.
        _ => Ok(Classified::Opaque(None)),
    }
}

mod stream;

use self::stream::Stream;

#[doc(hidden)]
pub mod fixture;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod captured;
