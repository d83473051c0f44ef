//! PEFT's adapter folder: `adapter_config.json` and `adapter_model.safetensors`.

use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::{Floats, LoraError, Module, RawDelta};
use crate::shape::LlamaShape;

/// The config's fields that change what the matrices mean, which Ferry does not do: refused,
/// named, when set to anything but their default.
const REFUSED: [(&str, &str); 6] = [
    ("use_dora", "DoRA"),
    ("rank_pattern", "per-module ranks"),
    ("alpha_pattern", "per-module alphas"),
    ("modules_to_save", "fully trained modules saved beside the adapter"),
    ("fan_in_fan_out", "transposed (Conv1D) weights"),
    ("lora_bias", "a bias on lora_B"),
];

/// Reads the folder `dir` into unchecked matrices with their scales.
pub(super) fn read(dir: &Path, shape: &LlamaShape) -> Result<Vec<RawDelta>, LoraError> {
    let invalid = |reason: String| LoraError::Invalid { path: dir.to_path_buf(), reason };
    let config_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&config_path)
        .map_err(|source| LoraError::Io { path: config_path.clone(), source })?;
    let config: Value = serde_json::from_str(&text)
        .map_err(|e| invalid(format!("adapter_config.json is not JSON: {e}")))?;
    let scale = check_config(&config).map_err(invalid)?;
    let weights_path = dir.join("adapter_model.safetensors");
    let bytes = std::fs::read(&weights_path)
        .map_err(|source| LoraError::Io { path: weights_path.clone(), source })?;
    let tensors = SafeTensors::deserialize(&bytes)
        .map_err(|e| invalid(format!("adapter_model.safetensors: {e}")))?;
    let mut halves: Vec<Half> = Vec::new();
    for (name, view) in tensors.tensors() {
        let (layer, module, is_a) = parse_key(&name, shape.family.fused).map_err(invalid)?;
        let dims = view.shape();
        let [rows, cols] = dims[..] else {
            return Err(invalid(format!("{name} has shape {dims:?}, not a matrix")));
        };
        let floats = match view.dtype() {
            Dtype::F32 => Floats::F32,
            Dtype::F16 => Floats::F16,
            Dtype::BF16 => Floats::Bf16,
            other => {
                let why = format!("{name}: dtype {other:?} is not supported (F32, F16 or BF16)");
                return Err(invalid(why));
            }
        };
        halves.push((layer, module, is_a, (rows, cols, floats.decode(view.data()))));
    }
    pair(halves, |_| scale).map_err(invalid)
}

/// `alpha / r` (rsLoRA: `alpha / √r`), after checking the config asks for nothing Ferry does
/// not do.
fn check_config(config: &Value) -> Result<f32, String> {
    if let Some(t) = config.get("peft_type").and_then(Value::as_str) {
        if t != "LORA" {
            return Err(format!("peft_type is {t}, only LORA adapters are served"));
        }
    }
    for (field, what) in REFUSED {
        let set = match config.get(field) {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(Value::Object(m)) => !m.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        if set {
            return Err(format!("{field} ({what}) is not supported"));
        }
    }
    if let Some(bias) = config.get("bias").and_then(Value::as_str) {
        if bias != "none" {
            return Err(format!("bias is \"{bias}\": only \"none\" is supported"));
        }
    }
    if let Some(list) = config.get("target_modules").and_then(Value::as_array) {
        for m in list {
            let name = m.as_str().unwrap_or_default();
            if !Module::ALL.iter().any(|x| x.peft_name() == name) {
                return Err(format!("target_modules names {m}, which Ferry cannot update"));
            }
        }
    }
    let r = config.get("r").and_then(Value::as_f64).ok_or("adapter_config.json has no r")?;
    let alpha = config.get("lora_alpha").and_then(Value::as_f64).unwrap_or(r);
    if r <= 0.0 {
        return Err(format!("r is {r}"));
    }
    let rs = config.get("use_rslora").and_then(Value::as_bool).unwrap_or(false);
    Ok((if rs { alpha / r.sqrt() } else { alpha / r }) as f32)
}

/// The layer, module and half (`true` for `lora_A`) a tensor key names.
fn parse_key(key: &str, fused: bool) -> Result<(usize, Module, bool), String> {
    let not_served = |what: &str| Err(format!("{key}: LoRA on {what} is not supported"));
    for part in ["embed_tokens", "lm_head", "lora_embedding", "magnitude"] {
        if key.contains(part) {
            return not_served(part);
        }
    }
    let Some((_, rest)) = key.split_once("layers.") else {
        return Err(format!("{key} is not a block's LoRA tensor"));
    };
    let (index, rest) = rest.split_once('.').ok_or_else(|| format!("{key}: no layer index"))?;
    let layer = index.parse().map_err(|_| format!("{key}: layer index {index} is not a number"))?;
    let is_a = if rest.contains(".lora_A.") {
        true
    } else if rest.contains(".lora_B.") {
        false
    } else {
        return Err(format!("{key} is neither lora_A nor lora_B"));
    };
    let module_path = rest.split(".lora_").next().unwrap_or_default();
    let name = module_path.rsplit('.').next().unwrap_or_default();
    let module = match Module::ALL.into_iter().find(|m| m.peft_name() == name) {
        Some(Module::Qkv | Module::GateUp) if !fused => {
            return Err(format!("{key}: {name} is a fused projection; this model has none"));
        }
        Some(m) => m,
        None => return not_served(module_path),
    };
    Ok((layer, module, is_a))
}

/// One of a module's matrices as read: its layer, module, whether it is `A`, and its rows,
/// columns and values.
pub(super) type Half = (usize, Module, bool, (usize, usize, Vec<f32>));

/// Pairs each module's `A` and `B`, each pair with the scale `scale` gives its rank.
pub(super) fn pair(
    mut halves: Vec<Half>,
    scale: impl Fn(usize) -> f32,
) -> Result<Vec<RawDelta>, String> {
    halves.sort_by_key(|h| (h.0, h.1, !h.2));
    let mut out = Vec::new();
    let mut it = halves.into_iter().peekable();
    while let Some((layer, module, is_a, a)) = it.next() {
        let what = format!("layer {layer} {}", module.peft_name());
        if !is_a {
            return Err(format!("{what} has lora_B but no lora_A"));
        }
        match it.next_if(|n| n.0 == layer && n.1 == module) {
            Some((_, _, false, b)) => {
                let scale = scale(a.0);
                out.push(RawDelta { layer, module, a, b, scale });
            }
            Some(_) => return Err(format!("{what} has lora_A twice")),
            None => return Err(format!("{what} has lora_A but no lora_B")),
        }
    }
    Ok(out)
}
