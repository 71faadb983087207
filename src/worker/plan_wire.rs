//! A compact, versioned byte encoding of the plan every worker receives for a
//! step ([`WorkerPlan`]), for serving backends whose scheduler and workers are
//! separate processes (vLLM sends the connector's metadata to each worker):
//! little-endian integers, no field names, a magic and a version in front.
//!
//! ```text
//! "KVOP" u16 version=3
//! u32 loads   { u64 job, u8 has_request, u64 request, spec }*
//! u32 stores  { u64 job, spec, u32 k, u64 key*k }*
//! u32 flushes { u64 job }*
//! u32 fetches { u64 job, u32 k, u64 key*k, u32 m, u32 chunk*m }*
//! u32 evictions { u64 key, u32 chunk }*
//! spec = u32 first_block_index, u32 n, u32 gpu_block*n, u32 m, u32 chunk*m,
//!        u32 g, { u32 num_keys, u32 num_blocks, u32 first_block_index }*g
//! ```
//!
//! (`g` is 0 for a transfer of one KV group; version 3 added it.)
//!
//! Decoding checks every length against the bytes left and rejects trailing
//! bytes, so a truncated or foreign buffer is a typed error, never a panic.

use thiserror::Error;

use crate::ids::{ChunkId, GpuBlockId, JobId, RequestId};
use crate::key::ChunkKey;
use crate::scheduler::GroupSpan;

use super::layout::TransferSpec;
use super::plan::{FetchJob, LoadJob, StoreJob, WorkerPlan};

const MAGIC: &[u8; 4] = b"KVOP";
/// The encoding's version.
pub const PLAN_WIRE_VERSION: u16 = 3;

/// Bytes that are not an encoded plan.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanWireError {
    /// The buffer ends inside a field.
    #[error("encoded step plan is truncated at byte {0}")]
    Truncated(usize),
    /// The buffer does not start with the plan's magic.
    #[error("not an encoded step plan (bad magic)")]
    BadMagic,
    /// Encoded by another version of this format.
    #[error("encoded step plan has version {0}, this build reads version {PLAN_WIRE_VERSION}")]
    Version(u16),
    /// Bytes after the plan.
    #[error("{0} trailing bytes after the encoded step plan")]
    Trailing(usize),
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_len(out: &mut Vec<u8>, n: usize) {
    // Plans never hold 2^32 entries (job ids, blocks and chunks are u32/u64
    // counts of real memory); saturate rather than wrap.
    put_u32(out, u32::try_from(n).unwrap_or(u32::MAX));
}

/// A transfer spec's fields, borrowed: what the encoding writes of one
/// [`TransferSpec`], so that a plan held in another form (the scheduler's)
/// is encoded without building the worker's plan first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecParts<'a> {
    /// [`TransferSpec::gpu_blocks`].
    pub gpu_blocks: &'a [GpuBlockId],
    /// [`TransferSpec::first_block_index`].
    pub first_block_index: u32,
    /// [`TransferSpec::chunks`].
    pub chunks: &'a [ChunkId],
    /// [`TransferSpec::groups`].
    pub groups: &'a [GroupSpan],
}

impl<'a> From<&'a TransferSpec> for SpecParts<'a> {
    fn from(s: &'a TransferSpec) -> Self {
        Self {
            gpu_blocks: &s.gpu_blocks,
            first_block_index: s.first_block_index,
            chunks: &s.chunks,
            groups: &s.groups,
        }
    }
}

fn put_spec(out: &mut Vec<u8>, s: SpecParts<'_>) {
    put_u32(out, s.first_block_index);
    put_len(out, s.gpu_blocks.len());
    for b in s.gpu_blocks {
        put_u32(out, b.0);
    }
    put_len(out, s.chunks.len());
    for c in s.chunks {
        put_u32(out, c.0);
    }
    put_len(out, s.groups.len());
    for g in s.groups {
        put_u32(out, g.num_keys);
        put_u32(out, g.num_blocks);
        put_u32(out, g.first_block_index);
    }
}

/// Encodes `plan` (appending to `out`, which is cleared first).
pub fn encode_plan(plan: &WorkerPlan, out: &mut Vec<u8>) {
    encode_plan_parts(
        plan.loads
            .iter()
            .map(|l| (l.job, l.request, SpecParts::from(&l.spec))),
        plan.stores
            .iter()
            .map(|s| (s.job, SpecParts::from(&s.spec), s.keys.as_slice())),
        &plan.flush,
        plan.fetches
            .iter()
            .map(|f| (f.job, f.keys.as_slice(), f.chunks.as_slice())),
        &plan.evictions,
        out,
    );
}

/// Encodes a plan given as its parts, the same bytes as [`encode_plan`] of
/// the [`WorkerPlan`] they make: loads as `(job, request, spec)`, stores as
/// `(job, spec, keys)`, the flushed jobs, the fetches as `(job, keys,
/// chunks)`, then the evicted chunks (`out` is cleared first).
pub fn encode_plan_parts<'a>(
    loads: impl ExactSizeIterator<Item = (JobId, Option<RequestId>, SpecParts<'a>)>,
    stores: impl ExactSizeIterator<Item = (JobId, SpecParts<'a>, &'a [ChunkKey])>,
    flush: &[JobId],
    fetches: impl ExactSizeIterator<Item = (JobId, &'a [ChunkKey], &'a [ChunkId])>,
    evictions: &[(ChunkKey, ChunkId)],
    out: &mut Vec<u8>,
) {
    out.clear();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&PLAN_WIRE_VERSION.to_le_bytes());
    put_len(out, loads.len());
    for (job, request, spec) in loads {
        put_u64(out, job.0);
        out.push(u8::from(request.is_some()));
        put_u64(out, request.map_or(0, |r| r.0));
        put_spec(out, spec);
    }
    put_len(out, stores.len());
    for (job, spec, keys) in stores {
        put_u64(out, job.0);
        put_spec(out, spec);
        put_len(out, keys.len());
        for k in keys {
            put_u64(out, k.0);
        }
    }
    put_len(out, flush.len());
    for j in flush {
        put_u64(out, j.0);
    }
    put_len(out, fetches.len());
    for (job, keys, chunks) in fetches {
        put_u64(out, job.0);
        put_len(out, keys.len());
        for k in keys {
            put_u64(out, k.0);
        }
        put_len(out, chunks.len());
        for c in chunks {
            put_u32(out, c.0);
        }
    }
    put_len(out, evictions.len());
    for (k, c) in evictions {
        put_u64(out, k.0);
        put_u32(out, c.0);
    }
}

/// A cursor over encoded bytes.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], PlanWireError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(PlanWireError::Truncated(self.at))?;
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, PlanWireError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, PlanWireError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, PlanWireError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, PlanWireError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    /// A count of `elem`-byte entries, checked against the bytes left (so a
    /// corrupt count cannot make the decoder allocate beyond the buffer).
    fn len(&mut self, elem: usize) -> Result<usize, PlanWireError> {
        let n = self.u32()? as usize;
        let left = self.buf.len() - self.at;
        if n.saturating_mul(elem) > left {
            return Err(PlanWireError::Truncated(self.at));
        }
        Ok(n)
    }

    fn spec(&mut self) -> Result<TransferSpec, PlanWireError> {
        let first_block_index = self.u32()?;
        let n = self.len(4)?;
        let mut gpu_blocks = Vec::with_capacity(n);
        for _ in 0..n {
            gpu_blocks.push(GpuBlockId(self.u32()?));
        }
        let m = self.len(4)?;
        let mut chunks = Vec::with_capacity(m);
        for _ in 0..m {
            chunks.push(ChunkId(self.u32()?));
        }
        let g = self.len(12)?;
        let mut groups = Vec::with_capacity(g);
        for _ in 0..g {
            groups.push(GroupSpan {
                num_keys: self.u32()?,
                num_blocks: self.u32()?,
                first_block_index: self.u32()?,
            });
        }
        Ok(TransferSpec {
            gpu_blocks,
            first_block_index,
            chunks,
            groups,
        })
    }
}

/// Decodes a plan encoded by [`encode_plan`].
pub fn decode_plan(buf: &[u8]) -> Result<WorkerPlan, PlanWireError> {
    let mut r = Reader { buf, at: 0 };
    if r.take(4).map_err(|_| PlanWireError::BadMagic)? != MAGIC {
        return Err(PlanWireError::BadMagic);
    }
    let version = r.u16()?;
    if version != PLAN_WIRE_VERSION {
        return Err(PlanWireError::Version(version));
    }
    // The smallest load is 8 + 1 + 8 + 16 bytes, a store 8 + 16 + 4, a flush 8.
    let n = r.len(33)?;
    let mut loads = Vec::with_capacity(n);
    for _ in 0..n {
        let job = JobId(r.u64()?);
        let has = r.u8()? != 0;
        let req = r.u64()?;
        loads.push(LoadJob {
            job,
            request: has.then_some(RequestId(req)),
            spec: r.spec()?,
        });
    }
    let n = r.len(28)?;
    let mut stores = Vec::with_capacity(n);
    for _ in 0..n {
        let job = JobId(r.u64()?);
        let spec = r.spec()?;
        let k = r.len(8)?;
        let mut keys = Vec::with_capacity(k);
        for _ in 0..k {
            keys.push(ChunkKey(r.u64()?));
        }
        stores.push(StoreJob { job, spec, keys });
    }
    let n = r.len(8)?;
    let mut flush = Vec::with_capacity(n);
    for _ in 0..n {
        flush.push(JobId(r.u64()?));
    }
    // The smallest fetch is 8 + 4 + 4 bytes.
    let n = r.len(16)?;
    let mut fetches = Vec::with_capacity(n);
    for _ in 0..n {
        let job = JobId(r.u64()?);
        let k = r.len(8)?;
        let mut keys = Vec::with_capacity(k);
        for _ in 0..k {
            keys.push(ChunkKey(r.u64()?));
        }
        let m = r.len(4)?;
        let mut chunks = Vec::with_capacity(m);
        for _ in 0..m {
            chunks.push(ChunkId(r.u32()?));
        }
        fetches.push(FetchJob { job, keys, chunks });
    }
    let n = r.len(12)?;
    let mut evictions = Vec::with_capacity(n);
    for _ in 0..n {
        let k = ChunkKey(r.u64()?);
        evictions.push((k, ChunkId(r.u32()?)));
    }
    let left = buf.len() - r.at;
    if left > 0 {
        return Err(PlanWireError::Trailing(left));
    }
    Ok(WorkerPlan {
        loads,
        stores,
        flush,
        fetches,
        evictions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WorkerPlan {
        WorkerPlan {
            loads: vec![
                LoadJob {
                    job: JobId(7),
                    request: Some(RequestId(3)),
                    spec: TransferSpec::new(&[1, 2, 3], 1, &[9, 10]),
                },
                LoadJob {
                    job: JobId(8),
                    request: None,
                    spec: TransferSpec::new(&[], 0, &[]),
                },
            ],
            stores: vec![
                StoreJob {
                    job: JobId(u64::MAX),
                    spec: TransferSpec::new(&[u32::MAX], 0, &[0]),
                    keys: vec![ChunkKey(u64::MAX)],
                },
                StoreJob {
                    job: JobId(10),
                    spec: TransferSpec {
                        groups: vec![
                            GroupSpan {
                                num_keys: 2,
                                num_blocks: 2,
                                first_block_index: 0,
                            },
                            GroupSpan {
                                num_keys: 1,
                                num_blocks: 1,
                                first_block_index: u32::MAX,
                            },
                        ],
                        ..TransferSpec::new(&[4, 5, 6], 0, &[1, 2, 3])
                    },
                    keys: vec![ChunkKey(1), ChunkKey(2), ChunkKey(3)],
                },
            ],
            flush: vec![JobId(1), JobId(2)],
            fetches: vec![FetchJob {
                job: JobId(9),
                keys: vec![ChunkKey(5), ChunkKey(6)],
                chunks: vec![ChunkId(1), ChunkId(u32::MAX)],
            }],
            evictions: vec![(ChunkKey(3), ChunkId(4))],
        }
    }

    #[test]
    fn plans_round_trip() {
        let mut buf = Vec::new();
        for plan in [sample(), WorkerPlan::default()] {
            encode_plan(&plan, &mut buf);
            assert_eq!(decode_plan(&buf).unwrap(), plan);
        }
        // 6 header + 5 counts of 4 bytes for an empty plan.
        encode_plan(&WorkerPlan::default(), &mut buf);
        assert_eq!(buf.len(), 26);
    }

    #[test]
    fn bad_bytes_are_typed_errors() {
        let mut buf = Vec::new();
        encode_plan(&sample(), &mut buf);
        // Every truncation is an error, never a panic.
        for cut in 0..buf.len() {
            assert!(decode_plan(&buf[..cut]).is_err(), "cut at {cut}");
        }
        let mut trailing = buf.clone();
        trailing.push(0);
        assert_eq!(decode_plan(&trailing), Err(PlanWireError::Trailing(1)));
        assert_eq!(decode_plan(b"nope"), Err(PlanWireError::BadMagic));
        let mut v1 = buf.clone();
        v1[4] = 1;
        assert_eq!(decode_plan(&v1), Err(PlanWireError::Version(1)));
        // A huge count is caught before allocating.
        let mut huge = buf.clone();
        huge[6..10].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_plan(&huge),
            Err(PlanWireError::Truncated(_))
        ));
    }
}
