//! What an opaque stream (neither TLS nor HTTP) carries, read from its first
//! bytes where they admit one reading only: so far an SSH-2.0
//! identification string (RFC 4253 §4.2). Anything else, including a line
//! that starts like one and then breaks its rules, is unreadable (`None`):
//! a guess would let a stream pass as a protocol an entry names.

use egress_policy::StreamProtocol;

/// What the first bytes of an opaque stream show so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stream {
    /// A prefix of a recognisable line: read on.
    NeedMore,
    /// Decided: a named protocol, or `None` for unreadable bytes.
    Done(Option<StreamProtocol>),
}

/// The only identification a client sends first: SSH protocol 2.0.
const SSH_PREFIX: &[u8] = b"SSH-2.0-";
/// The identification string's bound, CR LF included (RFC 4253 §4.2).
const SSH_MAX_LINE: usize = 255;

/// Classifies the first bytes of a stream that is neither TLS nor HTTP.
pub(super) fn identify(buf: &[u8]) -> Stream {
    let n = buf.len().min(SSH_PREFIX.len());
    if buf[..n] != SSH_PREFIX[..n] {
        return Stream::Done(None);
    }
    match buf.get(SSH_PREFIX.len()..) {
        None | Some([]) => Stream::NeedMore,
        Some(rest) => ssh_line(rest),
    }
}

/// The rest of `SSH-2.0-`: `softwareversion [SP comments] CR LF`, where
/// the software version is one or more printable US-ASCII characters other
/// than space and `-`, the comments printable US-ASCII or spaces, and the
/// whole line at most 255 bytes.
fn ssh_line(rest: &[u8]) -> Stream {
    let unreadable = Stream::Done(None);
    let mut version = 0usize;
    let mut comments = false;
    for (i, &b) in rest.iter().enumerate() {
        if SSH_PREFIX.len() + i + 2 > SSH_MAX_LINE {
            // CR LF would no longer fit.
            return unreadable;
        }
        match b {
            b'\r' if version > 0 => {
                return match rest.get(i + 1) {
                    None => Stream::NeedMore,
                    Some(b'\n') if reads_as_http(&rest[..i]) => unreadable,
                    Some(b'\n') => Stream::Done(Some(StreamProtocol::Ssh)),
                    Some(_) => unreadable,
                }
            }
            b' ' if version > 0 => comments = true,
            b'-' if !comments => return unreadable,
            0x21..=0x7e if comments => {}
            0x21..=0x7e => version += 1,
            _ => return unreadable,
        }
    }
    Stream::NeedMore
}

/// Whether an identification line also reads as an HTTP request line: a
/// server that takes any token as a method (Go's `net/http` takes
/// `SSH-2.0-X`) would serve `SSH-2.0-X /admin HTTP/1.1` by its `Host`,
/// which no one judged. No SSH implementation writes `HTTP/` in its line.
fn reads_as_http(line: &[u8]) -> bool {
    line.windows(5).any(|w| w.eq_ignore_ascii_case(b"HTTP/"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPENSSH: &[u8] = b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13.5\r\n";

    fn ssh() -> Stream {
        Stream::Done(Some(StreamProtocol::Ssh))
    }

    #[test]
    fn every_prefix_of_a_banner_waits_until_its_line_ends() {
        for banner in [
            OPENSSH,
            b"SSH-2.0-libssh2_1.11.0\r\n".as_slice(),
            b"SSH-2.0-Go\r\n",
            b"SSH-2.0-PuTTY_Release_0.81\r\n",
            b"SSH-2.0-paramiko_3.4.0\r\n",
        ] {
            for end in 0..banner.len() {
                assert_eq!(
                    identify(&banner[..end]),
                    Stream::NeedMore,
                    "{:?}",
                    String::from_utf8_lossy(&banner[..end])
                );
            }
            // Stable from the line's end on, whatever follows (the KEXINIT).
            let mut more = banner.to_vec();
            assert_eq!(identify(&more), ssh());
            more.extend_from_slice(&[0, 0, 5, 0xdc, 8, 0x14]);
            for end in banner.len()..=more.len() {
                assert_eq!(identify(&more[..end]), ssh());
            }
        }
    }

    #[test]
    fn anything_else_is_unreadable_as_soon_as_it_shows() {
        for (what, bytes) in [
            ("SSLv2-style hello", &[0x80, 0x2e, 0x01, 0x00, 0x02][..]),
            ("SSH 1", b"SSH-1.5-OpenSSH\r\n"),
            ("SSH 1.99 from a client", b"SSH-1.99-OpenSSH\r\n"),
            ("lower case", b"ssh-2.0-OpenSSH\r\n"),
            ("empty software version", b"SSH-2.0-\r\n"),
            ("comment without a version", b"SSH-2.0- comment\r\n"),
            ("a minus in the version", b"SSH-2.0-Open-SSH\r\n"),
            ("bare LF", b"SSH-2.0-OpenSSH\n"),
            ("CR without LF", b"SSH-2.0-OpenSSH\rX"),
            ("NUL", b"SSH-2.0-Open\0SSH\r\n"),
            ("non-ASCII", "SSH-2.0-Öpen\r\n".as_bytes()),
            ("tab", b"SSH-2.0-OpenSSH\tx\r\n"),
            ("postgres startup", &[0, 0, 0, 8, 4, 0xd2, 0x16, 0x2f]),
            ("an HTTP request line", b"SSH-2.0-X /admin HTTP/1.1\r\n"),
            ("an HTTP version in any case", b"SSH-2.0-X http/1.0\r\n"),
        ] {
            assert_eq!(identify(bytes), Stream::Done(None), "{what}");
        }
        // A minus is fine in the comments.
        assert_eq!(identify(b"SSH-2.0-OpenSSH a-b\r\n"), ssh());
    }

    #[test]
    fn the_line_is_bounded_at_255_bytes() {
        let line = |total: usize| {
            let mut l = SSH_PREFIX.to_vec();
            l.resize(total - 2, b'x');
            l.extend_from_slice(b"\r\n");
            l
        };
        assert_eq!(identify(&line(255)), ssh());
        assert_eq!(identify(&line(256)), Stream::Done(None));
        // Without its end, 255 bytes are already too many.
        assert_eq!(identify(&line(300)[..255]), Stream::Done(None));
        assert_eq!(identify(&line(300)[..253]), Stream::NeedMore);
    }
}
