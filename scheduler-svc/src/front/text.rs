//! Turning a request's tokens into the text a client sees: incremental detokenization that
//! never splits a UTF-8 character, and stop strings — text that could still be the start of a
//! stop string is held back until it cannot, so a client never sees part of one.

use ferry_model::{IncrementalDecoder, Tokenizer};

/// Text produced by one token.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pushed {
    /// Text safe to send now.
    pub text: String,
    /// The stop string that matched; the request must end here.
    pub stopped: Option<String>,
}

/// Per-request text state.
#[derive(Debug)]
pub struct TextAssembler {
    decoder: IncrementalDecoder,
    pending: String,
    stops: Vec<String>,
    include_stop: bool,
    hold: usize,
    /// Put control tokens' text in the output.
    keep_special: bool,
    /// The text of the last token, a control token kept, until the next token shows it did not
    /// end the request.
    held_special: Option<String>,
}

impl TextAssembler {
    /// A fresh assembler for `stops` (empty strings are ignored); with `keep_special`,
    /// control tokens' text is output too.
    pub fn new(stops: &[String], include_stop: bool, keep_special: bool) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let hold = stops.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
        Self {
            decoder: IncrementalDecoder::default(),
            pending: String::new(),
            stops,
            include_stop,
            hold,
            keep_special,
            held_special: None,
        }
    }

    /// Adds one token. Control tokens (EOS and the like) add no text, unless kept.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Pushed {
        if let Some(held) = self.held_special.take() {
            self.pending.push_str(&held);
        }
        if !tokenizer.is_special(token) {
            self.decoder.push_into(tokenizer, token, &mut self.pending);
        } else if self.keep_special {
            // A control token is whole bytes: what the decoder holds goes first.
            self.pending.push_str(&self.decoder.finish());
            self.held_special = Some(tokenizer.decode(&[token]));
        }
        // The earliest stop string in the pending text wins.
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, stop)) = first {
            let end = if self.include_stop { at + stop.len() } else { at };
            let text = self.pending[..end].to_string();
            let stopped = Some(stop.clone());
            self.pending.clear();
            return Pushed { text, stopped };
        }
        // Keep the tail that could still begin a stop string.
        let mut cut = self.pending.len().saturating_sub(self.hold);
        while !self.pending.is_char_boundary(cut) {
            cut -= 1;
        }
        let text = if cut == self.pending.len() {
            std::mem::take(&mut self.pending)
        } else {
            let text = self.pending[..cut].to_owned();
            self.pending.drain(..cut);
            text
        };
        Pushed { text, stopped: None }
    }

    /// Whatever is held at the end of the stream; `by_token` when the last token (EOS or a
    /// stop token) ended it, whose text then stays out unless stop strings are included.
    pub fn finish(&mut self, by_token: bool) -> String {
        let mut rest = std::mem::take(&mut self.pending);
        rest.push_str(&self.decoder.finish());
        if let Some(held) = self.held_special.take().filter(|_| !by_token || self.include_stop) {
            rest.push_str(&held);
        }
        rest
    }
}
