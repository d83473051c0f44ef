//! The tokenizer and chat template read from the real default model's GGUF metadata, and what
//! the header says of the model.

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
