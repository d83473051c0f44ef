//! The real default model, through the reference forward, greedy: it knows that Paris is the
//! capital of France (the check that the model is really there and loaded right).

use ferry_executor_svc::forward::{reference, LlamaWeights, LoadedModel};
use ferry_model::{ChatMessage, Tokenizer};

fn load() -> (Tokenizer, LlamaWeights) {
    let model = LoadedModel::open(None).expect("the default model");
    let file = std::sync::Arc::try_unwrap(model.file).expect("the only reference");
    (file.tokenizer, model.weights)
}

fn greedy(w: &LlamaWeights, tok: &Tokenizer, prompt: &[u32], max: usize) -> String {
    tok.decode(&reference::greedy(w, prompt, max, &tok.eog_token_ids).unwrap())
}

#[test]
fn completes_the_capital_of_france_with_paris() {
    let (tok, w) = load();
    let text = greedy(&w, &tok, &tok.encode("The capital of France is").unwrap(), 4);
    assert!(text.starts_with(" Paris"), "got {text:?}");
}

#[test]
fn answers_the_chat_question() {
    let (tok, w) = load();
    let messages = vec![
        ChatMessage { role: "system".into(), content: "You are a helpful assistant.".into() },
        ChatMessage { role: "user".into(), content: "What is the capital of France?".into() },
    ];
    let prompt = tok.encode(&tok.apply_chat_template(&messages, true).unwrap()).unwrap();
    let text = greedy(&w, &tok, &prompt, 16);
    assert_eq!(text, "The capital of France is Paris.");
}
