//! Ferry's executor service: it holds the model and the KV cache memory, applies each `Step`
//! the scheduler sends as a diff against its per-request state, runs the batch and streams the
//! sampled tokens back (DESIGN.md sections 4 and 5).
//!
//! The library is everything the service runs; `ferry-executor` only parses flags and calls
//! [`run`], so a test (or the all-in-one `serve`) can host an executor on a listener of its
//! choosing. Its `bench` command, which drives the forward directly, lives in the binary.

pub mod actor;
pub mod data_parallel;
pub mod engine;
pub mod engine_metrics;
pub mod executor_config;
pub mod forward;
pub mod gpu_sizing;
/// The matrix products against quantized weights (crate `ferry-kernels`).
pub use ferry_kernels as kernels;
pub mod service;

use std::sync::Arc;

use ferry_kv_wire::shm::Staging;
use ferry_runtime::GrpcHost;

pub use executor_config::{BackendKind, ExecutorConfig, Role};

/// Serves the executor's gRPC API for `model` on `listener` until `shutdown` resolves; with
/// `cluster`, registered in etcd under `/ferry/<cluster>/executors/<executor-id>` once the
/// weights are loaded and the service answers. On shutdown it drains within `drain`: health
/// says `NOT_SERVING`, the registration is withdrawn (so the scheduler moves this executor's
/// requests away), then the service stops; a session still open at the limit is cut. `model` is
/// `None` only for an executor that simulates a model profile (`--model-profile`).
pub async fn run(
    config: ExecutorConfig,
    model: Option<std::sync::Arc<ferry_model::ModelFile>>,
    cluster: Option<ferry_runtime::cluster::ClusterArgs>,
    ports: ferry_runtime::grpc::Ports,
    shutdown: ferry_runtime::Shutdown,
    drain: std::time::Duration,
) -> anyhow::Result<()> {
    let id = config.executor_id.clone();
    let pool = config.pool.clone();
    let token = config.leadership_token.clone();
    let step_bytes = usize::try_from(config.max_step_bytes).unwrap_or(usize::MAX);
    let trace = match &config.data_parallel.step_trace {
        Some(path) => Some(std::sync::Arc::new(
            data_parallel::StepTrace::open(path)
                .map_err(|e| anyhow::anyhow!("--step-trace {}: {e}", path.display()))?,
        )),
        None => None,
    };
    let built = tokio::task::spawn_blocking(move || match model {
        Some(model) => build(&config, model),
        None => build_simulated(&config),
    })
    .await??;
    let metrics = std::sync::Arc::new(engine_metrics::ExecutorMetrics {
        model_name: built.info.model.clone(),
        executor_id: id.clone(),
        num_blocks: built.info.num_blocks,
        engine: built.engine.clone(),
    });
    let service = service::ExecutorService::new(built.info, built.engine, built.identity)
        .with_leadership(cluster.clone(), token)
        .in_pool(pool.clone())
        .with_step_trace(trace);
    let host = GrpcHost::new()
        .callers(ferry_runtime::tls::EXECUTOR_CALLERS)
        .add_service(
            ferry_proto::v1::executor_server::ExecutorServer::new(service)
                .max_decoding_message_size(step_bytes),
        )
        .with_metrics(metrics);
    let kind = ferry_runtime::cluster::MemberKind::Executor;
    let member = (cluster.as_ref(), kind, id.as_str(), pool.as_deref());
    ferry_runtime::cluster::serve_registered(host, ports, member, shutdown, drain).await?;
    Ok(())
}

/// An engine on its thread and the facts the handshake states.
pub struct BuiltExecutor {
    /// Handle to the engine thread.
    pub engine: actor::EngineHandle,
    /// The model served, for an executor that serves its scheduler's (a simulated profile).
    pub identity: Option<std::sync::Arc<engine::simulated_gpu::SimIdentity>>,
    /// What the handshake answers.
    pub info: ferry_proto::v1::ExecutorInfo,
}

/// Loads `model`'s weights and starts the engine thread (blocking: call it off the async
/// runtime).
pub fn build(
    config: &ExecutorConfig,
    model: std::sync::Arc<ferry_model::ModelFile>,
) -> anyhow::Result<BuiltExecutor> {
    use ferry_proto::v1;
    let model = forward::LoadedModel::load(model)?;
    let shape = model.weights.shape;
    let block_size = config.kv_cache.block_size as usize;
    let dtype = config.kv_dtype();
    // A GPU fraction is turned into blocks on the device, once the weights are there (only a
    // CUDA executor takes one: `ExecutorConfig::validate_flags`).
    let blocks = match config.gpu_memory_utilization {
        Some(fraction) => gpu_sizing::KvBlocks::GpuFraction(fraction),
        None => gpu_sizing::KvBlocks::Count(config.kv_cache.num_blocks(&shape, dtype)?),
    };
    let num_blocks = match blocks {
        gpu_sizing::KvBlocks::Count(n) => n,
        gpu_sizing::KvBlocks::GpuFraction(_) => 0,
    };
    let eos = model.file.tokenizer.eog_token_ids.clone();
    let kv_layout = v1::KvLayout {
        num_layers: shape.num_layers as u32,
        block_size: config.kv_cache.block_size,
        num_kv_heads: shape.num_kv_heads as u32,
        head_dim: shape.head_dim as u32,
        dtype: dtype.proto().into(),
        model_fingerprint: model.file.fingerprint.clone(),
    };
    // The CPU backend keeps its KV pool in the region it shares with its agent, so that an
    // export's blocks leave from where they are, without a copy on the engine thread.
    let pool_blocks = if config.backend == BackendKind::Cpu { num_blocks as u32 } else { 0 };
    // Backends that produce logits can mask them for structured outputs; the simulator cannot.
    let grammars = (config.backend != BackendKind::Sim).then(|| model.file.clone());
    let (staging, pool) = engine::kv::staging(config, &kv_layout, pool_blocks).unzip();
    let backend: Box<dyn engine::ModelBackend> = match config.backend {
        BackendKind::Cpu => match pool.flatten() {
            Some(pool) => Box::new(engine::CpuBackend::in_pool(
                model.weights,
                dtype,
                block_size,
                num_blocks,
                pool,
            )),
            None => Box::new(engine::CpuBackend::with_dtype(
                model.weights,
                dtype,
                block_size,
                num_blocks,
            )),
        },
        BackendKind::Sim => {
            let sim_model = engine::simulated_gpu::SimModel::llama(
                shape.num_layers as u32,
                shape.hidden as u32,
                shape.intermediate as u32,
                shape.num_heads as u32,
                shape.num_kv_heads as u32,
                shape.vocab_size as u32,
                2.0,
            );
            let tp = config.tensor_parallel.unwrap_or(1);
            let hardware = config.sim_hardware(&config.profiles()?, "bf16", tp)?;
            let backend = engine::SimBackend::new(
                shape,
                sim_model,
                hardware,
                block_size,
                num_blocks,
                engine::simulated_gpu::SimClock::RealTime,
            );
            Box::new(backend.with_time_scale(config.time_scale))
        }
        BackendKind::Cuda => cuda_backend(&model.weights, block_size, blocks, config)?,
    };
    let num_blocks = backend.facts().num_blocks;
    let serves = Serves {
        model: model.file.name.clone(),
        num_layers: shape.num_layers,
        fingerprint: model.file.fingerprint.clone(),
        max_model_len: shape.max_model_len as u32,
        vocab_size: shape.vocab_size as u32,
        eos,
        grammars,
    };
    assemble(config, backend, (num_blocks as u32, kv_layout, staging), serves, None)
}

/// What an executor tells its scheduler of the model it serves.
struct Serves {
    model: String,
    /// The model's layers (a looped model's split names them).
    num_layers: usize,
    fingerprint: String,
    max_model_len: u32,
    vocab_size: u32,
    /// The tokens that end a generation, the EOS first (none for a simulated executor before
    /// its handshake).
    eos: Vec<u32>,
    grammars: engine::grammar::GrammarSource,
}

/// Starts the engine thread on `backend` with its KV port and states what the handshake says.
fn assemble(
    config: &ExecutorConfig,
    backend: Box<dyn engine::ModelBackend>,
    (num_blocks, kv_layout, staging): (u32, ferry_proto::v1::KvLayout, Option<Arc<Staging>>),
    serves: Serves,
    identity: Option<std::sync::Arc<engine::simulated_gpu::SimIdentity>>,
) -> anyhow::Result<BuiltExecutor> {
    use ferry_proto::v1;
    let kv_port = kv_port(config, &kv_layout, staging)?;
    // An executor without an end token (a simulated one before its handshake) never avoids one.
    let eos_token_id = serves.eos.first().copied().unwrap_or(u32::MAX);
    let looped = config.looped.shape(serves.num_layers).map_err(anyhow::Error::msg)?;
    let engine_config = engine::EngineConfig {
        eos_token_id,
        max_live_requests: config.max_live_requests as usize,
        looped,
    };
    let mut engine = engine::Engine::new(backend, engine_config).with_grammars(serves.grammars);
    // Relative adapter paths are in the model's folder.
    let dir = match &config.model {
        Some(model) => model.parent().map(std::path::Path::to_path_buf),
        None => Some(ferry_model::model_dir()),
    };
    let shape = engine.backend().facts().shape;
    engine = engine.with_adapters(engine::lora::Adapters::new(config.lora, shape, dir));
    let engine = actor::EngineHandle::spawn(engine.with_kv(kv_port))?;
    let info = v1::ExecutorInfo {
        executor_id: config.executor_id.clone(),
        model: serves.model,
        model_fingerprint: serves.fingerprint,
        block_size: config.kv_cache.block_size,
        num_blocks,
        max_model_len: serves.max_model_len,
        vocab_size: serves.vocab_size,
        eos_token_ids: serves.eos,
        role: v1::ExecutorRole::from(config.role).into(),
        backend: v1::Backend::from(config.backend).into(),
        kv_layout: Some(kv_layout),
        kv_agent_address: config.kv_agent.clone().unwrap_or_default(),
        max_live_requests: config.max_live_requests,
        max_step_bytes: config.max_step_bytes,
        data_parallel: config.data_parallel.rank().map_err(anyhow::Error::msg)?,
        looped: looped.map(|l| l.proto()),
        max_loras: config.lora.max_loras,
    };
    Ok(BuiltExecutor { engine, identity, info })
}

/// An executor that simulates `--model-profile` on `--hardware` with no model file: step
/// times from the roofline over each batch, KV capacity from the GPU's memory, deterministic
/// tokens of the model its scheduler serves (each handshake names it).
pub fn build_simulated(config: &ExecutorConfig) -> anyhow::Result<BuiltExecutor> {
    use engine::simulated_gpu::{activation_bytes, kv_capacity_blocks, SimIdentity};
    use ferry_proto::v1;
    let (profile, hardware) =
        config.sim_profile()?.ok_or_else(|| anyhow::anyhow!("no --model-profile to simulate"))?;
    let sim_model = profile.to_sim()?;
    let usize_of = |v: u32| v as usize;
    let shape = ferry_model::LlamaShape {
        family: ferry_model::Family::LLAMA,
        num_layers: usize_of(profile.num_layers),
        hidden: usize_of(profile.hidden),
        intermediate: usize_of(profile.intermediate),
        num_heads: usize_of(profile.num_heads),
        num_kv_heads: usize_of(profile.num_kv_heads),
        head_dim: usize_of(profile.head_dim),
        vocab_size: usize_of(profile.vocab_size),
        rope_theta: 500_000.0,
        rope_scale: 1.0,
        rope_dims: usize_of(profile.head_dim),
        rope_mscale: 1.0,
        rope_long: false,
        rms_eps: 1e-5,
        max_model_len: SIMULATED_MAX_MODEL_LEN,
        sliding_window: None,
        query_scale: 1.0 / (profile.head_dim as f32).sqrt(),
        attn_softcap: None,
        final_softcap: None,
    };
    // vLLM's default batch limits size the activation workspace.
    let activations = activation_bytes(&sim_model, hardware.tensor_parallel, 8192, 256);
    let blocks =
        kv_capacity_blocks(&hardware, &sim_model, config.kv_cache.block_size, 0.9, activations);
    let num_blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
    if num_blocks == 0 {
        anyhow::bail!(
            "{} does not fit {} {} GPU(s) with room for a KV block: raise --tensor-parallel",
            profile.name,
            hardware.tensor_parallel,
            config.hardware
        );
    }
    let identity = std::sync::Arc::new(SimIdentity::new(profile.vocab_size));
    let backend = engine::SimBackend::new(
        shape,
        sim_model,
        hardware,
        config.kv_cache.block_size as usize,
        num_blocks as usize,
        engine::simulated_gpu::SimClock::RealTime,
    )
    .with_time_scale(config.time_scale)
    .with_identity(identity.clone());
    let kv_dtype =
        if sim_model.kv_bytes_per_elem == 2 { v1::KvDtype::Bf16 } else { v1::KvDtype::F32 };
    let fingerprint = format!("sim:{}", profile.name);
    let kv_layout = v1::KvLayout {
        num_layers: profile.num_layers,
        block_size: config.kv_cache.block_size,
        num_kv_heads: profile.num_kv_heads,
        head_dim: profile.head_dim,
        dtype: kv_dtype.into(),
        model_fingerprint: fingerprint.clone(),
    };
    let serves = Serves {
        model: profile.name.clone(),
        num_layers: profile.num_layers as usize,
        fingerprint,
        max_model_len: SIMULATED_MAX_MODEL_LEN as u32,
        vocab_size: profile.vocab_size,
        eos: Vec::new(),
        grammars: None,
    };
    let staging = engine::kv::staging(config, &kv_layout, 0).map(|(region, _)| region);
    let kv = (num_blocks, kv_layout, staging);
    assemble(config, Box::new(backend), kv, serves, Some(identity))
}

/// Where `--kv-agent` sends the KV operations of blocks of `layout`, if anywhere.
fn kv_port(
    config: &ExecutorConfig,
    layout: &ferry_proto::v1::KvLayout,
    staging: Option<Arc<Staging>>,
) -> anyhow::Result<Option<engine::kv::KvPort>> {
    let Some(agent) = &config.kv_agent else { return Ok(None) };
    Ok(Some(engine::kv::KvPort {
        agent: agent.clone(),
        runtime: tokio::runtime::Handle::try_current()
            .map_err(|e| anyhow::anyhow!("KV transfers need the async runtime: {e}"))?,
        layout: layout.clone(),
        staging,
    }))
}

/// The longest sequence a simulated executor takes (its KV capacity may hold less).
const SIMULATED_MAX_MODEL_LEN: usize = 32_768;

/// The CUDA backend on `--cuda-device`; fails cleanly on a machine without the NVIDIA driver.
#[cfg(feature = "cuda")]
fn cuda_backend(
    weights: &forward::LlamaWeights,
    block_size: usize,
    blocks: gpu_sizing::KvBlocks,
    config: &ExecutorConfig,
) -> anyhow::Result<Box<dyn engine::ModelBackend>> {
    let precision = engine::cuda::Precision {
        weights: engine::cuda::Storage::of(config.dtype, &weights.shape.family),
        kv: config.kv_dtype(),
    };
    let backend = engine::CudaBackend::with_precision(
        weights,
        block_size,
        blocks,
        config.cuda_device,
        precision,
    )?;
    Ok(Box::new(backend))
}

/// Without the `cuda` feature there is no CUDA backend to build (`ExecutorConfig::validate`
/// already refuses `--backend cuda`; this covers callers of [`build`] that skip it).
#[cfg(not(feature = "cuda"))]
fn cuda_backend(
    _weights: &forward::LlamaWeights,
    _block_size: usize,
    _blocks: gpu_sizing::KvBlocks,
    _config: &ExecutorConfig,
) -> anyhow::Result<Box<dyn engine::ModelBackend>> {
    Err(executor_config::ConfigError::NoCuda.into())
}
