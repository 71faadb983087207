//! Key states written as letters, as `python/tests/corpus/hybrid` records
//! what vLLM's lookups saw: one string per group, one letter per chunk key.

use thiserror::Error;

use super::lookup::{GroupKeys, KeyState};

/// A letter that names no key state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error(
    "group {group} chunk {chunk}: {letter:?} is not a key state (H, P, R, M; lower case: being loaded)"
)]
pub struct UnknownKeyLetter {
    /// The group.
    pub group: usize,
    /// The chunk.
    pub chunk: usize,
    /// The letter found.
    pub letter: char,
}

/// Per group, each chunk key's state as a letter: `H` hit, `P` hit pending,
/// `R` retry, `M` miss; lower case while the chunk is being loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedKeys(Vec<Vec<u8>>);

impl RecordedKeys {
    /// Reads one string per group.
    pub fn parse<S: AsRef<str>>(groups: &[S]) -> Result<Self, UnknownKeyLetter> {
        let mut out = Vec::with_capacity(groups.len());
        for (group, letters) in groups.iter().enumerate() {
            let bytes = letters.as_ref().as_bytes().to_vec();
            if let Some((chunk, &b)) = bytes
                .iter()
                .enumerate()
                .find(|(_, b)| !b"HPRM".contains(&b.to_ascii_uppercase()))
            {
                return Err(UnknownKeyLetter {
                    group,
                    chunk,
                    letter: b as char,
                });
            }
            out.push(bytes);
        }
        Ok(Self(out))
    }
}

impl GroupKeys for RecordedKeys {
    fn num_keys(&self, group: usize) -> usize {
        self.0.get(group).map_or(0, Vec::len)
    }

    fn state(&mut self, group: usize, chunk: usize) -> KeyState {
        match self.0[group][chunk].to_ascii_uppercase() {
            b'H' => KeyState::Hit,
            b'P' => KeyState::HitPending,
            b'R' => KeyState::Retry,
            _ => KeyState::Miss,
        }
    }

    fn being_loaded(&self, group: usize, chunk: usize) -> bool {
        self.0[group][chunk].is_ascii_lowercase()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letters_read_as_states_and_bad_ones_are_named() {
        let mut keys = RecordedKeys::parse(&["HpRM", ""]).unwrap();
        assert_eq!(
            (keys.num_keys(0), keys.num_keys(1), keys.num_keys(2)),
            (4, 0, 0)
        );
        assert_eq!(keys.state(0, 1), KeyState::HitPending);
        assert!(keys.being_loaded(0, 1) && !keys.being_loaded(0, 0));
        assert_eq!(keys.state(0, 3), KeyState::Miss);
        assert_eq!(
            RecordedKeys::parse(&["HHx"]),
            Err(UnknownKeyLetter {
                group: 0,
                chunk: 2,
                letter: 'x'
            })
        );
    }
}
