"""The standard pod fields a value set gives each part reach that part's pods as given.

Usage: passthrough.py VALUES RENDERED. For the front, the schedulers (every shard), each executor
pool (its entry over `executorPoolDefaults`) and etcd: `runtimeClassName`, `priorityClassName`
and `topologySpreadConstraints` on the pod; an executor pool's `updateStrategy` on its
StatefulSet; `extraEnv` and `extraVolumeMounts` on the part's
main container, `extraVolumes` on the pod. Fails when the value set gives none of them (a set
that exercises nothing) or when a given field is missing or changed in a rendered pod.
"""
import sys

import yaml

POD = ("runtimeClassName", "priorityClassName", "topologySpreadConstraints")
WORKLOAD = ("updateStrategy",)  # on the StatefulSet itself
EXTRA = (("extraEnv", "env"), ("extraVolumeMounts", "volumeMounts"))


def parts(values):
    """(component-label prefix, main container, the part's values) for every part."""
    yield "front", "front", values.get("front", {})
    yield "scheduler-", "scheduler", values.get("scheduler", {})
    defaults = values.get("executorPoolDefaults", {})
    for pool in values.get("executorPools", [{"name": "cpu"}]):
        yield f"executor-{pool['name']}", "executor", {**defaults, **pool}
    yield "etcd", "etcd", values.get("etcd", {})


def main():
    values = yaml.safe_load(open(sys.argv[1])) or {}
    objects = [o for o in yaml.safe_load_all(open(sys.argv[2])) if o]
    workloads = [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    failures, checked = [], 0
    for prefix, main_name, part in parts(values):
        given = {k: part[k] for k in POD + WORKLOAD + ("extraVolumes",) +
                 tuple(k for k, _ in EXTRA) if part.get(k)}
        if not given:
            continue
        label = "app.kubernetes.io/component"
        pods = [w for w in workloads
                if w["spec"]["template"]["metadata"]["labels"].get(label, "").startswith(prefix)]
        if not pods:
            failures.append(f"{prefix}: no workload rendered")
        for w in pods:
            name, spec = w["metadata"]["name"], w["spec"]["template"]["spec"]
            main = next((c for c in spec["containers"] if c["name"] == main_name), None)
            for k in WORKLOAD:
                if k in given and w["spec"].get(k) != given[k]:
                    failures.append(f"{name}: {k} is {w['spec'].get(k)!r}, given {given[k]!r}")
                checked += k in given
            for k in POD:
                if k in given and spec.get(k) != given[k]:
                    failures.append(f"{name}: {k} is {spec.get(k)!r}, given {given[k]!r}")
                checked += k in given
            if "extraVolumes" in given:
                for v in given["extraVolumes"]:
                    if v not in spec.get("volumes", []):
                        failures.append(f"{name}: volume {v['name']} missing or changed")
                    checked += 1
            for key, field in EXTRA:
                for item in given.get(key, []):
                    if main is None or item not in main.get(field, []):
                        failures.append(f"{name}/{main_name}: {field} lacks {item}")
                    checked += 1
    if not checked and not failures:
        failures.append("the value set gives no standard pod field: it checks nothing")
    for f in failures:
        print(f"passthrough: FAIL {f}")
    print(f"passthrough: {'FAILED' if failures else 'ok'} ({checked} fields seen on pods)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
