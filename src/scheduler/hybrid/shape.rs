//! One KV cache group's shape as lookups and loads see it: the tokens of a
//! host chunk and, for a sliding-window group, its window.

use thiserror::Error;

/// A group shape that cannot exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum GroupShapeError {
    /// A chunk must hold at least one token.
    #[error("a KV group's chunk must hold at least one token")]
    EmptyChunk,
    /// A sliding window must cover at least one token.
    #[error("a sliding window must cover at least one token")]
    EmptyWindow,
}

/// A KV cache group's shape: its chunk size in tokens and, for sliding-window
/// attention, the window in tokens (vLLM's `SlidingWindowSpec.sliding_window`,
/// no extra retained tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupShape {
    tokens_per_chunk: u64,
    window_tokens: Option<u64>,
}

impl GroupShape {
    /// A full-attention group (every token attends to the whole prefix).
    pub fn full_attention(tokens_per_chunk: u64) -> Result<Self, GroupShapeError> {
        if tokens_per_chunk == 0 {
            return Err(GroupShapeError::EmptyChunk);
        }
        Ok(Self {
            tokens_per_chunk,
            window_tokens: None,
        })
    }

    /// A sliding-window group attending to the last `window_tokens` tokens.
    pub fn sliding_window(
        tokens_per_chunk: u64,
        window_tokens: u64,
    ) -> Result<Self, GroupShapeError> {
        if window_tokens == 0 {
            return Err(GroupShapeError::EmptyWindow);
        }
        Ok(Self {
            window_tokens: Some(window_tokens),
            ..Self::full_attention(tokens_per_chunk)?
        })
    }

    /// Full attention (`window_tokens: None`) or a sliding window.
    pub fn new(tokens_per_chunk: u64, window_tokens: Option<u64>) -> Result<Self, GroupShapeError> {
        match window_tokens {
            Some(w) => Self::sliding_window(tokens_per_chunk, w),
            None => Self::full_attention(tokens_per_chunk),
        }
    }

    /// Tokens of one host chunk of this group.
    pub fn tokens_per_chunk(&self) -> u64 {
        self.tokens_per_chunk
    }

    /// The window in tokens, `None` for full attention.
    pub fn window_tokens(&self) -> Option<u64> {
        self.window_tokens
    }

    /// The window in chunks (vLLM's `get_sliding_window_size_in_chunks`):
    /// the chunks a lookup needs in a row; `None` for full attention.
    pub fn window_chunks(&self) -> Option<u64> {
        let w = self.window_tokens?;
        let tpc = self.tokens_per_chunk;
        Some(w.div_ceil(tpc).max((w - 1).div_ceil(tpc)))
    }

    /// The chunks a load into this group covers when the hit ends at
    /// `hit_end` tokens (vLLM's `load_window_size_in_chunks`): the window,
    /// one chunk more where the window's first token falls in an earlier
    /// chunk because `hit_end` is not chunk-aligned; `None` for full
    /// attention (everything past the GPU's hit is loaded).
    pub fn load_window_chunks(&self, hit_end: u64) -> Option<u64> {
        let window = self.window_chunks()?;
        let w = self.window_tokens?;
        let tpc = self.tokens_per_chunk;
        let right_padding = (tpc - hit_end % tpc) % tpc;
        Some(window.max((w - 1 + right_padding).div_ceil(tpc)))
    }
}

/// Shapes the hybrid modules' tests share: 4-token chunks.
#[cfg(test)]
pub(super) mod fixtures {
    use super::GroupShape;

    /// Full attention, 4-token chunks.
    pub(in crate::scheduler::hybrid) fn full() -> GroupShape {
        GroupShape::full_attention(4).unwrap()
    }

    /// A window of `tokens`, 4-token chunks.
    pub(in crate::scheduler::hybrid) fn window(tokens: u64) -> GroupShape {
        GroupShape::sliding_window(4, tokens).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_refuse_empty_chunks_and_windows() {
        assert_eq!(
            GroupShape::full_attention(0),
            Err(GroupShapeError::EmptyChunk)
        );
        assert_eq!(
            GroupShape::sliding_window(4, 0),
            Err(GroupShapeError::EmptyWindow)
        );
        assert_eq!(
            GroupShape::sliding_window(0, 8),
            Err(GroupShapeError::EmptyChunk)
        );
    }

    #[test]
    fn windows_in_chunks_round_up_as_vllm() {
        let full = GroupShape::full_attention(4).unwrap();
        assert_eq!(full.window_chunks(), None);
        assert_eq!(full.load_window_chunks(13), None);
        // 8 tokens over 4-token chunks: 2 chunks; 13 tokens: 4.
        let w8 = GroupShape::sliding_window(4, 8).unwrap();
        assert_eq!(w8.window_chunks(), Some(2));
        assert_eq!(
            GroupShape::sliding_window(4, 13).unwrap().window_chunks(),
            Some(4)
        );
        assert_eq!(
            GroupShape::sliding_window(8, 1).unwrap().window_chunks(),
            Some(1)
        );
        // An aligned hit end loads the window; 3 tokens short of a boundary,
        // the 7 tokens before the end reach into a third chunk.
        assert_eq!(w8.load_window_chunks(16), Some(2));
        assert_eq!(w8.load_window_chunks(13), Some(3));
        assert_eq!(w8.load_window_chunks(15), Some(2));
    }
}
