//! Llama-family files Ferry did not write, against a forward Ferry did not write: tiny models
//! in GGUF as llama.cpp's converter lays them out (`llama_hf.py`, with the `gguf` package's
//! quantizers), their logits from a numpy forward after Hugging Face's `modeling_llama.py`
//! (f64, HF's layout and rotary scalings). Ferry loads each file and computes every position's
//! logits with its reference forward (the serving forward is held to that one elsewhere).

use std::path::{Path, PathBuf};

use ferry_executor_svc::forward::reference::{forward, ContiguousCache};
use ferry_executor_svc::forward::{LoadedModel, ModelFile};

/// Largest difference of a logit from the f64 reference: Ferry computes in f32 with the
/// file's exact weights (logits here are of size 1-4; measured: within 4e-6).
const TOLERANCE: f32 = 1e-4;

fn references() -> (PathBuf, serde_json::Value) {
    let dir = std::env::temp_dir().join(format!("ferry-families-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/executor/families/llama_hf.py");
    let status = std::process::Command::new("python3").arg(script).arg(&dir).status().unwrap();
    assert!(status.success(), "{script} failed (needs pip's numpy and gguf: scripts/setup)");
    let expected = serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap());
    (dir, expected.unwrap())
}

fn load(path: &Path) -> Result<LoadedModel, String> {
    let file = ModelFile::open(Some(path)).map_err(|e| e.to_string())?;
    LoadedModel::load(std::sync::Arc::new(file)).map_err(|e| e.to_string())
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn llama_files_compute_the_published_forward_with_their_rope_scaling_and_extras_are_refused() {
    let (dir, expected) = references();
    let mut checked = Vec::new();
    for (name, want) in expected["variants"].as_object().unwrap() {
        let model = load(Path::new(want["gguf"].as_str().unwrap())).unwrap();
        let w = &model.weights;
        let tokens = ids(&want["tokens"]);
        let mut cache = ContiguousCache::default();
        let mut worst = 0f32;
        for (i, (&t, logits)) in tokens.iter().zip(want["logits"].as_array().unwrap()).enumerate() {
            let got = forward(w, &[t], &mut cache).unwrap();
            let (want, unscaled) = (floats(logits), floats(&want["unscaled_logits"][i]));
            let diff = max_diff(&got, &want);
            assert!(diff < TOLERANCE, "{name}: position {i}: logits differ by {diff}");
            worst = worst.max(diff);
            // Where the variant's rotary scaling changes the logits, the test could tell a
            // forward that ignored it (the scaled and unscaled references differ by more).
            if i >= 4 && name != "llama" {
                assert!(max_diff(&want, &unscaled) > 10.0 * TOLERANCE, "{name}: {i}: no scaling");
            }
        }
        eprintln!("{name}: logits within {worst:e} of the f64 reference");
        // Greedy, from the reference's f64 argmax (which no near tie decides here).
        let mut next = tokens.clone();
        let mut cache = ContiguousCache::default();
        let mut logits = forward(w, &next, &mut cache).unwrap();
        for _ in 0..ids(&want["greedy"]).len() {
            let t = ferry_executor_svc::forward::ops::argmax(&logits).unwrap() as u32;
            next.push(t);
            logits = forward(w, &[t], &mut cache).unwrap();
        }
        assert_eq!(next[tokens.len()..], ids(&want["greedy"])[..], "{name}: greedy");
        checked.push(name.clone());
    }
    checked.sort();
    assert_eq!(checked, ["linear", "llama", "llama3"]);
    for (name, refused) in expected["refused"].as_object().unwrap() {
        let err = load(Path::new(refused[0].as_str().unwrap())).unwrap_err();
        let what = refused[1].as_str().unwrap();
        assert!(err.contains(what), "{name}: the refusal does not name {what}: {err}");
    }
    std::fs::remove_dir_all(dir).ok();
}
