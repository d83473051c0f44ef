"""Reading a rendered chart the way Kubernetes would: Services, workloads and the pods they make,
each container's command line with `$(VAR)` expanded from its environment (literal values and
the downward API), and the names the cluster's DNS gives Services and StatefulSet pods. A Job
makes one pod (`kind` "Job"), run to completion before the others when it is a Helm hook.

Shared by check.py (static checks of the wiring) and smoke.py (running the pods as processes).
"""

import re
from dataclasses import dataclass, field

import yaml

DNS_SUFFIXES = ("", ".{ns}", ".{ns}.svc", ".{ns}.svc.cluster.local")


def load(path):
    """The objects of a multi-document manifest, as dicts."""
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


@dataclass
class Container:
    name: str
    spec: dict
    init: bool  # an init container that runs to completion before the others
    sidecar: bool  # a native sidecar (init container with restartPolicy Always)

    @property
    def image(self):
        return self.spec.get("image", "")

    def ports(self):
        return {p.get("name"): p["containerPort"] for p in self.spec.get("ports", [])}


@dataclass
class Pod:
    name: str
    workload: str
    kind: str
    labels: dict
    spec: dict
    namespace: str
    ordinal: int  # its index among its workload's pods (pods of a workload differ only by it)
    service_name: str = ""  # a StatefulSet's governing Service
    claims: tuple = ()  # a StatefulSet's volumeClaimTemplates' names
    containers: list = field(default_factory=list)
    workload_annotations: dict = field(default_factory=dict)

    def container(self, name):
        return next(c for c in self.containers if c.name == name)

    def env(self, c, ip="10.0.0.1"):
        """The container's environment as Kubernetes sets it: literal values, the downward
        API (pod name, namespace, IP), each value expanded against the ones before it."""
        env = {}
        for e in c.spec.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
            elif "valueFrom" in e and "fieldRef" in e["valueFrom"]:
                path = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = {
                    "metadata.name": self.name,
                    "metadata.namespace": self.namespace,
                    "status.podIP": ip,
                    # A StatefulSet pod's index (its name's last part).
                    "metadata.labels['apps.kubernetes.io/pod-index']": str(self.ordinal),
                }[path]
            else:
                env[e["name"]] = None  # from a Secret or ConfigMap: checked elsewhere
        return env

    def argv(self, c, ip="10.0.0.1"):
        """command + args with `$(VAR)` expanded (the image's entrypoint is not used: every
        container of the chart names its command)."""
        env = {k: v for k, v in self.env(c, ip).items() if v is not None}
        return [expand(a, env) for a in c.spec.get("command", []) + c.spec.get("args", [])]

    def all_ports(self):
        ports = {}
        for c in self.containers:
            ports.update(c.ports())
        return ports


def expand(s, env):
    """Kubernetes' `$(VAR)` expansion: defined variables are replaced, `$$` escapes."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        s,
    )


class Manifest:
    def __init__(self, objects, namespace="default"):
        self.objects = objects
        self.namespace = namespace
        self.by_kind = {}
        for o in objects:
            self.by_kind.setdefault(o["kind"], []).append(o)
        self.services = {s["metadata"]["name"]: s for s in self.by_kind.get("Service", [])}
        self.pods = []
        for kind in ("Job", "Deployment", "StatefulSet", "DaemonSet"):
            for w in self.by_kind.get(kind, []):
                self.pods.extend(self._pods(kind, w))

    def _pods(self, kind, w):
        spec = w["spec"]
        tmpl = spec["template"]
        name = w["metadata"]["name"]
        replicas = spec.get("replicas", 1) if kind not in ("DaemonSet", "Job") else 1
        if kind == "Deployment" and "replicas" not in spec:
            replicas = 1  # autoscaled: the HPA sets it; one is enough to check and run
        pods = []
        for i in range(replicas):
            pod_name = f"{name}-{i}" if kind == "StatefulSet" else f"{name}-{i}-x"
            pod = Pod(
                name=pod_name,
                workload=name,
                kind=kind,
                labels=tmpl["metadata"].get("labels", {}),
                workload_annotations=w["metadata"].get("annotations") or {},
                spec=tmpl["spec"],
                namespace=self.namespace,
                ordinal=i,
                service_name=spec.get("serviceName", ""),
                claims=tuple(t["metadata"]["name"] for t in spec.get("volumeClaimTemplates", [])),
            )
            for c in tmpl["spec"].get("initContainers", []):
                sidecar = c.get("restartPolicy") == "Always"
                pod.containers.append(Container(c["name"], c, init=not sidecar, sidecar=sidecar))
            for c in tmpl["spec"]["containers"]:
                pod.containers.append(Container(c["name"], c, init=False, sidecar=False))
            pods.append(pod)
        return pods

    def selected(self, selector):
        """The pods whose labels match a Service's (or matchLabels) selector."""
        if not selector:
            return []
        return [p for p in self.pods if all(p.labels.get(k) == v for k, v in selector.items())]

    def names(self):
        """Every DNS name the cluster would give: Service names, and `pod.service` for the
        pods of a StatefulSet whose governing Service is headless; each with its suffixes.
        Maps a name to ("service", Service) or ("pod", Pod)."""
        names = {}
        ns = self.namespace
        for sname, svc in self.services.items():
            for suffix in DNS_SUFFIXES:
                names[sname + suffix.format(ns=ns)] = ("service", svc)
        for p in self.pods:
            svc = self.services.get(p.service_name)
            if svc and svc["spec"].get("clusterIP") == "None":
                for suffix in DNS_SUFFIXES:
                    names[f"{p.name}.{p.service_name}" + suffix.format(ns=ns)] = ("pod", p)
        return names
