//! The synthetic workload: conversations that share system prompts and resend
//! their history each turn, with token ids and chained block hashes.

use crate::key::BlockHash;

use super::rng::SimRng;

/// Shape of the workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkloadShape {
    /// Distinct system prompts shared by conversations.
    pub system_prompts: u64,
    /// Tokens of a system prompt (min, max).
    pub system_tokens: (u64, u64),
    /// New user tokens per turn (min, max).
    pub user_tokens: (u64, u64),
    /// Generated tokens per turn (min, max).
    pub output_tokens: (u64, u64),
    /// Turns per conversation (min, max).
    pub turns: (u64, u64),
    /// Steps between a turn's end and the next turn's arrival (min, max).
    pub think_steps: (u64, u64),
}

impl Default for WorkloadShape {
    fn default() -> Self {
        Self {
            system_prompts: 6,
            system_tokens: (128, 512),
            user_tokens: (16, 160),
            output_tokens: (16, 96),
            turns: (1, 4),
            think_steps: (2, 40),
        }
    }
}

/// One conversation: its history so far and what its turns will add.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// Tokens so far (system prompt, then user and assistant tokens of past turns).
    pub history: Vec<u64>,
    /// Turns left, this one included.
    pub turns_left: u64,
    rng: SimRng,
}

/// Generates conversations from a seed.
#[derive(Debug, Clone)]
pub struct Workload {
    shape: WorkloadShape,
    system: Vec<Vec<u64>>,
    rng: SimRng,
    tokens_per_block: u64,
}

impl Workload {
    /// A workload for `shape` with `tokens_per_block`-token blocks.
    pub fn new(shape: WorkloadShape, tokens_per_block: u64, seed: u64) -> Self {
        let mut rng = SimRng::new(seed);
        let system = (0..shape.system_prompts.max(1))
            .map(|_| {
                let n = rng.range(shape.system_tokens.0, shape.system_tokens.1);
                (0..n).map(|_| rng.next_u64()).collect()
            })
            .collect();
        Self {
            shape,
            system,
            rng,
            tokens_per_block: tokens_per_block.max(1),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &WorkloadShape {
        &self.shape
    }

    /// A new conversation (it starts with one of the shared system prompts).
    pub fn conversation(&mut self) -> Conversation {
        let i = self.rng.range(0, self.system.len() as u64 - 1) as usize;
        let turns = self
            .rng
            .range(self.shape.turns.0, self.shape.turns.1)
            .max(1);
        Conversation {
            history: self.system[i].clone(),
            turns_left: turns,
            rng: self.rng.fork(),
        }
    }

    /// Adds the next turn's user tokens to the history (which is then the
    /// turn's prompt: never a whole number of blocks) and returns how many
    /// tokens the turn will generate.
    pub fn next_turn(&self, conv: &mut Conversation) -> u64 {
        let mut n = conv
            .rng
            .range(self.shape.user_tokens.0, self.shape.user_tokens.1);
        if (conv.history.len() as u64 + n).is_multiple_of(self.tokens_per_block) {
            n += 1;
        }
        for _ in 0..n {
            let t = conv.rng.next_u64();
            conv.history.push(t);
        }
        let out = conv
            .rng
            .range(self.shape.output_tokens.0, self.shape.output_tokens.1)
            .max(1);
        conv.turns_left = conv.turns_left.saturating_sub(1);
        out
    }

    /// A generated token of a conversation (its history grows by it).
    pub fn generate(conv: &mut Conversation) -> u64 {
        let t = conv.rng.next_u64();
        conv.history.push(t);
        t
    }

    /// Whether a new conversation arrives (probability `p`).
    pub fn arrives(&mut self, p: f64) -> bool {
        self.rng.chance(p)
    }

    /// Steps until a conversation's next turn arrives.
    pub fn think_steps(&mut self) -> u64 {
        self.rng
            .range(self.shape.think_steps.0, self.shape.think_steps.1)
    }
}

/// Chained hashes of the full blocks of `tokens`, continuing from `prev`
/// (the hash of the block before the first one, or `None` at the start).
/// Hashes stay below 2^63 so a trace shows them as plain integers.
pub fn block_hashes(
    tokens: &[u64],
    tokens_per_block: usize,
    prev: Option<BlockHash>,
) -> Vec<BlockHash> {
    let tpb = tokens_per_block.max(1);
    let mut h = prev.map_or(0x6b76_6f66_666c_6f61, |p| p.0);
    tokens
        .chunks_exact(tpb)
        .map(|block| {
            for &t in block {
                h = mix(h ^ t);
            }
            h &= (1 << 63) - 1;
            BlockHash(h)
        })
        .collect()
}

fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_resend_history_and_hashes_chain() {
        let w = Workload::new(WorkloadShape::default(), 16, 3);
        let mut w2 = w.clone();
        let mut c = w2.conversation();
        w.next_turn(&mut c);
        let p1 = c.history.clone();
        Workload::generate(&mut c);
        w.next_turn(&mut c);
        let p2 = c.history.clone();
        assert!(p2.starts_with(&p1));
        assert_ne!(p1.len() % 16, 0);
        let h1 = block_hashes(&p1, 16, None);
        let h2 = block_hashes(&p2, 16, None);
        assert_eq!(&h2[..h1.len()], &h1[..]);
        let split = block_hashes(&p2[16..], 16, Some(h2[0]));
        assert_eq!(&h2[1..], &split[..]);
    }
}
