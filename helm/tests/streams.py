"""Streaming chat completions through the front, for the smoke run's faults and operations."""

import json
import threading
import time


class Streams:
    """`--streams` streaming chat completions through the front, started at once; the
    constructor returns once each has delivered two tokens."""

    def __init__(self, run, max_tokens=None):
        self.run, self.n = run, run.args.streams
        self.max_tokens = max_tokens or run.args.max_tokens
        self.results, self.progress, self.texts = [None] * self.n, [0] * self.n, [""] * self.n
        self.threads = [threading.Thread(target=self.stream, args=(i,)) for i in range(self.n)]
        for t in self.threads:
            t.start()
        deadline = time.time() + run.args.timeout
        while min(self.progress) < 2 and time.time() < deadline and any(
                t.is_alive() for t in self.threads):
            time.sleep(0.1)
        assert min(self.progress) >= 2, f"streams did not start: {self.progress} {self.results}"

    def stream(self, i):
        body = {"model": "", "messages": [{"role": "user", "content": f"Count to {i + 50}."}],
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        finish, usage, err = None, None, None
        try:
            with self.run.post(body) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        err = ev["error"]
                    for ch in ev.get("choices", []):
                        if ch.get("delta", {}).get("content"):
                            self.progress[i] += 1
                            self.texts[i] += ch["delta"]["content"]
                        finish = ch.get("finish_reason") or finish
                    usage = ev.get("usage") or usage
        except Exception as e:  # noqa: BLE001 - recorded as the stream's failure
            err = repr(e)
        self.results[i] = (finish, usage, err)

    def finish(self):
        """Waits for every stream; each must end normally with all its tokens."""
        for t in self.threads:
            t.join(timeout=self.run.args.timeout)
        for i, (finish, usage, err) in enumerate(self.results):
            assert err is None, f"stream {i} failed: {err}"
            assert finish == "length", f"stream {i} ended with {finish}"
            assert usage and usage["completion_tokens"] == self.max_tokens, f"stream {i}: {usage}"
