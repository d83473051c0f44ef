use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::*;
use crate::family::Family;

/// 2 layers, width 8, 2 query heads and 1 KV head of 4, FFN 12.
fn shape() -> LlamaShape {
    LlamaShape {
        family: Family::LLAMA,
        num_layers: 2,
        hidden: 8,
        intermediate: 12,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 4,
        vocab_size: 32,
        rope_theta: 10_000.0,
        rope_scale: 1.0,
        rope_dims: 4,
        rope_mscale: 1.0,
        rope_long: false,
        rms_eps: 1e-5,
        max_model_len: 64,
        sliding_window: None,
        query_scale: 0.5,
        attn_softcap: None,
        final_softcap: None,
    }
}

/// A PEFT folder holding `tensors` (name, rows, cols; values `i + 0.5·seed`) and `config`.
fn peft_dir(tag: &str, config: &serde_json::Value, tensors: &[(&str, usize, usize)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferry-lora-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .enumerate()
        .map(|(seed, &(name, rows, cols))| {
            let values = (0..rows * cols).map(|i| i as f32 + 0.5 * seed as f32);
            (name.to_string(), vec![rows, cols], values.flat_map(f32::to_le_bytes).collect())
        })
        .collect();
    let views: HashMap<String, TensorView> = data
        .iter()
        .map(|(n, s, d)| (n.clone(), TensorView::new(Dtype::F32, s.clone(), d).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("adapter_model.safetensors")).unwrap();
    dir
}

fn key(layer: usize, module: &str, half: &str) -> String {
    let block = if module.ends_with("_proj") && module.starts_with(['q', 'k', 'v', 'o']) {
        "self_attn"
    } else {
        "mlp"
    };
    format!("base_model.model.model.layers.{layer}.{block}.{module}.lora_{half}.weight")
}

fn config(r: usize, alpha: f64) -> serde_json::Value {
    serde_json::json!({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none",
        "target_modules": ["q_proj", "v_proj", "down_proj"], "use_rslora": false})
}

#[test]
fn a_peft_adapter_is_placed_in_the_stacked_products_with_q_rows_in_gguf_order() {
    let (qa, qb, va, vb, da, db) = (
        key(0, "q_proj", "A"),
        key(0, "q_proj", "B"),
        key(0, "v_proj", "A"),
        key(0, "v_proj", "B"),
        key(1, "down_proj", "A"),
        key(1, "down_proj", "B"),
    );
    let tensors =
        [(&*qa, 2, 8), (&*qb, 8, 2), (&*va, 2, 8), (&*vb, 4, 2), (&*da, 2, 12), (&*db, 8, 2)];
    let dir = peft_dir("placed", &config(2, 8.0), &tensors);
    let s = shape();
    let a = load(&dir, &s, 16).unwrap();
    assert_eq!((a.format, a.rank()), (LoraFormat::Peft, 2));
    assert_eq!(a.modules(), [Module::Q, Module::V, Module::Down]);
    let q = &a.layers[0].deltas(Product::Qkv)[0];
    assert_eq!(
        (q.module, q.col, q.in_features, q.out_features, q.scale),
        (Module::Q, 0, 8, 8, 4.0)
    );
    let v = &a.layers[0].deltas(Product::Qkv)[1];
    assert_eq!((v.col, v.out_features), (8 + 4, 4), "v after q and k");
    assert_eq!(a.layers[1].deltas(Product::Down)[0].in_features, 12);
    assert!(
        a.layers[1].deltas(Product::Qkv).is_empty() && a.layers[0].deltas(Product::Down).is_empty()
    );
    // Head 0's rows 0..4 were [r0 r1 r2 r3] (halves [r0 r1], [r2 r3]); llama.cpp's order
    // interleaves the halves: [r0 r2 r1 r3]. B's values are its index (seed 1: + 0.5).
    // B's column 0 is Bᵀ's row 0.
    let rows: Vec<usize> = (0..8).map(|i| q.bt[i] as usize / 2).collect();
    assert_eq!(rows, [0, 2, 1, 3, 4, 6, 5, 7]);
    let raw: Vec<f32> = [0, 2, 4, 6, 1, 3, 5, 7].iter().map(|&i| i as f32 + 1.5).collect();
    assert_eq!(v.bt, raw, "v rows keep their order (B transposed: column 0, then column 1)");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_update_adds_scale_times_b_a_x_to_its_columns() {
    let d = LoraDelta {
        module: Module::K,
        col: 2,
        in_features: 3,
        out_features: 2,
        a: vec![1.0, 2.0, 3.0, 0.0, -1.0, 1.0],
        bt: vec![1.0, 2.0, 0.0, -1.0],
        scale: 0.5,
    };
    let mut out = vec![10.0; 5];
    d.add_to(&[1.0, 1.0, 2.0], &mut out, &mut Vec::new());
    // A x = [9, 1]; · 0.5 = [4.5, 0.5]; B · that = [4.5, 8.5].
    assert_eq!(out, [10.0, 10.0, 14.5, 18.5, 10.0]);
}

/// A refusal case: tag, config, tensors, what the error says.
type Case<'a> = (&'a str, serde_json::Value, Vec<(&'a str, usize, usize)>, &'a str);

#[test]
fn what_ferry_does_not_do_is_refused_naming_it() {
    let (qa, qb) = (key(0, "q_proj", "A"), key(0, "q_proj", "B"));
    let (fa, fb) = (key(5, "q_proj", "A"), key(5, "q_proj", "B"));
    let ok = [(&*qa, 2, 8), (&*qb, 8, 2)];
    let s = shape();
    let cases: Vec<Case> = vec![
        ("dora", serde_json::json!({"r": 2, "use_dora": true}), ok.to_vec(), "use_dora"),
        (
            "pattern",
            serde_json::json!({"r": 2, "rank_pattern": {"q_proj": 4}}),
            ok.to_vec(),
            "rank_pattern",
        ),
        (
            "save",
            serde_json::json!({"r": 2, "modules_to_save": ["lm_head"]}),
            ok.to_vec(),
            "modules_to_save",
        ),
        ("bias", serde_json::json!({"r": 2, "bias": "all"}), ok.to_vec(), "bias"),
        (
            "target",
            serde_json::json!({"r": 2, "target_modules": ["dense"]}),
            ok.to_vec(),
            "\"dense\"",
        ),
        ("rank", config(2, 4.0), ok.to_vec(), "rank 2 is above --max-lora-rank 1"),
        ("inputs", config(2, 4.0), vec![(&*qa, 2, 7), (&*qb, 8, 2)], "takes 8 inputs"),
        ("outputs", config(2, 4.0), vec![(&*qa, 2, 8), (&*qb, 6, 2)], "has 8 outputs"),
        ("ranks", config(2, 4.0), vec![(&*qa, 2, 8), (&*qb, 8, 3)], "B has rank 3"),
        ("half", config(2, 4.0), vec![(&*qa, 2, 8)], "no lora_B"),
        (
            "head",
            config(2, 4.0),
            vec![("base_model.model.lm_head.lora_A.weight", 2, 8)],
            "LoRA on lm_head",
        ),
        ("layers", config(2, 4.0), vec![(&*fa, 2, 8), (&*fb, 8, 2)], "the model has 2 layers"),
    ];
    for (tag, config, tensors, want) in cases {
        let dir = peft_dir(tag, &config, &tensors);
        let max_rank = if tag == "rank" { 1 } else { 16 };
        let err = load(&dir, &s, max_rank).expect_err(tag).to_string();
        assert!(err.contains(want), "{tag}: {err}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
