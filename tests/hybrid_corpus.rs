//! The hybrid lookup and load plan ([`kvoffload::scheduler::hybrid`])
//! against vLLM 0.33.0's own answers: `python/tests/corpus/hybrid` holds
//! runs of vLLM's `OffloadingConnector` on hybrid KV cache configurations
//! (recorded by `python/tests/test_hybrid_vllm.py`), with, for every
//! lookup, what each of the request's chunk keys answered in each group, for
//! every load, the request's blocks it was planned from, and for every
//! store, the request's state it was planned from (with Mamba partial
//! tails, also each hash boundary's keys inside a block). Every such lookup is
//! asked again here and must get vLLM's answer (the tokens to load, or a
//! wait), every load must fill the blocks vLLM's did, and every store must
//! offer the chunks vLLM's offered.

use std::io::Read;
use std::path::{Path, PathBuf};

use kvoffload::scheduler::hybrid::{
    BridgeAnswer, GpuBlock, GroupKeys, GroupShape, HybridLookup, KeyState, PartialAnswer,
    PartialLookup, RecordedKeys, Retention, StorePolicy, StoreRequest, StoreView, alignment_tokens,
    lookup_complete_chunks, lookup_complete_chunks_with_ends, lookup_partial_tail_bridged,
    plan_load, store_candidates,
};
use serde_json::Value;

/// The committed corpus, or `KVOFFLOAD_HYBRID_CORPUS` (a folder that
/// `scripts/widen-hybrid.py` filled with more seeds).
fn corpus_dir() -> PathBuf {
    match std::env::var_os("KVOFFLOAD_HYBRID_CORPUS") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("python/tests/corpus/hybrid"),
    }
}

/// The committed corpus must exercise what is compared (a widened one
/// may hold a few seeds only).
fn committed() -> bool {
    std::env::var_os("KVOFFLOAD_HYBRID_CORPUS").is_none()
}

fn read_case(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut text = String::new();
    flate2::read::GzDecoder::new(&bytes[..])
        .read_to_string(&mut text)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn shapes(case: &Value) -> Vec<GroupShape> {
    case["shapes"]
        .as_array()
        .expect("shapes")
        .iter()
        .map(|s| {
            let tpc = s["tokens_per_chunk"].as_u64().expect("tokens_per_chunk");
            let shape = match s["attention_chunk_size"].as_u64() {
                _ if s["recurrent_state"].as_bool() == Some(true) => {
                    GroupShape::recurrent_state(tpc)
                }
                Some(local) => GroupShape::chunked_local(tpc, local),
                None => GroupShape::new(tpc, s["sliding_window"].as_u64()),
            }
            .expect("a group shape");
            let extra = s["extra_retained_tokens"].as_u64().unwrap_or(0);
            let shape = shape.retaining(extra).expect("retained tokens on a window");
            if s["eagle"].as_bool() == Some(true) {
                shape.eagle_draft()
            } else {
                shape
            }
        })
        .collect()
}

fn corpus_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(corpus_dir())
        .expect("python/tests/corpus/hybrid")
        .map(|e| e.expect("a corpus entry").path())
        .collect();
    files.sort();
    assert!(!committed() || files.len() >= 11, "corpus files: {files:?}");
    files
}

/// vLLM's partial tails in a case: tokens a hash, tokens a block, and
/// the EAGLE proof margin (0 without a draft group).
#[derive(Clone, Copy)]
struct Tails {
    tokens_per_hash: u64,
    block_tokens: u64,
    eagle_margin: u64,
}

fn partial_tail(case: &Value) -> Option<Tails> {
    let pt = case.get("partial_tail")?;
    Some(Tails {
        tokens_per_hash: pt["tokens_per_hash"].as_u64().expect("tokens_per_hash"),
        block_tokens: pt["block_tokens"].as_u64().expect("block_tokens"),
        eagle_margin: pt["eagle_proof_margin"].as_u64().unwrap_or(0),
    })
}

/// The partial-tail lookup past a `complete` hit, answered by the key
/// states recorded for the lookup (`[prompt tokens, [[boundary, letters],
/// ...]]`, each group's key at the boundary, a draft group's a proof
/// margin past it; a boundary not listed misses in every group), and the
/// bridge chunk by the complete chunks' recorded states (`keys`, `ends`:
/// each group's end of the chunks its complete lookup found).
fn ask_partial_tail(
    pt: Tails,
    groups: &[GroupShape],
    req: HybridLookup,
    complete: u64,
    keys: &mut RecordedKeys,
    ends: &[usize],
    recorded: Option<&Value>,
) -> Option<u64> {
    let Tails {
        tokens_per_hash,
        block_tokens,
        eagle_margin,
    } = pt;
    let num_groups = groups.len();
    let recorded = recorded.expect("a partial-tail case records its boundaries' keys");
    let prompt_tokens = recorded[0].as_u64().expect("prompt tokens");
    let boundaries: std::collections::HashMap<u64, Vec<u8>> = recorded[1]
        .as_array()
        .expect("boundaries")
        .iter()
        .map(|b| {
            (
                b[0].as_u64().expect("a boundary"),
                b[1].as_str().expect("letters").as_bytes().to_vec(),
            )
        })
        .collect();
    let lookup = PartialLookup {
        computed: req.computed,
        complete_hit: complete,
        prompt_tokens,
        max_load_tokens: req.max_load_tokens,
        block_tokens,
        tokens_per_hash,
        num_groups,
        eagle_margin,
        // The request's hashes cover its whole tokens.
        hash_tokens: req.num_tokens - req.num_tokens % tokens_per_hash,
    };
    // vLLM's bridge: every attention group's key being loaded is pending;
    // those the complete lookup did not confirm are looked up, in group
    // order up to a miss.
    let bridge = |chunk: usize| {
        let mut answer = BridgeAnswer::default();
        let attention = || (0..num_groups).filter(|&g| !groups[g].is_recurrent_state());
        for g in attention() {
            answer.pending |= chunk < keys.num_keys(g) && keys.being_loaded(g, chunk);
        }
        for g in attention().filter(|&g| ends[g] <= chunk) {
            let state = if chunk < keys.num_keys(g) {
                keys.state(g, chunk)
            } else {
                KeyState::Miss
            };
            match state {
                KeyState::Miss => {
                    answer.miss = true;
                    break;
                }
                KeyState::Hit => {}
                KeyState::HitPending | KeyState::Retry => answer.pending = true,
            }
        }
        answer
    };
    let state = |boundary: u64, g: usize| match boundaries.get(&boundary).map(|l| l[g]) {
        Some(b'H') => KeyState::Hit,
        Some(b'P') => KeyState::HitPending,
        Some(b'R') => KeyState::Retry,
        _ => KeyState::Miss,
    };
    match lookup_partial_tail_bridged(lookup, bridge, state) {
        PartialAnswer::Complete => Some(complete),
        PartialAnswer::Tail(boundary) => Some(boundary - req.computed),
        PartialAnswer::Defer => None,
    }
}

/// The request's `max_load_tokens` as vLLM reads its `kv_transfer_params`
/// (the corpus holds them by request): a non-negative integer; a bool, a
/// float, a string or a negative number is ignored.
fn load_cap(case: &Value, rid: &str) -> Option<u64> {
    case.get("kv_transfer_params")?
        .get(rid)?
        .get("max_load_tokens")?
        .as_u64()
}

fn name(path: &Path) -> String {
    path.file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned()
}

#[test]
fn every_recorded_lookup_gets_vllms_answer() {
    let files = corpus_files();
    let (mut asked, mut hits, mut waits, mut unaligned) = (0, 0, 0, 0);
    // Hits ending on a partial tail (inside a block).
    let mut partial_hits = 0u64;
    // Lookups whose answer the request's load cap changed.
    let mut capped = 0;
    for path in &files {
        let case = read_case(path);
        let groups = shapes(&case);
        for (n, step) in case["steps"].as_array().expect("steps").iter().enumerate() {
            let Some(lookups) = step.get("lookups").and_then(Value::as_array) else {
                continue;
            };
            for lk in lookups {
                let lk = lk.as_array().expect("a lookup");
                // Lookups deferred by the request's own jobs in flight
                // never reach the key lookup: no states recorded.
                let Some(states) = lk.get(5) else { continue };
                let letters: Vec<&str> = states
                    .as_array()
                    .expect("states")
                    .iter()
                    .map(|g| g.as_str().expect("a group's keys"))
                    .collect();
                let keys = || {
                    RecordedKeys::parse(&letters)
                        .unwrap_or_else(|e| panic!("{} step {n}: {e}", name(path)))
                };
                let req = HybridLookup {
                    computed: lk[1].as_u64().expect("computed"),
                    num_tokens: lk[2].as_u64().expect("num_tokens"),
                    max_load_tokens: load_cap(&case, lk[0].as_str().expect("a request")),
                    max_new_tokens: None,
                };
                let want = lk[3].as_u64();
                let mut recorded_keys = keys();
                let mut ends = Vec::new();
                let mut got =
                    lookup_complete_chunks_with_ends(&groups, &mut recorded_keys, req, &mut ends);
                if let (Some(pt), Some(complete)) = (partial_tail(&case), got) {
                    got = ask_partial_tail(
                        pt,
                        &groups,
                        req,
                        complete,
                        &mut recorded_keys,
                        &ends,
                        lk.get(6),
                    );
                    partial_hits += u64::from(
                        got.is_some_and(|h| !(req.computed + h).is_multiple_of(pt.block_tokens)),
                    );
                }
                assert_eq!(got, want, "{} step {n}: {lk:?}", name(path));
                if req.max_load_tokens.is_some() && partial_tail(&case).is_none() {
                    let uncapped = HybridLookup {
                        max_load_tokens: None,
                        ..req
                    };
                    capped +=
                        usize::from(lookup_complete_chunks(&groups, &mut keys(), uncapped) != got);
                }
                asked += 1;
                match want {
                    Some(h) if h > 0 => {
                        hits += 1;
                        let end = req.computed + h;
                        unaligned += usize::from(
                            !end.is_multiple_of(groups[0].tokens_per_chunk())
                                && end + 1 == req.num_tokens,
                        );
                    }
                    None => waits += 1,
                    Some(_) => {}
                }
            }
        }
    }
    // The corpus exercises what is compared.
    eprintln!(
        "{asked} lookups, {hits} hits, {waits} waits, {unaligned} ending on the last token, \
         {capped} changed by the request's load cap, {partial_hits} ending on a partial tail"
    );
    if committed() {
        assert!(asked >= 1000, "{asked} lookups");
        assert!(capped >= 20, "{capped} lookups changed by a load cap");
        assert!(hits >= 100 && waits >= 100, "{hits} hits, {waits} waits");
        assert!(unaligned >= 1, "no hit ending on the last token");
        assert!(partial_hits >= 1, "no hit ending on a partial tail");
    }
}

#[test]
fn every_recorded_load_fills_vllms_blocks() {
    let (mut planned, mut windowed, mut sync) = (0, 0, 0);
    for path in corpus_files() {
        let case = read_case(&path);
        let groups = shapes(&case);
        let bpc = case["blocks_per_chunk"].as_u64().expect("blocks_per_chunk") as usize;
        for (n, step) in case["steps"].as_array().expect("steps").iter().enumerate() {
            let Some(allocs) = step.get("allocs").and_then(Value::as_array) else {
                continue;
            };
            let loads = step["loads"].as_array().expect("loads");
            for a in allocs {
                let a = a.as_array().expect("an alloc");
                let rid = a[0].as_str().expect("a request");
                let blocks: Vec<Vec<GpuBlock>> = a[4]
                    .as_array()
                    .expect("blocks")
                    .iter()
                    .map(|g| {
                        g.as_str()
                            .expect("a group's blocks")
                            .bytes()
                            .map(|b| match b {
                                b'0' => GpuBlock::Null,
                                b'h' => GpuBlock::Cached,
                                b'n' => GpuBlock::Fresh,
                                other => panic!("unknown block state {:?}", other as char),
                            })
                            .collect()
                    })
                    .collect();
                let views: Vec<&[GpuBlock]> = blocks.iter().map(Vec::as_slice).collect();
                let is_sync = a[3].as_bool().expect("sync");
                let got = plan_load(
                    &groups,
                    bpc,
                    a[1].as_u64().expect("computed"),
                    a[2].as_u64().expect("external"),
                    is_sync,
                    &views,
                )
                .unwrap_or_else(|e| panic!("{} step {n}: {a:?}: {e}", name(&path)));
                // vLLM's load of the request in that step: per group, the
                // first block's index, then the blocks.
                let want = loads
                    .iter()
                    .find(|l| l[0].as_str() == Some(rid))
                    .unwrap_or_else(|| panic!("{} step {n}: no load for {rid}", name(&path)));
                let want = want[1].as_array().expect("per group");
                for (g, (plan, w)) in got.iter().zip(want).enumerate() {
                    let w = w.as_array().expect("a group's load");
                    let first = w[0].as_u64().expect("first block") as usize;
                    assert_eq!(
                        (plan.first_block, plan.num_blocks),
                        (first, w.len() - 1),
                        "{} step {n}: {rid} group {g}: {a:?} -> {w:?}",
                        name(&path)
                    );
                    if groups[g].window_chunks().is_some() && plan.first_block > 0 {
                        windowed += 1;
                    }
                }
                planned += 1;
                sync += usize::from(is_sync);
            }
        }
    }
    eprintln!("{planned} loads, {windowed} windowed, {sync} sync");
    assert!(
        !committed() || (planned >= 200 && windowed >= 50 && sync >= 20),
        "{planned} loads, {windowed} windowed, {sync} sync"
    );
}

#[test]
fn every_recorded_store_offers_vllms_chunks() {
    let (mut planned, mut offered, mut masked) = (0, 0, 0);
    for path in corpus_files() {
        let case = read_case(&path);
        let groups = shapes(&case);
        let policy = StorePolicy {
            blocks_per_chunk: case["blocks_per_chunk"].as_u64().expect("blocks_per_chunk") as usize,
            alignment_tokens: case["alignment_tokens"].as_u64(),
            retention: Retention::from_vllm(case["retention_interval"].as_u64()),
        };
        // What vLLM derived, derived here.
        assert_eq!(
            policy.alignment_tokens,
            alignment_tokens(&groups),
            "{}",
            name(&path)
        );
        for (n, step) in case["steps"].as_array().expect("steps").iter().enumerate() {
            let Some(inputs) = step.get("store_inputs").and_then(Value::as_array) else {
                continue;
            };
            let offers = step["store_candidates"]
                .as_array()
                .expect("store_candidates");
            for input in inputs {
                let input = input.as_array().expect("a store input");
                let rid = input[0].as_str().expect("a request");
                let req = StoreRequest {
                    finished: input[1].as_bool().expect("finished"),
                    num_prompt_tokens: input[2].as_u64().expect("num_prompt_tokens"),
                    shared_prefix_boundary: input[3].as_u64().expect("shared_prefix_boundary"),
                };
                let got: Vec<Vec<usize>> = groups
                    .iter()
                    .zip(input[4].as_array().expect("per group"))
                    .map(|(shape, g)| {
                        let held: Vec<bool> = g[3]
                            .as_str()
                            .expect("blocks")
                            .bytes()
                            .map(|b| b != b'0')
                            .collect();
                        let view = StoreView {
                            next_stored_chunk: g[0].as_u64().expect("next") as usize,
                            storable_chunks: g[1].as_u64().expect("storable") as usize,
                            prompt_chunks: g[2].as_u64().expect("prompt chunks") as usize,
                            held: &held,
                        };
                        let all = view.storable_chunks.saturating_sub(view.next_stored_chunk);
                        let chunks = store_candidates(shape, &policy, &req, &view);
                        if shape.window_tokens().is_some() && chunks.len() < all {
                            masked += 1;
                        }
                        chunks
                    })
                    .collect();
                // vLLM asks the tier only when some group offers a chunk.
                let want: Vec<Vec<usize>> = match offers.iter().find(|o| o[0].as_str() == Some(rid))
                {
                    Some(o) => o[1]
                        .as_array()
                        .expect("per group")
                        .iter()
                        .map(|g| {
                            g.as_array()
                                .expect("chunks")
                                .iter()
                                .map(|c| c.as_u64().expect("a chunk") as usize)
                                .collect()
                        })
                        .collect(),
                    None => vec![Vec::new(); groups.len()],
                };
                assert_eq!(got, want, "{} step {n}: {input:?}", name(&path));
                planned += 1;
                offered += usize::from(want.iter().any(|g| !g.is_empty()));
            }
        }
    }
    eprintln!("{planned} stores planned, {offered} offered, {masked} masked");
    assert!(
        !committed() || (planned >= 2000 && offered >= 500 && masked >= 200),
        "{planned} stores planned, {offered} offered, {masked} masked"
    );
}
