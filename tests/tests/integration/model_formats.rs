//! The default model in other weight types, re-quantized by the `gguf` package (not Ferry;
//! `requantize.py`), served end to end by `ferry serve --model FILE`: the file's greedy answers
//! over HTTP equal the reference forward's of the same file (f32 on its exactly converted
//! weights; that forward is held to an independent f64 one in the executor's tests). Two types
//! run here, one of each kind of packed form the default model does not already use: `Q5_1`
//! (bytes with factored parameters, the k-quants' `Q5_K` form, which the model's 576-wide rows
//! cannot take) and `BF16` (the float forms: the weights themselves, no scale); `Q8_0` and
//! `Q5_0` are the `Q8` form, which the default model's output head already runs, `F16` differs
//! from `BF16` only in its conversion (held to the `gguf` package's in the executor's tests),
//! and re-quantizing costs 5-8 s a type (`Q8_0`, `Q5_0`, `Q5_1`, `F16` and `BF16` passed when
//! run by hand: `TYPES`).

use ferry_executor_svc::forward::{reference, LoadedModel};
use ferry_tests::{http, Service};

const PROMPTS: [&str; 2] = ["The capital of France is", "def fibonacci(n):"];
const TOKENS: usize = 12;
const TYPES: [&str; 2] = ["Q5_1", "BF16"];

/// The reference forward's greedy continuation of `prompt` (up to EOS or `TOKENS`).
fn reference_answer(model: &LoadedModel, prompt: &str) -> String {
    let tok = &model.file.tokenizer;
    let prompt = tok.encode(prompt).unwrap();
    tok.decode(&reference::greedy(&model.weights, &prompt, TOKENS, &tok.eog_token_ids).unwrap())
}

#[test]
fn the_default_model_requantized_to_q5_1_and_bf16_serves_its_reference_greedy_answers() {
    let source = ferry_model::default_model_path().unwrap();
    let dir = std::env::temp_dir().join(format!("ferry-requantized-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/integration/requantize.py");
    for ty in TYPES {
        let path = dir.join(format!("smollm2-{ty}.gguf"));
        let status = std::process::Command::new("python3")
            .arg(script)
            .arg(&source)
            .arg(&path)
            .arg(ty)
            .status()
            .unwrap();
        assert!(status.success(), "{script} {ty} failed (needs pip's gguf: scripts/setup)");
        let model = LoadedModel::open(Some(&path)).unwrap();
        let want: Vec<String> = PROMPTS.iter().map(|p| reference_answer(&model, p)).collect();
        drop(model);
        let file = path.to_str().unwrap();
        let args =
            ["serve", "--model", file, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
        let serve = Service::start("ferry", &args, 4).unwrap();
        for (prompt, want) in PROMPTS.iter().zip(&want) {
            let body = serde_json::json!({
                "model": format!("smollm2-{ty}"), "prompt": prompt, "max_tokens": TOKENS,
                "temperature": 0,
            });
            let (status, text) =
                http(serve.addr("http"), "POST", "/v1/completions", body.to_string().as_bytes())
                    .unwrap();
            assert_eq!(status, 200, "{ty}: {text}");
            let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
            let got = answer["choices"][0]["text"].as_str().unwrap();
            assert_eq!(got, want, "{ty}: {prompt:?}");
            assert!(!got.is_empty(), "{ty}: {prompt:?}: an empty answer shows nothing");
        }
        eprintln!("{ty}: {want:?}");
        std::fs::remove_file(&path).ok();
    }
    std::fs::remove_dir_all(&dir).ok();
}
