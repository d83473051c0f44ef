//! The executor's configuration: one struct, every field a flag and a `FERRY_…` environment
//! variable, checked once at start-up.

use clap::{Args, ValueEnum};

use ferry_proto::v1;

/// The GPU weights' element type (`--dtype`, vLLM's values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum WeightDtype {
    /// bfloat16 for Gemma, float16 otherwise.
    Auto,
    /// IEEE half precision.
    #[value(alias = "half")]
    Float16,
    /// bfloat16: float32's range, 8 bits of precision.
    Bfloat16,
    /// 32-bit floats: the dequantized values exactly.
    #[value(alias = "float")]
    Float32,
}

/// Which engine runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// candle on the CPU with the quantized GGUF model.
    Cpu,
    /// The real model on an NVIDIA GPU through cudarc (needs a build with the `cuda` feature,
    /// and the NVIDIA driver, cuBLAS and NVRTC at run time).
    Cuda,
    /// The roofline timing simulator with deterministic tokens.
    Sim,
}

impl From<BackendKind> for v1::Backend {
    fn from(kind: BackendKind) -> Self {
        match kind {
            BackendKind::Cpu => v1::Backend::Cpu,
            BackendKind::Cuda => v1::Backend::Cuda,
            BackendKind::Sim => v1::Backend::Sim,
        }
    }
}

/// What the executor does in a disaggregated deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Role {
    /// Prefill and decode.
    Both,
    /// Prefill only; finished prompts export their KV.
    Prefill,
    /// Decode only; requests arrive with imported KV.
    Decode,
}

impl From<Role> for v1::ExecutorRole {
    fn from(role: Role) -> Self {
        match role {
            Role::Both => v1::ExecutorRole::Both,
            Role::Prefill => v1::ExecutorRole::Prefill,
            Role::Decode => v1::ExecutorRole::Decode,
        }
    }
}

/// Everything an executor needs to start.
#[derive(Clone, Debug, Args)]
pub struct ExecutorConfig {
    /// GGUF model file; the default model (obtained when missing) if absent. Architectures
    /// `llama`, `qwen2`, `qwen3`, `phi3`, `gemma2` and `gemma3`; tokenizers byte-level BPE and
    /// SentencePiece;
    /// matrices `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`, `Q4_K`,
    /// `Q5_K`, `Q6_K`, `F16`, `BF16`, `F32` (anything else is refused at start-up, named).
    #[arg(long, env = "FERRY_MODEL")]
    pub model: Option<std::path::PathBuf>,
    /// Stable id of this executor in the cluster.
    #[arg(long, env = "FERRY_EXECUTOR_ID", default_value = "executor-0")]
    pub executor_id: String,
    /// The scheduler pool (shard) that drives this executor: its sessions open only for that
    /// pool's leader. Without it, the shards that are up share the unlabelled executors
    /// (`ferry_sched_core::shards`).
    #[arg(long, env = "FERRY_POOL")]
    pub pool: Option<String>,
    /// Engine that runs the model.
    #[arg(long, env = "FERRY_BACKEND", value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Prefill, decode or both.
    #[arg(long, env = "FERRY_ROLE", value_enum, default_value_t = Role::Both)]
    pub role: Role,
    /// The KV cache's size: block size, memory, element type.
    #[command(flatten)]
    pub kv_cache: KvCacheArgs,
    /// With `--backend cuda`: the fraction of the GPU's memory this executor may use (vLLM's
    /// flag), from 0 to 1; the KV cache takes what is left of it once the weights are on the
    /// device (as the driver counts memory in use, other processes' included), less room for
    /// the activations of a step of 8,192 tokens. In place of `--kv-cache-mib`.
    #[arg(long, env = "FERRY_GPU_MEMORY_UTILIZATION", conflicts_with = "kv_cache_mib")]
    pub gpu_memory_utilization: Option<f64>,
    /// GPU to run on with `--backend cuda`, as the driver numbers them (0 first).
    #[arg(long, env = "FERRY_CUDA_DEVICE", default_value_t = 0)]
    pub cuda_device: usize,
    /// With `--backend cuda`: the weights' type on the GPU (vLLM's flag). `auto` is bfloat16
    /// for Gemma (whose activations can pass f16's range) and float16 otherwise: half the
    /// memory and bandwidth of float32, products on tensor cores with f32 accumulation.
    /// `float32` keeps the dequantized weights exactly (the exactness tests' setting).
    #[arg(long, env = "FERRY_DTYPE", value_enum, default_value_t = WeightDtype::Auto)]
    pub dtype: WeightDtype,
    /// This node's KV agent (`host:port`): KV exports and imports go through it. Without one,
    /// the executor refuses steps with KV operations.
    #[arg(long = "kv-agent", env = "FERRY_KV_AGENT")]
    pub kv_agent: Option<String>,
    /// Shared memory with the KV agent: a staging region of up to this many MiB (reserved as
    /// used) that exports and imports copy blocks through, so their bytes skip the agent's
    /// socket. 0: none. A transfer that finds no room takes the socket.
    #[arg(long, env = "FERRY_KV_STAGING_MIB", default_value_t = 256)]
    pub kv_staging_mib: u64,
    /// Without etcd: the token a scheduler must present to open a session (`ferry-executor
    /// --leadership-token-file`, or the one `ferry serve` shares with its parts).
    #[arg(skip)]
    pub leadership_token: Option<std::sync::Arc<[u8]>>,
    /// Directory of the staging region: a tmpfs that the agent shares (its `--shm-dir`).
    #[arg(long, env = "FERRY_KV_SHM_DIR", default_value = ferry_kv_wire::shm::DEFAULT_DIR)]
    pub kv_shm_dir: std::path::PathBuf,
    /// With `--backend sim`: the model whose step times and KV capacity are simulated, a model
    /// profile of `ferry-sim` (`ferry-sim --list-profiles`). No model file is read: the executor
    /// serves the model its scheduler tokenizes for (the handshake names its fingerprint,
    /// vocabulary and end tokens), and `--kv-cache-mib` gives way to the profile's capacity.
    #[arg(long, env = "FERRY_MODEL_PROFILE")]
    pub model_profile: Option<String>,
    /// With `--backend sim`: the simulated GPU (a hardware profile of `ferry-sim`).
    #[arg(long, env = "FERRY_HARDWARE", default_value = "h100")]
    pub hardware: String,
    /// With `--model-profile`: GPUs per executor (the model profile's default if absent).
    #[arg(long, env = "FERRY_TENSOR_PARALLEL")]
    pub tensor_parallel: Option<u32>,
    /// With `--backend sim`: wall-clock seconds per simulated second (0.1 runs ten times faster
    /// than the simulated GPU would).
    #[arg(long, env = "FERRY_TIME_SCALE", default_value_t = 1.0)]
    pub time_scale: f64,
    /// With `--model-profile`: more profiles (as `ferry-sim --profile-dir`).
    #[arg(long, env = "FERRY_PROFILE_DIR")]
    pub profile_dir: Option<std::path::PathBuf>,
    /// Most requests held at once (running and preempted); a step that would add more has the
    /// extra new requests refused (each alone). The handshake states it, and a scheduler keeps
    /// each executor's requests within it.
    #[arg(long, env = "FERRY_MAX_LIVE_REQUESTS", default_value_t = DEFAULT_MAX_LIVE_REQUESTS)]
    pub max_live_requests: u32,
    /// Largest `Step` message decoded, in bytes (gRPC's limit on the session stream); the
    /// handshake states it, and a scheduler whose largest possible step exceeds it refuses the
    /// session with the figures.
    #[arg(long, env = "FERRY_MAX_STEP_BYTES", default_value_t = DEFAULT_MAX_STEP_BYTES)]
    pub max_step_bytes: u64,
    /// Its data-parallel group, if any, and the step trace.
    #[command(flatten)]
    pub data_parallel: crate::data_parallel::DataParallelArgs,
    /// Whether it serves its model looped.
    #[command(flatten)]
    pub looped: crate::engine::looped::LoopedArgs,
    /// How many LoRA adapters it holds, and their largest rank.
    #[command(flatten)]
    pub lora: crate::engine::lora::LoraArgs,
}

/// Default `--max-live-requests`.
pub const DEFAULT_MAX_LIVE_REQUESTS: u32 = 4096;
/// Default `--max-step-bytes`: 256 MiB, room for 256 new requests of 128k tokens in one step.
pub const DEFAULT_MAX_STEP_BYTES: u64 = 256 << 20;
/// Least `--max-step-bytes`: 64 KiB.
pub const MIN_MAX_STEP_BYTES: u64 = 64 << 10;

/// Largest block size accepted: vLLM's largest is 256 tokens.
pub const MAX_BLOCK_SIZE: u32 = 256;

/// The KV cache's size, as an executor's flags give it: every program that sizes a CPU KV
/// cache (the executor, `ferry serve`'s embedded executors, `ferry-bench`'s in-process runs)
/// takes these flags and sizes it with [`KvCacheArgs::num_blocks`], the one block sizing.
#[derive(Clone, Debug, Args)]
pub struct KvCacheArgs {
    /// Tokens per KV block.
    #[arg(long, env = "FERRY_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// Memory for the KV cache, in MiB; the number of blocks follows from it.
    #[arg(long, env = "FERRY_KV_CACHE_MIB", default_value_t = 512)]
    pub kv_cache_mib: u64,
    /// Element type of the KV cache: `f16` (half the memory per token, so twice the tokens in
    /// `--kv-cache-mib`; the default of the CPU and CUDA backends, as llama.cpp's) or `f32`.
    #[arg(long, env = "FERRY_KV_CACHE_DTYPE")]
    pub kv_cache_dtype: Option<crate::forward::KvDtype>,
}

impl KvCacheArgs {
    /// The KV cache's element type on `backend`: as asked, else f16 on the CPU and the GPU
    /// and f32 in the simulator.
    pub fn dtype(&self, backend: BackendKind) -> crate::forward::KvDtype {
        use crate::forward::KvDtype;
        self.kv_cache_dtype.unwrap_or(if backend == BackendKind::Sim {
            KvDtype::F32
        } else {
            KvDtype::F16
        })
    }

    /// How many blocks of `--block-size` tokens of a model of `shape` fit in `--kv-cache-mib`
    /// with elements of `dtype`; an error naming the flags when not even one does.
    pub fn num_blocks(
        &self,
        shape: &ferry_model::LlamaShape,
        dtype: crate::forward::KvDtype,
    ) -> Result<usize, ConfigError> {
        use crate::forward::PagedKvCache;
        let block_size = self.block_size as usize;
        let budget = self.kv_cache_mib * 1024 * 1024;
        match PagedKvCache::blocks_for_budget(shape, dtype, block_size, budget) {
            0 => Err(ConfigError::NoBlock {
                mib: self.kv_cache_mib,
                block_size,
                bytes_per_token: PagedKvCache::bytes_per_token(shape, dtype),
            }),
            blocks => Ok(blocks),
        }
    }
}

impl ExecutorConfig {
    /// The KV cache's element type: as asked, else f16 on the CPU and the GPU, f32 in the
    /// simulator.
    pub fn kv_dtype(&self) -> crate::forward::KvDtype {
        self.kv_cache.dtype(self.backend)
    }

    /// Checks the values that clap's types cannot, with a message that names the limit, and
    /// that this build can run them (start-up: [`Self::validate_flags`], then
    /// [`Self::check_build`]).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_flags()?;
        self.check_build()
    }

    /// Whether this build can run the configuration: `--backend cuda` needs the `cuda`
    /// feature. Checked before the model is loaded, not after.
    pub fn check_build(&self) -> Result<(), ConfigError> {
        if self.backend == BackendKind::Cuda && !cfg!(feature = "cuda") {
            return Err(ConfigError::NoCuda);
        }
        Ok(())
    }

    /// Checks every flag's value and combination (what any build would accept; see
    /// [`Self::check_build`] for what this one can run).
    pub fn validate_flags(&self) -> Result<(), ConfigError> {
        let block_size = self.kv_cache.block_size;
        if block_size == 0 || block_size > MAX_BLOCK_SIZE || !block_size.is_power_of_two() {
            return Err(ConfigError::BlockSize(block_size));
        }
        if self.kv_cache.kv_cache_mib == 0 {
            return Err(ConfigError::KvCache);
        }
        if let Some(u) = self.gpu_memory_utilization {
            if !(u > 0.0 && u <= 1.0) {
                return Err(ConfigError::GpuMemoryUtilization(u));
            }
            if self.backend != BackendKind::Cuda {
                return Err(ConfigError::GpuMemoryUtilizationOffGpu);
            }
        }
        if self.dtype != WeightDtype::Auto && self.backend != BackendKind::Cuda {
            return Err(ConfigError::DtypeOffGpu);
        }
        if self.max_live_requests == 0 {
            return Err(ConfigError::MaxLiveRequests);
        }
        if self.max_step_bytes < MIN_MAX_STEP_BYTES || self.max_step_bytes > u64::from(u32::MAX) {
            return Err(ConfigError::MaxStepBytes(self.max_step_bytes));
        }
        if self.executor_id.trim().is_empty() {
            return Err(ConfigError::ExecutorId);
        }
        self.data_parallel.rank().map_err(ConfigError::DataParallel)?;
        if self.looped.looped_layers.is_some() && self.backend == BackendKind::Cuda {
            return Err(ConfigError::Looped(
                "--looped-layers runs on the cpu and sim backends; the cuda backend runs no \
                 looped model's stages"
                    .into(),
            ));
        }
        if let Some(pool) = &self.pool {
            let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
            if pool.is_empty() || !pool.chars().all(ok) {
                return Err(ConfigError::Pool(pool.clone()));
            }
        }
        if let Some(a) = &self.kv_agent {
            ferry_runtime::address::dial_address("kv-agent", a)
                .map_err(|_| ConfigError::KvAgent(a.clone()))?;
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(ConfigError::TimeScale(self.time_scale));
        }
        if self.backend == BackendKind::Sim {
            self.sim_hardware(&self.profiles()?, "bf16", self.tensor_parallel.unwrap_or(1))?;
        }
        if self.model_profile.is_some() {
            if self.backend != BackendKind::Sim {
                return Err(ConfigError::ProfileNeedsSim);
            }
            if self.model.is_some() {
                return Err(ConfigError::ProfileAndModel);
            }
            self.sim_profile()?;
        }
        Ok(())
    }

    /// The simulated model and GPU `--model-profile` and `--hardware` name (`None` without a
    /// model profile).
    pub fn sim_profile(
        &self,
    ) -> Result<Option<(ferry_roofline::ModelProfile, ferry_roofline::SimHardware)>, ConfigError>
    {
        let Some(name) = &self.model_profile else { return Ok(None) };
        let profiles = self.profiles()?;
        let model = profiles.model(name).map_err(profile_error)?.clone();
        model.to_sim().map_err(profile_error)?;
        let tp = self.tensor_parallel.unwrap_or(model.tensor_parallel);
        let hardware = self.sim_hardware(&profiles, model.compute_dtype(), tp)?;
        Ok(Some((model, hardware)))
    }

    /// The `--hardware` GPU computing in `dtype`, `tp` of them per executor.
    pub fn sim_hardware(
        &self,
        profiles: &ferry_roofline::Profiles,
        dtype: &str,
        tp: u32,
    ) -> Result<ferry_roofline::SimHardware, ConfigError> {
        profiles.hardware(&self.hardware).and_then(|h| h.to_sim(dtype, tp)).map_err(profile_error)
    }

    /// The built-in profiles and those of `--profile-dir`.
    pub fn profiles(&self) -> Result<ferry_roofline::Profiles, ConfigError> {
        let mut profiles = ferry_roofline::Profiles::built_in();
        if let Some(dir) = &self.profile_dir {
            profiles.add_dir(dir).map_err(profile_error)?;
        }
        Ok(profiles)
    }
}

#[allow(clippy::needless_pass_by_value)] // the shape `map_err` takes
fn profile_error(e: ferry_roofline::ProfileError) -> ConfigError {
    ConfigError::Profile(e.to_string())
}

/// A configuration value out of range.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Block size not a power of two in 1..=256.
    #[error("--block-size {0} is invalid: it must be a power of two from 1 to {MAX_BLOCK_SIZE}")]
    BlockSize(u32),
    /// `--dtype` off the GPU.
    #[error(
        "--dtype sets the weights' type on a GPU: it needs --backend cuda (the CPU backend \
         multiplies the quantized weights in f32)"
    )]
    DtypeOffGpu,
    /// No KV memory.
    #[error("--kv-cache-mib must be at least 1")]
    KvCache,
    /// The KV memory holds no block of the model.
    #[error(
        "--kv-cache-mib {mib} holds no block of {block_size} tokens ({bytes_per_token} bytes per \
         token)"
    )]
    NoBlock {
        /// `--kv-cache-mib`.
        mib: u64,
        /// `--block-size`.
        block_size: usize,
        /// What a token's keys and values take in the cache.
        bytes_per_token: usize,
    },
    /// A fraction of GPU memory outside (0, 1].
    #[error("--gpu-memory-utilization {0} is invalid: it must be above 0 and at most 1")]
    GpuMemoryUtilization(f64),
    /// A fraction of GPU memory for a backend without a GPU.
    #[error(
        "--gpu-memory-utilization sizes a GPU's KV cache: it needs --backend cuda (on the CPU, \
         give --kv-cache-mib)"
    )]
    GpuMemoryUtilizationOffGpu,
    /// The fraction of GPU memory leaves no room for a KV block.
    #[error(
        "--gpu-memory-utilization {utilization} of the GPU's {total_mib} MiB leaves no room for \
         a KV block: {used_mib} MiB are in use once the weights are loaded (this executor's and \
         any other process's) and {activations_mib} MiB are kept for a step's activations; raise \
         the fraction, free the GPU or use one with more memory"
    )]
    GpuMemory {
        /// `--gpu-memory-utilization`.
        utilization: f64,
        /// The device's memory.
        total_mib: u64,
        /// Memory in use after the weights' upload.
        used_mib: u64,
        /// Memory kept for activations.
        activations_mib: u64,
    },
    /// Empty id.
    #[error("--executor-id must not be empty")]
    ExecutorId,
    /// A data-parallel group's flags that do not fit together.
    #[error("{0}")]
    DataParallel(String),
    /// A looped model's flags that do not fit the backend or the model.
    #[error("{0}")]
    Looped(String),
    /// A pool name that cannot be an etcd key segment.
    #[error("--pool {0:?} must be non-empty and made of letters, digits, '-', '_' and '.'")]
    Pool(String),
    /// No room for a request.
    #[error("--max-live-requests must be at least 1")]
    MaxLiveRequests,
    /// A step limit too small for any step, or past gRPC's.
    #[error("--max-step-bytes {0} is invalid: it must be from {MIN_MAX_STEP_BYTES} to 4294967295")]
    MaxStepBytes(u64),
    /// A KV agent address that is not one.
    #[error("--kv-agent {0:?} is not an address (host:port)")]
    KvAgent(String),
    /// `--backend cuda` in a build without the CUDA backend.
    #[error(
        "--backend cuda: this build has no CUDA backend: rebuild with `--features cuda` \
         (cargo build -p ferry-executor-svc --features cuda)"
    )]
    NoCuda,
    /// A time scale that is not a positive number.
    #[error("--time-scale {0} is invalid: it must be a number above 0 (1: real time)")]
    TimeScale(f64),
    /// A model profile with another backend.
    #[error("--model-profile simulates a model: it needs --backend sim")]
    ProfileNeedsSim,
    /// A model profile and a model file.
    #[error("--model-profile and --model: a simulated executor reads no model file, give one")]
    ProfileAndModel,
    /// A profile that cannot be used.
    #[error("--model-profile / --hardware: {0}")]
    Profile(String),
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        executor: ExecutorConfig,
    }

    fn parse(args: &[&str]) -> ExecutorConfig {
        let argv = std::iter::once("ferry-executor").chain(args.iter().copied());
        Cli::try_parse_from(argv).expect("valid flags").executor
    }

    #[test]
    fn cuda_is_refused_at_start_up_only_in_builds_without_it() {
        let config = parse(&["--backend", "cuda", "--cuda-device", "1"]);
        assert_eq!(config.cuda_device, 1);
        let refused = matches!(config.validate(), Err(ConfigError::NoCuda));
        assert_eq!(refused, !cfg!(feature = "cuda"), "{:?}", config.validate());
        assert!(parse(&["--backend", "cpu"]).validate().is_ok());
        // Every flag is checked whatever the build: a dry run of a CUDA pool's flags in a CPU
        // build still refuses a bad one.
        let bad = parse(&["--backend", "cuda", "--time-scale=-1"]);
        assert!(matches!(bad.validate_flags(), Err(ConfigError::TimeScale(_))));
        assert!(parse(&["--backend", "cuda"]).validate_flags().is_ok());
    }

    /// The KV cache is f16 on the CPU unless asked otherwise, f32 on CUDA, which refuses f16
    /// naming the flag; an unknown dtype is a parse error naming the choices.
    #[test]
    fn the_kv_cache_dtype_defaults_per_backend_and_the_weights_dtype_is_the_gpus() {
        use crate::forward::KvDtype;
        assert_eq!(parse(&[]).kv_dtype(), KvDtype::F16);
        assert_eq!(parse(&["--kv-cache-dtype", "f32"]).kv_dtype(), KvDtype::F32);
        assert_eq!(parse(&["--backend", "cuda"]).kv_dtype(), KvDtype::F16);
        assert_eq!(parse(&["--backend", "sim"]).kv_dtype(), KvDtype::F32);
        let cuda = parse(&["--backend", "cuda", "--kv-cache-dtype", "f32", "--dtype", "half"]);
        assert_eq!((cuda.kv_dtype(), cuda.dtype), (KvDtype::F32, WeightDtype::Float16));
        cuda.validate_flags().unwrap();
        assert_eq!(parse(&["--backend", "cuda", "--dtype", "float"]).dtype, WeightDtype::Float32);
        let err = parse(&["--dtype", "bfloat16"]).validate_flags().unwrap_err().to_string();
        assert!(err.contains("it needs --backend cuda"), "{err}");
        let argv = ["ferry-executor", "--kv-cache-dtype", "int8"];
        let err = Cli::try_parse_from(argv).err().expect("no such dtype").to_string();
        assert!(err.contains("not f16 or f32"), "{err}");
    }

    /// `--gpu-memory-utilization` is CUDA's, a fraction in (0, 1], and replaces
    /// `--kv-cache-mib` (given both, clap refuses naming them).
    #[test]
    fn the_gpu_memory_fraction_is_a_fraction_on_cuda_in_place_of_kv_cache_mib() {
        let ok = parse(&["--backend", "cuda", "--gpu-memory-utilization", "0.9"]);
        assert_eq!(ok.gpu_memory_utilization, Some(0.9));
        ok.validate_flags().unwrap();
        let cases: [(&[&str], &str); 3] = [
            (&["--backend", "cuda", "--gpu-memory-utilization", "0"], "must be above 0"),
            (&["--backend", "cuda", "--gpu-memory-utilization", "1.5"], "at most 1"),
            (&["--gpu-memory-utilization", "0.9"], "it needs --backend cuda"),
        ];
        for (args, want) in cases {
            let err = parse(args).validate_flags().unwrap_err().to_string();
            assert!(err.contains(want), "{args:?}: {err}");
        }
        let argv =
            ["x", "--backend", "cuda", "--gpu-memory-utilization", "0.9", "--kv-cache-mib", "9"];
        let err = Cli::try_parse_from(argv).err().expect("one or the other").to_string();
        assert!(err.contains("--kv-cache-mib"), "{err}");
    }

    #[test]
    fn limits_out_of_range_are_refused_naming_the_flag() {
        let cases: [(&[&str], &str); 3] = [
            (&["--max-live-requests", "0"], "--max-live-requests must be at least 1"),
            (&["--max-step-bytes", "1000"], "--max-step-bytes 1000 is invalid"),
            (&["--max-step-bytes", "5000000000"], "--max-step-bytes 5000000000 is invalid"),
        ];
        for (args, want) in cases {
            let err = parse(args).validate_flags().unwrap_err().to_string();
            assert!(err.contains(want), "{args:?}: {err}");
        }
        let ok = parse(&["--max-live-requests", "8", "--max-step-bytes", "65536"]);
        assert!(ok.validate_flags().is_ok());
    }

    #[test]
    fn a_model_profile_needs_the_sim_backend_no_model_file_and_known_profiles() {
        let ok =
            parse(&["--backend", "sim", "--model-profile", "llama-3-70b", "--time-scale", "0.1"]);
        ok.validate().unwrap();
        let (model, hw) = ok.sim_profile().unwrap().unwrap();
        assert_eq!((model.name.as_str(), hw.tensor_parallel), ("llama-3-70b", 4));
        let cases: [(&[&str], &str); 6] = [
            (&["--backend", "sim", "--hardware", "tpu"], "no hardware profile \"tpu\""),
            (&["--model-profile", "llama-3-8b"], "needs --backend sim"),
            (
                &["--backend", "sim", "--model-profile", "llama-3-8b", "--model", "x.gguf"],
                "reads no model file",
            ),
            (&["--backend", "sim", "--model-profile", "gpt-9"], "no model profile \"gpt-9\""),
            (
                &["--backend", "sim", "--model-profile", "llama-3-8b", "--hardware", "tpu"],
                "no hardware profile",
            ),
            (&["--backend", "sim", "--time-scale", "0"], "--time-scale 0 is invalid"),
        ];
        for (args, want) in cases {
            let err = parse(args).validate().unwrap_err().to_string();
            assert!(err.contains(want), "{args:?}: {err}");
        }
    }
}
