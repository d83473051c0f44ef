//! The baseline for the service path's cost: the same workload driven through the scheduling
//! core and the executor engine directly, in one thread, with no gRPC, HTTP or tasks between
//! them. `ferry-bench serve --in-process` reports it in the same shape as a served run.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use ferry_executor_svc::engine::{CpuBackend, Engine, EngineConfig};
use ferry_executor_svc::executor_config::{BackendKind, KvCacheArgs};
use ferry_executor_svc::forward::LoadedModel;
use ferry_proto::v1;
use ferry_sched_core::{RequestEvent, RequestId, Scheduler, SchedulerStats, Timestamp};
use ferry_sched_flags::Geometry;
use ferry_scheduler_svc::config::SchedulerSettings;
use ferry_scheduler_svc::link::{self, wire};
use ferry_scheduler_svc::request::RequestSpec;

use super::{Job, Percentiles, Report};

/// Runs `jobs` at `concurrency` through core + engine in this thread, the core configured from
/// `settings` as a scheduler configures it and the KV cache sized from `kv` as a CPU executor
/// sizes it; every request samples with `sampling` (its seed, when it has one, plus the
/// request's number). The report, and the core's counters at the end.
pub fn run(
    jobs: &[Job],
    concurrency: usize,
    settings: &SchedulerSettings,
    kv: &KvCacheArgs,
    sampling: &v1::SamplingParams,
) -> anyhow::Result<(Report, SchedulerStats)> {
    let model = LoadedModel::open(None)?;
    let shape = model.weights.shape;
    let dtype = kv.dtype(BackendKind::Cpu);
    let block_size = kv.block_size as usize;
    let num_blocks = kv.num_blocks(&shape, dtype)?;
    let tokenizer = &model.file.tokenizer;
    let eos = tokenizer.eos_token_id;
    let prompts: Vec<(Vec<u32>, u64)> = jobs
        .iter()
        .map(|j| Ok((tokenizer.encode(&j.prompt)?, j.max_tokens)))
        .collect::<anyhow::Result<_>>()?;
    let mut engine = Engine::new(
        Box::new(CpuBackend::with_dtype(model.weights, dtype, block_size, num_blocks)),
        EngineConfig::new(eos),
    );
    let geometry = Geometry {
        block_size,
        num_blocks,
        max_model_len: shape.max_model_len.min(num_blocks * block_size),
        kv_agent: false,
        looped: None,
        max_loras: 0,
    };
    let mut core = Scheduler::new(settings.core_config("in-process", geometry)?)?;
    let start = Instant::now();
    let now = || Timestamp(start.elapsed().as_nanos() as u64);
    let mut pending: VecDeque<(u64, (Vec<u32>, u64))> =
        prompts.into_iter().enumerate().map(|(i, p)| (i as u64 + 1, p)).collect();
    let (mut live, mut completed, mut output_tokens, mut prompt_tokens) =
        (0usize, 0usize, 0u64, 0u64);
    let spec = RequestSpec { ignore_eos: true, sampling: sampling.clone(), ..Default::default() };
    let mut events = Vec::new();
    let mut specs: HashMap<u64, RequestSpec> = HashMap::new();
    loop {
        while live < concurrency {
            let Some((id, (prompt, max_tokens))) = pending.pop_front() else { break };
            prompt_tokens += prompt.len() as u64;
            let mut spec = RequestSpec {
                prompt: prompt.into(),
                max_tokens: max_tokens as usize,
                ..spec.clone()
            };
            spec.sampling.seed = sampling.seed.map(|s| s + id);
            core.add_request(link::core_request(
                &spec,
                RequestId(id),
                Vec::new(),
                &[eos],
                None,
                now(),
            ))?;
            specs.insert(id, spec);
            live += 1;
        }
        if core.is_drained() {
            break;
        }
        let step =
            wire::to_proto(core.schedule(now())?, 0, 0, 0, |id| Some((specs.get(&id.0)?, None)));
        let result = engine.execute(&step)?;
        events.clear();
        core.apply_result(&wire::outcome_of(&result), now(), &mut events)?;
        for ev in &events {
            match ev {
                RequestEvent::Token { .. } => output_tokens += 1,
                RequestEvent::Finished(done) => {
                    specs.remove(&done.id.0);
                    live -= 1;
                    completed += 1;
                }
                _ => {}
            }
        }
    }
    let duration = start.elapsed().as_secs_f64();
    let report = Report {
        completed,
        failed: 0,
        duration_s: duration,
        output_tokens_per_s: output_tokens as f64 / duration,
        requests_per_s: completed as f64 / duration,
        prompt_tokens,
        output_tokens,
        ttft: Percentiles::default(),
        tpot: Percentiles::default(),
        itl: Percentiles::default(),
        e2e: Percentiles::default(),
        errors: Vec::new(),
    };
    Ok((report, core.stats()))
}
