//! llama.cpp's LoRA GGUF (`convert_lora_to_gguf.py`): `blk.{i}.<module>.weight.lora_a`
//! (GGUF dims `[inputs, rank]`) and `lora_b` (`[rank, outputs]`), `adapter.lora.alpha`.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use super::{peft::pair, Floats, LoraError, Module, RawDelta};
use crate::gguf::{ggml_type_name, GgufHeader, TensorInfo};
use crate::shape::LlamaShape;

/// Reads the file at `path` into unchecked matrices with their scales.
pub(super) fn read(path: &Path, shape: &LlamaShape) -> Result<Vec<RawDelta>, LoraError> {
    let invalid = |reason: String| LoraError::Invalid { path: path.to_path_buf(), reason };
    let header = GgufHeader::open(path).map_err(|e| invalid(e.to_string()))?;
    let str_of = |key: &str| header.get(key).and_then(|v| v.as_str()).unwrap_or_default();
    if str_of("general.type") != "adapter" || str_of("adapter.type") != "lora" {
        return Err(invalid(format!(
            "not a LoRA GGUF (general.type \"{}\", adapter.type \"{}\"; want \"adapter\", \"lora\")",
            str_of("general.type"),
            str_of("adapter.type")
        )));
    }
    let arch = str_of("general.architecture");
    if arch != shape.family.name {
        return Err(LoraError::Unfit {
            path: path.to_path_buf(),
            reason: format!("it is for a {arch} model, the model is {}", shape.family.name),
        });
    }
    let alpha =
        header.get("adapter.lora.alpha").and_then(crate::gguf::Value::as_f32).unwrap_or(0.0);
    let mut file =
        std::fs::File::open(path).map_err(|source| LoraError::Io { path: path.into(), source })?;
    let mut halves = Vec::new();
    for t in &header.tensors {
        let Some(base) = t
            .name
            .strip_suffix(".weight.lora_a")
            .map(|b| (b, true))
            .or_else(|| t.name.strip_suffix(".weight.lora_b").map(|b| (b, false)))
        else {
            return Err(invalid(format!("{} is not a LoRA tensor", t.name)));
        };
        let (layer, module) = parse_name(base.0, shape.family.fused).map_err(invalid)?;
        let [cols, rows] = t.dims[..] else {
            return Err(invalid(format!("{} has dims {:?}, not a matrix", t.name, t.dims)));
        };
        let (rows, cols) = (to_usize(rows), to_usize(cols));
        let data = read_f32(&mut file, &header, t, rows * cols)
            .map_err(|e| LoraError::Io { path: path.into(), source: e })?
            .ok_or_else(|| {
                let ty = ggml_type_name(t.ggml_type);
                invalid(format!("{}: type {ty} is not supported (F32, F16 or BF16)", t.name))
            })?;
        halves.push((layer, module, base.1, (rows, cols, data)));
    }
    // llama.cpp: `alpha / rank`, or 1 when the file gives no alpha.
    let scale = |rank: usize| if alpha == 0.0 || rank == 0 { 1.0 } else { alpha / rank as f32 };
    pair(halves, scale).map_err(invalid)
}

/// The layer and module of `blk.{i}.<module>`.
fn parse_name(base: &str, fused: bool) -> Result<(usize, Module), String> {
    let bad = || format!("{base}.weight: not a block's projection Ferry can update");
    let rest = base.strip_prefix("blk.").ok_or_else(bad)?;
    let (index, name) = rest.split_once('.').ok_or_else(bad)?;
    let layer = index.parse().map_err(|_| bad())?;
    let module = Module::from_gguf(name, fused).ok_or_else(bad)?;
    Ok((layer, module))
}

fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Tensor `t`'s `n` values as `f32` (`None` for a type other than F32, F16, BF16).
fn read_f32(
    file: &mut std::fs::File,
    header: &GgufHeader,
    t: &TensorInfo,
    n: usize,
) -> std::io::Result<Option<Vec<f32>>> {
    let floats = match t.ggml_type {
        0 => Floats::F32,
        1 => Floats::F16,
        30 => Floats::Bf16,
        _ => return Ok(None),
    };
    let at = header.data_offset + t.offset;
    let len = n.saturating_mul(floats.width());
    if at.saturating_add(len as u64) > header.file_len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("{} runs past the end of the file", t.name),
        ));
    }
    file.seek(SeekFrom::Start(at))?;
    let mut bytes = vec![0u8; len];
    file.read_exact(&mut bytes)?;
    Ok(Some(floats.decode(&bytes)))
}
