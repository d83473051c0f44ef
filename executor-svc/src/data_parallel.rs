//! An executor's place in a data-parallel group, and the step trace that shows a group's
//! lockstep from the executors' side.
//!
//! A group's ranks (data-parallel attention with expert parallelism: each step of a rank joins
//! an all-to-all with every other rank) must step together; the executor only states its place
//! in the handshake, and its scheduler runs the rounds (`ferry-scheduler`'s link module).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

use clap::Args;
use ferry_proto::v1;

/// `--dp-group`, `--dp-rank`, `--dp-size` and `--step-trace`.
#[derive(Clone, Debug, Default, Args)]
pub struct DataParallelArgs {
    /// The data-parallel group this executor is a rank of: its scheduler gives every rank of
    /// the group one step per round (an empty one to a rank without work) and starts no round
    /// before every rank answered the last. With --dp-rank and --dp-size.
    #[arg(long, env = "FERRY_DP_GROUP", requires_all = ["dp_rank", "dp_size"])]
    pub dp_group: Option<String>,
    /// This executor's rank in --dp-group, below --dp-size.
    #[arg(long, env = "FERRY_DP_RANK", requires = "dp_group")]
    pub dp_rank: Option<u32>,
    /// Ranks in --dp-group.
    #[arg(long, env = "FERRY_DP_SIZE", requires = "dp_group")]
    pub dp_size: Option<u32>,
    /// Appends a JSON line per step executed to this file: its id, its data-parallel round,
    /// when it was received and answered (microseconds since the Unix epoch) and its tokens.
    #[arg(long, env = "FERRY_STEP_TRACE")]
    pub step_trace: Option<PathBuf>,
}

impl DataParallelArgs {
    /// The handshake's statement of the group, checked: a name of letters, digits, `-`, `_`
    /// and `.`, a rank below a size of at least 1.
    ///
    /// # Errors
    ///
    /// What is wrong, naming the flag.
    pub fn rank(&self) -> Result<Option<v1::DataParallelRank>, String> {
        let (Some(group), Some(rank), Some(size)) = (&self.dp_group, self.dp_rank, self.dp_size)
        else {
            return Ok(None);
        };
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if group.is_empty() || !group.chars().all(ok) {
            return Err(format!(
                "--dp-group {group:?} is invalid: use letters, digits, '-', '_' and '.'"
            ));
        }
        if size == 0 || rank >= size {
            return Err(format!(
                "--dp-rank {rank} must be below --dp-size {size} (and the size at least 1)"
            ));
        }
        Ok(Some(v1::DataParallelRank { group: group.clone(), rank, size }))
    }
}

/// The `--step-trace` file.
pub struct StepTrace {
    file: Mutex<std::fs::File>,
}

impl StepTrace {
    /// Opens (appends to) `path`.
    ///
    /// # Errors
    ///
    /// The file cannot be opened.
    pub fn open(path: &std::path::Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self { file: Mutex::new(file) })
    }

    /// Records the step `traced` noted, answered now. A write that fails is logged, not
    /// fatal: the trace is for following the executor, not serving.
    pub fn record(&self, traced: TracedStep) {
        let line = serde_json::json!({
            "step": traced.step_id, "round": traced.round, "received_us": traced.received_us,
            "answered_us": ferry_runtime::clock::now_unix_us(), "tokens": traced.tokens,
            "prompt_tokens": traced.prompt_tokens,
        });
        // One write per line: `writeln!` writes the JSON in pieces, so a process killed
        // mid-line left half a line for whoever reads the trace.
        let line = format!("{line}\n");
        let mut file = self.file.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(e) = file.write_all(line.as_bytes()) {
            tracing::warn!(error = %e, "the step trace could not be written");
        }
    }
}

/// What the trace says of a step, noted when it is received (the step itself goes on to the
/// engine).
#[derive(Debug, Clone, Copy)]
pub struct TracedStep {
    step_id: u64,
    round: u64,
    received_us: u64,
    tokens: u32,
    prompt_tokens: u32,
}

impl TracedStep {
    /// `step`, received now.
    pub fn of(step: &v1::Step) -> Self {
        let prompt = |w: &&v1::ScheduledWork| {
            matches!(w.key(), v1::WorkKey::Prompt | v1::WorkKey::PromptChunk)
        };
        Self {
            step_id: step.step_id,
            round: step.dp_round,
            received_us: ferry_runtime::clock::now_unix_us(),
            tokens: step.total_num_tokens,
            prompt_tokens: step.work.iter().filter(prompt).map(|w| w.num_tokens).sum(),
        }
    }
}
