#!/usr/bin/env python3
"""Random LoRA adapters for a GGUF Llama model, and the model with each merged in: an
independent merge (numpy, float64) for Ferry's adapter path to be checked against.

    lora_adapters.py SRC OUT

Writes into OUT:
  base.gguf          SRC with every tensor dequantized to F32 (metadata as is)
  x/                 adapter x as PEFT writes it (adapter_config.json, adapter_model.safetensors:
                     Hugging Face's layout, Q and K rows unpermuted), rank 8, alpha 16, all seven
                     projections of every layer
  x.gguf             adapter x as llama.cpp's convert_lora_to_gguf.py writes it (F32; lora_b of
                     Q and K permuted to GGUF's rotary layout)
  y/                 adapter y (PEFT), rank 4, rsLoRA, alpha 8, q_proj and v_proj only
  merged-x.gguf      base.gguf with W + scale * B @ A for adapter x (Q and K: B permuted)
  merged-y.gguf      the same for y
"""
import json
import os
import struct
import sys

import numpy as np

import gguf

PEFT = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (rows of each head interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def f32_tensors(reader):
    out = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        # GGUF dims are innermost first; numpy's shape is outermost first.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = data.reshape(shape)
    return out


def write_model(path, reader, tensors):
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(path, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == "general.file_type":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for name, data in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_safetensors(path, tensors):
    header, blobs, at = {}, [], 0
    for name, data in tensors.items():
        raw = np.ascontiguousarray(data, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(data.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def make_adapter(rng, base, n_layers, modules, rank, sigma_b):
    """{(layer, module): (A, B)} in Hugging Face's layout."""
    out = {}
    for layer in range(n_layers):
        for m in modules:
            rows, cols = base[f"blk.{layer}.{m}.weight"].shape
            a = rng.normal(0.0, 1.0 / np.sqrt(cols), (rank, cols)).astype(np.float32)
            b = rng.normal(0.0, sigma_b, (rows, rank)).astype(np.float32)
            out[(layer, m)] = (a, b)
    return out


def gguf_b(m, b, heads, kv_heads):
    if m == "attn_q":
        return permute(b, heads)
    if m == "attn_k":
        return permute(b, kv_heads)
    return b


def main():
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_layers = reader.fields[f"{arch}.block_count"].contents()
    heads = reader.fields[f"{arch}.attention.head_count"].contents()
    kv_heads = reader.fields[f"{arch}.attention.head_count_kv"].contents()
    base = f32_tensors(reader)
    write_model(os.path.join(out, "base.gguf"), reader, base)
    rng = np.random.default_rng(1234)
    specs = {
        "x": (make_adapter(rng, base, n_layers, list(PEFT), 8, 0.03), 16.0, False),
        "y": (make_adapter(rng, base, n_layers, ["attn_q", "attn_v"], 4, 0.05), 8.0, True),
    }
    for name, (adapter, alpha, rslora) in specs.items():
        rank = next(iter(adapter.values()))[0].shape[0]
        scale = alpha / np.sqrt(rank) if rslora else alpha / rank
        folder = os.path.join(out, name)
        os.makedirs(folder, exist_ok=True)
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": alpha,
            "use_rslora": rslora,
            "target_modules": sorted({PEFT[m].split(".")[1] for (_, m) in adapter}),
            "bias": "none",
            "use_dora": False,
            "modules_to_save": None,
            "task_type": "CAUSAL_LM",
        }
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        tensors = {}
        for (layer, m), (a, b) in adapter.items():
            key = f"base_model.model.model.layers.{layer}.{PEFT[m]}"
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = b
        write_safetensors(os.path.join(folder, "adapter_model.safetensors"), tensors)
        if not rslora:
            writer = gguf.GGUFWriter(os.path.join(out, f"{name}.gguf"), arch)
            writer.add_string("general.type", "adapter")
            writer.add_string("adapter.type", "lora")
            writer.add_float32("adapter.lora.alpha", alpha)
            for (layer, m), (a, b) in adapter.items():
                writer.add_tensor(f"blk.{layer}.{m}.weight.lora_a", a)
                writer.add_tensor(f"blk.{layer}.{m}.weight.lora_b", np.ascontiguousarray(gguf_b(m, b, heads, kv_heads)))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
        merged = dict(base)
        for (layer, m), (a, b) in adapter.items():
            w = f"blk.{layer}.{m}.weight"
            delta = scale * (gguf_b(m, b, heads, kv_heads).astype(np.float64) @ a.astype(np.float64))
            merged[w] = (base[w].astype(np.float64) + delta).astype(np.float32)
        write_model(os.path.join(out, f"merged-{name}.gguf"), reader, merged)


if __name__ == "__main__":
    main()
