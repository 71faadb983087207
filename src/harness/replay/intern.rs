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

    /// `msg` with every request id it names (`req<N>`, as [`RequestId`]
    /// displays) written as the trace names that request (a JSON string).
    pub fn name_ids_in(&self, msg: &str) -> String {
        let mut out = String::with_capacity(msg.len());
        let mut rest = msg;
        while let Some(at) = rest.find("req") {
            let (before, tail) = rest.split_at(at);
            out.push_str(before);
            let digits = tail[3..].bytes().take_while(u8::is_ascii_digit).count();
            let starts_word = !before
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_');
            let ends_word = !tail[3 + digits..]
                .chars()
                .next()
                .is_some_and(|c| c.is_alphanumeric() || c == '_');
            let name = tail[3..3 + digits]
                .parse::<usize>()
                .ok()
                .filter(|_| digits > 0 && starts_word && ends_word)
                .and_then(|i| self.names.get(i));
            match name {
                Some(n) => {
                    out.push_str(&Value::from(n.as_str()).to_string());
                    rest = &tail[3 + digits..];
                }
                None => {
                    out.push_str("req");
                    rest = &tail[3..];
                }
            }
        }
        out.push_str(rest);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_in_messages_become_trace_names() {
        let mut r = Requests::default();
        let a = r.intern("nobody");
        let b = r.intern("r2");
        assert_eq!(
            r.name_ids_in(&format!("unknown request {a}")),
            "unknown request \"nobody\""
        );
        assert_eq!(
            r.name_ids_in(&format!("request {b} has jobs in flight; {a} too")),
            "request \"r2\" has jobs in flight; \"nobody\" too"
        );
        // Not a request id: left alone.
        assert_eq!(
            r.name_ids_in("prereq12 req99 requests req"),
            "prereq12 req99 requests req"
        );
    }
}
