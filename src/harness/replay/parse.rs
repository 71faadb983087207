//! Typed access to the fields of one trace line; every failure is a
//! "malformed line" reason.

use serde_json::{Map, Value};

use crate::ids::{GpuBlockId, JobId};

/// The fields of one JSON object line.
#[derive(Debug)]
pub(crate) struct Fields<'a> {
    map: &'a Map<String, Value>,
}

/// Result of reading a field: the reason text on failure.
pub(crate) type Field<T> = Result<T, String>;

fn non_negative(v: &Value, name: &str) -> Field<u64> {
    v.as_u64()
        .ok_or_else(|| format!("field {name:?} must be a non-negative integer, got {v}"))
}

impl<'a> Fields<'a> {
    /// Wraps a line's object.
    pub fn new(map: &'a Map<String, Value>) -> Self {
        Self { map }
    }

    fn req_field(&self, name: &str) -> Field<&'a Value> {
        self.map
            .get(name)
            .ok_or_else(|| format!("missing field {name:?}"))
    }

    /// Whether the field is present (and not null).
    pub fn has(&self, name: &str) -> bool {
        self.map.get(name).is_some_and(|v| !v.is_null())
    }

    /// A required non-negative integer.
    pub fn u64(&self, name: &str) -> Field<u64> {
        non_negative(self.req_field(name)?, name)
    }

    /// An optional non-negative integer.
    pub fn opt_u64(&self, name: &str) -> Field<Option<u64>> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => non_negative(v, name).map(Some),
        }
    }

    /// A required string.
    pub fn str(&self, name: &str) -> Field<&'a str> {
        let v = self.req_field(name)?;
        v.as_str()
            .ok_or_else(|| format!("field {name:?} must be a string, got {v}"))
    }

    /// An optional string.
    pub fn opt_str(&self, name: &str) -> Field<Option<&'a str>> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| format!("field {name:?} must be a string, got {v}")),
        }
    }

    /// An optional boolean with a default.
    pub fn bool_or(&self, name: &str, default: bool) -> Field<bool> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| format!("field {name:?} must be a boolean, got {v}")),
        }
    }

    /// A required array.
    pub fn array(&self, name: &str) -> Field<&'a [Value]> {
        let v = self.req_field(name)?;
        v.as_array()
            .map(Vec::as_slice)
            .ok_or_else(|| format!("field {name:?} must be a list, got {v}"))
    }

    /// An optional array (empty when absent).
    pub fn opt_array(&self, name: &str) -> Field<&'a [Value]> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(&[]),
            Some(_) => self.array(name),
        }
    }

    /// A required object.
    pub fn object(&self, name: &str) -> Field<&'a Map<String, Value>> {
        let v = self.req_field(name)?;
        v.as_object()
            .ok_or_else(|| format!("field {name:?} must be an object, got {v}"))
    }

    /// A list of GPU block ids (required or, with `optional`, empty when absent).
    pub fn blocks(&self, name: &str, optional: bool) -> Field<Vec<GpuBlockId>> {
        let arr = if optional {
            self.opt_array(name)?
        } else {
            self.array(name)?
        };
        arr.iter()
            .map(|v| {
                let n = non_negative(v, name)?;
                u32::try_from(n)
                    .map(GpuBlockId)
                    .map_err(|_| format!("block id {n} in {name:?} is too large"))
            })
            .collect()
    }

    /// A list of job ids (empty when absent).
    pub fn jobs(&self, name: &str) -> Field<Vec<JobId>> {
        self.opt_array(name)?
            .iter()
            .map(|v| non_negative(v, name).map(JobId))
            .collect()
    }

    /// A list of strings (empty when absent).
    pub fn strings(&self, name: &str) -> Field<Vec<&'a str>> {
        self.opt_array(name)?
            .iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| format!("field {name:?} must list strings, got {v}"))
            })
            .collect()
    }
}

/// The text identifying a key (string or non-negative integer) and its form.
pub(crate) fn key_text(v: &Value, name: &str) -> Field<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) if n.is_u64() => Ok(n.to_string()),
        _ => Err(format!(
            "field {name:?} must list keys (strings or non-negative integers), got {v}"
        )),
    }
}
