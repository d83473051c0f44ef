//! Workloads: when requests arrive, how long their prompts and outputs are, which of them share
//! a prefix; generated from a seed (the same seed, the same requests) or read from a trace.
//!
//! Requests are produced one at a time, in arrival order, so a run of a million requests never
//! holds more than the ones in flight.
//!
//! The parts: `rng` is the seeded generator every draw comes from; `distributions` the arrival
//! processes and length distributions; `generated` a workload made from a seed, `conversation`
//! the multi-turn conversations it may open; `trace` a workload read from a JSONL file;
//! `tokens` the token ids of a prompt, shared within a prefix group or a conversation.

mod conversation;
mod distributions;
mod generated;
mod rng;
mod tokens;
mod trace_file;

use std::io::BufRead;
use std::sync::Arc;

pub use conversation::{Conversations, Turn, CONVERSATION_GROUPS};
pub use distributions::{Arrivals, Lengths};
pub use generated::{Generated, PrefixGroups};
pub use rng::{mix, Rng};
pub use tokens::{prompt_tokens, shared_token};

/// A request of the workload.
#[derive(Debug, Clone)]
pub struct SimRequest {
    /// Its number, from 0 in arrival order.
    pub index: u64,
    /// Arrival, seconds from the start.
    pub arrival: f64,
    /// Prompt tokens.
    pub prompt: Arc<[u32]>,
    /// Output tokens it generates (it ignores EOS).
    pub output_len: u32,
    /// Its prefix group, if any.
    pub group: Option<u32>,
    /// The conversation it is a turn of, if any: its whole prompt, and its answer, are that
    /// conversation's tokens ([`shared_token`]), so a later turn's prompt starts with them.
    pub conversation: Option<u32>,
    /// The conversation's turns after this one.
    pub follow_ups: Vec<Turn>,
}

/// Where requests come from.
#[derive(Debug)]
pub enum Source {
    /// Generated from a seed.
    Generated {
        /// What to generate.
        spec: Generated,
        /// Its generator.
        rng: Rng,
        /// Requests made so far.
        made: u64,
        /// The last arrival, seconds.
        clock: f64,
    },
    /// Read from a JSONL trace: one object per line with `arrival` (seconds),
    /// `prompt_len`, `output_len` and optionally `prefix_group` and `prefix_len`.
    Trace {
        /// Its lines.
        lines: std::io::Lines<std::io::BufReader<std::fs::File>>,
        /// Its name, for errors.
        path: String,
        /// Requests read so far.
        made: u64,
        /// Lines read so far.
        line: u64,
        /// Token ids are drawn below this.
        vocab_size: u32,
        /// The last arrival (a trace must be in arrival order).
        clock: f64,
    },
}

impl Source {
    /// Requests generated from `spec` with `seed`.
    pub fn generated(spec: Generated, seed: u64) -> Self {
        Self::Generated { spec, rng: Rng::new(seed), made: 0, clock: 0.0 }
    }

    /// Requests read from the JSONL trace at `path`.
    pub fn trace(path: &str, vocab_size: u32) -> Result<Self, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("trace {path}: {e}"))?;
        let lines = std::io::BufReader::new(file).lines();
        Ok(Self::Trace { lines, path: path.into(), made: 0, line: 0, vocab_size, clock: 0.0 })
    }

    /// The next request, `None` after the last; an error for a bad trace line.
    pub fn next_request(&mut self) -> Result<Option<SimRequest>, String> {
        match self {
            Self::Generated { spec, rng, made, clock } => {
                Ok(generated::next_request(spec, rng, made, clock))
            }
            Self::Trace { lines, path, made, line, vocab_size, clock } => {
                trace_file::next_request(lines, path, made, line, *vocab_size, clock)
            }
        }
    }
}
