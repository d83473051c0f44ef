#!/usr/bin/env python3
"""A GGUF model whose layers [A, B) are repeated K times: layers 0..A, then A..B K times, then
B..n, renumbered, every other tensor and metadata value copied as is (block_count updated). A
looped model running A:B for K loops must compute what this file computes.

    repeat_layers.py SRC OUT A B K      (writes OUT/repeated.gguf)
"""
import os
import re
import sys

import gguf


def main():
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    dst = os.path.join(out, "repeated.gguf")
    a, b, k = (int(x) for x in sys.argv[3:6])
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n = reader.fields[f"{arch}.block_count"].contents()
    order = list(range(a)) + list(range(a, b)) * k + list(range(b, n))
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == f"{arch}.block_count":
            value = len(order)
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    by_layer = {}
    others = []
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append((m.group(2), t))
        else:
            others.append((t.name, t))
    tensors = list(others)
    for new, old in enumerate(order):
        tensors += [(f"blk.{new}.{rest}", t) for rest, t in by_layer[old]]
    for name, t in tensors:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in tensors:
        writer.write_tensor_data(t.data)
    writer.close()


if __name__ == "__main__":
    main()
