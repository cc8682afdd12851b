//! Text from elsewhere (a peer's answer, a sandbox's input) kept within a
//! bound before it goes into a message, a log line or an Event, and JSON
//! whose text a terminal shows rather than acts on.

/// `text` cut to at most `max` bytes at a character boundary, and `…`
/// appended when it was cut.
pub fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// `v` as JSON, as `serde_json` writes it but for every character a
/// terminal or a viewer acts on rather than shows, which goes as a
/// `\uXXXX` escape: DEL and the C1 controls (U+007F to U+009F; xterm
/// reads U+009B as the start of a control sequence), the line and
/// paragraph separators, and the bidirectional marks, embeddings,
/// overrides and isolates (which reorder what is shown). A sandbox's
/// request path, percent-decoded, may hold any of them, and lands in the
/// flow log and in API answers an operator reads in a terminal. The JSON
/// reads back the same; shown, it shows what it holds.
pub fn json_to_writer<W: std::io::Write, T: serde::Serialize + ?Sized>(
    w: W,
    v: &T,
) -> serde_json::Result<()> {
    v.serialize(&mut serde_json::Serializer::with_formatter(w, Shown))
}

/// [`json_to_writer`] into a new buffer.
pub fn json_vec<T: serde::Serialize + ?Sized>(v: &T) -> serde_json::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(128);
    json_to_writer(&mut out, v)?;
    Ok(out)
}

/// The compact formatter, with [`acts`] characters escaped.
struct Shown;

impl serde_json::ser::Formatter for Shown {
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        if fragment.bytes().all(|b| b < 0x7f) {
            return writer.write_all(fragment.as_bytes());
        }
        let mut start = 0;
        for (i, c) in fragment.char_indices().filter(|&(_, c)| acts(c)) {
            writer.write_all(&fragment.as_bytes()[start..i])?;
            write!(writer, "\\u{:04x}", u32::from(c))?;
            start = i + c.len_utf8();
        }
        writer.write_all(&fragment.as_bytes()[start..])
    }
}

/// Whether a terminal or a viewer acts on `c` rather than show it (beyond
/// the C0 controls, which `serde_json` escapes itself).
fn acts(c: char) -> bool {
    matches!(
        c,
        '\u{7f}'..='\u{9f}'
            | '\u{61c}'
            | '\u{200e}'
            | '\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2066}'..='\u{2069}'
    )
}

#[cfg(test)]
mod tests {
    use super::{bounded, json_vec};

    /// Every character a terminal acts on goes as an escape, and the JSON
    /// reads back the same: a path with a control sequence (U+009B is CSI),
    /// a right-to-left override, a line separator, DEL.
    #[test]
    fn json_shows_what_a_terminal_would_act_on_as_escapes() {
        let path = "/v1/\u{9b}2J\u{9b}31mOK/\u{202e}gnp.exe\u{2028}x\u{7f}é→";
        let doc = serde_json::json!({ "path": path, "plain": "/a/b" });
        let out = String::from_utf8(json_vec(&doc).expect("json")).expect("utf-8");
        assert!(
            !out.chars().any(super::acts),
            "a character a terminal acts on is written as it is: {out:?}"
        );
        assert!(out.contains("\\u009b2J") && out.contains("é→"), "{out}");
        let back: serde_json::Value = serde_json::from_str(&out).expect("reads back");
        assert_eq!(back, doc);
        assert_eq!(json_vec("/a/b").expect("json"), br#""/a/b""#);
    }

    #[test]
    fn text_is_cut_at_a_character_boundary() {
        let cases: [(&str, usize, &str); 5] = [
            ("short", 8, "short"),
            ("exactly8", 8, "exactly8"),
            ("ninechars", 8, "ninechar…"),
            // "é" is two bytes: the cut falls back to the boundary before it.
            ("abcdefgé", 8, "abcdefg…"),
            ("", 0, ""),
        ];
        for (text, max, expected) in cases {
            assert_eq!(bounded(text, max), expected, "{text:?} within {max}");
        }
    }
}
