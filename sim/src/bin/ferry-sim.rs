//! `ferry-sim`: simulate a cluster of GPUs serving a workload, in virtual time, with Ferry's
//! scheduling core and router; print latency percentiles, throughput and goodput.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use ferry_roofline::{activation_bytes, kv_capacity_blocks, Profiles, SimHardware, SimModel};
use ferry_sched_flags::{Geometry, SchedulingArgs};
use ferry_sim::des::{
    self, ClusterSpec, ControlPlane, DataParallel, KvTier, LoopedSim, ModelPool, Report, Router,
    Slo,
};
use ferry_sim::workload::{Arrivals, Conversations, Generated, Lengths, PrefixGroups, Source};

/// Simulate N GPUs serving a workload with Ferry's scheduler and router, in virtual time.
#[derive(Debug, Parser)]
#[command(name = "ferry-sim", version)]
#[allow(clippy::struct_excessive_bools)] // independent command-line switches
struct Args {
    /// The GPU (a hardware profile; `--list-profiles` names them).
    #[arg(long, default_value = "h100")]
    hardware: String,
    /// The model (a model profile).
    #[arg(long, default_value = "llama-3-8b")]
    model_profile: String,
    /// GPUs per executor (tensor parallelism); the model profile's default if absent.
    #[arg(long)]
    tensor_parallel: Option<u32>,
    /// Executors (model replicas).
    #[arg(long, default_value_t = 4)]
    executors: usize,
    /// Another base model served by executors of its own, `PROFILE:EXECUTORS:SHARE` (its
    /// profile's tensor parallelism, on `--hardware`): that share of the requests asks for it
    /// and is routed to its executors only; repeat for more. The rest ask for
    /// `--model-profile`.
    #[arg(long)]
    extra_model: Vec<String>,
    /// Requests to simulate (generated workloads).
    #[arg(long, default_value_t = 10_000)]
    requests: u64,
    /// Arrivals: `poisson:RATE`, `gamma:RATE:CV` (requests per second) or `inf` (all at once).
    #[arg(long, default_value = "poisson:20")]
    arrivals: String,
    /// Prompt lengths: `N`, `LO:HI`, `lognormal:MEDIAN:SIGMA[:MAX]` or `hist:FILE`.
    #[arg(long, default_value = "lognormal:512:0.8:8192")]
    prompt_len: String,
    /// Output lengths, as `--prompt-len`.
    #[arg(long, default_value = "lognormal:200:0.8:2048")]
    output_len: String,
    /// Distinct shared prefixes (system prompts); each request starts with one of them.
    #[arg(long, default_value_t = 0)]
    prefix_groups: u32,
    /// Tokens of each shared prefix.
    #[arg(long, default_value_t = 0)]
    prefix_len: u32,
    /// Multi-turn conversations: each arrival opens one of this many turns (`N`, `LO:HI`, ...,
    /// as `--prompt-len`); each later turn sends the conversation so far (prompts and answers)
    /// and a new user message.
    #[arg(long)]
    conversation_turns: Option<String>,
    /// With `--conversation-turns`: mean seconds between an answer and the next turn.
    #[arg(long, default_value_t = 10.0)]
    think_time: f64,
    /// With `--conversation-turns`: tokens of each later turn's new user message.
    #[arg(long, default_value = "lognormal:64:0.8:1024")]
    user_len: String,
    /// A JSONL trace instead of a generated workload: one object per line with `arrival`
    /// (seconds), `prompt_len`, `output_len`, and optionally `prefix_group`, `prefix_len`.
    #[arg(long)]
    trace: Option<String>,
    /// Executors (of `--executors`) that only prefill: a request with a long enough prompt is
    /// computed on one and its KV moved to a decode executor (disaggregation).
    #[arg(long, default_value_t = 0)]
    prefill_executors: usize,
    /// Shortest uncached prompt worth disaggregating.
    #[arg(long, default_value_t = 256)]
    disaggregation_min_tokens: usize,
    /// Fixed cost of a KV transfer on top of its bytes, milliseconds.
    #[arg(long, default_value_t = 0.5)]
    transfer_latency_ms: f64,
    /// The KV tier: blocks each node's agent keeps of what its executor's finished requests
    /// computed (0: no tier); a new request reads its prefix from any agent's store when that
    /// covers `--kv-tier-min-tokens` more than its executor caches.
    #[arg(long, default_value_t = 0)]
    kv_tier_blocks: usize,
    /// Shortest gain of a KV-tier read over the executor's own cache, tokens.
    #[arg(long, default_value_t = 64)]
    kv_tier_min_tokens: usize,
    /// Host-to-GPU bandwidth of a KV-tier read from the executor's own node, GB/s.
    #[arg(long, default_value_t = 25.0)]
    host_gbps: f64,
    /// How new requests are placed.
    #[arg(long, value_enum, default_value_t = Router::KvAware)]
    router: Router,
    /// With `--router kv-aware`: tokens of cached prefix that one more live request on an
    /// executor outweighs (0: the longest prefix wins however busy its executor).
    #[arg(long, default_value_t = ferry_sched_core::routing::LOAD_TOKENS)]
    route_load_tokens: usize,
    /// Scheduler shards sharing the executors (Ferry's assignment); a request goes to the
    /// shard whose best executor the router would pick, then to that executor.
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// Data-parallel groups of this many consecutive executors, stepped together in rounds (a
    /// round lasts as long as its slowest rank's step plus the experts' all-to-all); 0 or 1:
    /// none. With --throttle-prefills, vLLM's prefill throttle on the rounds between aligned
    /// ones (--prefill-schedule-interval).
    #[arg(long, default_value_t = 0)]
    dp_size: usize,
    /// Simulate the model looped, as the executor's --looped-layers serves it: layers [0, A)
    /// once, [A, B) up to --max-loops times, [B, n) once, each stage a step of its own costed
    /// by its layers.
    #[arg(long, value_name = "A:B")]
    looped_layers: Option<String>,
    /// With --looped-layers: the loops every request runs at most.
    #[arg(long, default_value_t = 4, requires = "looped_layers")]
    max_loops: u8,
    /// With --looped-layers: every request's exit threshold (the simulated exit score after
    /// loop l is l / (l + 1)); unset: every token runs --max-loops loops.
    #[arg(long, requires = "looped_layers")]
    exit_threshold: Option<f32>,
    /// Each shard scheduler's CPU per streamed token, microseconds (`ferry-bench
    /// control-plane` measures it; 0: the control plane costs nothing). A shard streams its
    /// executors' step results one after another.
    #[arg(long, default_value_t = 0.0)]
    scheduler_cpu_token_us: f64,
    /// Each shard scheduler's CPU per request, microseconds.
    #[arg(long, default_value_t = 0.0)]
    scheduler_cpu_request_us: f64,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Longest prompt + output; longer requests are refused.
    #[arg(long, default_value_t = 32_768)]
    max_model_len: usize,
    /// Fraction of GPU memory for weights, activations and KV cache (vLLM's).
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_utilization: f64,
    /// How each simulated executor's core schedules: the scheduler's own flags, with its
    /// defaults (`ferry-scheduler --help`).
    #[command(flatten)]
    scheduling: SchedulingArgs,
    /// The SLO of the goodput figure: longest time to first token, seconds.
    #[arg(long, default_value_t = 2.0)]
    slo_ttft: f64,
    /// The SLO of the goodput figure: longest time per output token, seconds.
    #[arg(long, default_value_t = 0.1)]
    slo_tpot: f64,
    /// The workload's seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Write PNG plots (`latency.png`, `timeline.png`) into this folder.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// More profiles: `DIR/hardware/*.json`, `DIR/models/*.json`, or `*.json` in `DIR`.
    #[arg(long)]
    profile_dir: Vec<PathBuf>,
    /// List the profiles and exit.
    #[arg(long)]
    list_profiles: bool,
    /// Check every core's invariants after every step (slow).
    #[arg(long)]
    check_invariants: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut profiles = Profiles::built_in();
    for dir in &args.profile_dir {
        profiles.add_dir(dir)?;
    }
    if args.list_profiles {
        println!("hardware:");
        for h in profiles.hardware.values() {
            println!("  {:<16} {}", h.name, h.description);
        }
        println!("models:");
        for m in profiles.models.values() {
            println!("  {:<16} {}", m.name, m.description);
        }
        return Ok(());
    }
    let (spec, tp) = cluster(&args, &profiles)?;
    let model = spec.model;
    let mut source = source(&args, model.vocab_size)?;
    let total = if args.trace.is_some() { None } else { Some(args.requests) };
    let tty = std::io::stderr().is_terminal();
    let report = des::run(&spec, &mut source, |p| {
        if tty {
            let of = total.map(|t| format!(" of {t}")).unwrap_or_default();
            eprint!("\r{:>10.1} s simulated, {} arrived, {} done{of}   ", p.now, p.arrived, p.done);
        }
    })
    .map_err(anyhow::Error::msg)?;
    if tty {
        eprintln!();
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&args, tp, &report);
    }
    if let Some(dir) = &args.plot {
        let title = format!(
            "{} x {} {} ({} prefill), {}",
            args.executors,
            args.hardware,
            args.model_profile,
            args.prefill_executors,
            args.router.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string())
        );
        for path in ferry_sim::plot::write_plots(&report, &title, dir)? {
            eprintln!("wrote {}", path.display());
        }
    }
    Ok(())
}

/// The cluster `args` describe, and its tensor-parallel degree.
fn cluster(args: &Args, profiles: &Profiles) -> anyhow::Result<(ClusterSpec, u32)> {
    let m = profiles.model(&args.model_profile)?;
    let tp = args.tensor_parallel.unwrap_or(m.tensor_parallel);
    let model = m.to_sim()?;
    let hardware = profiles.hardware(&args.hardware)?.to_sim(m.compute_dtype(), tp)?;
    anyhow::ensure!(
        args.scheduling.speculative_config.is_none(),
        "--speculative-config: ferry-sim's executors sample one token per step; speculative \
         decoding is not simulated"
    );
    for (flag, us) in [
        ("--scheduler-cpu-token-us", args.scheduler_cpu_token_us),
        ("--scheduler-cpu-request-us", args.scheduler_cpu_request_us),
    ] {
        anyhow::ensure!(us.is_finite() && us >= 0.0, "{flag} {us} must be microseconds >= 0");
    }
    let looped = looped_of(args, model.num_layers)?;
    let scheduler = core_for(args, (&m.name, &model, &hardware, tp), looped.map(|(_, l)| l))?;
    let mut extra_models = Vec::new();
    for extra in &args.extra_model {
        let parts: Vec<&str> = extra.split(':').collect();
        let [profile, executors, share] = parts[..] else {
            anyhow::bail!("--extra-model {extra:?} is not PROFILE:EXECUTORS:SHARE");
        };
        let (executors, share) = (executors.parse::<usize>(), share.parse::<f64>());
        let (Ok(executors), Ok(share)) = (executors, share) else {
            anyhow::bail!("--extra-model {extra:?}: EXECUTORS is a count, SHARE a fraction");
        };
        let p = profiles.model(profile)?;
        let model = p.to_sim()?;
        let hardware =
            profiles.hardware(&args.hardware)?.to_sim(p.compute_dtype(), p.tensor_parallel)?;
        let scheduler = core_for(args, (&p.name, &model, &hardware, p.tensor_parallel), None)?;
        let name = p.name.clone();
        extra_models.push(ModelPool { name, executors, hardware, model, scheduler, share });
    }
    let spec = ClusterSpec {
        executors: args.executors,
        hardware,
        model,
        model_name: m.name.clone(),
        scheduler,
        router: args.router,
        route_load_tokens: args.route_load_tokens,
        slo: Slo { ttft: args.slo_ttft, tpot: args.slo_tpot },
        check_invariants: args.check_invariants,
        prefill_executors: args.prefill_executors,
        disaggregation_min_tokens: args.disaggregation_min_tokens,
        transfer_latency: args.transfer_latency_ms / 1e3,
        kv_tier: (args.kv_tier_blocks > 0).then_some(KvTier {
            blocks_per_agent: args.kv_tier_blocks,
            min_tokens: args.kv_tier_min_tokens,
            host_gbps: args.host_gbps,
        }),
        shards: args.shards,
        data_parallel: (args.dp_size > 1).then_some(DataParallel {
            size: args.dp_size,
            throttle: args.scheduling.prefill_throttle()?,
        }),
        looped: looped.map(|(sim, _)| sim),
        control_plane: (args.scheduler_cpu_token_us > 0.0 || args.scheduler_cpu_request_us > 0.0)
            .then_some(ControlPlane {
                token_secs: args.scheduler_cpu_token_us / 1e6,
                request_secs: args.scheduler_cpu_request_us / 1e6,
            }),
        extra_models,
    };
    spec.check_models().map_err(anyhow::Error::msg)?;
    Ok((spec, tp))
}

/// The scheduling core of an executor of `model` (named `name`) on `hardware` in groups of
/// `tp` GPUs, as the scheduler configures one for its handshake: `args`' policy and block
/// size, and the blocks that fit beside the weights and activations.
fn core_for(
    args: &Args,
    (name, model, hardware, tp): (&str, &SimModel, &SimHardware, u32),
    looped: Option<ferry_sched_core::LoopedModel>,
) -> anyhow::Result<ferry_sched_core::SchedulerConfig> {
    let policy = args.scheduling.policy()?;
    let (bs, seqs, tokens) =
        (args.block_size, policy.max_num_seqs(), policy.core().max_num_batched_tokens);
    let activations = activation_bytes(model, tp, tokens as u32, seqs as u32);
    let blocks =
        kv_capacity_blocks(hardware, model, bs as u32, args.gpu_memory_utilization, activations);
    if blocks == 0 {
        anyhow::bail!(
            "{name} does not fit {tp} GPU(s) of {} with room for a KV block: try --tensor-parallel",
            args.hardware
        );
    }
    // As the scheduler configures a core for an executor's handshake; the core queues its
    // finished requests' blocks for the tier only when the executor has an agent (a tier).
    let geometry = Geometry {
        block_size: bs,
        num_blocks: usize::try_from(blocks)?,
        max_model_len: args.max_model_len,
        kv_agent: args.kv_tier_blocks > 0,
        looped,
        max_loras: 0,
    };
    Ok(policy.for_executor(geometry)?)
}

/// `--looped-layers` of a model of `num_layers` layers, checked: the simulation's split and
/// the cores' looped model.
fn looped_of(
    args: &Args,
    num_layers: u32,
) -> anyhow::Result<Option<(LoopedSim, ferry_sched_core::LoopedModel)>> {
    let Some(spec) = &args.looped_layers else { return Ok(None) };
    let parse = |s: &str| s.trim().parse::<u32>().ok();
    let Some((a, b)) = spec.split_once(':').and_then(|(a, b)| Some((parse(a)?, parse(b)?))) else {
        anyhow::bail!("--looped-layers {spec:?} is not A:B (two layer numbers)");
    };
    if a >= b || b > num_layers {
        anyhow::bail!("--looped-layers {a}:{b} must name a non-empty block of {num_layers} layers");
    }
    if let Some(t) = args.exit_threshold.filter(|t| !(*t > 0.0 && *t <= 1.0)) {
        anyhow::bail!("--exit-threshold must be in (0, 1], got {t}");
    }
    let mut model = ferry_sched_core::LoopedModel::new(args.max_loops);
    model.prelude_kv = a > 0;
    model.coda_kv = b < num_layers;
    let sim = LoopedSim { prelude_end: a, coda_start: b, exit_threshold: args.exit_threshold };
    Ok(Some((sim, model)))
}

/// Where the requests of `args` come from.
fn source(args: &Args, vocab_size: u32) -> anyhow::Result<Source> {
    if let Some(path) = &args.trace {
        return Source::trace(path, vocab_size).map_err(anyhow::Error::msg);
    }
    let prefixes = (args.prefix_groups > 0 && args.prefix_len > 0)
        .then_some(PrefixGroups { groups: args.prefix_groups, prefix_len: args.prefix_len });
    let conversations = match &args.conversation_turns {
        None => None,
        Some(_) if prefixes.is_some() => {
            anyhow::bail!("--conversation-turns and --prefix-groups: give one or the other")
        }
        Some(_) if !(args.think_time.is_finite() && args.think_time >= 0.0) => {
            anyhow::bail!("--think-time {} must be a number of seconds >= 0", args.think_time)
        }
        Some(turns) => Some(Conversations {
            turns: Lengths::parse(turns).map_err(anyhow::Error::msg)?,
            think_time: args.think_time,
            user_len: Lengths::parse(&args.user_len).map_err(anyhow::Error::msg)?,
        }),
    };
    let generated = Generated {
        arrivals: Arrivals::parse(&args.arrivals).map_err(anyhow::Error::msg)?,
        prompt: Lengths::parse(&args.prompt_len).map_err(anyhow::Error::msg)?,
        output: Lengths::parse(&args.output_len).map_err(anyhow::Error::msg)?,
        prefixes,
        conversations,
        requests: args.requests,
        vocab_size,
    };
    Ok(Source::generated(generated, args.seed))
}

fn print_table(args: &Args, tp: u32, r: &Report) {
    println!(
        "{} executors ({} prefill-only) of {} x{tp} running {}, {} blocks each; router {:?}",
        r.executors,
        args.prefill_executors,
        args.hardware,
        args.model_profile,
        r.blocks_per_executor,
        r.router
    );
    if r.shards > 1 || r.scheduler_cpu_busy > 0.0 {
        println!(
            "{} scheduler shards; the busiest shard's CPU busy {:.0} % of the run",
            r.shards,
            r.scheduler_cpu_busy * 100.0
        );
    }
    println!(
        "{} requests: {} finished, {} refused; {:.1} s simulated in {:.1} s ({:.0}x)",
        r.requests, r.finished, r.rejected, r.makespan, r.wall_seconds, r.speedup
    );
    println!(
        "throughput {:.0} output tokens/s, {:.2} requests/s; goodput {:.2} requests/s (TTFT <= {} s, TPOT <= {} s)",
        r.output_tokens_per_s, r.requests_per_s, r.goodput, r.slo.ttft, r.slo.tpot
    );
    println!("{:<8} {:>10} {:>10} {:>10} {:>10} {:>10}", "ms", "mean", "p50", "p90", "p99", "max");
    for (name, l) in [("TTFT", r.ttft), ("TPOT", r.tpot), ("ITL", r.itl), ("E2E", r.e2e)] {
        println!(
            "{name:<8} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            l.mean * 1e3,
            l.p50 * 1e3,
            l.p90 * 1e3,
            l.p99 * 1e3,
            l.max * 1e3
        );
    }
    println!(
        "prefix hit rate {:.1} %, prompt tokens computed {:.2}x of prompts, preemptions {}, steps {}, busy {:.1} %, KV usage mean {:.1} % max {:.1} %",
        r.prefix_hit_rate * 100.0,
        r.computed_prompt_tokens as f64 / r.prompt_tokens.max(1) as f64,
        r.preemptions,
        r.steps,
        r.busy_fraction * 100.0,
        r.kv_usage_mean * 100.0,
        r.kv_usage_max * 100.0
    );
    for m in &r.models {
        println!(
            "model {}: {} executors, {} requests, {} finished, {:.0} output tokens/s, TTFT p50 {:.1} ms p99 {:.1} ms",
            m.name,
            m.executors,
            m.requests,
            m.finished,
            m.output_tokens_per_s,
            m.ttft.p50 * 1e3,
            m.ttft.p99 * 1e3
        );
    }
    if r.dp_rounds > 0 {
        println!(
            "data-parallel rounds {}, steps that deferred prefills {}",
            r.dp_rounds, r.prefills_deferred
        );
    }
    if r.tier_writes > 0 {
        println!(
            "KV tier: {} blocks written, {} reads ({} tokens), {} failed",
            r.tier_writes, r.tier_reads, r.tier_read_tokens, r.tier_read_failures
        );
    }
    if r.disaggregated > 0 {
        println!(
            "disaggregated {} requests, {:.1} GB of KV moved, {:.1} ms a transfer",
            r.disaggregated,
            r.transfer_bytes as f64 / 1e9,
            r.transfer_seconds_mean * 1e3
        );
    }
}
