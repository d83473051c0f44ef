//! The model's tokenizer and chat template, read from the GGUF metadata, for the front to use.
//!
//! Encoding is byte-level BPE (GPT-2 style) built from `tokenizer.ggml.tokens` and `.merges`
//! with the `tokenizers` crate, after the pre-tokenizer `tokenizer.ggml.pre` names
//! ([`crate::pre_tokenizer`]), or SentencePiece as llama.cpp encodes it (`crate::spm`: merges
//! by `tokenizer.ggml.scores`, byte fallback); control and user-defined tokens (`<|im_start|>`
//! …) are matched as whole tokens in the text (`crate::vocab`). Decoding does not go through
//! `tokenizers`: every id maps to its raw bytes once at load, so decoding is a concatenation,
//! and [`IncrementalDecoder`] emits the longest complete UTF-8 prefix — it never splits a
//! character, whatever the token boundaries.

use minijinja::Environment;

use crate::chat::{self, ChatOptions};
use crate::gguf::{GgufHeader, Value};
use crate::template_helpers;
use crate::vocab::{
    bad, bpe, end_of_generation, meta, partition, spm, strings, token_bytes, token_id, token_types,
    Encoder, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED,
};
pub use crate::vocab::{TokenizerError, END_OF_GENERATION_TEXTS};

/// A chat message for the template.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ChatMessage {
    /// "system", "user", "assistant", …
    pub role: String,
    /// The text.
    pub content: String,
}

/// The tokenizer of one model.
pub struct Tokenizer {
    inner: Encoder,
    /// Raw bytes of each token id, for decoding.
    token_bytes: Vec<Vec<u8>>,
    /// End-of-sequence token.
    pub eos_token_id: u32,
    /// Every token that ends a generation, as llama.cpp collects them: the EOS first, then
    /// the EOT, EOM and fill-in-the-middle ids the metadata names and every token whose text
    /// is one of [`END_OF_GENERATION_TEXTS`] (Llama 3's `<|eot_id|>` beside its EOS
    /// `<|end_of_text|>`, Qwen's `<|endoftext|>` beside `<|im_end|>`).
    pub eog_token_ids: Vec<u32>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// Whether prompts start with BOS.
    pub add_bos: bool,
    chat_template: Option<String>,
    /// Control tokens (`<|im_end|>` …), which decoded output leaves out.
    special: Vec<bool>,
    /// User-defined tokens: matched whole in text, kept in decoded output.
    added: Vec<bool>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.token_bytes.len())
            .field("eos_token_id", &self.eos_token_id)
            .field("eog_token_ids", &self.eog_token_ids)
            .finish_non_exhaustive()
    }
}

/// The environment a chat template renders in, as `transformers` compiles one: blocks' first
/// newline trimmed and their leading whitespace stripped, Python's string and dict methods
/// (`.strip()`, `.split()`, `.items()` …), and its helpers `raise_exception`, `strftime_now`
/// (at `now`) and `tojson` (Python's `json.dumps`, where Jinja's escapes HTML).
fn template_environment(now: std::time::SystemTime) -> Environment<'static> {
    use minijinja::{Error, ErrorKind};
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |message: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_function("strftime_now", move |format: String| -> Result<String, Error> {
        template_helpers::strftime(&format, now)
            .map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
    });
    env.add_filter(
        "tojson",
        |value: minijinja::Value, kwargs: minijinja::value::Kwargs| -> Result<String, Error> {
            let indent: Option<usize> = kwargs.get("indent")?;
            // Python's other arguments: ASCII escapes and sorted keys are not what templates
            // ask for; refused rather than ignored.
            for unsupported in ["ensure_ascii", "sort_keys", "separators"] {
                if kwargs.has(unsupported) {
                    let message = format!("tojson: {unsupported} is not supported");
                    return Err(Error::new(ErrorKind::InvalidOperation, message));
                }
            }
            kwargs.assert_all_used()?;
            let json = serde_json::to_value(&value)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            Ok(template_helpers::tojson(&json, indent))
        },
    );
    env
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's metadata.
    pub fn from_gguf(header: &GgufHeader) -> Result<Self, TokenizerError> {
        let key = "tokenizer.ggml.model";
        let model = meta(header, key)?;
        let model = model.as_str().ok_or_else(|| bad(key, "a string", model))?;
        let tokens = strings(header, "tokenizer.ggml.tokens")?;
        let mut types = token_types(header, tokens.len())?;
        let key = "tokenizer.ggml.eos_token_id";
        let missing = || TokenizerError::Metadata { key, reason: "missing".into() };
        let eos_token_id = token_id(header, key, tokens.len())?.ok_or_else(missing)?;
        let eog_token_ids = end_of_generation(header, eos_token_id, &tokens, &mut types)?;
        let (inner, add_bos_default) = match model {
            "gpt2" => bpe(header, &tokens, &types)?,
            "llama" => spm(header, &tokens, &types)?,
            other => return Err(TokenizerError::Unsupported(other.to_string())),
        };
        let bos_token_id = token_id(header, "tokenizer.ggml.bos_token_id", tokens.len())?;
        let add_bos = header
            .get("tokenizer.ggml.add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or(add_bos_default);
        let chat_template =
            header.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_string);
        let token_bytes = token_bytes(model == "gpt2", &tokens, &types);
        let special = types.iter().map(|t| *t == TOKEN_TYPE_CONTROL).collect();
        let added = types.iter().map(|t| *t == TOKEN_TYPE_USER_DEFINED).collect();
        Ok(Self {
            inner,
            token_bytes,
            eos_token_id,
            eog_token_ids,
            bos_token_id,
            add_bos,
            chat_template,
            special,
            added,
        })
    }

    /// This tokenizer with `template` in place of the model's chat template.
    #[must_use]
    pub fn with_chat_template(mut self, template: String) -> Self {
        self.chat_template = Some(template);
        self
    }

    /// Number of token ids.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their
    /// ids; BOS is prepended when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if self.add_bos {
            ids.extend(self.bos_token_id);
        }
        match &self.inner {
            Encoder::Bpe(bpe) => {
                bpe.encode(text, &mut ids)
                    .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
            }
            Encoder::Spm { spm, add_space_prefix, specials } => {
                // A space before the text and after each special token, as llama.cpp does.
                let mut after_special = true;
                for part in partition(text, specials) {
                    match part {
                        Ok(run) => spm.encode(run, *add_space_prefix && after_special, &mut ids),
                        Err(id) => ids.push(id),
                    }
                    after_special = part.is_err();
                }
            }
        }
        Ok(ids)
    }

    /// Whether `id` is a control token (left out of generated text, as vLLM's
    /// `skip_special_tokens` does by default).
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Whether `id` is a user-defined token (matched whole in a text, like a control token,
    /// but kept in generated text).
    pub fn is_added(&self, id: u32) -> bool {
        self.added.get(id as usize).copied().unwrap_or(false)
    }

    /// The raw bytes of a token (empty for an id out of range).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Text of `ids` (invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> =
            ids.iter().flat_map(|id| self.token_bytes(*id).iter().copied()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Renders a conversation with the model's chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        self.render_chat(messages, &ChatOptions { add_generation_prompt, ..ChatOptions::default() })
    }

    /// Renders a conversation (messages as [`crate::chat::message`] builds them) with the
    /// model's chat template, with tools, names and calls written in when the template does
    /// not render them ([`crate::chat`]).
    pub fn render_chat(
        &self,
        mut messages: Vec<serde_json::Value>,
        options: &ChatOptions<'_>,
    ) -> Result<String, TokenizerError> {
        let err = |m: String| TokenizerError::Template(m);
        let source = self
            .chat_template
            .as_deref()
            .ok_or_else(|| err("the model has no chat template".into()))?;
        if options.add_generation_prompt && options.continue_final_message {
            return Err(err(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                    .into(),
            ));
        }
        let env = template_environment(options.now.unwrap_or_else(std::time::SystemTime::now));
        let mut env = env;
        env.add_template("chat", source).map_err(|e| err(e.to_string()))?;
        let template = env.get_template("chat").map_err(|e| err(e.to_string()))?;
        // Whether the template renders names: asked with a probe only when a message has one.
        if messages.iter().any(chat::names_participant) {
            const PROBE: &str = "ferry-name-probe";
            let probe = serde_json::json!([{"role": "user", "content": "x", "name": PROBE}]);
            let shown = template
                .render(minijinja::context! { messages => probe, add_generation_prompt => false })
                .is_ok_and(|t| t.contains(PROBE));
            if !shown {
                chat::names_in_content(&mut messages);
            }
        }
        let renders_tools = template.undeclared_variables(false).contains("tools");
        if !renders_tools {
            messages = chat::hermes(messages, options.tools);
        }
        let last = if options.continue_final_message {
            let text = messages
                .last()
                .and_then(|m| m.get("content"))
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_string();
            if text.is_empty() {
                return Err(err(
                    "continue_final_message needs a last message with text to continue".into(),
                ));
            }
            Some(text)
        } else {
            None
        };
        let mut context = options.kwargs.cloned().unwrap_or_default();
        if let Some(k) =
            context.keys().find(|k| chat::RESERVED_TEMPLATE_VARIABLES.contains(&k.as_str()))
        {
            return Err(err(format!("chat_template_kwargs may not set {k:?}")));
        }
        context.insert("messages".into(), messages.into());
        if renders_tools && !options.tools.is_empty() {
            context.insert("tools".into(), options.tools.to_vec().into());
        }
        context.insert("add_generation_prompt".into(), options.add_generation_prompt.into());
        context.insert("continue_final_message".into(), options.continue_final_message.into());
        context.insert(
            "bos_token".into(),
            self.bos_token_id.map(|id| self.decode(&[id])).unwrap_or_default().into(),
        );
        context.insert("eos_token".into(), self.decode(&[self.eos_token_id]).into());
        let mut text = template.render(context).map_err(|e| err(e.to_string()))?;
        if let Some(last) = last {
            // As vLLM does: cut the rendering right after the last message's text.
            let end = text.rfind(&last).ok_or_else(|| {
                err("continue_final_message: the template does not render the last message's \
                     text as given, so it cannot be left open"
                    .into())
            })? + last.len();
            text.truncate(end);
        }
        Ok(text)
    }
}

/// Turns a stream of token ids into text deltas that never split a UTF-8 character.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    /// Bytes of a character that is not complete yet (at most 3).
    pending: Vec<u8>,
}

impl IncrementalDecoder {
    /// Appends one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        let mut out = String::new();
        self.push_into(tokenizer, id, &mut out);
        out
    }

    /// [`Self::push`], the text appended to `out`.
    pub fn push_into(&mut self, tokenizer: &Tokenizer, id: u32, out: &mut String) {
        let bytes = tokenizer.token_bytes(id);
        if self.pending.is_empty() {
            // The common case: a token of whole characters, nothing held before it.
            if let Ok(s) = std::str::from_utf8(bytes) {
                out.push_str(s);
                return;
            }
        }
        self.pending.extend_from_slice(bytes);
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[..valid]).expect("prefix checked valid"),
                    );
                    match e.error_len() {
                        // An incomplete character at the end: keep it for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return;
                        }
                        // Bytes that can never form a character: replace them and go on.
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + len);
                        }
                    }
                }
            }
        }
    }

    /// Text still held at the end of the stream (an incomplete character, replaced).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
