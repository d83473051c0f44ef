//! Structured outputs: a request's grammar (a JSON schema, a regular expression, a list of
//! choices, a Lark grammar) compiled against the model's vocabulary with llguidance, the
//! library vLLM and SGLang use.
//!
//! Why it exists: the front compiles a request's grammar to refuse a bad one with a 400 before
//! it is placed, and the executor compiles it again (it trusts no scheduler) into a [`Matcher`]
//! whose token mask it applies before sampling. Both sides build the grammar the same way,
//! here.
//!
//! What it guarantees:
//! - A matcher allows exactly the tokens that keep the output a prefix of a sentence of the
//!   grammar; once the grammar is complete it allows only the end-of-sequence token, so a
//!   constrained output always parses unless `max_tokens` cuts it.
//! - Control tokens (`<|im_start|>` …) are never allowed, except the end of sequence when the
//!   grammar accepts.
//! - JSON is written compactly, with `", "` and `": "` as separators and no other whitespace
//!   between tokens: with free whitespace a small model at temperature 1 can pad a value with
//!   blanks until `max_tokens` and never close it. A schema's own `x-guidance` options win.
//! - Building the vocabulary's trie costs ~100 ms for 49k tokens, so [`Grammars`] is built
//!   once per model, on first use; compiling a grammar costs about a millisecond for a
//!   typical schema; the lexer's states are built lazily as masks need them, within
//!   llguidance's default limits (each mask is bounded in work).

use std::sync::Arc;

use ferry_proto::v1;
use llguidance::api::{GrammarWithLexer, ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::ParserFactory;
use serde_json::{json, Value};

use crate::Tokenizer;

pub use llguidance::toktrie::SimpleVob as TokenMask;
pub use llguidance::Matcher;

/// The most bytes a request's constraint may take on the wire (its schema, regex, Lark grammar
/// or choices, encoded). vLLM has no limit; a bound keeps a request's compile time and a step's
/// size bounded.
pub const MAX_GRAMMAR_BYTES: usize = 64 * 1024;

/// Why a grammar cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The constraint names no grammar.
    #[error("the structured output constraint is empty")]
    Empty,
    /// The grammar's source is too long.
    #[error("the grammar takes {len} bytes, more than the limit of {max}")]
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// [`MAX_GRAMMAR_BYTES`].
        max: usize,
    },
    /// The JSON schema is not JSON.
    #[error("the JSON schema is not valid JSON: {0}")]
    SchemaJson(String),
    /// A choice list is empty or has an empty string.
    #[error("{0}")]
    Choice(&'static str),
    /// llguidance refused the grammar (the message says why).
    #[error("{0}")]
    Compile(String),
    /// The model's vocabulary could not be turned into a token trie.
    #[error("structured outputs are unavailable for this model: {0}")]
    Vocabulary(String),
    /// Tokens already generated (a continuation) leave the grammar.
    #[error("its {count} earlier tokens break the grammar: {reason}")]
    Replay {
        /// How many tokens were replayed.
        count: usize,
        /// llguidance's reason.
        reason: String,
    },
}

/// llguidance's view of the model's vocabulary: each token's bytes, with control tokens marked
/// special so that no grammar can produce them.
struct Vocabulary {
    trie: TokTrie,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    // llguidance tokenizes only grammar literals for its own bookkeeping (this service uses
    // no prompt healing or forced tokens); the longest-match split of the trie is enough.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }
}

/// Compiles grammars for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    vocab_size: usize,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("vocab_size", &self.vocab_size).finish_non_exhaustive()
    }
}

impl Grammars {
    /// The compiler for `tokenizer`'s vocabulary, whose end of sequence is `eos_token_id`.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, GrammarError> {
        let n = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id);
                if tokenizer.is_special(id) || tokenizer.is_added(id) {
                    let mut marked = Vec::with_capacity(bytes.len() + 1);
                    marked.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    marked.extend_from_slice(bytes);
                    marked
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(n as u32, tokenizer.eos_token_id);
        info.tok_bos = tokenizer.bos_token_id;
        let env: TokEnv = Arc::new(Vocabulary { trie: TokTrie::from(&info, &words) });
        let caps = InferenceCapabilities {
            ff_tokens: false,
            backtrack: false,
            conditional_ff_tokens: false,
            fork: false,
        };
        let mut factory = ParserFactory::new(
            &env,
            caps,
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits { verbose_errors: false, ..ParserLimits::default() };
        Ok(Self { factory, vocab_size: n })
    }

    /// Tokens in the vocabulary (a mask's length).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A matcher for `constraint` that has consumed `output` (the tokens a continuation
    /// already generated), where the next token is drawn.
    pub fn compile_after(
        &self,
        constraint: &v1::StructuredOutput,
        output: &[u32],
    ) -> Result<Matcher, GrammarError> {
        let mut matcher = self.compile(constraint)?;
        if !output.is_empty() {
            matcher
                .consume_tokens(output)
                .map_err(|e| GrammarError::Replay { count: output.len(), reason: e.to_string() })?;
        }
        Ok(matcher)
    }

    /// A matcher at the start of `constraint`'s grammar.
    pub fn compile(&self, constraint: &v1::StructuredOutput) -> Result<Matcher, GrammarError> {
        let grammar = top_level(constraint)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Compile(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Compile(e));
        }
        Ok(matcher)
    }
}

/// The JSON compile options this service defaults to (see the module's head).
pub(crate) fn json_defaults() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` (a JSON schema object) with whitespace between its tokens following `pattern` (a
/// regular expression; vLLM's `guided_whitespace_pattern`) and bare `,` and `:` separators;
/// the schema's own `x-guidance` options win, as they win over the defaults.
pub fn with_whitespace_pattern(schema: &mut serde_json::Map<String, Value>, pattern: &str) {
    let mut options =
        json!({"whitespace_pattern": pattern, "item_separator": ",", "key_separator": ":"});
    if let Some(own) = schema.get("x-guidance") {
        llguidance::json_merge(&mut options, own);
    }
    schema.insert("x-guidance".into(), options);
}

/// The encoded size of `constraint`, checked against [`MAX_GRAMMAR_BYTES`].
fn check_size(constraint: &v1::StructuredOutput) -> Result<(), GrammarError> {
    let len = prost::Message::encoded_len(constraint);
    if len > MAX_GRAMMAR_BYTES {
        return Err(GrammarError::TooLong { len, max: MAX_GRAMMAR_BYTES });
    }
    Ok(())
}

/// llguidance's grammar for `constraint`.
fn top_level(constraint: &v1::StructuredOutput) -> Result<TopLevelGrammar, GrammarError> {
    use v1::structured_output::Kind;
    check_size(constraint)?;
    let json_schema = |mut schema: Value| {
        if let Value::Object(o) = &mut schema {
            let mut options = json_defaults();
            if let Some(own) = o.get("x-guidance") {
                llguidance::json_merge(&mut options, own);
            }
            o.insert("x-guidance".into(), options);
        } else if schema.is_boolean() {
            // `true` accepts any value, `false` none: as an object schema, with the options.
            schema = if schema == true {
                json!({"x-guidance": json_defaults()})
            } else {
                json!({"not": {}, "x-guidance": json_defaults()})
            };
        }
        TopLevelGrammar::from_json_schema(schema)
    };
    Ok(match constraint.kind.as_ref().ok_or(GrammarError::Empty)? {
        Kind::JsonSchema(text) => {
            let schema: Value =
                serde_json::from_str(text).map_err(|e| GrammarError::SchemaJson(e.to_string()))?;
            json_schema(schema)
        }
        Kind::JsonObject(_) => json_schema(json!({"type": "object"})),
        Kind::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Kind::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        Kind::Choice(c) => {
            if c.choices.is_empty() {
                return Err(GrammarError::Choice("the choice list is empty"));
            }
            if c.choices.iter().any(String::is_empty) {
                return Err(GrammarError::Choice("a choice is an empty string"));
            }
            let alternatives: Vec<String> = c
                .choices
                .iter()
                .map(|s| serde_json::to_string(s).expect("a string serializes"))
                .collect();
            let mut g = GrammarWithLexer::from_lark(format!("start: {}", alternatives.join(" | ")));
            g.name = Some("choice".into());
            TopLevelGrammar::from_grammar(g)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(k: v1::structured_output::Kind) -> v1::StructuredOutput {
        v1::StructuredOutput { kind: Some(k) }
    }

    #[test]
    fn sources_are_checked_before_compiling() {
        use v1::structured_output::Kind;
        assert_eq!(top_level(&v1::StructuredOutput::default()).unwrap_err(), GrammarError::Empty);
        // A tag and a 3-byte length, then the text.
        let long = "a".repeat(MAX_GRAMMAR_BYTES - 3);
        assert_eq!(
            top_level(&kind(Kind::Regex(long))).unwrap_err(),
            GrammarError::TooLong { len: MAX_GRAMMAR_BYTES + 1, max: MAX_GRAMMAR_BYTES }
        );
        let fits = "a".repeat(MAX_GRAMMAR_BYTES - 4);
        assert!(top_level(&kind(Kind::Regex(fits))).is_ok());
        assert!(matches!(
            top_level(&kind(Kind::JsonSchema("{".into()))).unwrap_err(),
            GrammarError::SchemaJson(_)
        ));
        let empty = kind(Kind::Choice(v1::Choices { choices: vec![] }));
        assert_eq!(top_level(&empty).unwrap_err().to_string(), "the choice list is empty");
        let blank = kind(Kind::Choice(v1::Choices { choices: vec!["a".into(), String::new()] }));
        assert_eq!(top_level(&blank).unwrap_err().to_string(), "a choice is an empty string");
    }

    #[test]
    fn a_schema_gets_compact_separators_unless_it_sets_its_own() {
        use v1::structured_output::Kind;
        let own = r#"{"type": "object", "x-guidance": {"item_separator": ","}}"#;
        let g = top_level(&kind(Kind::JsonSchema(own.into()))).unwrap();
        let schema = g.grammars[0].json_schema.as_ref().unwrap();
        assert_eq!(schema["x-guidance"]["item_separator"], ",");
        assert_eq!(schema["x-guidance"]["key_separator"], ": ");
        assert_eq!(schema["x-guidance"]["whitespace_flexible"], false);
    }
}
