//! The gather/scatter kernels (`kernels/copy_blocks.cu`) and their persistent
//! descriptor tables: a device buffer of fixed capacity per slot, refreshed from
//! pinned staging by a memcpy on the copy stream, optionally captured together
//! with the kernel launch into a CUDA graph and replayed.

use crate::Direction;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaStream, LaunchConfig, PushKernelArg, sys,
};
use cudarc::nvrtc::Ptx;

use crate::worker::{CopyDesc, DescriptorTable};

use super::error::{CudaError, check, driver};
use super::memory::{DeviceBuffer, PinnedBuffer};

/// Bytes of a table with room for `capacity` descriptors (one header entry first).
pub fn table_bytes(capacity: usize) -> usize {
    (capacity + 1) * std::mem::size_of::<CopyDesc>()
}

/// Grid shape of a copy launch: the grid size is the SM budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    /// CTAs (at most one per SM is resident per CTA slot; a few by default).
    pub ctas: u32,
    /// Threads per CTA (a multiple of 32, at most 256).
    pub threads: u32,
}

impl LaunchShape {
    /// The grid and block sizes a launch uses: at least one CTA, threads
    /// clamped to 32..=256 and rounded down to whole warps.
    pub fn dims(self) -> (u32, u32) {
        (self.ctas.max(1), self.threads.clamp(32, 256) & !31)
    }

    /// Warps in the grid.
    pub fn warps(self) -> u64 {
        let (ctas, threads) = self.dims();
        u64::from(ctas) * u64::from(threads / 32)
    }
}

impl Default for LaunchShape {
    fn default() -> Self {
        Self {
            ctas: 8,
            threads: 256,
        }
    }
}

/// The loaded copy kernels.
#[derive(Debug)]
pub struct CopyKernels {
    gather_table: CudaFunction,
    scatter_table: CudaFunction,
}

impl CopyKernels {
    /// Loads `copy_blocks` from the embedded fatbin.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let module = crate::kernels::module("copy_blocks").ok_or(CudaError::KernelsNotBuilt)?;
        // A Vec copy gives the image the alignment cuModuleLoadData expects.
        let image = module.fatbin.to_vec();
        let m = ctx
            .load_module(Ptx::from_binary(image))
            .map_err(driver("cuModuleLoadData"))?;
        Ok(Self {
            gather_table: m
                .load_function("kv_gather_table")
                .map_err(driver("cuModuleGetFunction"))?,
            scatter_table: m
                .load_function("kv_scatter_table")
                .map_err(driver("cuModuleGetFunction"))?,
        })
    }

    /// The table kernel of `direction` (store = gather into host rows).
    pub fn table_function(&self, direction: Direction) -> &CudaFunction {
        match direction {
            Direction::Store => &self.gather_table,
            Direction::Load => &self.scatter_table,
        }
    }
}

/// Launches a table kernel over the table at `table` (device address).
pub fn launch_table(
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    table: u64,
    capacity: u32,
    shape: LaunchShape,
) -> Result<(), CudaError> {
    let (ctas, threads) = shape.dims();
    let cfg = LaunchConfig {
        grid_dim: (ctas, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(f);
    b.arg(&table).arg(&capacity);
    // SAFETY: the kernel takes (const CopyDesc*, uint32_t); `table` is a device
    // buffer of `capacity + 1` descriptors whose header holds the count, and every
    // descriptor names memory the backend's layout contract keeps valid.
    unsafe { b.launch(cfg) }.map_err(driver("cuLaunchKernel"))?;
    Ok(())
}

/// Splits descriptors into pieces of at most `max` bytes (so one warp never
/// owns a huge run while others idle); appends to `out`. `max` is rounded
/// down to a multiple of 16 (at least 16): every piece after a 16-byte
/// aligned start stays aligned, and the kernel's 16-byte path takes it.
pub fn split_descs(descs: &[CopyDesc], max: u64, out: &mut Vec<CopyDesc>) {
    let max = (max & !15).max(16);
    for d in descs {
        let mut off = 0;
        while off < d.bytes {
            let n = (d.bytes - off).min(max);
            out.push(CopyDesc {
                src: d.src + off,
                dst: d.dst + off,
                bytes: n,
            });
            off += n;
        }
    }
}

/// Smallest piece [`piece_bytes`] chooses: below it a warp's pieces cost
/// more in descriptor reads than they gain in spread.
pub const MIN_PIECE_BYTES: u64 = 4 << 10;

/// The piece size for a kernel job of `total` bytes on a grid of `warps`
/// warps: small enough that the job splits into at least twice as many
/// pieces as there are warps (few large blocks would otherwise leave most
/// warps idle: 8 blocks of 128 KiB in 64 KiB pieces keep 16 of 64 busy),
/// at least [`MIN_PIECE_BYTES`], at most `max`, a multiple of 16.
pub fn piece_bytes(total: u64, warps: u64, max: u64) -> u64 {
    let max = (max & !15).max(16);
    let target = total.div_ceil(2 * warps.max(1)).next_multiple_of(16);
    target.clamp(MIN_PIECE_BYTES.min(max), max)
}

/// The pieces a kernel job copies, appended to `out`: the job's descriptors
/// split for a launch of `shape` (`piece_bytes`, at most `max_piece`
/// bytes a piece), as the kernel strategies split them.
pub fn kernel_pieces(
    table: &DescriptorTable,
    shape: LaunchShape,
    max_piece: u64,
    out: &mut Vec<CopyDesc>,
) {
    let piece = piece_bytes(table.bytes, shape.warps(), max_piece);
    split_descs(&table.descs, piece, out);
}

/// A table's header entry: the table kernels read the count of the
/// descriptors that follow it from its `bytes`.
pub fn table_header(count: usize) -> CopyDesc {
    CopyDesc {
        src: 0,
        dst: 0,
        bytes: count as u64,
    }
}

/// A captured graph, owned by one slot of one backend: the exec, and its
/// table-refresh memcpy node with the parameters it was captured with (the
/// copy is narrowed to the live entries before each replay).
struct SlotGraph {
    graph: CudaGraph,
    /// The refresh copy's node and its captured parameters; `None` if the
    /// graph had no single memcpy node (then the whole table is copied).
    copy: Option<(sys::CUgraphNode, sys::CUDA_MEMCPY3D)>,
    /// Bytes the exec's copy node is set to copy now.
    copy_bytes: usize,
    /// The graph records the slot's `consumed` event itself, right after
    /// the refresh copy (an external event-record node).
    records_consumed: bool,
}

// SAFETY: a graph exec handle (and its nodes) may be used from any thread
// that binds its context; the slot (behind the backend's `&mut`) never uses
// it concurrently, and the copy parameters only hold addresses of the slot's
// own buffers.
unsafe impl Send for SlotGraph {}

impl std::fmt::Debug for SlotGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotGraph")
            .field("narrowed_copy", &self.copy.is_some())
            .field("copy_bytes", &self.copy_bytes)
            .field("records_consumed", &self.records_consumed)
            .finish()
    }
}

/// The single memcpy node of `graph` and its parameters, if it has exactly one.
fn find_copy_node(
    graph: sys::CUgraph,
) -> Result<Option<(sys::CUgraphNode, sys::CUDA_MEMCPY3D)>, CudaError> {
    let mut count = 0usize;
    // SAFETY: a null node array asks for the count only.
    check("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count)
    })?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); count];
    // SAFETY: `nodes` has room for `count` handles.
    check("cuGraphGetNodes", unsafe {
        sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count)
    })?;
    nodes.truncate(count);
    let mut found = None;
    for node in nodes {
        let mut kind = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` belongs to `graph`; `kind` is a valid out-pointer.
        check("cuGraphNodeGetType", unsafe {
            sys::cuGraphNodeGetType(node, &mut kind)
        })?;
        if kind != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY {
            continue;
        }
        if found.is_some() {
            return Ok(None);
        }
        // SAFETY: all-zero is a valid bit pattern of this plain C struct
        // (null pointers, zero sizes), overwritten by the call below.
        let mut params: sys::CUDA_MEMCPY3D = unsafe { std::mem::zeroed() };
        // SAFETY: `node` is a memcpy node of `graph`; `params` is a valid out-pointer.
        check("cuGraphMemcpyNodeGetParams", unsafe {
            sys::cuGraphMemcpyNodeGetParams(node, &mut params)
        })?;
        found = Some((node, params));
    }
    Ok(found)
}

/// One persistent table: pinned staging, device copy, a graph once captured,
/// and an event telling when the device has consumed the staging: recorded
/// right after the refresh copy, on both paths (on the graph path by the
/// graph itself; after the whole graph only where the driver refused an
/// event-record node in the capture).
#[derive(Debug)]
pub struct TableSlot {
    capacity: usize,
    staging: PinnedBuffer,
    device: DeviceBuffer,
    consumed: CudaEvent,
    used: bool,
    graph: Option<SlotGraph>,
}

impl TableSlot {
    /// A slot with room for `capacity` descriptors.
    pub fn new(ctx: &Arc<CudaContext>, capacity: usize) -> Result<Self, CudaError> {
        let bytes = table_bytes(capacity);
        Ok(Self {
            capacity,
            staging: PinnedBuffer::host_alloc(ctx, bytes)?,
            device: DeviceBuffer::new(ctx, bytes)?,
            consumed: ctx.new_event(None).map_err(driver("cuEventCreate"))?,
            used: false,
            graph: None,
        })
    }

    /// Writes the count and descriptors into the staging buffer. Returns true when
    /// it had to wait for the previous use of this slot (a host sync; rare with
    /// a ring of slots).
    pub fn fill(&mut self, descs: &[CopyDesc]) -> Result<bool, CudaError> {
        let n = descs.len().min(self.capacity);
        let mut waited = false;
        if self.used
            && !self
                .consumed
                .try_is_complete()
                .map_err(driver("cuEventQuery"))?
        {
            self.consumed
                .synchronize()
                .map_err(driver("cuEventSynchronize"))?;
            waited = true;
        }
        let header = table_header(n);
        // SAFETY: the staging is not read by the device any more (the `consumed`
        // event of its previous use has completed, checked above), and both writes
        // are within `table_bytes(capacity)`.
        unsafe {
            self.staging.write(0, bytemuck::bytes_of(&header));
            self.staging.write(
                std::mem::size_of::<CopyDesc>(),
                bytemuck::cast_slice(&descs[..n]),
            );
        }
        Ok(waited)
    }

    /// Enqueues the staging -> device refresh of `n` descriptors (plus header).
    pub fn enqueue_refresh(&self, stream: &CudaStream, n: usize) -> Result<(), CudaError> {
        let bytes = table_bytes(n.min(self.capacity));
        // SAFETY: both buffers hold at least `bytes`; the staging is pinned, so the
        // copy is asynchronous and reads it when the stream reaches it (it is not
        // rewritten before `consumed` completes).
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                self.device.addr(),
                self.staging.addr() as *const std::ffi::c_void,
                bytes,
                stream.cu_stream(),
            )
        })
    }

    /// Enqueues refresh + kernel directly (no graph).
    pub fn enqueue_direct(
        &mut self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        n: usize,
        shape: LaunchShape,
    ) -> Result<(), CudaError> {
        self.enqueue_refresh(stream, n)?;
        // The staging is free again once the refresh has read it: the event
        // goes between the copy and the kernel, so the next fill of this slot
        // waits for the copy, not for the kernel (the device table itself is
        // rewritten only by this stream's next refresh, after the kernel).
        self.mark_used(stream)?;
        launch_table(stream, f, self.device.addr(), self.capacity as u32, shape)
    }

    /// Captures the slot's graph now, if it has none (the backend does it at
    /// construction, so that no capture lands on a submit). Returns whether
    /// it captured. The graph is: refresh copy, an event-record node of
    /// `consumed`, the kernel; where the driver refuses the event node, the
    /// copy and the kernel alone (`consumed` is then recorded after it).
    pub fn capture(
        &mut self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        shape: LaunchShape,
    ) -> Result<bool, CudaError> {
        if self.graph.is_some() {
            return Ok(false);
        }
        let graph = match self.capture_with(stream, f, shape, true) {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(error = %e, "capturing with an event-record node failed: the staging is released after the whole graph");
                self.capture_with(stream, f, shape, false)?
            }
        };
        self.graph = Some(graph);
        Ok(true)
    }

    fn capture_with(
        &self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        shape: LaunchShape,
        record_consumed: bool,
    ) -> Result<SlotGraph, CudaError> {
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("cuStreamBeginCapture"))?;
        let body = self
            .enqueue_refresh(stream, self.capacity)
            .and_then(|()| {
                if !record_consumed {
                    return Ok(());
                }
                // SAFETY: event and stream belong to the same context; under
                // capture, the external flag adds an event-record node.
                check("cuEventRecordWithFlags", unsafe {
                    sys::cuEventRecordWithFlags(
                        self.consumed.cu_event(),
                        stream.cu_stream(),
                        sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
                    )
                })
            })
            .and_then(|()| {
                launch_table(stream, f, self.device.addr(), self.capacity as u32, shape)
            });
        let end = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver("cuStreamEndCapture"));
        body?;
        let graph = end?.ok_or(CudaError::Driver {
            op: "cuStreamEndCapture",
            message: "empty graph".into(),
        })?;
        graph.upload().map_err(driver("cuGraphUpload"))?;
        let copy = find_copy_node(graph.cu_graph())?;
        if copy.is_none() {
            tracing::warn!(
                "no single memcpy node in a captured table graph: replays copy the whole table"
            );
        }
        Ok(SlotGraph {
            graph,
            copy,
            copy_bytes: table_bytes(self.capacity),
            records_consumed: record_consumed,
        })
    }

    /// Replays the slot's graph (capturing it first if it has none): the
    /// refresh of the `n` live descriptors (the exec's copy node narrowed to
    /// them), then the kernel, which reads the count from the table.
    pub fn enqueue_graph(
        &mut self,
        ctx: &CudaContext,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        n: usize,
        shape: LaunchShape,
    ) -> Result<bool, CudaError> {
        let captured = self.capture(stream, f, shape)?;
        let live = table_bytes(n.min(self.capacity));
        let mut records_consumed = false;
        if let Some(g) = &mut self.graph {
            if let Some((node, params)) = &mut g.copy
                && g.copy_bytes != live
            {
                params.WidthInBytes = live;
                // SAFETY: `node` is the memcpy node of the graph `g.graph` was
                // instantiated from, the parameters are the captured 1-D ones
                // with a width within both buffers (`live ≤ table_bytes(capacity)`),
                // and no launch of this exec is being enqueued concurrently.
                check("cuGraphExecMemcpyNodeSetParams", unsafe {
                    sys::cuGraphExecMemcpyNodeSetParams(
                        g.graph.cu_graph_exec(),
                        *node,
                        params,
                        ctx.cu_ctx(),
                    )
                })?;
                g.copy_bytes = live;
            }
            g.graph.launch().map_err(driver("cuGraphLaunch"))?;
            records_consumed = g.records_consumed;
        }
        if records_consumed {
            self.used = true;
        } else {
            self.mark_used(stream)?;
        }
        Ok(captured)
    }

    /// Bytes of the table refresh the graph's next replay copies (`None`
    /// without a graph): for tests of the narrowing.
    pub fn graph_copy_bytes(&self) -> Option<usize> {
        self.graph.as_ref().map(|g| g.copy_bytes)
    }

    fn mark_used(&mut self, stream: &CudaStream) -> Result<(), CudaError> {
        self.consumed
            .record(stream)
            .map_err(driver("cuEventRecord"))?;
        self.used = true;
        Ok(())
    }
}

/// Slots of one direction: per capacity bucket, a ring of slots.
#[derive(Debug)]
pub struct TableRing {
    buckets: Vec<(usize, Vec<TableSlot>, usize)>,
}

impl TableRing {
    /// `slots` slots for each capacity in `capacities` (ascending).
    pub fn new(
        ctx: &Arc<CudaContext>,
        capacities: &[usize],
        slots: usize,
    ) -> Result<Self, CudaError> {
        let mut caps = capacities.to_vec();
        caps.sort_unstable();
        caps.dedup();
        let mut buckets = Vec::with_capacity(caps.len());
        for c in caps {
            let ring = (0..slots.max(1))
                .map(|_| TableSlot::new(ctx, c))
                .collect::<Result<Vec<_>, _>>()?;
            buckets.push((c, ring, 0));
        }
        Ok(Self { buckets })
    }

    /// The next slot of the smallest bucket that holds `n` descriptors.
    pub fn acquire(&mut self, n: usize) -> Option<&mut TableSlot> {
        let (_, ring, next) = self.buckets.iter_mut().find(|(c, _, _)| *c >= n)?;
        let i = *next;
        *next = (i + 1) % ring.len();
        ring.get_mut(i)
    }

    /// Captures every slot's graph that is not captured yet; returns how many.
    pub fn capture_all(
        &mut self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        shape: LaunchShape,
    ) -> Result<u64, CudaError> {
        let mut n = 0;
        for (_, ring, _) in &mut self.buckets {
            for slot in ring {
                n += u64::from(slot.capture(stream, f, shape)?);
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_keeps_bytes_and_order() {
        let d = [CopyDesc {
            src: 0,
            dst: 1000,
            bytes: 100,
        }];
        let mut out = Vec::new();
        split_descs(&d, 48, &mut out);
        assert_eq!(out.len(), 3);
        assert_eq!(out.iter().map(|d| d.bytes).sum::<u64>(), 100);
        assert_eq!(out[2].src, 96);
        assert_eq!(out[2].dst, 1096);
        assert_eq!(table_bytes(2), 72);
    }

    #[test]
    fn a_split_size_off_16_is_rounded_down_so_pieces_stay_aligned() {
        let d = [CopyDesc {
            src: 4096,
            dst: 8192,
            bytes: 1000,
        }];
        let mut out = Vec::new();
        split_descs(&d, 100, &mut out);
        assert!(out.iter().all(|p| p.src % 16 == 0 && p.dst % 16 == 0));
        assert_eq!(out[0].bytes, 96);
        assert_eq!(out.iter().map(|d| d.bytes).sum::<u64>(), 1000);
    }

    #[test]
    fn pieces_outnumber_the_warps_twice_when_the_job_allows() {
        let warps = 8 * 256 / 32;
        // 8 blocks of 128 KiB: 1 MiB in 8 KiB pieces, 128 pieces for 64 warps.
        let p = piece_bytes(8 << 17, warps, 64 << 10);
        assert_eq!(p, 8 << 10);
        assert!((8u64 << 17).div_ceil(p) >= 2 * warps);
        // Large jobs keep the configured maximum; tiny ones the minimum.
        assert_eq!(piece_bytes(1 << 30, warps, 64 << 10), 64 << 10);
        assert_eq!(piece_bytes(4096, warps, 64 << 10), MIN_PIECE_BYTES);
        // Always a multiple of 16, never above the maximum.
        for total in [1u64, 17, 1000, 123_457, 9 << 20] {
            let p = piece_bytes(total, warps, 60_000);
            assert!(p.is_multiple_of(16) && p <= 60_000, "{total}: {p}");
        }
    }
}
