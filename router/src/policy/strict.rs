//! Parses params into a JSON value, refusing duplicate object keys at any depth.
//!
//! The policy must check exactly what the worker will act on. `serde_json::Value` keeps the
//! last of two equal keys while a worker's deserializer may keep the first (or reject the
//! message), so params with duplicate keys are refused outright instead of guessed at.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// A JSON value parsed without duplicate keys.
pub struct Strict(pub Value);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Strict, D::Error> {
        d.deserialize_any(StrictVisitor)
    }
}

struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Strict;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value without duplicate keys")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Strict, E> {
        Ok(Strict(Value::Bool(v)))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Strict, E> {
        Ok(Strict(v.into()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Strict, E> {
        Ok(Strict(Value::String(v.to_owned())))
    }

    fn visit_string<E>(self, v: String) -> Result<Strict, E> {
        Ok(Strict(Value::String(v)))
    }

    fn visit_unit<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }

    fn visit_none<E>(self) -> Result<Strict, E> {
        Ok(Strict(Value::Null))
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Strict, D::Error> {
        Strict::deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
        let mut out = Vec::new();
        while let Some(Strict(v)) = seq.next_element()? {
            out.push(v);
        }
        Ok(Strict(Value::Array(out)))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Strict, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let Strict(v) = map.next_value()?;
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate key {key:?}")));
            }
            out.insert(key, v);
        }
        Ok(Strict(Value::Object(out)))
    }
}

/// Parses `text`, refusing duplicate keys.
pub fn parse(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str::<Strict>(text).map(|s| s.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        assert_eq!(
            parse(r#"{"a":[1,{"b":null}],"c":-2.5,"d":"x"}"#).unwrap(),
            serde_json::json!({"a":[1,{"b":null}],"c":-2.5,"d":"x"})
        );
        assert!(parse(r#"{"path":"/ws/a","path":"/etc/passwd"}"#).is_err());
        assert!(parse(r#"{"s":{"type":"readOnly","type":"dangerFullAccess"}}"#).is_err());
        assert!(parse(r#"{"l":[{"p":1,"p":2}]}"#).is_err());
    }
}
