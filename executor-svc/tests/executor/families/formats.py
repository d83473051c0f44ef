#!/usr/bin/env python3
"""Blocks of every GGUF type Ferry reads, made and read back by the `gguf` package: the legacy
and float types quantized from random weights by its numpy quantizers (BF16 rounded to nearest
even as ggml does; the weights spread over many binades, some f16 subnormals), the k-quants
(which it only dequantizes) as random blocks with sane f16 scales. For each type, OUT_DIR/<type>.bin holds the
raw blocks of a [ROWS, COLS] matrix and OUT_DIR/<type>.f32 the package's dequantization
(little-endian f32); OUT_DIR/formats.json lists them.

    formats.py OUT_DIR
"""
import json
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

ROWS, COLS = 24, 512
LEGACY = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
FLOATS = [Q.F16, Q.BF16, Q.F32]


def random_k_blocks(rng, qtype, rows, cols, d_scale):
    """Random k-quant blocks: random codes and sub-block scales, f16 super-block scales (the
    minimums' scale so that weights average about zero, as a trained model's do)."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // 256
    raw = rng.integers(0, 256, size=(n, block_bytes), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=n) * d_scale).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == Q.Q6_K:
        raw[:, 208:210] = d
    else:
        centre = {Q.Q4_K: 7.5, Q.Q5_K: 15.5}[qtype]
        dmin = (rng.uniform(0.5, 1.5, size=n) * d_scale * centre).astype(np.float16)
        raw[:, 0:2] = d
        raw[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, cols // 256 * block_bytes)


def main():
    out_dir = sys.argv[1]
    rng = np.random.default_rng(5)
    listed = []
    for qtype in LEGACY + K_QUANTS + FLOATS:
        if qtype in LEGACY:
            raw = gguf.quants.quantize(rng.normal(0, 1, (ROWS, COLS)).astype(np.float32), qtype)
        elif qtype in FLOATS:
            spread = np.exp2(rng.integers(-30, 4, size=(ROWS, COLS)))
            values = (rng.normal(0, 1, (ROWS, COLS)) * spread).astype(np.float32)
            raw = gguf.quants.quantize(values, qtype)
            raw = raw.view(np.uint8).reshape(ROWS, -1)
        else:
            raw = random_k_blocks(rng, qtype, ROWS, COLS, 1e-3)
        values = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        assert values.shape == (ROWS, COLS)
        raw.tofile(f"{out_dir}/{qtype.name}.bin")
        values.astype("<f4").tofile(f"{out_dir}/{qtype.name}.f32")
        listed.append(qtype.name)
    with open(f"{out_dir}/formats.json", "w") as f:
        json.dump({"rows": ROWS, "cols": COLS, "types": listed}, f)


if __name__ == "__main__":
    main()
