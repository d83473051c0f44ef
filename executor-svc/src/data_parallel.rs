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

    /// Records `step`, received and answered at those Unix times (microseconds). A write that
    /// fails is logged, not fatal: the trace is for following the executor, not serving.
    pub fn record(&self, step: &v1::Step, received_us: u64, answered_us: u64) {
        let prompt: u32 = step
            .work
            .iter()
            .filter(|w| w.key() == v1::WorkKey::Prompt || w.key() == v1::WorkKey::PromptChunk)
            .map(|w| w.num_tokens)
            .sum();
        let line = serde_json::json!({
            "step": step.step_id, "round": step.dp_round, "received_us": received_us,
            "answered_us": answered_us, "tokens": step.total_num_tokens, "prompt_tokens": prompt,
        });
        let mut file = self.file.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(e) = writeln!(file, "{line}") {
            tracing::warn!(error = %e, "the step trace could not be written");
        }
    }
}

/// Microseconds since the Unix epoch.
pub fn now_unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}
