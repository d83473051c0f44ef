//! A second reference Ferry did not write: candle-transformers' quantized models
//! (`quantized_llama`, `quantized_qwen2`, `quantized_qwen3`, `quantized_phi3`,
//! `quantized_gemma3`) read the same files and compute each position's logits one token at a
//! time, with every matrix dequantized to f32 (`CANDLE_DEQUANTIZE_ALL`: candle's own products
//! over quantized blocks round the activations to 8 bits). Where a candle model leaves out
//! something the file asks for, only the positions it cannot change are compared: candle
//! applies no window to a single token (Phi-3's window of 5 cuts from position 5). Left to the
//! numpy forward alone: Llama 3 and linear rope scaling, `LongRoPE` and Gemma 2, which candle
//! does not model, and Gemma 3, whose quantized model in candle 0.11 gates its feed-forward with
//! `SiLU` where Gemma 3 uses GELU (tanh) — its logits were 0.51 off at the first position here
//! (candle issue 3745, open).

use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::{Device, Tensor};
use candle_transformers::models::{
    quantized_llama, quantized_phi3, quantized_qwen2, quantized_qwen3,
};

enum Model {
    Llama(quantized_llama::ModelWeights),
    Qwen2(quantized_qwen2::ModelWeights),
    Qwen3(quantized_qwen3::ModelWeights),
    Phi3(quantized_phi3::ModelWeights),
}

/// The candle model for `variant` and how many leading positions it computes as the file
/// means, or `None` where candle has no model for it.
fn model(variant: &str, path: &Path) -> Option<(Model, usize)> {
    let (kind, positions) = match variant {
        "llama" | "mixed" | "k-quants" | "floats" => ("llama", usize::MAX),
        "qwen2" | "qwen3" => (variant, usize::MAX),
        "phi3" => ("phi3", 5),
        _ => return None,
    };
    let mut file = std::fs::File::open(path).unwrap();
    let mut content = gguf_file::Content::read(&mut file).unwrap();
    let (f, cpu) = (&mut file, &Device::Cpu);
    let loaded = match kind {
        "llama" => quantized_llama::ModelWeights::from_gguf(content, f, cpu).map(Model::Llama),
        "qwen2" => quantized_qwen2::ModelWeights::from_gguf(content, f, cpu).map(Model::Qwen2),
        "qwen3" => {
            // Without `general.dtype`, candle's Qwen 3 computes in f16.
            content.metadata.insert("general.dtype".into(), Value::U32(0));
            quantized_qwen3::ModelWeights::from_gguf(content, f, cpu).map(Model::Qwen3)
        }
        _ => quantized_phi3::ModelWeights::from_gguf(false, content, f, cpu).map(Model::Phi3),
    };
    let model = loaded.unwrap_or_else(|e| panic!("{variant}: candle does not load it: {e}"));
    Some((model, positions))
}

/// candle's logits at the leading positions of `tokens` it computes as `variant`'s file
/// means (see the module's comment), or `None` where it has no model for the variant.
pub fn logits(variant: &str, path: &Path, tokens: &[u32]) -> Option<Vec<Vec<f32>>> {
    // Read once per thread, at candle's first quantized matrix: set before any is loaded.
    std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
    let (mut model, positions) = model(variant, path)?;
    let mut out = Vec::new();
    for (i, &t) in tokens.iter().enumerate().take(positions) {
        let x = Tensor::new(&[t], &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        let y = match &mut model {
            Model::Llama(m) => m.forward(&x, i),
            Model::Qwen2(m) => m.forward(&x, i),
            Model::Qwen3(m) => m.forward(&x, i),
            Model::Phi3(m) => m.forward(&x, i),
        };
        out.push(y.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    Some(out)
}
