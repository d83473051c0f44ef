//! The tokenizer and chat template read from the real default model's GGUF metadata, and what
//! the header says of the model.

use ferry_model::gguf::Value;
use ferry_model::{ChatMessage, IncrementalDecoder, ModelFile, Tokenizer};

fn model() -> ModelFile {
    ModelFile::open(None).expect("the default model")
}

fn tokenizer() -> Tokenizer {
    model().tokenizer
}

#[test]
fn the_header_gives_the_shape_name_and_a_stable_fingerprint() {
    let m = model();
    assert_eq!(m.name, "SmolLM2-135M-Instruct");
    let s = m.shape;
    assert_eq!((s.num_layers, s.hidden, s.num_heads, s.num_kv_heads), (30, 576, 9, 3));
    assert_eq!(
        (s.intermediate, s.head_dim, s.vocab_size, s.max_model_len),
        (1536, 64, 49152, 8192)
    );
    // The fingerprint depends on the file alone, and differs for another file.
    assert_eq!(m.fingerprint, model().fingerprint);
    assert_eq!(m.fingerprint.len(), 16);
    let mut other = ferry_model::GgufHeader::open(&m.path).unwrap();
    other.tensors.pop();
    assert_ne!(ferry_model::fingerprint(&other), m.fingerprint);
}

#[test]
fn round_trips_text_and_keeps_special_tokens_whole() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 49152);
    for text in ["The capital of France is", "naïve café — 東京 🚀 123456", "  spaces\n\ttabs", ""]
    {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids), text);
    }
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>").unwrap();
    let im_start = tok.encode("<|im_start|>").unwrap();
    assert_eq!(im_start.len(), 1, "special token must be one id");
    assert_eq!(ids[0], im_start[0]);
    assert_eq!(*ids.last().unwrap(), tok.eos_token_id, "<|im_end|> is the EOS of this model");
    // Digits are split one by one, as the model was trained.
    assert_eq!(tok.encode("2024").unwrap().len(), 4);
}

#[test]
fn incremental_decoding_never_splits_a_character() {
    let tok = tokenizer();
    let text = "Grüße aus 東京 🚀🚀 and plain text";
    let ids = tok.encode(text).unwrap();
    let mut dec = IncrementalDecoder::default();
    let mut out = String::new();
    for id in &ids {
        let delta = dec.push(&tok, *id);
        // Every delta is valid UTF-8 by construction (a String); none may hold U+FFFD here.
        assert!(!delta.contains(char::REPLACEMENT_CHARACTER), "split character in {delta:?}");
        out.push_str(&delta);
    }
    out.push_str(&dec.finish());
    assert_eq!(out, text);
    // Raw bytes that are not UTF-8 become U+FFFD instead of being lost or panicking.
    let mut dec = IncrementalDecoder::default();
    let lone = (0..tok.vocab_size() as u32).find(|id| tok.token_bytes(*id) == [0xF0]).unwrap();
    assert_eq!(dec.push(&tok, lone), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
}

#[test]
fn chat_template_renders_the_conversation() {
    let tok = tokenizer();
    let messages = vec![
        ChatMessage { role: "system".into(), content: "You are a helpful assistant.".into() },
        ChatMessage { role: "user".into(), content: "What is the capital of France?".into() },
    ];
    let text = tok.apply_chat_template(&messages, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    // Without a system message the template supplies its default one.
    let text = tok.apply_chat_template(&messages[1..], false).unwrap();
    assert!(text.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    assert!(!text.ends_with("assistant\n"));
}

fn msg(role: &str, content: &str) -> serde_json::Value {
    ferry_model::chat::message(role, content, "", "", "").unwrap()
}

#[test]
fn a_template_without_tools_gets_them_in_the_hermes_format() {
    use ferry_model::chat::{message, ChatOptions};
    let tok = tokenizer();
    let tools = [
        serde_json::json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}),
    ];
    let calls = r#"[{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]"#;
    let messages = vec![
        msg("user", "What time is it?"),
        message("assistant", "", "", calls, "").unwrap(),
        message("tool", "12:00", "", "", "c1").unwrap(),
    ];
    let options =
        ChatOptions { add_generation_prompt: true, tools: &tools, ..ChatOptions::default() };
    let text = tok.render_chat(messages, &options).unwrap();
    assert!(text.starts_with("<|im_start|>system\n# Tools\n"), "{text}");
    assert!(
        text.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_time\""),
        "{text}"
    );
    assert!(text.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}\n</tool_call><|im_end|>"), "{text}");
    assert!(text.contains("<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), "{text}");
}

#[test]
fn names_continuations_and_template_variables_reach_the_prompt() {
    use ferry_model::chat::{message, ChatOptions};
    let tok = tokenizer();
    // SmolLM2's template renders no names: the name goes before the text.
    let named = vec![message("user", "hello", "ann", "", "").unwrap()];
    let text = tok.render_chat(named, &ChatOptions::default()).unwrap();
    assert!(text.contains("<|im_start|>user\nann: hello<|im_end|>"), "{text}");
    // The last message left open.
    let open = vec![msg("user", "Capital of France?"), msg("assistant", "The capital is")];
    let options = ChatOptions { continue_final_message: true, ..ChatOptions::default() };
    let text = tok.render_chat(open.clone(), &options).unwrap();
    assert!(text.ends_with("<|im_start|>assistant\nThe capital is"), "{text}");
    let both = ChatOptions { add_generation_prompt: true, ..options };
    let err = tok.render_chat(open, &both).unwrap_err().to_string();
    assert!(
        err.contains("Cannot set both `continue_final_message` and `add_generation_prompt`"),
        "{err}"
    );
    // A template that knows tools, names and variables gets them as values.
    let own = "{% for m in messages %}[{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}]{{ m.content }}{% for c in m.tool_calls or [] %}<call {{ c.function.name }} {{ c.function.arguments.tz }}>{% endfor %}{% endfor %}{% if tools %}tools={{ tools | length }}{% endif %}{% if enable_thinking is defined %} thinking={{ enable_thinking }}{% endif %}";
    let tok = tok.with_chat_template(own.into());
    let calls = r#"[{"type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]"#;
    let messages = vec![
        message("user", "hi", "ann", "", "").unwrap(),
        message("assistant", "", "", calls, "").unwrap(),
    ];
    let tools = [serde_json::json!({"type": "function", "function": {"name": "get_time"}})];
    let kwargs: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(r#"{"enable_thinking": false}"#).unwrap();
    let options = ChatOptions { tools: &tools, kwargs: Some(&kwargs), ..ChatOptions::default() };
    let text = tok.render_chat(messages.clone(), &options).unwrap();
    assert_eq!(text, "[user:ann]hi[assistant]<call get_time UTC>tools=1 thinking=False");
    let reserved: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(r#"{"messages": []}"#).unwrap();
    let options = ChatOptions { kwargs: Some(&reserved), ..ChatOptions::default() };
    let err = tok.render_chat(messages, &options).unwrap_err().to_string();
    assert!(err.contains("chat_template_kwargs may not set \"messages\""), "{err}");
}

#[test]
fn bad_words_are_masked_alone_and_after_a_space() {
    use ferry_model::sampling::LogitAdjust;
    let tok = tokenizer();
    let seqs =
        LogitAdjust::bad_word_sequences(&tok, &["Paris".into(), " hello world".into()]).unwrap();
    let texts: Vec<String> = seqs.iter().map(|s| tok.decode(&s.ids)).collect();
    // Each word as it starts a text and as it follows a space (vLLM's two forms).
    assert_eq!(texts, ["Paris", " Paris", "hello world", " hello world"], "{seqs:?}");
    assert!(seqs.iter().all(|s| tok.bos_token_id.is_none_or(|b| s.ids[0] != b)));
}

/// The tokens that end a generation, as llama.cpp collects them: the EOS, the ids the metadata
/// names (EOT, EOM, fill-in-the-middle) and the tokens of the known end texts, made control
/// tokens where the file left them normal; an id past the vocabulary is refused, naming its key.
#[test]
fn the_end_of_generation_set_is_llama_cpps() {
    let tok = tokenizer();
    // SmolLM2: its EOS <|im_end|>, and <|endoftext|>.
    assert_eq!(tok.decode(&[2, 0]), "<|im_end|><|endoftext|>");
    assert_eq!(tok.eog_token_ids, [2, 0]);

    // A Llama 3 style vocabulary: EOS <|end_of_text|>, the EOT key naming <|eot_id|>, an
    // <|eom_id|> of the normal type, and a fill-in-the-middle separator.
    let mut header = ferry_model::GgufHeader::open(&model().path).unwrap();
    let set = |h: &mut ferry_model::GgufHeader, key: &str, v: Value| {
        h.metadata.insert(key.into(), v);
    };
    let rename = |h: &mut ferry_model::GgufHeader, id: usize, text: &str, ty: i64| {
        let Some(Value::Array(tokens)) = h.metadata.get_mut("tokenizer.ggml.tokens") else {
            panic!("tokens")
        };
        tokens[id] = Value::String(text.into());
        let Some(Value::Array(types)) = h.metadata.get_mut("tokenizer.ggml.token_type") else {
            panic!("types")
        };
        types[id] = Value::I64(ty);
    };
    for (id, text, ty) in [
        (0, "<|end_of_text|>", 3),
        (2, "<|eot_id|>", 3),
        (3, "<|eom_id|>", 1),
        (4, "<|fim_sep_custom|>", 3),
    ] {
        rename(&mut header, id, text, ty);
    }
    set(&mut header, "tokenizer.ggml.eos_token_id", Value::U64(0));
    set(&mut header, "tokenizer.ggml.eot_token_id", Value::U64(2));
    set(&mut header, "tokenizer.ggml.fim_sep_token_id", Value::U64(4));
    let llama3 = Tokenizer::from_gguf(&header).unwrap();
    assert_eq!(llama3.eog_token_ids, [0, 2, 3, 4]);
    // The normal-typed <|eom_id|> became a control token: matched whole, left out of text.
    assert_eq!(llama3.encode("a<|eom_id|>").unwrap().len(), 2);
    assert!(llama3.is_special(3));

    set(&mut header, "tokenizer.ggml.eom_token_id", Value::U64(49_152));
    let err = Tokenizer::from_gguf(&header).unwrap_err().to_string();
    assert!(err.contains("tokenizer.ggml.eom_token_id") && err.contains("49152"), "{err}");
}

/// Each family's published chat template (`tests/templates/`, as llama.cpp keeps them from the
/// model cards) renders as `transformers` renders it with Jinja2 (`reference_templates.py`:
/// trimmed blocks, its `tojson`, `raise_exception` and `strftime_now`, the clock fixed):
/// byte for byte, and with the template's own refusals (Gemma's system role, Mistral's tool-call
/// ids) where Jinja2 raises.
#[test]
fn published_chat_templates_render_as_transformers_renders_them() {
    use ferry_model::ChatOptions;
    let tok = tokenizer();
    let (bos, eos) = (tok.decode(&[tok.bos_token_id.unwrap()]), tok.decode(&[tok.eos_token_id]));
    let dir = std::env::temp_dir().join(format!("ferry-templates-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("expected.json");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/reference_templates.py");
    let status =
        std::process::Command::new("python3").arg(script).arg(&out).arg(&bos).arg(&eos).status();
    assert!(status.unwrap().success(), "{script} failed (needs pip's jinja2: scripts/setup)");
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    // The reference's clock: 2026-12-05 13:45:07.
    let now = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_796_478_307);
    let mut rendered = std::collections::BTreeMap::new();
    let mut tokenizers = std::collections::HashMap::new();
    for case in expected["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let t = tokenizers.entry(name).or_insert_with(|| {
            let path = format!("{}/tests/templates/{name}", env!("CARGO_MANIFEST_DIR"));
            tokenizer().with_chat_template(std::fs::read_to_string(path).unwrap())
        });
        let messages = case["messages"].as_array().unwrap().clone();
        let tools = case["tools"].as_array().unwrap().clone();
        let options = ChatOptions {
            add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
            tools: &tools,
            now: Some(now),
            ..ChatOptions::default()
        };
        let what = format!("{name}, {}, {}", case["conversation"], case["add_generation_prompt"]);
        match (t.render_chat(messages, &options), case["text"].as_str()) {
            (Ok(got), Some(want)) => assert_eq!(got, want, "{what}"),
            (Err(e), None) => {
                let want = case["error"].as_str().unwrap();
                assert!(e.to_string().contains(want), "{what}: {e} is not {want:?}");
            }
            (got, _) => panic!("{what}: {got:?}, where Jinja2 gave {}", case["text"]),
        }
        *rendered.entry(name).or_insert(0) += 1;
    }
    std::fs::remove_dir_all(&dir).ok();
    // Every template, every conversation it takes, both ways.
    assert_eq!(rendered.len(), 9, "{rendered:?}");
    assert!(rendered.values().all(|&n| n >= 4), "{rendered:?}");
}
