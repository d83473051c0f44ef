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
}

impl TextAssembler {
    /// A fresh assembler for `stops` (empty strings are ignored).
    pub fn new(stops: &[String], include_stop: bool) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let hold = stops.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
        Self {
            decoder: IncrementalDecoder::default(),
            pending: String::new(),
            stops,
            include_stop,
            hold,
        }
    }

    /// Adds one token. Control tokens (EOS and the like) add no text.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Pushed {
        if !tokenizer.is_special(token) {
            self.pending.push_str(&self.decoder.push(tokenizer, token));
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
        let text: String = self.pending.drain(..cut).collect();
        Pushed { text, stopped: None }
    }

    /// Whatever is held at the end of the stream.
    pub fn finish(&mut self) -> String {
        let mut rest = std::mem::take(&mut self.pending);
        rest.push_str(&self.decoder.finish());
        rest
    }
}
