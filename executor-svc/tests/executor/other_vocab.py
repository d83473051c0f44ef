#!/usr/bin/env python3
"""A second base model for the tests of several models behind one front: a tiny Llama written
by `families/llama_hf.py` (2 layers of 64, random weights) whose byte-level vocabulary of 262
tokens is nothing like SmolLM2's 49152 — the same text is other token ids in each.

    other_vocab.py SRC OUT_DIR

writes OUT_DIR/tiny.gguf (SRC, the default model, is not read).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "families"))
import llama_hf  # noqa: E402


def main():
    out_dir = sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    llama_hf.build(os.path.join(out_dir, "tiny.gguf"), np.random.default_rng(11), 10000.0, tied=False)


if __name__ == "__main__":
    main()
