#!/usr/bin/env python3
"""`ddtree serve` under load: C concurrent clients x R requests each, through the official openai
client, on the codepair fixture (float32, greedy, CPU by default).

Starts the server as a subprocess on a free loopback port (stopped with SIGTERM at the end: it
must exit 0), computes every reply in advance with in-process `ddtree generate` (one `--prompts`
run per method, `--stats-json` for the token ids), then runs the clients. Each request picks a
prompt, chat or text completion, streamed or not, and a method (ar, dflash, ddtree) in turn; its
reply must equal `generate`'s token for token. The server's resident memory (VmRSS from
/proc/PID/status) is sampled every 0.1 s: the growth from the end of the first round (every
client finished its first request) to the end must stay within --max-rss-growth. The queue waits
(usage.ddtree.queue_s) are reported as percentiles. Writes JSON (--out); exit status 1 when a
check fails. Examples:
    python scripts/load_serve.py                                   # 8 clients x 20 requests
    python scripts/load_serve.py --clients 3 --requests 2 --out /tmp/load.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE = Path(os.environ.get("DDTREE_FIXTURE") or REPO.parent / "shared" / "fixtures" / "codepair")
METHODS = ("ar", "dflash", "ddtree")


def child_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class Server:
    """`python -m ddtree serve ARGS --port 0` as a subprocess: its URL once /health answers 200;
    stop() sends SIGTERM and returns the exit status. stderr is kept (self.log)."""

    def __init__(self, args: list, timeout: float = 180, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "ddtree", "serve", *map(str, args), "--port", "0"],
                                     cwd=str(REPO), env=env or child_env(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        found = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    found.set()
            found.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        t0 = time.monotonic()
        found.wait(timeout)
        if self.url is None:
            self.stop()
            raise RuntimeError("the server printed no address:\n" + self.log)
        import httpx

        self.health: list[int] = []  # the statuses /health answered while starting
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n" + self.log)
            try:
                self.health.append(httpx.get(self.url + "/health", timeout=2).status_code)
                if self.health[-1] == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("the server was not ready in time:\n" + self.log)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_mib(self) -> float | None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._pump.join(5)
        return self.proc.returncode


def model_args(fixture: Path, max_length: int, max_new: int) -> list:
    return ["--target", fixture / "target", "--drafter", fixture / "drafter", "--dtype", "float32", "--devices", "cpu",
            "--budget", 8, "--max-length", max_length, "--max-new-tokens", max_new]


def references(fixture: Path, rows: list[dict], max_length: int, max_new: int, methods=METHODS) -> dict:
    """{(method, row id): (text, token ids)} from in-process `ddtree generate --prompts --stats-json`
    (rows: {"id", "prompt"}, the text as the server sees it: a completion's prompt, a chat's transcript)."""
    from typer.testing import CliRunner

    from ddtree.app.cli import app

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for method in methods:
            stats = Path(tmp) / f"{method}.json"
            r = CliRunner().invoke(app, ["generate", *map(str, model_args(fixture, max_length, max_new)), "--method",
                                         method, "--prompts", str(prompts), "--stats-json", str(stats), "--jsonl"])
            if r.exit_code != 0:
                raise RuntimeError(f"generate failed ({r.exit_code}): {r.output}")
            for p in json.loads(stats.read_text())["runs"][0]["prompts"]:
                out[method, p["prompt_id"]] = (p["text"], p["token_ids"])
    return out


def load_rows(fixture: Path, n: int, chars: int = 400) -> list[dict]:
    """n prompts of the fixture (their last `chars` characters) as requests: even ones as text
    completions, odd ones as one-message chats (the server renders a plain transcript: the message
    and a newline)."""
    rows = []
    with open(fixture / "prompts.jsonl") as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            text = json.loads(line)["prompt"][-chars:]
            kind = "completion" if i % 2 == 0 else "chat"
            rows.append({"id": f"p{i}", "kind": kind, "text": text,
                         "prompt": text if kind == "completion" else text + "\n"})
    return rows


def one_request(client, model: str, row: dict, method: str, stream: bool, max_new: int) -> dict:
    """-> {"text", "token_ids", "finish", "queue_s", "latency_s"} of one request through the openai client."""
    extra = {"ddtree": {"method": method, "record": True}}
    t0 = time.perf_counter()
    text, usage, finish = "", None, None
    if row["kind"] == "chat":
        kw = dict(model=model, messages=[{"role": "user", "content": row["text"]}], max_tokens=max_new,
                  temperature=0, extra_body=extra)
        if stream:
            for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
                if ch.usage:
                    usage = ch.usage
        else:
            r = client.chat.completions.create(**kw)
            text, usage, finish = r.choices[0].message.content, r.usage, r.choices[0].finish_reason
    else:
        kw = dict(model=model, prompt=row["text"], max_tokens=max_new, temperature=0, extra_body=extra)
        if stream:
            for ch in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                if ch.choices:
                    text += ch.choices[0].text or ""
                    finish = ch.choices[0].finish_reason or finish
                if ch.usage:
                    usage = ch.usage
        else:
            r = client.completions.create(**kw)
            text, usage, finish = r.choices[0].text, r.usage, r.choices[0].finish_reason
    d = usage.model_extra["ddtree"] if usage.model_extra and "ddtree" in usage.model_extra else usage.ddtree
    return {"text": text, "token_ids": d["record"]["token_ids"], "finish": finish, "queue_s": d["queue_s"],
            "latency_s": time.perf_counter() - t0, "reused": d["reused_tokens"]}


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p):
        return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]

    return {"p50": q(50), "p90": q(90), "p99": q(99), "max": s[-1], "mean": sum(s) / len(s)}


def run_load(server: Server, clients: int, requests: int, rows: list[dict], refs: dict, max_new: int,
             methods=METHODS, api_key: str = "none") -> dict:
    """The clients against a running server; -> the figures and every mismatch or error."""
    import openai

    model = openai.OpenAI(base_url=server.url + "/v1", api_key=api_key).models.list().data[0].id
    results: list[dict] = []
    errors: list[str] = []
    firsts = threading.Barrier(clients + 1)
    lock = threading.Lock()
    rss: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            m = server.rss_mib()
            if m is not None:
                rss.append((time.perf_counter(), m))
            stop.wait(0.1)

    def client(c: int):
        api = openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120)
        for i in range(requests):
            k = c * requests + i
            row, method, stream = rows[k % len(rows)], methods[k % len(methods)], (k // len(methods)) % 2 == 0
            try:
                got = one_request(api, model, row, method, stream, max_new)
                want_text, want_ids = refs[method, row["id"]]
                ok = got["text"] == want_text and got["token_ids"] == want_ids
                with lock:
                    results.append(dict(got, client=c, request=i, row=row["id"], method=method, stream=stream, equal=ok))
                    if not ok:
                        errors.append(f"client {c} request {i} ({row['id']}, {method}, stream {stream}): reply differs "
                                      f"from generate's: {got['text']!r} vs {want_text!r}")
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                with lock:
                    errors.append(f"client {c} request {i}: {type(e).__name__}: {e}")
            if i == 0:
                firsts.wait()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    firsts.wait()
    t_first = time.perf_counter()
    rss_first = server.rss_mib()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    rss_end = server.rss_mib()
    stop.set()
    sampler.join()
    after = [m for t, m in rss if t >= t_first]
    growth = (max(after + [rss_end]) / rss_first - 1) if rss_first and after else None
    return {
        "clients": clients, "requests_per_client": requests, "requests": len(results), "errors": errors,
        "all_equal": bool(results) and all(r["equal"] for r in results) and len(results) == clients * requests,
        "wall_s": wall, "requests_per_s": len(results) / wall if wall else None,
        "queue_wait_s": percentiles([r["queue_s"] for r in results]),
        "latency_s": percentiles([r["latency_s"] for r in results]),
        "rss_mib": {"first_round": rss_first, "end": rss_end, "peak_after_first_round": max(after) if after else None,
                    "growth_after_first_round": growth, "samples": len(rss)},
        "streamed": sum(r["stream"] for r in results),
        "by_method": {m: sum(r["method"] == m for r in results) for m in methods},
    }


def git_commit() -> str:
    if os.environ.get("DDTREE_COMMIT"):  # a copy of the tree without its history (the GPU machine's)
        return os.environ["DDTREE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20, help="per client")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts of the fixture")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--time-limit", type=float, default=180, help="seconds the load may take")
    ap.add_argument("--fixture", default=str(FIXTURE))
    ap.add_argument("--out", default="results/serve-load-cpu.json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    fixture = Path(args.fixture)
    rows = load_rows(fixture, args.prompts)
    t0 = time.perf_counter()
    refs = references(fixture, rows, args.max_length, args.max_new_tokens)
    print(f"references: {len(refs)} generations in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    server = Server(model_args(fixture, args.max_length, args.max_new_tokens)
                    + ["--max-queue", max(args.clients, 1)])
    try:
        doc = run_load(server, args.clients, args.requests, rows, refs, args.max_new_tokens)
    finally:
        rc = server.stop()
    growth = doc["rss_mib"]["growth_after_first_round"]
    checks = {"no_error": not doc["errors"], "every_reply_equal": doc["all_equal"],
              "rss_flat": growth is not None and growth <= args.max_rss_growth,
              "within_time_limit": doc["wall_s"] <= args.time_limit, "sigterm_exit_0": rc == 0}
    doc = {"what": "ddtree serve under load: concurrent openai clients against one server, every reply checked "
                   "against ddtree generate", "date": str(datetime.date.today()), "commit": git_commit(),
           "machine": {"cpus": os.cpu_count(), "device": "cpu", "dtype": "float32", "omp_threads": 1},
           "fixture": "codepair (target + drafter)", "max_new_tokens": args.max_new_tokens,
           "prompts": len(rows), **doc, "checks": checks, "passed": all(checks.values())}
    q, rs = doc["queue_wait_s"], doc["rss_mib"]
    print(f"{doc['requests']} requests ({args.clients} clients x {args.requests}) in {doc['wall_s']:.1f} s, "
          f"{len(doc['errors'])} errors, every reply equal to generate's: {doc['all_equal']}; queue wait p50 "
          f"{q.get('p50', 0):.3f} s, p90 {q.get('p90', 0):.3f} s, p99 {q.get('p99', 0):.3f} s, max {q.get('max', 0):.3f} s; "
          f"RSS {rs['first_round']:.0f} MiB after the first round, {rs['end']:.0f} MiB at the end "
          f"(growth {100 * (growth or 0):.1f}%); SIGTERM exit {rc}")
    for e in doc["errors"][:10]:
        print("  " + e, file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
