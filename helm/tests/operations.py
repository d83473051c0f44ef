"""Day-two operations in the smoke run (smoke.py --operations): what a platform team does to a
running release, each under streams that must all end with their tokens.

- An etcd member's volume is lost: its pod is killed (SIGKILL), its data folder emptied, and
  the pod started again as the StatefulSet would. Its start-up helper (`ferry-scheduler
  etcd-member`) finds the running cluster, removes the member it was and adds it again; it
  rejoins with a new member id, and Ferry's keys are readable from it (it caught up).
- etcd is scaled from 3 to 5 members (the two new pods from the chart rendered with
  `etcd.replicas=5`): both join the running cluster. No Ferry pod template differs between the
  two renders, so the scale restarts no executor.
- The log level changes (the chart's `log.level`, a ConfigMap every Ferry container mounts and
  follows with `--log-filter-file`): the kubelet's update of the file is stood in for by
  writing it; every Ferry container logs the change, and none restarts.
- The executors roll, one pod at a time as a StatefulSet's rolling update does: SIGTERM (the
  executor withdraws its registration and its scheduler moves its requests), the pod started
  again, ready before the next. Every stream ends with all its tokens, equal to an undisturbed
  run's; the leader's `ferry_requests_moved` counts the moves.
"""

import base64
import json
import os
import shutil
import signal
import time
import urllib.request

from smokelog import log


def etcd_call(run, pod, path, body):
    """etcd's JSON gateway (plaintext client port) on `pod`."""
    req = urllib.request.Request(f"http://{run.ips[pod]}:2379{path}",
                                 data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.load(r)


def members(run, pod):
    return etcd_call(run, pod, "/v3/cluster/member/list", {}).get("members", [])


def ferry_keys(run, pod):
    """How many of Ferry's keys `pod` holds, read locally (serializable: no leader asked)."""
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    r = etcd_call(run, pod, "/v3/kv/range",
                  {"key": b64("/ferry/"), "range_end": b64("/ferry0"), "serializable": True,
                   "count_only": True})
    return int(r.get("count", 0))


def wait_for(what, check, timeout=120):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as e:
            last = e
        time.sleep(0.5)
    raise AssertionError(f"{what}: not after {timeout} s (last: {last})")


def restart_killed(run):
    """Starts again the pods the faults killed, as their controllers would."""
    dead = [p for p in run.m.pods if p.kind != "Job" and not any(
        pod.name == p.name and not c.init and proc.poll() is None for pod, c, proc in run.procs)]
    run.start_pods(dead)
    run.wait_serving()
    log(f"started again the pods the faults killed: {sorted(p.name for p in dead)}")


def replace_member(run, streams_cls):
    pods = sorted(run.pods_of("etcd"), key=lambda p: p.name)
    victim, witness = pods[1], pods[0]
    before = {m["name"]: m["ID"] for m in members(run, witness.name)}
    keys = ferry_keys(run, witness.name)
    assert len(before) == 3 and keys > 0, f"members {before}, {keys} Ferry keys"
    streams = streams_cls(run)
    run.kill_pod(victim.name, "an etcd member, whose volume is then lost")
    data = os.path.join(run.root, victim.name, "data")
    shutil.rmtree(data)
    log(f"emptied {victim.name}'s data volume; starting the pod again")
    run.start_pods([victim])
    def rejoined():
        m = {x.get("name", ""): x["ID"] for x in members(run, witness.name)}
        return m if len(m) == 3 and all(m) and victim.name in m else None
    after = wait_for("the replaced member started in the member list", rejoined)
    assert after[victim.name] != before[victim.name], f"{victim.name} kept its id: {after}"
    caught_up = wait_for(f"{victim.name} holding Ferry's keys",
                         lambda: ferry_keys(run, victim.name) or None)
    streams.finish()
    log(f"{victim.name} rejoined with a new member id ({before[victim.name]} -> "
        f"{after[victim.name]}) and holds {caught_up} of Ferry's keys; all {streams.n} streams "
        "finished")


def scale_etcd(run, scaled, streams_cls):
    """`scaled`: the Manifest rendered with etcd.replicas=5 (its two new pods are spare pods
    of the run, on the network but not started)."""
    def ferry_templates(m):
        return {w["metadata"]["name"]: w["spec"]["template"]
                for kind in ("StatefulSet", "Deployment") for w in m.by_kind.get(kind, [])
                if w["metadata"]["labels"].get("app.kubernetes.io/component") != "etcd"}
    assert ferry_templates(run.m) == ferry_templates(scaled), \
        "a Ferry pod template changes with etcd.replicas: scaling etcd would restart it"
    log("no Ferry pod template changes between etcd.replicas 3 and 5: nothing restarts")
    new = run.spare_pods()
    assert len(new) == 2, [p.name for p in new]
    streams = streams_cls(run)
    run.start_pods(new)
    witness = min(p.name for p in run.pods_of("etcd"))
    def five():
        m = [x.get("name", "") for x in members(run, witness)]
        return m if len(m) == 5 and all(m) else None
    listed = wait_for("five started members", five)
    for p in new:
        wait_for(f"{p.name} holding Ferry's keys", lambda: ferry_keys(run, p.name) or None)
    streams.finish()
    log(f"etcd scaled to 5 members {sorted(listed)}, the new ones caught up; all {streams.n} "
        "streams finished")


def roll_executors(run, streams_cls):
    executors = run.executors()
    before = run.metric("ferry_requests_moved", "scheduler-")
    streams = streams_cls(run, max_tokens=run.args.max_tokens * 4)
    for p in executors:
        procs = [proc for pod, _, proc in run.procs if pod.name == p.name and proc.poll() is None]
        assert procs, f"pod {p.name} has no running process"
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=60)
        log(f"stopped {p.name} (SIGTERM, as a rolling update does); starting its new revision")
        run.start_pods([p])
        run.wait_serving()
    streams.finish()
    moved = run.metric("ferry_requests_moved", "scheduler-") - before
    assert moved > 0, "no request moved off a stopping executor"
    calm = streams_cls(run, max_tokens=run.args.max_tokens * 4)
    calm.finish()
    for i in range(calm.n):
        assert streams.texts[i] == calm.texts[i], \
            f"stream {i}: {streams.texts[i]!r}, undisturbed: {calm.texts[i]!r}"
    log(f"rolled {len(executors)} executor pods one at a time under {streams.n} streams: every "
        f"stream finished with its tokens, equal to an undisturbed run's ({moved:.0f} moved)")


def change_log_filter(run):
    ferry = [(p, c, proc) for p, c, proc in run.procs
             if c.image.split(":")[0] == run.args.image_repo and not c.init
             and proc.poll() is None and p.spec.get("volumes") and
             any(v["name"] == "log" for v in p.spec["volumes"])]
    assert ferry, "no running Ferry container mounts the log ConfigMap"

    def changes(p, c):
        with open(os.path.join(run.root, f"{p.name}.{c.name}.log")) as f:
            return f.read().count("log filter changed")
    before = {(p.name, c.name): changes(p, c) for p, c, _ in ferry}
    for p in {p.name: p for p, _, _ in ferry}.values():
        with open(os.path.join(run.root, p.name, "log", "filter"), "w") as f:
            f.write("debug,h2=info,hyper=info,tonic=info,tower=info\n")
    for p, c, _ in ferry:
        wait_for(f"{p.name}/{c.name} following the new filter",
                 lambda: changes(p, c) > before[(p.name, c.name)], timeout=30)
    assert all(proc.poll() is None for _, _, proc in ferry), "a container stopped"
    log(f"the log filter changed in all {len(ferry)} Ferry containers, none restarted")
