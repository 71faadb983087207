//! Request names (vLLM's request ids) and kvoffload's numeric ids.

use kvoffload::RequestId;
use pyo3::prelude::*;
use rustc_hash::FxHashMap;

use crate::convert::value_error;

/// Request names (vLLM's request ids) and kvoffload's numeric ids.
#[derive(Default)]
pub(crate) struct Names {
    pub(crate) ids: FxHashMap<String, RequestId>,
    pub(crate) names: FxHashMap<RequestId, String>,
    pub(crate) next: u64,
}

impl Names {
    pub(crate) fn intern(&mut self, name: &str) -> RequestId {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = RequestId(self.next);
        self.next += 1;
        self.ids.insert(name.to_owned(), id);
        self.names.insert(id, name.to_owned());
        id
    }

    pub(crate) fn get(&self, name: &str) -> PyResult<RequestId> {
        self.ids
            .get(name)
            .copied()
            .ok_or_else(|| value_error(format!("unknown request {name:?}")))
    }

    pub(crate) fn name(&self, id: RequestId) -> String {
        self.names.get(&id).cloned().unwrap_or_default()
    }

    /// Forgets a request the scheduler no longer tracks.
    pub(crate) fn forget(&mut self, id: RequestId) {
        if let Some(n) = self.names.remove(&id) {
            self.ids.remove(&n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_keeps_its_id_until_forgotten_and_then_gets_a_new_one() {
        let mut n = Names::default();
        let a = n.intern("req-a");
        let b = n.intern("req-b");
        assert_ne!(a, b);
        assert_eq!(n.intern("req-a"), a);
        assert_eq!(n.get("req-a").ok(), Some(a));
        assert_eq!(n.name(b), "req-b");
        n.forget(a);
        assert!(n.get("req-a").is_err(), "a forgotten name is unknown");
        assert_eq!(n.name(a), "", "a forgotten id has no name");
        assert!(n.ids.len() == 1 && n.names.len() == 1);
        let again = n.intern("req-a");
        assert!(again != a && again != b, "ids are never reused");
    }

    #[test]
    fn forgetting_an_unknown_id_changes_nothing() {
        let mut n = Names::default();
        let a = n.intern("x");
        n.forget(RequestId(a.0 + 100));
        assert_eq!(n.get("x").ok(), Some(a));
    }
}
