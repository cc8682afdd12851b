//! Text from elsewhere (a peer's answer, a sandbox's input) kept within a
//! bound before it goes into a message, a log line or an Event.

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

#[cfg(test)]
mod tests {
    use super::bounded;

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
