#!/usr/bin/env python3
"""The default model in other weight types, made by the `gguf` package (not Ferry): every
quantized matrix dequantized and quantized again into TYPE, norms left f32, the metadata copied.

    requantize.py SOURCE.gguf OUT.gguf TYPE      (TYPE: Q8_0, Q5_0, Q5_1, Q4_0, F16, BF16)
"""
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q


def main():
    source, out, qtype = sys.argv[1], sys.argv[2], Q[sys.argv[3]]
    r = gguf.GGUFReader(source)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out, arch)
    for name, field in r.fields.items():
        # The writer's own keys, and the file type the new weights no longer are.
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), vtype, sub)
    for t in r.tensors:
        rows_cols = [int(d) for d in reversed(t.shape)]
        if t.tensor_type in (Q.F32, Q.F16) or len(rows_cols) == 1:
            w.add_tensor(t.name, np.asarray(t.data))
            continue
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        values = values.reshape(rows_cols)
        w.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
