//! Interning of trace names: keys (strings or integers, identified by their
//! text) and request ids (strings).

use std::collections::HashMap;

use serde_json::Value;

use crate::ids::RequestId;
use crate::key::ChunkKey;

/// Engine keys of non-numeric key names start here; a decimal name below it is
/// its own number, so messages about numeric keys read as in the trace.
const NAMED_BASE: u64 = 1 << 63;

/// Key text → engine key, and back to the form in which it first appeared.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    ids: HashMap<String, u64>,
    forms: HashMap<u64, Value>,
    named: u64,
}

impl Keys {
    /// The key named by `text`, first seen as `form`.
    pub fn intern(&mut self, text: String, form: Value) -> ChunkKey {
        if let Some(&id) = self.ids.get(&text) {
            return ChunkKey(id);
        }
        let id = match text.parse::<u64>() {
            Ok(n) if n < NAMED_BASE && n.to_string() == text => n,
            _ => {
                self.named += 1;
                NAMED_BASE + self.named
            }
        };
        self.forms.insert(id, form);
        self.ids.insert(text, id);
        ChunkKey(id)
    }

    /// The form in which `key` first appeared.
    pub fn show(&self, key: ChunkKey) -> Value {
        self.forms
            .get(&key.0)
            .cloned()
            .unwrap_or_else(|| Value::from(key.0))
    }

    /// Several keys.
    pub fn show_all(&self, keys: &[ChunkKey]) -> Value {
        Value::Array(keys.iter().map(|&k| self.show(k)).collect())
    }
}

/// Request name → [`RequestId`], and back.
#[derive(Debug, Default)]
pub(crate) struct Requests {
    ids: HashMap<String, RequestId>,
    names: Vec<String>,
}

impl Requests {
    /// The request named `name`.
    pub fn intern(&mut self, name: &str) -> RequestId {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = RequestId(self.names.len() as u64);
        self.names.push(name.to_string());
        self.ids.insert(name.to_string(), id);
        id
    }

    /// The name of `id`.
    pub fn show(&self, id: RequestId) -> Value {
        Value::from(self.names.get(id.0 as usize).cloned().unwrap_or_default())
    }
}
