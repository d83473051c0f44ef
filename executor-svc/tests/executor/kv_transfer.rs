//! KV operations on the real model, through two real KV agents: a prompt computed on one
//! engine is exported, imported into another engine's blocks, and the second engine decodes
//! from it exactly as the first would have; a failed import writes nothing and says why; steps
//! with bad KV operations are refused whole. The moved-KV test runs on CPU engines and on CUDA
//! engines (under the CPU emulation of CUDA in CI: `engine::cuda::emulation`).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ferry_executor_svc::engine::kv::KvPort;
use ferry_executor_svc::engine::{CpuBackend, Engine, EngineConfig, ModelBackend};
use ferry_executor_svc::forward::LoadedModel;
use ferry_model::ModelFile;
use ferry_proto::v1::{self, kv_operation::Op};
use ferry_runtime::clock::unix_deadline;

const BS: u32 = 4;
const BLOCKS: u32 = 64;

fn model() -> &'static Arc<ModelFile> {
    static M: OnceLock<Arc<ModelFile>> = OnceLock::new();
    M.get_or_init(|| Arc::new(ModelFile::open(None).expect("the default model")))
}

fn layout() -> v1::KvLayout {
    let s = model().shape;
    v1::KvLayout {
        num_layers: s.num_layers as u32,
        block_size: BS,
        num_kv_heads: s.num_kv_heads as u32,
        head_dim: s.head_dim as u32,
        dtype: v1::KvDtype::F32.into(),
        model_fingerprint: model().fingerprint.clone(),
    }
}

/// Which backend an engine under test runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda,
}

fn engine(agent: Option<&str>, backend: Backend) -> Engine {
    let weights = LoadedModel::load(model().clone()).unwrap().weights;
    let port = agent.map(|a| KvPort {
        agent: a.to_string(),
        runtime: tokio::runtime::Handle::current(),
        layout: layout(),
        staging: None,
    });
    let (bs, blocks) = (BS as usize, BLOCKS as usize);
    let backend: Box<dyn ModelBackend> = match backend {
        Backend::Cpu => Box::new(CpuBackend::new(weights, bs, blocks)),
        #[cfg(feature = "cuda")]
        Backend::Cuda => Box::new(
            ferry_executor_svc::engine::CudaBackend::new(&weights, bs, blocks, 0)
                .expect("the CUDA backend"),
        ),
    };
    Engine::new(backend, EngineConfig::new(model().tokenizer.eos_token_id)).with_kv(port)
}

async fn agent(node: &str) -> String {
    let (listener, addr) = ferry_runtime::grpc::bind("127.0.0.1:0").await.unwrap();
    let config = ferry_kv_transfer_svc::KvAgentConfig {
        node_id: node.into(),
        store_mib: 64,
        shm_dir: ferry_kv_wire::shm::DEFAULT_DIR.into(),
    };
    tokio::spawn(ferry_kv_transfer_svc::run(
        config,
        None,
        listener.into(),
        Box::pin(std::future::pending()),
        Duration::from_secs(5),
    ));
    addr.to_string()
}

/// An engine under test: it numbers the steps and keeps every KV result it reports (a
/// transfer may end, and be reported, in any later step — even the next one).
struct Exec {
    engine: Engine,
    last_step: u64,
    reported: Vec<v1::KvOperationResult>,
}

impl Exec {
    fn new(agent: Option<&str>) -> Self {
        Self::on(agent, Backend::Cpu)
    }

    fn on(agent: Option<&str>, backend: Backend) -> Self {
        Self { engine: engine(agent, backend), last_step: 0, reported: Vec::new() }
    }

    /// Runs `step` (numbered here), telling the runtime this thread blocks while it runs.
    fn step(&mut self, mut step: v1::Step) -> Result<v1::StepResult, String> {
        self.last_step += 1;
        step.step_id = self.last_step;
        let result = tokio::task::block_in_place(|| self.engine.execute(&step))
            .map_err(|e| e.to_string())?;
        self.reported.extend(result.kv_results.iter().cloned());
        Ok(result)
    }

    /// A step with only `ops`.
    fn kv(&mut self, ops: Vec<v1::KvOperation>) -> Result<v1::StepResult, String> {
        self.step(v1::Step { kv_ops: ops, ..Default::default() })
    }

    /// Sends empty steps until the KV operation `tid` has been reported; its result.
    async fn until_reported(&mut self, tid: &str) -> v1::KvOperationResult {
        for _ in 0..1000 {
            if let Some(done) = self.reported.iter().find(|k| k.transfer_id == tid) {
                return done.clone();
            }
            self.step(v1::Step::default()).unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "KV operation {tid} was never reported ({} in progress)",
            self.engine.kv_in_progress()
        );
    }
}

fn prompt_step(
    id: u64,
    prompt: &[u32],
    output: &[u32],
    blocks: &[u32],
    computed: usize,
) -> v1::Step {
    let n = prompt.len() + output.len() - computed;
    v1::Step {
        new_requests: vec![v1::NewRequest {
            id,
            prompt_token_ids: prompt.to_vec(),
            output_token_ids: output.to_vec(),
            block_ids: blocks.to_vec(),
            num_computed_tokens: computed as u32,
            ..Default::default()
        }],
        work: vec![v1::ScheduledWork {
            id,
            key: v1::WorkKey::PromptChunk.into(),
            num_tokens: n as u32,
            draft_token_ids: vec![],
            loop_index: 0,
        }],
        total_num_tokens: n as u32,
        ..Default::default()
    }
}

fn decode_step(id: u64, new_block: Option<u32>) -> v1::Step {
    v1::Step {
        cached_requests: new_block
            .map(|b| v1::CachedRequestUpdate { id, new_block_ids: vec![b], ..Default::default() })
            .into_iter()
            .collect(),
        work: vec![v1::ScheduledWork {
            id,
            key: v1::WorkKey::Decode.into(),
            num_tokens: 1,
            draft_token_ids: vec![],
            loop_index: 0,
        }],
        total_num_tokens: 1,
        ..Default::default()
    }
}

fn token(result: &v1::StepResult) -> u32 {
    result.outputs[0].token_ids[0]
}

fn hashes(n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| 0xabc0 + i).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_computed_on_one_engine_decodes_on_another_from_its_moved_kv() {
    moved_kv_decodes_as_computed(Backend::Cpu).await;
}

#[cfg(feature = "cuda")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_cuda_a_prompt_computed_on_one_engine_decodes_on_another_from_its_moved_kv() {
    use ferry_executor_svc::engine::cuda_emulation::{device_for_tests, Emulation};
    if !device_for_tests() {
        return;
    }
    let before = Emulation::stats();
    moved_kv_decodes_as_computed(Backend::Cuda).await;
    // Under the emulation: both engines computed on the (emulated) device.
    if let (Some(before), Some(after)) = (before, Emulation::stats()) {
        assert!(after.gemms > before.gemms && after.launches > before.launches);
    }
}

/// P computes a prompt and exports its full blocks through its agent to D's, which imports them
/// into blocks of its own; D then computes the rest and decodes the same tokens as P.
async fn moved_kv_decodes_as_computed(backend: Backend) {
    let (a, b) = (agent("node-p").await, agent("node-d").await);
    let mut p = Exec::on(Some(&a), backend);
    let mut d = Exec::on(Some(&b), backend);
    let prompt = model()
        .tokenizer
        .encode("The capital of France is Paris, and the capital of Italy is")
        .unwrap();
    assert!(prompt.len() > 8, "at least two full blocks");
    // Full blocks only, leaving at least one token to compute on D.
    let full = (prompt.len() - 1) / BS as usize;
    // P computes the prompt and samples the first token.
    let p_blocks: Vec<u32> = (0..=(prompt.len().div_ceil(BS as usize) as u32)).collect();
    let first = token(&p.step(prompt_step(7, &prompt, &[], &p_blocks, 0)).unwrap());
    // Its full blocks go to D's agent, while D is already waiting for them in blocks of its
    // own, scattered.
    let d_blocks: Vec<u32> = (0..full as u32).map(|i| 40 - 3 * i).collect();
    let import = v1::KvOperation {
        transfer_id: "t-7".into(),
        deadline_unix_ms: unix_deadline(Duration::from_secs(30)),
        traceparent: String::new(),
        op: Some(Op::Import(v1::KvImport {
            request_id: 7,
            block_ids: d_blocks.clone(),
            block_hashes: hashes(full),
            source_agent: String::new(),
        })),
    };
    d.kv(vec![import]).unwrap();
    let export = v1::KvOperation {
        transfer_id: "t-7".into(),
        deadline_unix_ms: unix_deadline(Duration::from_secs(30)),
        traceparent: String::new(),
        op: Some(Op::Export(v1::KvExport {
            request_id: 7,
            block_ids: p_blocks[..full].to_vec(),
            block_hashes: hashes(full),
            destination_agent: b.clone(),
        })),
    };
    p.kv(vec![export]).unwrap();
    let exported = p.until_reported("t-7").await;
    assert!(exported.ok, "{exported:?}");
    let imported = d.until_reported("t-7").await;
    assert!(imported.ok, "{imported:?}");
    assert_eq!(imported.bytes, exported.bytes);
    // D computes the rest of the prompt and the first token, then both decode: same tokens.
    let mut table = d_blocks.clone();
    table.extend([50, 51]);
    let on_d = d.step(prompt_step(7, &prompt, &[first], &table, full * BS as usize)).unwrap();
    let mut d_tokens = vec![token(&on_d)];
    let mut p_tokens = vec![token(&p.step(decode_step(7, None)).unwrap())];
    let p_next = p_blocks.len() as u32 + 1;
    for i in 0..6 {
        let grow = i == 2;
        d_tokens.push(token(&d.step(decode_step(7, grow.then_some(52))).unwrap()));
        p_tokens.push(token(&p.step(decode_step(7, grow.then_some(p_next))).unwrap()));
    }
    assert_eq!(d_tokens, p_tokens, "decoding from the moved KV is decoding from the computed KV");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_stored_to_the_kv_tier_are_read_back_by_another_engine_exactly() {
    let (a, b) = (agent("node-a").await, agent("node-b").await);
    let mut first = Exec::new(Some(&a));
    let mut second = Exec::new(Some(&b));
    let prompt = model()
        .tokenizer
        .encode("Rivers of the world: the Nile, the Amazon, the Yangtze and the")
        .unwrap();
    let full = (prompt.len() - 1) / BS as usize;
    assert!(full >= 2, "at least two full blocks");
    // The first engine computes the prompt, then (its request finished) stores its full
    // blocks to its own agent; the blocks are overwritten right after, in the same step.
    let blocks: Vec<u32> = (0..=(prompt.len().div_ceil(BS as usize) as u32)).collect();
    let first_token = token(&first.step(prompt_step(3, &prompt, &[], &blocks, 0)).unwrap());
    let mut expected = vec![first_token];
    expected.push(token(&first.step(decode_step(3, None)).unwrap()));
    let store = v1::KvOperation {
        transfer_id: "tier-1".into(),
        deadline_unix_ms: unix_deadline(Duration::from_secs(30)),
        traceparent: String::new(),
        op: Some(Op::Store(v1::KvStore {
            block_ids: blocks[..full].to_vec(),
            block_hashes: hashes(full),
        })),
    };
    let mut step = prompt_step(4, &[9; 12], &[], &blocks[..3], 0);
    step.finished_ids = vec![3];
    step.kv_ops = vec![store];
    first.step(step).unwrap();
    let stored = first.until_reported("tier-1").await;
    assert!(stored.ok, "{stored:?}");
    // The second engine reads them from the first node's agent (a KV-tier read), then
    // computes the rest of the prompt and decodes: the same tokens as the first.
    let own: Vec<u32> = (0..full as u32).map(|i| 30 + 2 * i).collect();
    let read = |tid: &str, block_ids: Vec<u32>, hashes: Vec<u64>| v1::KvOperation {
        transfer_id: tid.into(),
        deadline_unix_ms: unix_deadline(Duration::from_secs(30)),
        traceparent: String::new(),
        op: Some(Op::Import(v1::KvImport {
            request_id: 5,
            block_ids,
            block_hashes: hashes,
            source_agent: a.clone(),
        })),
    };
    second.kv(vec![read("r-1", own.clone(), hashes(full))]).unwrap();
    let imported = second.until_reported("r-1").await;
    assert!(imported.ok, "{imported:?}");
    assert_eq!(imported.bytes, stored.bytes);
    let mut table = own.clone();
    table.extend([60, 61]);
    let on_second = second.step(prompt_step(5, &prompt, &[], &table, full * BS as usize));
    let mut got = vec![token(&on_second.unwrap())];
    got.push(token(&second.step(decode_step(5, None)).unwrap()));
    assert_eq!(got, expected, "the tier's blocks are the computed blocks");
    // Blocks the store does not hold: the read fails at once, saying so, and writes nothing.
    let missing: Vec<u64> = (0..full as u64).map(|i| 0xdead_0000 + i).collect();
    second.kv(vec![read("r-2", (10..10 + full as u32).collect(), missing)]).unwrap();
    let failed = second.until_reported("r-2").await;
    assert!(!failed.ok && failed.error.contains("not in this agent's store"), "{failed:?}");
    assert_eq!(failed.failure, i32::from(v1::KvFailure::NotFound), "{failed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_import_writes_nothing_and_bad_kv_operations_are_refused() {
    let b = agent("node-d").await;
    let mut d = Exec::new(Some(&b));
    // An import of a transfer that never comes: it fails at its deadline, with the reason.
    let import = |tid: &str, blocks: Vec<u32>, hashes: Vec<u64>| v1::KvOperation {
        transfer_id: tid.into(),
        deadline_unix_ms: unix_deadline(Duration::from_millis(400)),
        traceparent: String::new(),
        op: Some(Op::Import(v1::KvImport {
            request_id: 9,
            block_ids: blocks,
            block_hashes: hashes,
            source_agent: String::new(),
        })),
    };
    d.kv(vec![import("t-never", vec![3, 4], hashes(2))]).unwrap();
    let failed = d.until_reported("t-never").await;
    assert!(!failed.ok && failed.error.contains("deadline"), "{failed:?}");
    // An agent that takes the connection and never answers: the executor gives up at the
    // deadline on its own.
    let stalled = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut e = Exec::new(Some(&stalled.local_addr().unwrap().to_string()));
    let _held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = stalled.accept().await {
            held.push(conn);
        }
    });
    e.kv(vec![import("t-stalled", vec![3, 4], hashes(2))]).unwrap();
    let failed = e.until_reported("t-stalled").await;
    assert!(!failed.ok && failed.error.contains("deadline passed"), "{failed:?}");
    assert_eq!(e.engine.kv_in_progress(), 0);
    // Each refused with its request, alone, saying why; the operation is reported failed.
    d.step(prompt_step(1, &[1, 2, 3, 4, 5, 6], &[], &[0, 1], 0)).unwrap();
    d.step(prompt_step(2, &[1, 2, 3], &[], &[7], 0)).unwrap();
    let export = |tid: &str, request_id: u64, block: u32| v1::KvOperation {
        transfer_id: tid.into(),
        op: Some(Op::Export(v1::KvExport {
            request_id,
            block_ids: vec![block],
            block_hashes: hashes(1),
            destination_agent: b.clone(),
        })),
        deadline_unix_ms: unix_deadline(Duration::from_secs(30)),
        traceparent: String::new(),
    };
    let import_for = |request_id: u64, tid: &str, blocks: Vec<u32>, hashes: Vec<u64>| {
        let mut op = import(tid, blocks, hashes);
        if let Some(Op::Import(i)) = &mut op.op {
            i.request_id = request_id;
        }
        op
    };
    let cases = [
        (import_for(11, "t-a", vec![1], hashes(1)), 11, "block 1 is in use"),
        (import_for(12, "t-b", vec![999], hashes(1)), 12, "out of range"),
        (import_for(13, "t-c", vec![5, 6], hashes(1)), 13, "1 block hashes for 2 blocks"),
        (export("t-d", 42, 0), 42, "request 42 is not live"),
        (v1::KvOperation { deadline_unix_ms: 0, ..export("t-f", 2, 7) }, 2, "no deadline"),
        (export("t-e", 1, 9), 1, "block 9 is not request 1's"),
    ];
    for (op, id, needle) in cases {
        let tid = op.transfer_id.clone();
        let result = d.kv(vec![op]).unwrap();
        let refused: Vec<(u64, &str)> =
            result.refused.iter().map(|r| (r.id, r.reason.as_str())).collect();
        assert!(
            refused.len() == 1 && refused[0].0 == id && refused[0].1.contains(needle),
            "{refused:?} should refuse request {id} saying {needle:?}"
        );
        let failed = result.kv_results.iter().find(|k| k.transfer_id == tid).unwrap();
        assert!(!failed.ok && failed.error.contains(needle), "{failed:?}");
    }
    assert_eq!(d.engine.num_requests(), 0, "requests 1 and 2 were refused and forgotten");
    assert_eq!(d.engine.kv_in_progress(), 0, "nothing was started by a refused request");
    // Without an agent, any KV operation is refused.
    let err = Exec::new(None).kv(vec![import("t-x", vec![2], hashes(1))]).unwrap_err();
    assert!(err.contains("no KV agent"), "{err}");
}
