//! `#[serde(with = "crate::json_value")]` for a `serde_json::Value` field: as is in
//! human-readable formats (JSON, TOML), as JSON text in binary ones. postcard cannot
//! carry a `Value` itself: it is not self-describing, and `Value` needs that to decode.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

/// Serializes `v`.
pub fn serialize<S: Serializer>(v: &Value, s: S) -> Result<S::Ok, S::Error> {
    if s.is_human_readable() {
        v.serialize(s)
    } else {
        s.serialize_str(&v.to_string())
    }
}

/// Deserializes what [`serialize`] wrote.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
    if d.is_human_readable() {
        Value::deserialize(d)
    } else {
        let text = String::deserialize(d)?;
        serde_json::from_str(&text).map_err(D::Error::custom)
    }
}
