//! One KV cache group's shape as lookups, loads and stores see it: the
//! tokens of a host chunk and the group's kind of attention (full, a
//! sliding window, chunked-local attention, or a recurrent state).

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
    /// A local-attention chunk must cover at least one token.
    #[error("a chunked-local attention chunk must cover at least one token")]
    EmptyAttentionChunk,
    /// Only a sliding window retains extra tokens behind it.
    #[error("only a sliding-window group retains extra tokens behind its window")]
    RetainedWithoutWindow,
}

/// What the tokens of a group attend to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attention {
    /// Every token attends to the whole prefix (vLLM's `FullAttentionSpec`).
    Full,
    /// Each token attends to the last `window_tokens` tokens (vLLM's
    /// `SlidingWindowSpec.sliding_window`, no extra retained tokens).
    SlidingWindow {
        /// The window in tokens.
        window_tokens: u64,
    },
    /// Each token attends to the tokens of its own aligned chunk of
    /// `chunk_tokens` tokens (vLLM's `ChunkedLocalAttentionSpec.
    /// attention_chunk_size`, Llama 4's local layers).
    ChunkedLocal {
        /// The attention chunk in tokens.
        chunk_tokens: u64,
    },
    /// A recurrent state per block (vLLM's `MambaSpec` in
    /// `mamba_cache_mode="align"`): the block at a boundary holds the
    /// state after the tokens up to it, so a hit needs one chunk (vLLM's
    /// window of one chunk) and hits end on the group's chunks. Its chunks
    /// are stored only from the boundary states vLLM hands over
    /// (copy-on-write sources), never from the block table.
    State,
}

/// A KV cache group's shape: its chunk size in tokens, its attention,
/// whether it holds an EAGLE/MTP drafter's layers, and the tokens a sliding
/// window retains behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupShape {
    tokens_per_chunk: u64,
    attention: Attention,
    eagle_draft: bool,
    extra_retained_tokens: u64,
}

impl GroupShape {
    /// A full-attention group (every token attends to the whole prefix).
    pub fn full_attention(tokens_per_chunk: u64) -> Result<Self, GroupShapeError> {
        Self::with_attention(tokens_per_chunk, Attention::Full)
    }

    /// A sliding-window group attending to the last `window_tokens` tokens.
    pub fn sliding_window(
        tokens_per_chunk: u64,
        window_tokens: u64,
    ) -> Result<Self, GroupShapeError> {
        Self::with_attention(tokens_per_chunk, Attention::SlidingWindow { window_tokens })
    }

    /// A chunked-local attention group: tokens attend within aligned chunks
    /// of `chunk_tokens` tokens.
    pub fn chunked_local(
        tokens_per_chunk: u64,
        chunk_tokens: u64,
    ) -> Result<Self, GroupShapeError> {
        Self::with_attention(tokens_per_chunk, Attention::ChunkedLocal { chunk_tokens })
    }

    /// A recurrent-state group (see [`Attention::State`]).
    pub fn recurrent_state(tokens_per_chunk: u64) -> Result<Self, GroupShapeError> {
        Self::with_attention(tokens_per_chunk, Attention::State)
    }

    /// Full attention (`window_tokens: None`) or a sliding window.
    pub fn new(tokens_per_chunk: u64, window_tokens: Option<u64>) -> Result<Self, GroupShapeError> {
        match window_tokens {
            Some(w) => Self::sliding_window(tokens_per_chunk, w),
            None => Self::full_attention(tokens_per_chunk),
        }
    }

    /// A group of `attention` over chunks of `tokens_per_chunk` tokens.
    pub fn with_attention(
        tokens_per_chunk: u64,
        attention: Attention,
    ) -> Result<Self, GroupShapeError> {
        if tokens_per_chunk == 0 {
            return Err(GroupShapeError::EmptyChunk);
        }
        match attention {
            Attention::SlidingWindow { window_tokens: 0 } => Err(GroupShapeError::EmptyWindow),
            Attention::ChunkedLocal { chunk_tokens: 0 } => {
                Err(GroupShapeError::EmptyAttentionChunk)
            }
            _ => Ok(Self {
                tokens_per_chunk,
                attention,
                eagle_draft: false,
                extra_retained_tokens: 0,
            }),
        }
    }

    /// The same group holding an EAGLE/MTP drafter's layers (vLLM's
    /// `KVCacheGroupSpec.is_eagle_group`, set with speculative decoding whose
    /// draft KV at a position depends on the next token): its last chunk is
    /// volatile, so a lookup needs the chunk after a hit's end too, and a
    /// decoding request's last chunk is not stored.
    pub fn eagle_draft(self) -> Self {
        Self {
            eagle_draft: true,
            ..self
        }
    }

    /// Whether the group holds an EAGLE/MTP drafter's layers.
    pub fn is_eagle_draft(&self) -> bool {
        self.eagle_draft
    }

    /// The same sliding window keeping `tokens` more behind it (vLLM's
    /// `SlidingWindowSpec.extra_retained_tokens`, set with multi-module MTP:
    /// the drafter re-reads them): a lookup needs, and a store keeps, that
    /// much more history. Refused for other kinds of groups.
    pub fn retaining(self, tokens: u64) -> Result<Self, GroupShapeError> {
        match self.attention {
            Attention::SlidingWindow { .. } => Ok(Self {
                extra_retained_tokens: tokens,
                ..self
            }),
            _ if tokens == 0 => Ok(self),
            _ => Err(GroupShapeError::RetainedWithoutWindow),
        }
    }

    /// Tokens a sliding window retains behind it (0 but with multi-module
    /// MTP).
    pub fn extra_retained_tokens(&self) -> u64 {
        self.extra_retained_tokens
    }

    /// Tokens of one host chunk of this group.
    pub fn tokens_per_chunk(&self) -> u64 {
        self.tokens_per_chunk
    }

    /// What this group's tokens attend to.
    pub fn attention(&self) -> Attention {
        self.attention
    }

    /// Whether this is a full-attention group (vLLM frees none of a running
    /// request's blocks; a lookup needs every chunk of the prefix).
    pub fn is_full_attention(&self) -> bool {
        self.attention == Attention::Full
    }

    /// Whether this group holds a recurrent state (Mamba): stored only from
    /// vLLM's boundary-state hand-offs (vLLM's `requires_cow_source`).
    pub fn is_recurrent_state(&self) -> bool {
        self.attention == Attention::State
    }

    /// The sliding window in tokens; `None` for full and chunked-local
    /// attention.
    pub fn window_tokens(&self) -> Option<u64> {
        match self.attention {
            Attention::SlidingWindow { window_tokens } => Some(window_tokens),
            _ => None,
        }
    }

    /// The window in chunks (vLLM's `get_sliding_window_size_in_chunks`):
    /// the chunks a lookup needs in a row before the hit's end; `None` for
    /// full attention. A chunked-local group needs its attention chunk's
    /// worth (vLLM's bound: attention never reaches back past one chunk); a
    /// recurrent state one chunk (it depends on a single state).
    pub fn window_chunks(&self) -> Option<u64> {
        let tpc = self.tokens_per_chunk;
        match self.attention {
            Attention::Full => None,
            Attention::SlidingWindow { window_tokens: w } => {
                let extra = self.extra_retained_tokens;
                Some(w.div_ceil(tpc).max((w - 1 + extra).div_ceil(tpc)))
            }
            Attention::ChunkedLocal { chunk_tokens } => Some(chunk_tokens.div_ceil(tpc)),
            Attention::State => Some(1),
        }
    }

    /// The chunks a load into this group covers when the hit ends at
    /// `hit_end` tokens (vLLM's `load_window_size_in_chunks`): a sliding
    /// window's chunks, one more where the window's first token falls in an
    /// earlier chunk because `hit_end` is not chunk-aligned; a chunked-local
    /// group's window; `None` for full attention (everything past the GPU's
    /// hit is loaded).
    pub fn load_window_chunks(&self, hit_end: u64) -> Option<u64> {
        let window = self.window_chunks()?;
        let Some(w) = self.window_tokens() else {
            return Some(window);
        };
        let tpc = self.tokens_per_chunk;
        let right_padding = (tpc - hit_end % tpc) % tpc;
        let extra = self.extra_retained_tokens;
        Some(window.max((w - 1 + extra + right_padding).div_ceil(tpc)))
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
        assert_eq!(
            GroupShape::chunked_local(4, 0),
            Err(GroupShapeError::EmptyAttentionChunk)
        );
    }

    #[test]
    fn retained_tokens_widen_a_sliding_window_as_vllm() {
        // vLLM: max(cdiv(w, tpc), cdiv(w - 1 + extra, tpc)), and the load
        // window with its right padding on top.
        let w8 = GroupShape::sliding_window(4, 8)
            .unwrap()
            .retaining(2)
            .unwrap();
        assert_eq!(w8.extra_retained_tokens(), 2);
        assert_eq!(w8.window_chunks(), Some(3));
        assert_eq!(w8.load_window_chunks(16), Some(3));
        assert_eq!(w8.load_window_chunks(13), Some(3));
        assert_eq!(w8.load_window_chunks(15), Some(3));
        let w7 = GroupShape::sliding_window(4, 7)
            .unwrap()
            .retaining(1)
            .unwrap();
        assert_eq!(w7.window_chunks(), Some(2));
        assert_eq!(w7.load_window_chunks(13), Some(3));
        assert_eq!(
            GroupShape::chunked_local(4, 8).unwrap().retaining(2),
            Err(GroupShapeError::RetainedWithoutWindow)
        );
        assert!(GroupShape::full_attention(4).unwrap().retaining(0).is_ok());
    }

    #[test]
    fn a_chunked_local_group_needs_its_attention_chunk_and_loads_no_padding() {
        // vLLM: cdiv(attention_chunk_size, tokens_per_chunk), and the load
        // window is that (no right padding, unlike a sliding window).
        let local8 = GroupShape::chunked_local(4, 8).unwrap();
        assert!(!local8.is_full_attention());
        assert_eq!(local8.window_tokens(), None);
        assert_eq!(local8.window_chunks(), Some(2));
        assert_eq!(local8.load_window_chunks(13), Some(2));
        assert_eq!(local8.load_window_chunks(16), Some(2));
        assert_eq!(
            GroupShape::chunked_local(8, 12).unwrap().window_chunks(),
            Some(2)
        );
        assert_eq!(
            GroupShape::chunked_local(16, 8).unwrap().window_chunks(),
            Some(1)
        );
        assert_eq!(
            local8.attention(),
            Attention::ChunkedLocal { chunk_tokens: 8 }
        );
    }

    #[test]
    fn a_recurrent_state_needs_one_chunk_and_loads_one() {
        let state = GroupShape::recurrent_state(4).unwrap();
        assert!(state.is_recurrent_state());
        assert!(!state.is_full_attention());
        assert_eq!(state.window_tokens(), None);
        assert_eq!(state.window_chunks(), Some(1));
        assert_eq!(state.load_window_chunks(13), Some(1));
        assert_eq!(state.load_window_chunks(16), Some(1));
        assert!(!GroupShape::full_attention(4).unwrap().is_recurrent_state());
        assert_eq!(
            GroupShape::recurrent_state(0),
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
