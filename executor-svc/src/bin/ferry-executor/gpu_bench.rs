//! `ferry-executor gpu-bench`: decode and prefill tokens/s of the CUDA backend on models of
//! real shapes with random weights made on the spot (`forward::synthetic`), beside the GPU's
//! memory-bandwidth roofline. What `scripts/gpu-check` runs on a GPU machine, where the model
//! files cannot travel.

#[cfg(feature = "cuda")]
use std::time::Instant;

#[cfg(feature = "cuda")]
use candle_core::quantized::GgmlDType;
#[cfg(feature = "cuda")]
use ferry_executor_svc::engine::cuda::{Precision, Storage};
#[cfg(feature = "cuda")]
use ferry_executor_svc::engine::{CudaBackend, ModelBackend};
#[cfg(feature = "cuda")]
use ferry_executor_svc::forward::paged::SeqSlice;
#[cfg(feature = "cuda")]
use ferry_executor_svc::forward::synthetic::synthesize;
use ferry_executor_svc::forward::synthetic::SyntheticShape;
#[cfg(feature = "cuda")]
use ferry_executor_svc::forward::KvDtype;
#[cfg(feature = "cuda")]
use ferry_executor_svc::gpu_sizing::KvBlocks;

/// What to measure.
#[derive(Debug, Clone, clap::Args)]
pub struct GpuBenchOptions {
    /// The model's shape.
    #[arg(long, value_enum, default_value = "smollm2")]
    pub shape: SyntheticShape,
    /// GGUF types to make the weights in (`f16`, `q8_0`, `q4_0`); each is uploaded as
    /// float16.
    #[arg(long, value_delimiter = ',', default_value = "f16,q8_0")]
    pub formats: Vec<String>,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    pub batches: Vec<usize>,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 16)]
    pub steps: usize,
    /// Context of each sequence before the timed decode steps.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Prefill prompt length.
    #[arg(long, default_value_t = 2048)]
    pub prefill_len: usize,
    /// Prefill repetitions (0 skips the prefill figure).
    #[arg(long, default_value_t = 3)]
    pub prefill_reps: usize,
    /// Share of the GPU's memory for the weights and the KV cache.
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
}

/// Without the CUDA backend there is nothing to measure.
#[cfg(not(feature = "cuda"))]
pub fn report(_: &GpuBenchOptions) -> anyhow::Result<()> {
    anyhow::bail!("gpu-bench: this build has no CUDA backend: rebuild with --features cuda")
}

#[cfg(feature = "cuda")]
const BLOCK: usize = 16;

#[cfg(feature = "cuda")]
fn dtype_of(name: &str) -> anyhow::Result<GgmlDType> {
    Ok(match name {
        "f16" => GgmlDType::F16,
        "q8_0" => GgmlDType::Q8_0,
        "q4_0" => GgmlDType::Q4_0,
        other => anyhow::bail!("--formats {other}: expected f16, q8_0 or q4_0"),
    })
}

/// Runs `batch` on `gpu`, failing with the batch error.
#[cfg(feature = "cuda")]
fn step(gpu: &mut CudaBackend, batch: &[SeqSlice]) -> anyhow::Result<()> {
    gpu.run(batch).map_err(|e| anyhow::anyhow!("a step failed: {e}"))?;
    Ok(())
}

/// Measures and prints every figure of `o`.
#[cfg(feature = "cuda")]
pub fn report(o: &GpuBenchOptions) -> anyhow::Result<()> {
    let shape = o.shape.shape();
    for format in &o.formats {
        let dtype = dtype_of(format)?;
        let t = Instant::now();
        let weights = synthesize(shape, dtype, 7).map_err(anyhow::Error::msg)?;
        let made = t.elapsed();
        let precision = Precision { weights: Storage::F16, kv: KvDtype::F16 };
        let fraction = KvBlocks::GpuFraction(o.gpu_memory_utilization);
        let mut gpu = CudaBackend::with_precision(&weights, BLOCK, fraction, 0, precision)?;
        drop(weights);
        let (device, bandwidth) = gpu.device_bandwidth()?;
        let weight_bytes = gpu.weight_bytes() as f64;
        let blocks = gpu.facts().num_blocks;
        let kv_per_token = (shape.num_layers * 2 * shape.kv_dim() * 2) as f64;
        println!(
            "{:?} ({} layers, width {}), {format} weights as float16 ({:.2} GB, made in {:.1} s), \
             f16 KV ({blocks} blocks of {BLOCK}) on {device}: peak memory bandwidth {:.0} GB/s",
            o.shape,
            shape.num_layers,
            shape.hidden,
            weight_bytes / 1e9,
            made.as_secs_f64(),
            bandwidth / 1e9
        );
        let vocab = shape.vocab_size as u32;
        let token = |i: usize| (i as u32 * 7919) % vocab;
        // Prefill: one prompt, the median of the repetitions.
        if o.prefill_reps > 0 {
            let need = o.prefill_len.div_ceil(BLOCK);
            anyhow::ensure!(need <= blocks, "a {}-token prompt needs {need} blocks", o.prefill_len);
            let table: Vec<u32> = (0..need as u32).collect();
            let prompt: Vec<u32> = (0..o.prefill_len).map(token).collect();
            let mut times = Vec::new();
            for _ in 0..o.prefill_reps {
                let batch = [SeqSlice::base(&prompt, 0, &table, 1)];
                let t = Instant::now();
                step(&mut gpu, &batch)?;
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            let tps = o.prefill_len as f64 / times[times.len() / 2];
            // Bandwidth bound of a prefill: the weights read once for the whole prompt.
            let roof = o.prefill_len as f64 * bandwidth / weight_bytes;
            println!(
                "  prefill {:>5} tokens: {tps:>10.0} tokens/s (bandwidth bound {roof:.0})",
                o.prefill_len
            );
        }
        for &b in &o.batches {
            let per_seq = (o.context + o.steps).div_ceil(BLOCK);
            if b * per_seq > blocks {
                println!(
                    "  decode batch {b:>4}: skipped: needs {} KV blocks, has {blocks}",
                    b * per_seq
                );
                continue;
            }
            let tables: Vec<Vec<u32>> = (0..b)
                .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
                .collect();
            let context: Vec<u32> = (0..o.context).map(token).collect();
            // Each sequence's context, in batches of up to 8,192 tokens.
            let per_batch = (8192 / o.context.max(1)).max(1);
            for chunk in tables.chunks(per_batch) {
                let batch: Vec<SeqSlice> =
                    chunk.iter().map(|t| SeqSlice::base(&context, 0, t, 0)).collect();
                step(&mut gpu, &batch)?;
            }
            let next: Vec<[u32; 1]> = (0..b).map(|s| [token(s + 1)]).collect();
            let t = Instant::now();
            for i in 0..o.steps {
                let batch: Vec<SeqSlice> = tables
                    .iter()
                    .zip(&next)
                    .map(|(t, tok)| SeqSlice::base(tok, o.context + i, t, 1))
                    .collect();
                step(&mut gpu, &batch)?;
            }
            let tps = (b * o.steps) as f64 / t.elapsed().as_secs_f64();
            let read =
                weight_bytes + b as f64 * (o.context as f64 + o.steps as f64 / 2.0) * kv_per_token;
            let roof = b as f64 * bandwidth / read;
            println!(
                "  decode batch {b:>4}: {tps:>10.0} tokens/s (roofline {roof:.0}: {:.0}% of it)",
                100.0 * tps / roof
            );
        }
    }
    Ok(())
}
