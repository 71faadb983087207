//! The serving backend's GPU block pool, with a prefix cache over free blocks
//! (a small model of vLLM's KV cache manager: freed blocks keep their hash
//! until they are reused, oldest freed first).

use std::collections::{HashMap, VecDeque};

use crate::ids::GpuBlockId;
use crate::key::BlockHash;

/// GPU blocks: free list (eviction order) and the hashes of cached free blocks.
#[derive(Debug, Clone)]
pub struct GpuPool {
    free: VecDeque<u32>,
    cached: HashMap<BlockHash, u32>,
    hash_of: Vec<Option<BlockHash>>,
    is_free: Vec<bool>,
}

impl GpuPool {
    /// A pool over block ids `1..n`, all free and empty (block 0 is the null
    /// block, never handed out, as in vLLM).
    pub fn new(n: u32) -> Self {
        let mut is_free = vec![true; n as usize];
        if let Some(b) = is_free.first_mut() {
            *b = false;
        }
        Self {
            free: (1..n).collect(),
            cached: HashMap::new(),
            hash_of: vec![None; n as usize],
            is_free,
        }
    }

    /// Free blocks (cached or not).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks that can be handed out (the null block excluded).
    pub fn capacity(&self) -> usize {
        self.is_free.len().saturating_sub(1)
    }

    /// How many leading `hashes` are held by free cached blocks.
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Takes the free cached blocks of the first `n` hashes (a prefix hit).
    pub fn take_cached(&mut self, hashes: &[BlockHash]) -> Vec<GpuBlockId> {
        let mut out = Vec::with_capacity(hashes.len());
        for h in hashes {
            let Some(&b) = self.cached.get(h) else { break };
            self.cached.remove(h);
            self.hash_of[b as usize] = None;
            self.is_free[b as usize] = false;
            if let Some(pos) = self.free.iter().position(|&x| x == b) {
                self.free.remove(pos);
            }
            out.push(GpuBlockId(b));
        }
        out
    }

    /// Allocates `n` blocks (evicting cached ones, oldest freed first), or none
    /// when fewer than `n` are free.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<GpuBlockId>> {
        if self.free.len() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.free.pop_front()?;
            if let Some(h) = self.hash_of[b as usize].take()
                && self.cached.get(&h) == Some(&b)
            {
                self.cached.remove(&h);
            }
            self.is_free[b as usize] = false;
            out.push(GpuBlockId(b));
        }
        Some(out)
    }

    /// Frees `blocks`; block `i` keeps `hashes[i]` (its computed content) when given.
    /// The tail is freed first, so it is evicted first.
    pub fn free(&mut self, blocks: &[GpuBlockId], hashes: &[BlockHash]) {
        for (i, b) in blocks.iter().enumerate().rev() {
            let idx = b.0 as usize;
            if idx >= self.is_free.len() || self.is_free[idx] {
                continue;
            }
            self.is_free[idx] = true;
            if let Some(&h) = hashes.get(i)
                && !self.cached.contains_key(&h)
            {
                self.cached.insert(h, b.0);
                self.hash_of[idx] = Some(h);
            }
            self.free.push_back(b.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_blocks_hit_until_reused() {
        let mut p = GpuPool::new(5);
        let a = p.alloc(2).unwrap();
        assert!(!a.contains(&GpuBlockId(0)));
        let h = [BlockHash(1), BlockHash(2)];
        p.free(&a, &h);
        assert_eq!(p.match_prefix(&h), 2);
        let got = p.take_cached(&h[..1]);
        assert_eq!(got, vec![a[0]]);
        assert_eq!(p.num_free(), 3);
        let _ = p.alloc(3).unwrap();
        assert_eq!(p.match_prefix(&h[1..]), 0);
        assert!(p.alloc(1).is_none());
    }
}
