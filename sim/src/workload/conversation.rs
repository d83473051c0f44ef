//! Multi-turn conversations: each later turn sends the conversation so far (earlier prompts and
//! answers, all of them the conversation's tokens) and a new user message, so its prompt starts
//! with the last turn's prompt and answer: what a prefix cache can serve.

use super::distributions::Lengths;
use super::tokens::prompt_tokens;
use super::SimRequest;

/// Multi-turn conversations: each arrival opens one, whose turns each send the whole
/// conversation so far (earlier prompts and answers) plus a new user message, after the user
/// read the previous answer and thought for a while.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversations {
    /// Turns per conversation (at least 1).
    pub turns: Lengths,
    /// Mean seconds between an answer and the next turn (exponential).
    pub think_time: f64,
    /// Tokens of each later turn's new user message.
    pub user_len: Lengths,
}

/// A later turn of a conversation, sent `think` seconds after the previous answer ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Turn {
    /// Seconds after the previous answer.
    pub think: f64,
    /// Tokens of its new user message.
    pub user_len: u32,
    /// Tokens of its answer.
    pub output_len: u32,
}

/// Group ids of conversations start here (above any `--prefix-groups`).
pub const CONVERSATION_GROUPS: u32 = 1 << 31;

impl SimRequest {
    /// The next turn of this request's conversation, `index` its number: the conversation so
    /// far (this prompt and its `output_len` answer tokens) and a new user message; `None` if
    /// it was the last.
    pub fn next_turn(&self, index: u64, arrival: f64, vocab: u32) -> Option<SimRequest> {
        let conversation = self.conversation?;
        let (turn, rest) = self.follow_ups.split_first()?;
        let len = self.prompt.len() as u32 + self.output_len + turn.user_len;
        Some(SimRequest {
            index,
            arrival,
            prompt: prompt_tokens(index, len, Some(conversation), len, vocab),
            output_len: turn.output_len,
            group: Some(conversation),
            conversation: Some(conversation),
            follow_ups: rest.to_vec(),
        })
    }
}
