//! The shares of a chunk a worker holds in the remote tier, and where their
//! bytes lie in its host slot (`docs/remote-tier.md`, "Keys and values": shares).
//!
//! By default a chunk has one share a worker: the worker's whole slot of the
//! chunk row, under its rank. Such shares tie a chunk to the tensor-parallel
//! size that wrote it. With **KV heads as shares** ([`RemoteShares::kv_heads`])
//! a chunk has one share per KV head of the model: the bytes of that head,
//! every layer and block of the chunk, in an order no parallel layout
//! changes (tensor, block, K then V, token). A worker puts and fetches the
//! shares of the heads it holds, so nodes of different tensor-parallel
//! sizes read each other's chunks.

use thiserror::Error;

use super::layout::SlotLayout;

/// A byte range inside a worker's slot of one chunk row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRange {
    /// Offset from the start of the slot.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One share of a chunk that this worker holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldShare {
    /// The share's index in the store (the rank field of its key and value).
    pub index: u32,
    /// Whether this worker puts it (of several workers holding the same
    /// head, one writes it; all fetch it).
    pub writes: bool,
    /// Where its bytes lie in the slot, in the share's order; `None`: the
    /// whole slot.
    pub ranges: Option<Vec<SlotRange>>,
    /// Bytes of the share (`None` ranges: the slot's bytes, checked when used).
    pub bytes: Option<u64>,
}

/// How the KV of one tensor's page is laid out, for KV heads as shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadPage {
    /// Token-major (vLLM's NHD: the heads of a token together) or
    /// head-major (HND: the tokens of a head together).
    pub order: HeadOrder,
    /// 2 where K and V fill separate halves of the page, 1 where a head's
    /// K and V lie side by side.
    pub halves: u32,
    /// Tokens of a block.
    pub block_tokens: u64,
    /// KV heads this worker holds in the page.
    pub heads: u32,
    /// Bytes of one head of one token in one half.
    pub head_bytes: u64,
}

/// The order of a page's KV heads and tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadOrder {
    /// The heads of a token lie together (vLLM's NHD).
    TokenMajor,
    /// The tokens of a head lie together (vLLM's HND).
    HeadMajor,
}

/// Which KV heads of the model a worker holds (vLLM's tensor-parallel
/// sharding of attention heads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadPlacement {
    /// KV heads of the model.
    pub total_heads: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// This worker's tensor-parallel rank.
    pub tp_rank: u32,
}

/// Shares that cannot be built from what they were given.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ShareError {
    /// Heads that tensor parallelism cannot split evenly.
    #[error(
        "{total_heads} KV heads cannot be split over {tp_size} tensor-parallel ranks (one must divide the other)"
    )]
    Indivisible {
        /// KV heads of the model.
        total_heads: u32,
        /// Tensor-parallel size.
        tp_size: u32,
    },
    /// A rank outside the tensor-parallel group.
    #[error("tensor-parallel rank {tp_rank} is out of range: allowed 0..{tp_size}")]
    RankOutOfRange {
        /// The rank.
        tp_rank: u32,
        /// Tensor-parallel size.
        tp_size: u32,
    },
    /// A page holds another number of heads than the placement gives a rank.
    #[error("tensor {tensor}: its page holds {heads} KV heads, a rank holds {expected}")]
    HeadCount {
        /// The tensor (in slot order).
        tensor: usize,
        /// Heads in its page.
        heads: u32,
        /// Heads a rank holds.
        expected: u32,
    },
    /// A page's KV does not fit in the slot's page, or is empty.
    #[error(
        "tensor {tensor}: {kv_bytes} bytes of KV a block do not fit its page of {page_bytes} bytes"
    )]
    PageSize {
        /// The tensor (in slot order).
        tensor: usize,
        /// Bytes of KV the page description gives.
        kv_bytes: u64,
        /// Bytes of the slot's page.
        page_bytes: u64,
    },
    /// One page description per tensor of the slot is needed.
    #[error("{pages} page descriptions for a slot of {tensors} tensors")]
    TensorCount {
        /// Page descriptions given.
        pages: usize,
        /// Tensors in the slot.
        tensors: usize,
    },
    /// K and V in one or two halves only.
    #[error("tensor {tensor}: {halves} halves (allowed: 1, K and V side by side, or 2)")]
    Halves {
        /// The tensor (in slot order).
        tensor: usize,
        /// Halves given.
        halves: u32,
    },
}

/// The shares of each chunk a worker holds, and how many a chunk has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteShares {
    held: Vec<HeldShare>,
    total: u32,
}

impl RemoteShares {
    /// One share a worker: the whole slot, under `rank`, `total` shares a
    /// chunk (the workers whose slots make it up). `writes`: whether this
    /// worker puts it.
    pub fn whole_slot(rank: u32, total: u32, writes: bool) -> Self {
        Self {
            held: vec![HeldShare {
                index: rank,
                writes,
                ranges: None,
                bytes: None,
            }],
            total: total.max(1),
        }
    }

    /// KV heads as shares: a chunk has `placement.total_heads` shares; this
    /// worker holds its heads' (`pages[t]` describes tensor `t` of `slot`,
    /// `blocks_per_chunk` blocks a chunk). Where several ranks hold the same
    /// head (more ranks than heads), the first of them writes it.
    pub fn kv_heads(
        pages: &[HeadPage],
        slot: &SlotLayout,
        blocks_per_chunk: u32,
        placement: HeadPlacement,
    ) -> Result<Self, ShareError> {
        let HeadPlacement {
            total_heads,
            tp_size,
            tp_rank,
        } = placement;
        if tp_rank >= tp_size {
            return Err(ShareError::RankOutOfRange { tp_rank, tp_size });
        }
        let indivisible = ShareError::Indivisible {
            total_heads,
            tp_size,
        };
        if total_heads == 0 || tp_size == 0 {
            return Err(indivisible);
        }
        // As vLLM shards heads: `total / tp` heads a rank, or, with more
        // ranks than heads, one head held by `tp / total` ranks.
        let (local, first, writes) = if total_heads >= tp_size {
            if total_heads % tp_size != 0 {
                return Err(indivisible);
            }
            let local = total_heads / tp_size;
            (local, tp_rank * local, true)
        } else {
            if tp_size % total_heads != 0 {
                return Err(indivisible);
            }
            let replicas = tp_size / total_heads;
            (1, tp_rank / replicas, tp_rank % replicas == 0)
        };
        if pages.len() != slot.tensor_page_bytes.len() {
            return Err(ShareError::TensorCount {
                pages: pages.len(),
                tensors: slot.tensor_page_bytes.len(),
            });
        }
        for (t, p) in pages.iter().enumerate() {
            if p.heads != local {
                return Err(ShareError::HeadCount {
                    tensor: t,
                    heads: p.heads,
                    expected: local,
                });
            }
            if p.halves != 1 && p.halves != 2 {
                return Err(ShareError::Halves {
                    tensor: t,
                    halves: p.halves,
                });
            }
            let page_bytes = slot.tensor_page_bytes[t];
            let kv_bytes = u64::from(p.halves)
                .checked_mul(p.block_tokens)
                .and_then(|b| b.checked_mul(u64::from(p.heads)))
                .and_then(|b| b.checked_mul(p.head_bytes))
                .unwrap_or(u64::MAX);
            if kv_bytes == 0 || kv_bytes > page_bytes {
                return Err(ShareError::PageSize {
                    tensor: t,
                    kv_bytes,
                    page_bytes,
                });
            }
        }
        let held = (0..local)
            .map(|j| {
                let mut ranges: Vec<SlotRange> = Vec::new();
                for (t, p) in pages.iter().enumerate() {
                    let tensor_start = slot.tensor_offsets[t];
                    let page_bytes = slot.tensor_page_bytes[t];
                    for sub in 0..u64::from(blocks_per_chunk) {
                        let page_start = tensor_start + sub * page_bytes;
                        head_ranges(p, j, page_start, &mut ranges);
                    }
                }
                let bytes = ranges.iter().map(|r| r.len).sum();
                HeldShare {
                    index: first + j,
                    writes,
                    ranges: Some(ranges),
                    bytes: Some(bytes),
                }
            })
            .collect();
        Ok(Self {
            held,
            total: total_heads,
        })
    }

    /// The shares this worker holds.
    pub fn held(&self) -> &[HeldShare] {
        &self.held
    }

    /// Shares a chunk has in the store (a lookup finds a chunk when all are there).
    pub fn total(&self) -> u32 {
        self.total
    }
}

impl HeldShare {
    /// The share's bytes in a slot of `slot_len` bytes (`None`: it does not fit).
    pub fn len_in(&self, slot_len: usize) -> Option<usize> {
        match &self.ranges {
            None => Some(slot_len),
            Some(ranges) => {
                let end = ranges.iter().map(|r| r.offset + r.len).max().unwrap_or(0);
                (end <= slot_len as u64).then(|| self.bytes.unwrap_or(0) as usize)
            }
        }
    }

    /// Appends the share's bytes, read from `slot`, to `out` (cleared first).
    /// Whether the share fits in the slot.
    pub fn gather(&self, slot: &[u8], out: &mut Vec<u8>) -> bool {
        out.clear();
        match &self.ranges {
            None => out.extend_from_slice(slot),
            Some(ranges) => {
                for r in ranges {
                    let Some(part) = range_of(slot.len(), r).and_then(|x| slot.get(x)) else {
                        return false;
                    };
                    out.extend_from_slice(part);
                }
            }
        }
        true
    }

    /// Writes `bytes` (a share's value) into `slot` at the share's ranges.
    /// Whether they had the share's length and it fits in the slot (nothing
    /// is written otherwise).
    pub fn scatter(&self, bytes: &[u8], slot: &mut [u8]) -> bool {
        if self.len_in(slot.len()) != Some(bytes.len()) {
            return false;
        }
        match &self.ranges {
            None => slot.copy_from_slice(bytes),
            Some(ranges) => {
                let mut at = 0usize;
                for r in ranges {
                    let len = r.len as usize;
                    let Some(dst) = range_of(slot.len(), r).and_then(|x| slot.get_mut(x)) else {
                        return false;
                    };
                    dst.copy_from_slice(&bytes[at..at + len]);
                    at += len;
                }
            }
        }
        true
    }
}

/// `r` as an index range of a slot of `slot_len` bytes.
fn range_of(slot_len: usize, r: &SlotRange) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(r.offset).ok()?;
    let end = start.checked_add(usize::try_from(r.len).ok()?)?;
    (end <= slot_len).then_some(start..end)
}

/// Appends the ranges of local head `j` in a page at `page_start`, in the
/// share's order (K then V, token after token), merging adjacent ones.
fn head_ranges(p: &HeadPage, j: u32, page_start: u64, out: &mut Vec<SlotRange>) {
    let heads = u64::from(p.heads);
    let j = u64::from(j);
    let half_bytes = p.block_tokens * heads * p.head_bytes;
    for half in 0..u64::from(p.halves) {
        let half_start = page_start + half * half_bytes;
        match p.order {
            HeadOrder::TokenMajor => {
                for token in 0..p.block_tokens {
                    let offset = half_start + (token * heads + j) * p.head_bytes;
                    push_merged(out, offset, p.head_bytes);
                }
            }
            HeadOrder::HeadMajor => {
                let offset = half_start + j * p.block_tokens * p.head_bytes;
                push_merged(out, offset, p.block_tokens * p.head_bytes);
            }
        }
    }
}

fn push_merged(out: &mut Vec<SlotRange>, offset: u64, len: u64) {
    if let Some(last) = out.last_mut()
        && last.offset + last.len == offset
    {
        last.len += len;
        return;
    }
    out.push(SlotRange { offset, len });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::layout::HostRowLayout;

    /// One block of `tokens` tokens, `heads` heads of `hb` bytes a half:
    /// byte `(half, token, global head, i)` written as a value no two
    /// positions share, laid out as `order` for a rank holding `heads`
    /// heads from `first`.
    fn page(
        order: HeadOrder,
        halves: u64,
        tokens: u64,
        heads: u64,
        first: u64,
        hb: u64,
    ) -> Vec<u8> {
        let mut out = vec![0u8; (halves * tokens * heads * hb) as usize];
        for half in 0..halves {
            for token in 0..tokens {
                for j in 0..heads {
                    for i in 0..hb {
                        let at = match order {
                            HeadOrder::TokenMajor => ((half * tokens + token) * heads + j) * hb + i,
                            HeadOrder::HeadMajor => ((half * heads + j) * tokens + token) * hb + i,
                        };
                        let g = first + j;
                        out[at as usize] = (half * 97 + token * 31 + g * 7 + i * 3) as u8;
                    }
                }
            }
        }
        out
    }

    /// A worker's pages: `layers` tensors of `tokens`-token blocks, `bpc`
    /// blocks a chunk, heads of `hb` bytes a half, in `order`.
    #[derive(Clone, Copy)]
    struct Case {
        order: HeadOrder,
        halves: u32,
        tokens: u64,
        hb: u64,
        layers: usize,
        bpc: u32,
    }

    impl Case {
        /// The shares rank `placement` holds, and its slot.
        fn shares(self, placement: HeadPlacement) -> (RemoteShares, SlotLayout) {
            let (tokens, hb, layers, bpc) = (self.tokens, self.hb, self.layers, self.bpc);
            let heads = (placement.total_heads / placement.tp_size).max(1);
            let page_bytes = u64::from(self.halves) * tokens * u64::from(heads) * hb;
            let row = HostRowLayout::uniform(bpc, 1, &vec![page_bytes; layers]).unwrap();
            let slot = row.slot(0).unwrap().clone();
            let p = HeadPage {
                order: self.order,
                halves: self.halves,
                block_tokens: tokens,
                heads,
                head_bytes: hb,
            };
            let s = RemoteShares::kv_heads(&vec![p; layers], &slot, bpc, placement).unwrap();
            (s, slot)
        }

        /// A slot filled as rank `p.tp_rank` holds it: every tensor and
        /// block the same pattern plus its tensor and block index.
        fn slot_bytes(self, p: HeadPlacement) -> Vec<u8> {
            let heads = u64::from((p.total_heads / p.tp_size).max(1));
            let first = if p.total_heads >= p.tp_size {
                u64::from(p.tp_rank) * heads
            } else {
                u64::from(p.tp_rank / (p.tp_size / p.total_heads))
            };
            let mut out = Vec::new();
            for t in 0..self.layers {
                for b in 0..self.bpc {
                    let halves = u64::from(self.halves);
                    let mut pg = page(self.order, halves, self.tokens, heads, first, self.hb);
                    for x in &mut pg {
                        *x = x.wrapping_add((t * 13 + b as usize * 5) as u8);
                    }
                    out.extend(pg);
                }
            }
            out
        }
    }

    #[test]
    fn a_head_s_share_is_the_same_bytes_at_every_tensor_parallel_size_and_order() {
        for halves in [1, 2] {
            let (tokens, hb, layers, bpc, total) = (4, 3, 2, 2, 4);
            let mut by_head: std::collections::HashMap<u32, Vec<u8>> = Default::default();
            for order in [HeadOrder::TokenMajor, HeadOrder::HeadMajor] {
                for tp in [1, 2, 4, 8] {
                    for rank in 0..tp {
                        let placement = HeadPlacement {
                            total_heads: total,
                            tp_size: tp,
                            tp_rank: rank,
                        };
                        let case = Case {
                            order,
                            halves,
                            tokens,
                            hb,
                            layers,
                            bpc,
                        };
                        let (s, _) = case.shares(placement);
                        assert_eq!(s.total(), total);
                        let slot = case.slot_bytes(placement);
                        let mut buf = Vec::new();
                        for h in s.held() {
                            assert_eq!(h.writes, tp <= total || rank % (tp / total) == 0);
                            assert!(h.gather(&slot, &mut buf));
                            assert_eq!(Some(buf.len() as u64), h.bytes);
                            let want = by_head.entry(h.index).or_insert_with(|| buf.clone());
                            assert_eq!(
                                *want, buf,
                                "head {} at tp {tp}, {order:?}, {halves} halves",
                                h.index
                            );
                        }
                    }
                }
            }
            assert_eq!(by_head.len(), total as usize);
        }
    }

    #[test]
    fn scattering_every_share_a_rank_holds_rebuilds_its_slot() {
        for order in [HeadOrder::TokenMajor, HeadOrder::HeadMajor] {
            let (tokens, hb, layers, bpc, total) = (3, 5, 3, 2, 4);
            // Shares gathered on one worker of all heads...
            let one = HeadPlacement {
                total_heads: total,
                tp_size: 1,
                tp_rank: 0,
            };
            let case = Case {
                order,
                halves: 2,
                tokens,
                hb,
                layers,
                bpc,
            };
            let (s1, _) = case.shares(one);
            let full = case.slot_bytes(one);
            let mut values = std::collections::HashMap::new();
            for h in s1.held() {
                let mut buf = Vec::new();
                assert!(h.gather(&full, &mut buf));
                values.insert(h.index, buf);
            }
            // ...fill each rank's slot of a two-way split as it holds it.
            for rank in 0..2 {
                let p = HeadPlacement {
                    total_heads: total,
                    tp_size: 2,
                    tp_rank: rank,
                };
                let (s2, slot_layout) = case.shares(p);
                let want = case.slot_bytes(p);
                let mut got = vec![0u8; slot_layout.bytes as usize];
                for h in s2.held() {
                    assert!(h.scatter(&values[&h.index], &mut got));
                }
                assert_eq!(got, want, "rank {rank}, {order:?}");
                // A value of another length writes nothing.
                let h = &s2.held()[0];
                let mut untouched = vec![0u8; slot_layout.bytes as usize];
                assert!(!h.scatter(&values[&h.index][1..], &mut untouched));
                assert!(untouched.iter().all(|&b| b == 0));
            }
        }
    }

    /// Pages of 16-token blocks, heads of 8 bytes a half, K and V apart.
    fn sixteen_tokens(order: HeadOrder, layers: usize, bpc: u32) -> Case {
        Case {
            order,
            halves: 2,
            tokens: 16,
            hb: 8,
            layers,
            bpc,
        }
    }

    #[test]
    fn head_major_heads_are_one_range_a_half_and_token_major_ones_a_range_a_token() {
        let p = HeadPlacement {
            total_heads: 2,
            tp_size: 1,
            tp_rank: 0,
        };
        let (s, _) = sixteen_tokens(HeadOrder::HeadMajor, 1, 1).shares(p);
        assert_eq!(s.held()[0].ranges.as_ref().unwrap().len(), 2);
        let (s, _) = sixteen_tokens(HeadOrder::TokenMajor, 1, 1).shares(p);
        assert_eq!(s.held()[0].ranges.as_ref().unwrap().len(), 32);
        // One head a page: its ranges merge into the whole page.
        let one = HeadPlacement {
            total_heads: 2,
            tp_size: 2,
            tp_rank: 1,
        };
        let (s, slot) = sixteen_tokens(HeadOrder::TokenMajor, 2, 2).shares(one);
        assert_eq!(
            s.held()[0].ranges.as_ref().unwrap(),
            &vec![SlotRange {
                offset: 0,
                len: slot.bytes
            }]
        );
        assert_eq!(s.held()[0].index, 1);
    }

    #[test]
    fn bad_placements_and_pages_are_typed_errors() {
        let row = HostRowLayout::uniform(1, 1, &[64]).unwrap();
        let slot = row.slot(0).unwrap();
        let page = HeadPage {
            order: HeadOrder::TokenMajor,
            halves: 2,
            block_tokens: 4,
            heads: 2,
            head_bytes: 4,
        };
        let at = |total_heads, tp_size, tp_rank| HeadPlacement {
            total_heads,
            tp_size,
            tp_rank,
        };
        let err = |pages: &[HeadPage], p| RemoteShares::kv_heads(pages, slot, 1, p).unwrap_err();
        assert!(matches!(
            err(&[page], at(3, 2, 0)),
            ShareError::Indivisible { .. }
        ));
        assert!(matches!(
            err(&[page], at(2, 3, 0)),
            ShareError::Indivisible { .. }
        ));
        assert!(matches!(
            err(&[page], at(4, 2, 2)),
            ShareError::RankOutOfRange { .. }
        ));
        assert!(matches!(
            err(&[page], at(8, 2, 0)),
            ShareError::HeadCount { expected: 4, .. }
        ));
        assert!(matches!(
            err(&[page, page], at(4, 2, 0)),
            ShareError::TensorCount { .. }
        ));
        let big = HeadPage {
            head_bytes: 5,
            ..page
        };
        assert!(matches!(
            err(&[big], at(4, 2, 0)),
            ShareError::PageSize { kv_bytes: 80, .. }
        ));
        let odd = HeadPage { halves: 3, ..page };
        assert!(matches!(
            err(&[odd], at(4, 2, 0)),
            ShareError::Halves { .. }
        ));
        assert!(RemoteShares::kv_heads(&[page], slot, 1, at(4, 2, 1)).is_ok());
    }

    #[test]
    fn a_whole_slot_share_is_the_slot() {
        let s = RemoteShares::whole_slot(3, 4, true);
        assert_eq!(s.total(), 4);
        let h = &s.held()[0];
        assert_eq!((h.index, h.len_in(10)), (3, Some(10)));
        let mut buf = Vec::new();
        assert!(h.gather(&[1, 2, 3], &mut buf));
        assert_eq!(buf, [1, 2, 3]);
        let mut slot = [0u8; 3];
        assert!(h.scatter(&[4, 5, 6], &mut slot) && slot == [4, 5, 6]);
        assert!(!h.scatter(&[4, 5], &mut slot));
    }
}
