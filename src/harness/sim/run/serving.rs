//! The serving backend's model: arrivals, admission (GPU prefix cache,
//! lookup, allocation), preemption when the GPU pool runs out, token progress
//! and request completion.

use std::collections::VecDeque;

use serde_json::{Value, json};

use crate::ids::{GpuBlockId, RequestId};
use crate::scheduler::{LookupOutcome, ScheduledRequest, StepInput};

use super::super::recorder::req_name;
use super::super::workload::{Conversation, Workload, block_hashes};
use super::{Phase, Req, Sim, SimError, ids};

impl Sim {
    pub(super) fn arrive(&mut self, step: u64, draining: bool) -> Result<(), SimError> {
        if draining {
            return Ok(());
        }
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.arrivals.len() {
            if self.arrivals[i].0 <= step {
                due.push(self.arrivals.remove(i).1);
            } else {
                i += 1;
            }
        }
        // Open conversations: a turn in the backend, a turn arriving now, or
        // a user thinking.
        let open = (self.reqs.len() + due.len() + self.arrivals.len()) as u64;
        if self.next_req + (due.len() as u64) < self.opts.requests
            && self.workload.arrives(self.opts.arrival_rate)
            && open < self.opts.max_conversations
        {
            due.push(self.workload.conversation());
        }
        for conv in due {
            if self.next_req >= self.opts.requests {
                break;
            }
            self.add(conv)?;
        }
        Ok(())
    }

    pub(super) fn add(&mut self, mut conv: Conversation) -> Result<(), SimError> {
        let id = RequestId(self.next_req);
        self.next_req += 1;
        let out = self.workload.next_turn(&mut conv);
        let hashes = block_hashes(&conv.history, self.tpb as usize, None);
        let n = conv.history.len() as u64;
        self.timed(|s| s.add_request(id, n, &hashes))?;
        self.rec.call(|| {
            json!({
                "op": "add_request", "req": req_name(id), "prompt_tokens": n,
                "block_hashes": hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
            })
        });
        self.summary.work.requests += 1;
        self.reqs.insert(
            id,
            Req {
                conv,
                hashes,
                prompt_len: n,
                out_target: out,
                generated: 0,
                blocks: Vec::new(),
                computed: 0,
                local: 0,
                external: 0,
                phase: Phase::Waiting,
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    pub(super) fn blocks_for(&self, tokens: u64) -> usize {
        tokens.div_ceil(self.tpb) as usize
    }

    /// The backend model's scheduling decisions for this step.
    pub(super) fn schedule(&mut self) -> Result<StepInput, SimError> {
        let mut input = StepInput {
            finished: std::mem::take(&mut self.finished_prev),
            ..StepInput::default()
        };
        let mut budget = self.opts.max_batch_tokens;
        // 1. Running requests: one token each (or the rest of their prefill).
        let mut idx = 0;
        while idx < self.running.len() {
            let id = self.running[idx];
            let (len, computed, have) = {
                let q = &self.reqs[&id];
                (q.conv.history.len() as u64, q.computed, q.blocks.len())
            };
            let want = len - computed;
            let need = self.blocks_for(len).saturating_sub(have);
            let mut preempted_self = false;
            while self.gpu.num_free() < need {
                let Some(&victim) = self.running.last() else {
                    break;
                };
                self.preempt(victim, &mut input);
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                continue;
            }
            let new = self.gpu.alloc(need).unwrap_or_default();
            let q = self.reqs.get_mut(&id).expect("running request is tracked");
            q.blocks.extend_from_slice(&new);
            input.scheduled.push(ScheduledRequest {
                req: id,
                new_block_ids: new,
                computed_tokens: computed,
                scheduled_tokens: want,
                full_table: false,
            });
            budget = budget.saturating_sub(want);
            idx += 1;
        }
        // 2. Requests whose load ended.
        let mut keep = Vec::new();
        for id in std::mem::take(&mut self.loading) {
            let q = &self.reqs[&id];
            let len = q.conv.history.len() as u64;
            let computed = match q.phase {
                Phase::LoadDone => (q.local + q.external).min(len - 1),
                Phase::LoadFailed => q.local,
                _ => {
                    keep.push(id);
                    continue;
                }
            };
            if len - computed > budget && !input.scheduled.is_empty() {
                keep.push(id);
                continue;
            }
            let blocks = q.blocks.clone();
            self.timed(|s| s.on_alloc(id, &blocks, 0))?;
            self.rec.call(|| json!({"op": "alloc", "req": req_name(id), "block_ids": ids(&blocks), "external_tokens": 0}));
            self.rec.decision(|| json!({"op": "alloc"}));
            let q = self.reqs.get_mut(&id).expect("loading request is tracked");
            if q.phase == Phase::LoadDone {
                self.summary.work.loaded_tokens += q.external;
            }
            budget = budget.saturating_sub(self.start_running(id, blocks, computed, &mut input));
        }
        self.loading = keep;
        // 3. Waiting requests, in order; a deferred one is skipped.
        let mut skipped = VecDeque::new();
        while let Some(id) = self.waiting.pop_front() {
            if self.running.len() + self.loading.len() >= self.opts.max_running {
                self.waiting.push_front(id);
                break;
            }
            // A request preempted in this step waits for the next one.
            if input.preempted.contains(&id) {
                skipped.push_back(id);
                continue;
            }
            let (len, local) = {
                let q = &self.reqs[&id];
                let len = q.conv.history.len() as u64;
                let max_local = ((len - 1) / self.tpb) as usize;
                let m = self
                    .gpu
                    .match_prefix(&q.hashes[..max_local.min(q.hashes.len())]);
                (len, m as u64 * self.tpb)
            };
            let outcome = self.timed(|s| s.lookup(id, local))?;
            self.rec
                .call(|| json!({"op": "lookup", "req": req_name(id), "computed_tokens": local}));
            let ext = match outcome {
                LookupOutcome::Defer => {
                    self.rec.decision(|| json!({"op": "lookup", "defer": true}));
                    skipped.push_back(id);
                    continue;
                }
                // `sync`: the sync-load budget reserved the hit (as replay
                // writes it).
                LookupOutcome::Hit(n) if self.sched.sync_load_reserved(id) => {
                    self.rec
                        .decision(|| json!({"op": "lookup", "hit_tokens": n, "sync": true}));
                    n
                }
                LookupOutcome::Hit(n) => {
                    self.rec
                        .decision(|| json!({"op": "lookup", "hit_tokens": n}));
                    n
                }
            };
            // A synchronous load is waited in this step, before the model
            // runs: the request computes the rest of its prompt in the same
            // step (vLLM's `load_kv_async = False`); an asynchronous one
            // computes nothing until its load ends.
            let sync = ext > 0 && self.sched.sync_load_reserved(id);
            let total = self.blocks_for(len);
            let local_blocks = (local / self.tpb) as usize;
            let new_needed = total - local_blocks;
            let compute = match (ext, sync) {
                (0, _) => len - local,
                (_, true) => len - local - ext,
                (_, false) => 0,
            };
            if self.gpu.num_free() < total || (compute > budget && !input.scheduled.is_empty()) {
                self.waiting.push_front(id);
                break;
            }
            let hashes = self.reqs[&id].hashes[..local_blocks].to_vec();
            let mut blocks = self.gpu.take_cached(&hashes);
            self.check_prefix_hit(&blocks, &hashes);
            blocks.extend(self.gpu.alloc(new_needed).unwrap_or_default());
            let job = self.timed(|s| s.on_alloc(id, &blocks, ext))?;
            self.rec.call(|| json!({"op": "alloc", "req": req_name(id), "block_ids": ids(&blocks), "external_tokens": ext}));
            self.rec.decision(|| match job {
                Some(j) => json!({"op": "alloc", "load_job": j.0}),
                None => json!({"op": "alloc"}),
            });
            self.summary.work.prompt_tokens += len;
            self.summary.work.gpu_hit_tokens += local;
            let q = self.reqs.get_mut(&id).expect("waiting request is tracked");
            q.blocks = blocks.clone();
            q.local = local;
            q.external = ext;
            match job {
                Some(_) if !sync => {
                    q.phase = Phase::Loading;
                    self.loading.push(id);
                }
                _ => {
                    if let Some(job) = job {
                        self.sync_jobs.push((job, id));
                    }
                    let computed = local + if sync { ext } else { 0 };
                    budget =
                        budget.saturating_sub(self.start_running(id, blocks, computed, &mut input));
                }
            }
        }
        while let Some(id) = skipped.pop_back() {
            self.waiting.push_front(id);
        }
        Ok(input)
    }

    /// `id` runs from `computed` tokens on with its whole table `blocks`,
    /// scheduled for the rest of its tokens (returned).
    fn start_running(
        &mut self,
        id: RequestId,
        blocks: Vec<GpuBlockId>,
        computed: u64,
        input: &mut StepInput,
    ) -> u64 {
        let q = self.reqs.get_mut(&id).expect("admitted request is tracked");
        let rest = q.conv.history.len() as u64 - computed;
        q.phase = Phase::Running;
        q.computed = computed;
        input.scheduled.push(ScheduledRequest {
            req: id,
            new_block_ids: blocks,
            computed_tokens: computed,
            scheduled_tokens: rest,
            full_table: true,
        });
        self.running.push(id);
        rest
    }

    pub(super) fn preempt(&mut self, id: RequestId, input: &mut StepInput) {
        self.running.retain(|&r| r != id);
        let tpb = self.tpb;
        if let Some(q) = self.reqs.get_mut(&id) {
            let full = ((q.computed / tpb) as usize).min(q.hashes.len());
            self.gpu.free(&q.blocks, &q.hashes[..full]);
            q.blocks.clear();
            q.computed = 0;
            q.phase = Phase::Waiting;
        }
        input.preempted.push(id);
        self.waiting.push_front(id);
        self.summary.work.preemptions += 1;
    }

    /// After the step: scheduled tokens are computed, one token is generated
    /// per request at the end of its prompt; finished requests free their blocks.
    pub(super) fn advance_tokens(&mut self, input: &StepInput) -> Result<(), SimError> {
        let tpb = self.tpb as usize;
        for s in &input.scheduled {
            let Some(q) = self.reqs.get_mut(&s.req) else {
                continue;
            };
            if q.phase != Phase::Running {
                continue;
            }
            // Its synchronous load failed: what the step computed from the
            // load's blocks on is discarded, and it computes again from
            // there (vLLM truncates a request's computed tokens to its first
            // block that failed to load, and drops the step's sampled token).
            if self.sync_failed.contains(&s.req) {
                q.computed = q.local;
                continue;
            }
            q.computed = s.computed_tokens + s.scheduled_tokens;
            if q.computed < q.conv.history.len() as u64 {
                continue;
            }
            Workload::generate(&mut q.conv);
            q.generated += 1;
            self.summary.work.generated_tokens += 1;
            let have = q.hashes.len();
            let new = if q.conv.history.len() / tpb > have {
                block_hashes(&q.conv.history[have * tpb..], tpb, q.hashes.last().copied())
            } else {
                Vec::new()
            };
            q.hashes.extend_from_slice(&new);
            let n = q.conv.history.len() as u64;
            let done = q.generated >= q.out_target;
            self.timed(|sch| sch.update_request(s.req, n, &new))?;
            let mut line = json!({"op": "update_request", "req": req_name(s.req), "num_tokens": n});
            if !new.is_empty() {
                line["block_hashes"] = Value::from(new.iter().map(|h| h.0).collect::<Vec<_>>());
            }
            self.rec.call(|| line);
            if done {
                self.finish_request(s.req)?;
            }
        }
        Ok(())
    }

    pub(super) fn finish_request(&mut self, id: RequestId) -> Result<(), SimError> {
        let Some(q) = self.reqs.remove(&id) else {
            return Ok(());
        };
        self.running.retain(|&r| r != id);
        let blocks = q.blocks.clone();
        self.timed(|s| s.request_finished(id, &blocks, false, 0))?;
        self.rec.call(
            || json!({"op": "request_finished", "req": req_name(id), "block_ids": ids(&blocks)}),
        );
        let full = ((q.computed / self.tpb) as usize).min(q.hashes.len());
        self.gpu.free(&blocks, &q.hashes[..full]);
        self.finished_prev.push(id);
        self.summary.work.finished += 1;
        let _ = q.prompt_len;
        if q.conv.turns_left > 0 {
            let at = self.step + self.workload.think_steps();
            self.arrivals.push((at, q.conv));
        }
        Ok(())
    }
}
