//! The pool of host chunk slots: fresh ids `0..n-1` in order, then a LIFO free list.

/// Hands out host slot ids exactly like vLLM's CPU manager.
#[derive(Debug, Clone)]
pub(crate) struct SlotPool {
    capacity: u32,
    next_fresh: u32,
    free: Vec<u32>,
}

impl SlotPool {
    pub(crate) fn new(capacity: u32) -> Self {
        Self {
            capacity,
            next_fresh: 0,
            free: Vec::new(),
        }
    }

    /// Slots that can be allocated right now.
    pub(crate) fn available(&self) -> usize {
        self.free.len() + (self.capacity - self.next_fresh) as usize
    }

    /// The next slot: a never-used id first, else the most recently freed one.
    pub(crate) fn alloc(&mut self) -> Option<u32> {
        if self.next_fresh < self.capacity {
            let id = self.next_fresh;
            self.next_fresh += 1;
            return Some(id);
        }
        self.free.pop()
    }

    /// Returns a slot to the free list (it will be the next one reused).
    pub(crate) fn release(&mut self, id: u32) {
        debug_assert!(id < self.next_fresh, "slot {id} was never handed out");
        self.free.push(id);
    }

    /// Forgets every allocation; slots for which `held` is true stay out of the pool.
    /// The others come back in id order, as fresh slots would.
    pub(crate) fn reset(&mut self, held: impl Fn(u32) -> bool) {
        self.free.clear();
        if (0..self.next_fresh).any(&held) {
            self.free
                .extend((0..self.capacity).rev().filter(|&i| !held(i)));
            self.next_fresh = self.capacity;
        } else {
            self.next_fresh = 0;
        }
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.free.capacity() * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_ids_in_order_then_lifo() {
        let mut p = SlotPool::new(3);
        assert_eq!((p.alloc(), p.alloc()), (Some(0), Some(1)));
        p.release(0);
        assert_eq!(p.available(), 2);
        assert_eq!(p.alloc(), Some(2), "fresh ids before the free list");
        p.release(2);
        assert_eq!(p.alloc(), Some(2), "LIFO");
        assert_eq!(p.alloc(), Some(0));
        assert_eq!(p.alloc(), None);
        assert_eq!(p.available(), 0);
    }

    #[test]
    fn reset_skips_held_slots_and_restarts_in_order() {
        let mut p = SlotPool::new(4);
        for _ in 0..4 {
            p.alloc();
        }
        p.reset(|i| i == 1);
        assert_eq!(p.available(), 3);
        assert_eq!(
            (p.alloc(), p.alloc(), p.alloc(), p.alloc()),
            (Some(0), Some(2), Some(3), None)
        );
        p.reset(|_| false);
        assert_eq!(p.available(), 4);
        assert_eq!(p.alloc(), Some(0));
    }
}
