//! JSON parsing with errors that name where they happened.
//!
//! Every document goes through [`parse`]: serde's derived structs refuse
//! unknown fields (`deny_unknown_fields`) and repeated fields, the
//! destination visitor refuses repeated selectors, and maps that would keep
//! the last of two equal keys are read with [`Entries`] so the caller sees
//! the duplicate.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};

/// A JSON error with the path of the offending value (`sensor.allow[1]`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", path_prefix(path))]
pub struct JsonError {
    /// Where in the document, `.`-separated; empty for the top level.
    pub path: String,
    /// What is wrong, naming the value.
    pub message: String,
    /// Whether the text is not JSON at all (as opposed to JSON of the wrong shape).
    pub syntax: bool,
}

fn path_prefix(path: &str) -> String {
    if path.is_empty() || path == "." {
        String::new()
    } else {
        format!("{path}: ")
    }
}

/// Deserialises `T` from `text`, recording the path of the first error.
///
/// Use it for documents that embed policies (the gateway's push API), so
/// errors name the field the same way everywhere.
pub fn parse<'a, T: Deserialize<'a>>(text: &'a str) -> Result<T, JsonError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        // serde_path_to_error says `?` or `.` when the error has no place.
        let path = match e.path().to_string() {
            p if p == "?" || p == "." => String::new(),
            p => p,
        };
        let inner = e.into_inner();
        JsonError {
            path,
            syntax: inner.is_syntax() || inner.is_eof(),
            message: inner.to_string(),
        }
    })?;
    de.end().map_err(|e| JsonError {
        path: String::new(),
        message: e.to_string(),
        syntax: true,
    })?;
    Ok(value)
}

/// Reads `text` as a JSON value whose objects each have distinct keys.
///
/// `serde_json::Value` keeps the last of two equal keys: a document read
/// into one and only then into its type (as a route that looks at a field
/// first does) would lose the first silently, and `{"default": "deny",
/// "default": "allow"}` would be read as one of its two readings.
pub fn value(text: &str) -> Result<serde_json::Value, JsonError> {
    parse::<Unique>(text).map(|u| u.0)
}

/// A JSON value read by [`value`].
struct Unique(serde_json::Value);

impl<'de> Deserialize<'de> for Unique {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueVisitor)
    }
}

struct UniqueVisitor;

impl<'de> Visitor<'de> for UniqueVisitor {
    type Value = Unique;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Unique, E> {
        Ok(Unique(b.into()))
    }

    fn visit_i64<E>(self, n: i64) -> Result<Unique, E> {
        Ok(Unique(n.into()))
    }

    fn visit_u64<E>(self, n: u64) -> Result<Unique, E> {
        Ok(Unique(n.into()))
    }

    fn visit_f64<E>(self, n: f64) -> Result<Unique, E> {
        Ok(Unique(n.into()))
    }

    fn visit_str<E>(self, s: &str) -> Result<Unique, E> {
        Ok(Unique(s.into()))
    }

    fn visit_string<E>(self, s: String) -> Result<Unique, E> {
        Ok(Unique(s.into()))
    }

    fn visit_unit<E>(self) -> Result<Unique, E> {
        Ok(Unique(serde_json::Value::Null))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Unique, A::Error> {
        let mut out = Vec::new();
        while let Some(Unique(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Unique(out.into()))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Unique, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(A::Error::custom(format!("duplicate key `{key}`")));
            }
            let Unique(v) = map.next_value()?;
            out.insert(key, v);
        }
        Ok(Unique(out.into()))
    }
}

/// Implements `Deserialize` for a struct whose derive is `#[serde(remote = "Self")]`,
/// accepting only a JSON object.
///
/// serde's derived struct visitors also accept a sequence of the fields in
/// order (`[true, [..]]`); a policy document must never parse from a shape
/// nobody wrote on purpose.
macro_rules! object_only {
    ($ty:ty) => {
        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct ObjectVisitor;
                impl<'de> serde::de::Visitor<'de> for ObjectVisitor {
                    type Value = $ty;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str("an object")
                    }
                    fn visit_map<A: serde::de::MapAccess<'de>>(
                        self,
                        map: A,
                    ) -> Result<$ty, A::Error> {
                        <$ty>::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    }
                }
                d.deserialize_map(ObjectVisitor)
            }
        }
    };
}
pub(crate) use object_only;

/// The entries of a JSON object in document order, duplicates kept, so the
/// caller can refuse them by name.
#[derive(Debug)]
pub(crate) struct Entries<V>(pub(crate) Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for Entries<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct EntriesVisitor<V>(PhantomData<V>);

        impl<'de, V: Deserialize<'de>> Visitor<'de> for EntriesVisitor<V> {
            type Value = Entries<V>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries<V>, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry()? {
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }

        d.deserialize_map(EntriesVisitor(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_value_refuses_a_key_twice_at_any_depth_and_names_where() {
        let v = super::value(r#"{"a": [1, -2, 3.5, "x", null, true], "b": {"c": {}}}"#);
        assert_eq!(
            v.expect("distinct keys"),
            serde_json::json!({"a": [1, -2, 3.5, "x", null, true], "b": {"c": {}}})
        );
        for (text, path) in [
            (r#"{"default": "deny", "default": "allow"}"#, ""),
            (
                r#"{"policy": {"deny": [], "deny": [{"ip": "1.2.3.4"}]}}"#,
                "policy",
            ),
            (r#"{"a": [{"k": 1, "k": 2}]}"#, "a[0]"),
        ] {
            let e = super::value(text).expect_err(text);
            assert!(e.message.contains("duplicate key"), "{text}: {e}");
            assert_eq!(e.path, path, "{text}: {e}");
        }
    }
}
