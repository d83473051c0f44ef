"""The model fetch's URL mode, run as rendered: the model-cache Job's container (its python
script and arguments, `/models` mapped to a folder) against a local HTTP server that wants a
bearer token. With the Secret's token and the file the value set's `fetch.sha256` names, the
file lands in place; without the token, or when the server sends other bytes, the fetch fails,
naming why, and leaves nothing behind.

Usage: fetch_url.py RENDERED GGUF   (GGUF: the file whose sha256 the value set gives)
"""
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading

from manifests import Manifest, load

TOKEN = "hf_smoke_token"


def serve(folder):
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=folder, **kw)

        def do_GET(self):
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self.send_error(403, "no or wrong token")
                return
            super().do_GET()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main():
    manifest, gguf = sys.argv[1], sys.argv[2]
    job = next(p for p in Manifest(load(manifest)).pods if p.kind == "Job")
    c = job.containers[-1]
    argv = job.argv(c)
    work = tempfile.mkdtemp(prefix="ferry-fetch-url-")
    served, models = os.path.join(work, "served"), os.path.join(work, "models")
    os.makedirs(served)
    server = serve(served)
    failures = []
    try:
        url = argv[-2]
        name = url.rsplit("/", 1)[1]
        argv[-2] = f"http://127.0.0.1:{server.server_port}/{name}"
        script = argv[2].replace('"/models"', repr(models))
        cmd = [sys.executable, "-c", script, *argv[3:]]
        dest = os.path.join(models, argv[4])

        def fetch(token, content):
            shutil.rmtree(models, ignore_errors=True)
            os.makedirs(models)
            shutil.copy(content, os.path.join(served, name))
            env = {"PATH": os.environ["PATH"], "HOME": work}
            if token:
                env["HF_TOKEN"] = token
            return subprocess.run(cmd, env=env, capture_output=True, text=True)

        r = fetch(TOKEN, gguf)
        with open(gguf, "rb") as a:
            same = os.path.exists(dest) and open(dest, "rb").read() == a.read()
        if r.returncode != 0 or not same:
            failures.append(f"with the token and the right file: exit {r.returncode}, file "
                            f"{'in place' if same else 'missing or different'}: {r.stderr[-300:]}")
        r = fetch(None, gguf)
        if r.returncode == 0 or "403" not in r.stderr or os.listdir(models):
            failures.append(f"without the token: exit {r.returncode}, left {os.listdir(models)}")
        other = os.path.join(work, "other.gguf")
        with open(gguf, "rb") as a, open(other, "wb") as b:
            data = bytearray(a.read())
            data[-1] ^= 1
            b.write(data)
        r = fetch(TOKEN, other)
        if r.returncode == 0 or "sha256" not in r.stderr or os.listdir(models):
            failures.append(f"other bytes: exit {r.returncode}, left {os.listdir(models)}: "
                            f"{r.stderr[-300:]}")
    finally:
        server.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        print(f"fetch_url: FAIL {f}")
    print("fetch_url: FAILED" if failures else "fetch_url: ok (with the token and the sha256 "
          "the file landed; without the token, and with changed bytes, refused, nothing left)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
