//! JSON parsing with errors that name where they happened.
//!
//! Every document goes through [`parse`]: serde's derived structs refuse
//! unknown fields (`deny_unknown_fields`) and repeated fields, the
//! destination visitor refuses repeated selectors, and maps that would keep
//! the last of two equal keys are read with [`Entries`] so the caller sees
//! the duplicate.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};

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
