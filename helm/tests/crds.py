"""Custom resources the chart renders, validated against their projects' published schemas.

kubernetes-validate knows only Kubernetes' own kinds (it skips the others with a warning). The
schemas in `schemas/` are the `openAPIV3Schema` of the projects' CRDs as published (each file
names the repository, commit and path), descriptions removed: Gateway API's `HTTPRoute`, the
Gateway API inference extension's `InferencePool` and KEDA's `ScaledObject`.

Usage: crds.py RENDERED [--expect KIND ...]. Fails on an object of a schema's group whose
version or kind has no schema here, on an object the schema refuses, and on an expected kind
the manifest does not have.
"""
import argparse
import json
import pathlib
import sys

import jsonschema
import yaml

SCHEMAS = pathlib.Path(__file__).parent / "schemas"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("manifest")
    ap.add_argument("--expect", action="append", default=[], help="a kind that must be there")
    args = ap.parse_args()
    schemas = {}
    for f in sorted(SCHEMAS.glob("*.json")):
        doc = json.loads(f.read_text())
        schemas[(doc["apiVersion"], doc["kind"])] = doc["schema"]
    groups = {api.split("/")[0] for api, _ in schemas}
    failures, seen = [], {}
    for o in yaml.safe_load_all(open(args.manifest)):
        if not o:
            continue
        key = (o.get("apiVersion", ""), o.get("kind", ""))
        if key[0].split("/")[0] not in groups:
            continue
        name = f"{key[1]} {o.get('metadata', {}).get('name')}"
        schema = schemas.get(key)
        if schema is None:
            failures.append(f"{name}: no published schema here for {key[0]} {key[1]}")
            continue
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(o), key=str)
        for e in errors:
            where = "/".join(str(p) for p in e.absolute_path)
            failures.append(f"{name}: at {where or '/'}: {e.message}")
        seen[key[1]] = seen.get(key[1], 0) + 1
    for kind in args.expect:
        if kind not in seen:
            failures.append(f"no {kind} rendered")
    for f in failures:
        print(f"crds: FAIL {f}")
    counts = ", ".join(f"{n} {k}" for k, n in sorted(seen.items())) or "nothing"
    print(f"crds: {'FAILED' if failures else 'ok'} ({counts} validated)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
