#!/usr/bin/env python3
"""`ddtree serve` and `ddtree chat` measured: a server under load (CPU), against the in-process
commands (GPU; on a CPU too, slowly), and chat's kept state against re-prefilling (GPU).

load: C concurrent clients x R requests each through the official openai client on the codepair
    fixture (float32, greedy, CPU). The server runs as a subprocess on a free loopback port
    (stopped with SIGTERM at the end: it must exit 0); every reply is computed first with
    in-process `ddtree generate` and must equal it token for token; each request picks a prompt,
    chat or text completion, streamed or not, and a method in turn. The server's VmRSS is sampled
    every 0.1 s: its growth from the end of the first round to the end stays within
    --max-rss-growth. Queue waits (usage.ddtree.queue_s) as percentiles; exit 1 when a check fails.

oneoff: the codepair pair (target + drafter-distilled, the commands' defaults: bf16 on cuda). A
    `ddtree serve` subprocess is started and made ready (its ready line is kept); then --runs fresh
    processes of `ddtree generate --server URL -n 96 "def quicksort(xs):"`, each timed from its
    spawn to the first byte on stdout (the first token) and to its exit (the whole command); the
    first is the first client process after the server's start. With --baseline, as many fresh
    `ddtree generate --target ... --drafter ...` processes (the in-process one-off) before it.
random: the Qwen3.6-27B shapes with random weights on one GPU (a forward's cost does not depend
    on weight values), served in this process: the app and its engine over the prebuilt pair
    (a tokenizer of token ids: the prompt "12 345 ..." is those ids, a reply's text its ids), uvicorn
    in a thread, streamed requests over loopback HTTP (httpx). Per prompt (--prompts random prompts
    of --prompt-tokens, --new-tokens each; ar and ddtree --budget): the decode tok/s the engine
    measured and the one the client saw (first to last chunk), against `Decoder.generate` on the
    same decoder and prompt (what `ddtree bench` times), after a warm-up of every prompt through both;
    the time to first token the client saw against the engine's (what HTTP adds). With --chat, a
    conversation with a --system-tokens system prompt: the second turn's time to first token at the
    client against 1.2 x the same number of tokens prefilled alone + 20 ms (the chat part's
    target).
chat: `ddtree chat`'s kept state against re-prefilling the whole conversation every turn, with
    random weights of full-size shapes (a forward's cost does not depend on weight values), on one GPU.
    
    A conversation of token ids: a system prompt of --system-tokens, then --turns turns, each a user
    message of --turn-tokens and a reply of --reply-tokens (random weights never stop), every next
    prompt the conversation so far (a plain transcript at the token level). Per turn:
      * chat: time to first token of `Conversation.turn` (restore, prefill of what the kept state
        lacks, first draft), the tokens it reused and prefilled, and the settle after the reply;
      * re-prefill: time to first token of a fresh `Decoder.prefill` of the whole conversation;
      * alone: a fresh prefill of just as many tokens as the chat turn prefilled (from position 0),
        through the path the turn took (Decoder.prefill's rule: a kept state's turn takes the fast
        path once a fast prefill ran; a fresh short prompt would take the eager twins);
      * target (turns > 1): chat TTFT <= 1.2 x alone + 20 ms.
    The conversation runs --passes times from a fresh Conversation (the same tokens); a turn's chat
    TTFT is the median over the passes, as `alone` is the median of three prefills: one sample of a
    launch-bound 200-token prefill on a shared host is not a figure. After each settle the heap is
    frozen as `ddtree chat` does (ddtree.decode.startup.freeze_heap); every turn records the time
    spent in the collector's full collections (generation 2) during it.
    Then decode tok/s of one long reply (--decode-tokens) after the whole conversation, through
    `Conversation.turn` and through `Decoder.generate` on the same tokens (target: within 3%), and
    whether their tokens agree. Prints a table, writes JSON (--out). Feeds docs/USAGE.md's chat
    figures and the chat rows of docs/PERFORMANCE.md's targets (results/chat-h200.json). (results/chat-h200.json).
Writes JSON (--out). Examples:
    python scripts/bench_serve.py chat --out results/chat-h200.json   # 27B shapes, cuda:0, bf16
    python scripts/bench_serve.py chat --tiny --out /tmp/chat-tiny.json
    python scripts/bench_serve.py load                             # 8 clients x 20 requests: results/serve-load-cpu.json
    python scripts/bench_serve.py oneoff --fixture .fixture/codepair --baseline --out results/serve-oneoff-h100.json
    python scripts/bench_serve.py random --chat --out results/serve-27b-h100.json
    python scripts/bench_serve.py random --tiny --chat --out /tmp/serve-tiny.json   # CPU: the script's own check
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import gc
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))  # bench_engine, also where this is imported as scripts.bench_serve

from ddtree.decode.clock import sync  # noqa: E402
from ddtree.decode.conversation import Conversation  # noqa: E402
from ddtree.decode.decoder import Decoder  # noqa: E402
from ddtree.decode.sampling import SamplingParams  # noqa: E402
from ddtree.decode.startup import freeze_heap  # noqa: E402
from ddtree.model.presets import PRESETS  # noqa: E402
from ddtree.model.synthetic import build_random_on_devices, tiny_drafter_config, tiny_hybrid_config  # noqa: E402
from ddtree.options import DEFAULT_BUDGET, Options  # noqa: E402

from bench_engine import git_commit  # noqa: E402
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



def part_load(args) -> int:
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



ONEOFF_PROMPT = "def quicksort(xs):"


# ============================================================================================
# oneoff: fresh client processes against a warm server
# ============================================================================================


def timed_process(argv: list[str], env: dict) -> dict:
    """Spawn argv; -> seconds to its first stdout byte and to its exit, its status and stderr."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = p.stdout.read(1)
    t_first = time.perf_counter() - t0 if first else None
    out = first + p.stdout.read()
    err = p.stderr.read()
    rc = p.wait()
    return {"first_token_s": t_first, "command_s": time.perf_counter() - t0, "rc": rc,
            "stdout": out.decode(errors="replace"), "stderr": err.decode(errors="replace").strip().splitlines()}


def part_oneoff(args) -> dict:
    fixture = Path(args.fixture)
    model = ["--target", str(fixture / "target"), "--drafter", str(fixture / args.drafter)]
    if args.devices:
        model += ["--devices", args.devices]
    env = dict(child_env(), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    gen = ["-n", str(args.oneoff_tokens), ONEOFF_PROMPT]
    doc: dict = {"prompt": ONEOFF_PROMPT, "new_tokens": args.oneoff_tokens, "drafter": args.drafter}
    if args.baseline:
        doc["in_process"] = [timed_process([sys.executable, "-m", "ddtree", "generate", *model, *gen], env)
                             for _ in range(args.runs)]
    t0 = time.perf_counter()
    server = Server(model + ["--max-new-tokens", str(args.oneoff_tokens)], timeout=900, env=env)
    doc["server_ready_s"] = time.perf_counter() - t0
    doc["server_ready_line"] = next((ln.strip() for ln in server.lines if " ready " in ln), None)
    try:
        doc["through_server"] = [timed_process([sys.executable, "-m", "ddtree", "generate", "--server", server.url,
                                                *gen], env) for _ in range(args.runs)]
    finally:
        doc["server_exit"] = server.stop()
        doc["server_log"] = [ln.rstrip() for ln in server.lines[-80:]]  # where its start-up went
    if args.baseline:
        doc["same_text"] = all(r["stdout"] == doc["in_process"][0]["stdout"] for r in doc["through_server"])
    for key in ("in_process", "through_server"):
        for r in doc.get(key, []):
            first = "none" if r["first_token_s"] is None else f"{r['first_token_s']:.3f} s"
            print(f"{key:>14}: first token {first}, command {r['command_s']:.3f} s (exit {r['rc']})")
            if r["rc"]:
                print("\n".join(r["stderr"][-5:]))
    return doc


# ============================================================================================
# random: the 27B shapes served in this process
# ============================================================================================


class IdsTokenizer:
    """Text of token ids: "12 345 6" encodes to [12, 345, 6] and decodes back; any other word to an
    id of its own (the chat's probes, the warm-up's words). No chat template, no stop token."""

    chat_template = None
    eos_token_id = None

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(w) if w.isdigit() else 10 + sum(map(ord, w)) % (self.vocab - 10) for w in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids) + (" " if ids else "")


def ids_text(ids: list[int]) -> str:
    """A prompt of these ids (ending in a space, as IdsTokenizer.decode's text: a text that follows starts a new id)."""
    return "".join(f"{i} " for i in ids)


class InProcess:
    """The serve app over a prebuilt decoder, uvicorn in a thread on a free loopback port."""

    def __init__(self, target, drafter, dtype, devices, max_len: int, method: str, budget, new_tokens: int):
        import socket

        import uvicorn

        from ddtree.app.options import defaults
        from ddtree.app.serve.api import create_app
        from ddtree.app.serve.engine import Engine
        from ddtree.app.serve.metrics import Metrics
        from ddtree.app.setup import ModelSpec

        spec = ModelSpec(target_ref="random", target_dir=REPO, target_cfg=target.cfg, drafter_ref="random",
                         drafter_dir=None, drafter_cfg=drafter.cfg if drafter is not None else None,
                         devices=[torch.device(d) for d in devices], dtype=dtype,
                         tokenizer=IdsTokenizer(target.cfg.vocab_size), stop_ids=frozenset())
        opts = dict(defaults("serve"), target="random", max_new_tokens=new_tokens, method=method, budget=budget,
                    max_queue=4)
        self.dec_box: list = []

        def load():
            self.dec_box.append(Decoder(target, drafter, max_len=max_len, options=Options.from_env()))
            return self.dec_box[0]

        metrics = Metrics()
        room = max(257 if budget == "auto" else int(budget) + 1, drafter.cfg.block_size if drafter is not None else 1)
        self.engine = Engine(spec, opts, method, budget, max_len, room, False, metrics, lambda s: None,
                             time.perf_counter(), 0.0, load=load)
        app = create_app(self.engine, metrics, "random", None)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # (asyncio sets TCP_NODELAY)
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                                    log_config=None))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        t0 = time.perf_counter()
        self.engine.start(on_fail=lambda: None)
        while not self.engine.ready.is_set():
            if self.engine.error is not None:
                raise self.engine.error
            time.sleep(0.05)
        self.ready_s = time.perf_counter() - t0
        self.engine.idle.wait()

    @property
    def dec(self):
        return self.dec_box[0]

    def request(self, client, path: str, body: dict) -> dict:
        """A streamed request: client-side times, the text, the usage."""
        body = dict(body, model="random", stream=True, stream_options={"include_usage": True})
        t0 = time.perf_counter()
        t_first = t_last = None
        chunks, usage, text = 0, None, ""
        with client.stream("POST", self.url + path, json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{r.status_code}: {r.text}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = obj["usage"]
                for c in obj.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content") or c.get("text")
                    if piece:
                        text += piece
                        t_last = time.perf_counter()
                        t_first = t_first or t_last
                        chunks += 1
        self.engine.idle.wait()  # the settle after the reply is done: the decoder is free
        d = usage["ddtree"]
        n = usage["completion_tokens"]
        return {"client_ttft_s": t_first - t0, "client_last_s": t_last - t0,  "engine_ttft_s": d["ttft_s"], "queue_s": d["queue_s"],
                "http_ttft_overhead_s": (t_first - t0) - d["ttft_s"] - d["queue_s"], "new_tokens": n,
                "engine_decode_tok_s": d["decode_tok_s"],
                "client_decode_tok_s": (n - 1) / (t_last - t_first) if t_last > t_first else None,
                "chunks": chunks, "reused": d["reused_tokens"], "prefilled": d["prefilled_tokens"],
                "tokens_per_target_forward": d["tokens_per_target_forward"], "text": text}

    def generate(self, ids: list[int], method: str, budget, n: int):
        """Decoder.generate on the same decoder (the engine idle), then the engine's kept state forgotten."""
        rec = self.dec.generate(ids, method, budget, max_new_tokens=n)
        self.engine.conv.reset()
        return rec

    def stop(self):
        self.engine.shutdown()
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.join(30)


def random_pair_configs(args, tiny_eos: bool):
    """The random pair the random and chat parts build: --tiny's tiny hybrid in float32 on the
    CPU (without an end-of-sequence token unless tiny_eos), else --preset's full shapes in bf16 on
    cuda:0; --devices overrides the device. -> (devices, dtype, target config, drafter config, name)."""
    devices = (args.devices or ("cpu" if args.tiny else "cuda:0")).split(",")
    if not args.tiny:
        mk_t, mk_d = PRESETS[args.preset]
        return devices, torch.bfloat16, mk_t(), mk_d(), args.preset
    raw_t = tiny_hybrid_config(vocab=97)
    if not tiny_eos:  # (a random model's replies run to their length)
        raw_t["text_config"].pop("eos_token_id", None)
    return devices, torch.float32, raw_t, tiny_drafter_config(raw_t), "tiny-hybrid"


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(10, vocab) for _ in range(n)]


def part_random(args) -> dict:
    import httpx

    from ddtree.app.cli import setup_logging

    setup_logging(False)
    devices, dtype, raw_t, raw_d, name = random_pair_configs(args, tiny_eos=False)
    system = args.system_tokens if args.chat else 0
    max_len = max(args.prompt_tokens, system + 2 * (args.turn_tokens + args.reply_tokens)) + args.new_tokens + 1024
    t0 = time.perf_counter()
    target, drafter = build_random_on_devices(raw_t, raw_d, devices, dtype, max_len)
    built = time.perf_counter() - t0
    budget = args.budget if args.budget == "auto" else int(args.budget)
    runs = [("ar", None), ("ddtree", budget)]
    srv = InProcess(target, drafter, dtype, devices, max_len, "ddtree", budget, min(args.new_tokens, 64))
    vocab = target.cfg.vocab_size
    print(f"[{name}] built in {built:.1f} s, served after {srv.ready_s:.1f} s more", file=sys.stderr, flush=True)
    client = httpx.Client(timeout=None)
    prompts = [rand_ids(args.prompt_tokens, vocab, 100 + i) for i in range(args.prompts)]
    doc: dict = {"preset": name, "max_len": max_len, "built_s": built, "ready_s": srv.ready_s, "runs": []}
    try:
        for method, b in runs:
            knobs = {"method": method, **({"budget": b} if method == "ddtree" else {})}
            body = lambda ids: {"prompt": ids_text(ids), "max_tokens": args.new_tokens, "ddtree": knobs}  # noqa: E731
            t0 = time.perf_counter()
            for ids in prompts:  # warm-up: every prompt through both paths (bench warms the same lengths up)
                for _ in range(args.warmup):
                    srv.request(client, "/v1/completions", body(ids))
                    srv.generate(ids, method, b or DEFAULT_BUDGET, args.new_tokens)
            rows = []
            for i, ids in enumerate(prompts):
                s = srv.request(client, "/v1/completions", body(ids))
                g = srv.generate(ids, method, b or DEFAULT_BUDGET, args.new_tokens)
                s["same_tokens"] = s.pop("text").split() == [str(t) for t in g.token_ids]
                s.update(prompt=i, generate_decode_tok_s=g.decode_tok_s, generate_ttft_s=g.ttft_s,
                         ratio_engine=s["engine_decode_tok_s"] / g.decode_tok_s,
                         ratio_client=(s["client_decode_tok_s"] or 0) / g.decode_tok_s)
                rows.append(s)
            med = {k: statistics.median(r[k] for r in rows) for k in
                   ("engine_decode_tok_s", "client_decode_tok_s", "generate_decode_tok_s", "ratio_engine",
                    "ratio_client", "http_ttft_overhead_s", "client_ttft_s", "engine_ttft_s")}
            doc["runs"].append({"method": method, "budget": b, "warmup_s": time.perf_counter() - t0, "prompts": rows,
                                "median": med, "within_2pct": abs(med["ratio_client"] - 1) <= 0.02,
                                "http_ttft_within_5ms": med["http_ttft_overhead_s"] <= 0.005})
            print(f"{method} {b or ''}: server {med['client_decode_tok_s']:.1f} tok/s at the client "
                  f"({med['engine_decode_tok_s']:.1f} in the engine), generate {med['generate_decode_tok_s']:.1f}: "
                  f"ratio {med['ratio_client']:.3f} ({med['ratio_engine']:.3f}); HTTP adds "
                  f"{med['http_ttft_overhead_s'] * 1e3:.1f} ms to the first token", flush=True)
        if args.chat:
            doc["chat"] = chat_turns(srv, client, args, vocab, budget)
    finally:
        client.close()
        srv.stop()
    return doc


def chat_turns(srv: InProcess, client, args, vocab: int, budget) -> dict:
    """Two turns of a conversation with a long system prompt, each through the server (--passes
    times, a fresh conversation each); the second turn's client TTFT against the same number of
    tokens prefilled alone (median of 3, through the path the turn took)."""

    system = ids_text(rand_ids(args.system_tokens, vocab, 1))
    knobs = {"method": "ddtree", "budget": budget}
    rows = []
    for p in range(args.passes + 1):  # the first pass warms up (its graphs and its prefill lengths)
        srv.engine.idle.wait()
        srv.engine.conv.reset()
        u1 = ids_text(rand_ids(args.turn_tokens, vocab, 1000 + p))
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": u1}]
        body = {"messages": msgs, "max_tokens": args.reply_tokens, "ddtree": knobs}
        first = srv.request(client, "/v1/chat/completions", body)
        msgs = msgs + [{"role": "assistant", "content": first.pop("text")},
                       {"role": "user", "content": ids_text(rand_ids(args.turn_tokens, vocab, 2000 + p))}]
        second = srv.request(client, "/v1/chat/completions", dict(body, messages=msgs))
        if p:
            second.pop("text")
            rows.append({"first": first, "second": second})
    dec = srv.dec
    n = rows[-1]["second"]["prefilled"]
    job = dec.job("ddtree", budget, SamplingParams(), 8, 0, False, n)
    fast = dec.target.fast_prefill_ran
    alone = []
    for i in range(3):
        ids = rand_ids(n, vocab, 3000 + i)
        t0 = time.perf_counter()
        dec.prefill(ids, job, fast=fast)
        alone.append(time.perf_counter() - t0)
    srv.engine.conv.reset()
    ttft = statistics.median(r["second"]["client_ttft_s"] for r in rows)
    alone_s = statistics.median(alone)
    out = {"system_tokens": args.system_tokens, "turn_tokens": args.turn_tokens, "reply_tokens": args.reply_tokens,
           "passes": rows, "second_turn_client_ttft_s": ttft, "alone_prefill_s": alone_s, "alone_path":
           "fast" if fast else "eager", "target_s": 1.2 * alone_s + 0.020, "meets": ttft <= 1.2 * alone_s + 0.020}
    print(f"chat: second turn's first token {ttft * 1e3:.1f} ms at the client ({n} tokens prefilled; alone "
          f"{alone_s * 1e3:.1f} ms; target {out['target_s'] * 1e3:.1f} ms: {'met' if out['meets'] else 'NOT met'})")
    return out


# ============================================================================================
# chat: the kept state against re-prefilling
# ============================================================================================


def chat_rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def fresh_ttft(dec: Decoder, ids: list[int], job, fast: bool | None = None) -> float:
    """Time to first token of a fresh prefill (reset, the whole prompt, the first draft), in s;
    fast: Decoder.prefill's path (default its rule)."""
    sync(dec.device)
    t0 = time.perf_counter()
    dec.prefill(ids, job, fast=fast)
    return time.perf_counter() - t0


class FullCollections:
    """Milliseconds the collector spends in full collections (generation 2) while counting."""

    def __init__(self):
        self.ms, self._t0 = 0.0, None
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict):
        if info["generation"] == 2:
            if phase == "start":
                self._t0 = time.perf_counter()
            elif self._t0 is not None:
                self.ms += (time.perf_counter() - self._t0) * 1e3
                self._t0 = None

    def take(self) -> float:
        ms, self.ms = self.ms, 0.0
        return ms


def run_conversation(dec: Decoder, args, vocab: int, method: str, budget, turns: int,
                     full: FullCollections | None = None) -> tuple[list[dict], list[int]]:
    """The chat: per turn its prompt, TTFT, reuse and settle (then, where `full` counts, the heap
    frozen as ddtree chat does after a settle). -> (rows, the conversation's tokens after the last reply)."""
    conv = Conversation(dec)
    ids = chat_rand_ids(args.system_tokens, vocab, 1) + chat_rand_ids(args.turn_tokens, vocab, 100)
    rows = []
    for n in range(turns):
        job = dec.job(method, budget, SamplingParams(), args.reply_tokens, 0, False, len(ids))
        if full:
            full.take()
        rec = conv.turn(ids, job, marks=(args.system_tokens,), pin=(args.system_tokens,))
        gc_ms = full.take() if full else None  # in full collections during the turn (prefill and reply)
        r = conv.last
        sync(dec.device)
        t0 = time.perf_counter()
        done = ids + rec.token_ids
        s = conv.settle(done, taps=method != "ar")
        sync(dec.device)
        settle_ms = (time.perf_counter() - t0) * 1e3
        if full:
            freeze_heap(dec.graphs)
        rows.append({"turn": n + 1, "prompt_tokens": len(ids), "reused": r.reused, "prefilled": r.prefilled,
                     "chat_ttft_ms": rec.ttft_s * 1e3, "decode_tok_s": rec.decode_tok_s, "ids": list(ids),
                     "full_gc_ms": gc_ms, "settle_prefilled": s.prefilled, "settle_ms": settle_ms})
        ids = done + chat_rand_ids(args.turn_tokens, vocab, 101 + n)
    return rows, ids[: len(ids) - args.turn_tokens]


def heap_probe() -> dict:
    """What a full collection costs in this process now (before the heap is frozen): objects tracked, ms."""
    n = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    return {"tracked_objects": n, "full_collection_ms": (time.perf_counter() - t0) * 1e3}


def decode_rates(dec: Decoder, ids: list[int], method: str, budget, n_tokens: int, reps: int) -> dict:
    """Decode tok/s of one reply after `ids`: through a Conversation turn (its state resumed from
    a settle at ids) and through Decoder.generate (a fresh prefill), best of reps each."""
    job = dec.job(method, budget, SamplingParams(), n_tokens, 0, False, len(ids) + 1)
    prompt = ids + [11]  # the next message: one token
    chat, gen, same = [], [], True
    for _ in range(reps):
        conv = Conversation(dec)
        conv.settle(ids, taps=method != "ar")
        a = conv.turn(prompt, job)
        b = dec.generate(prompt, method, budget, max_new_tokens=n_tokens)
        chat.append(a.decode_tok_s)
        gen.append(b.decode_tok_s)
        same &= a.token_ids == b.token_ids
    c, g = max(chat), max(gen)
    return {"context": len(prompt), "new_tokens": n_tokens, "chat_tok_s": c, "generate_tok_s": g,
            "ratio": c / g if g else None, "chat_runs": chat, "generate_runs": gen, "same_tokens": same}


def part_chat(args) -> None:
    from ddtree.app.cli import setup_logging

    setup_logging(False)  # INFO: loguru's default sink would time auto's per-round debug lines
    small = dict(system_tokens=256, turns=3, turn_tokens=20, reply_tokens=8, decode_tokens=16)
    full = dict(system_tokens=16384, turns=8, turn_tokens=200, reply_tokens=64, decode_tokens=256)
    for k, v in (small if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    budget = args.budget if args.budget == "auto" else int(args.budget)
    devices, dtype, raw_t, raw_d, name = random_pair_configs(args, tiny_eos=True)
    max_len = args.system_tokens + (args.turns + 1) * (args.turn_tokens + args.reply_tokens) + args.decode_tokens + 1024
    t0 = time.perf_counter()
    target, drafter = build_random_on_devices(raw_t, raw_d, devices, dtype, max_len)
    dec = Decoder(target, drafter, options=Options.from_env())
    vocab = target.cfg.vocab_size
    print(f"[{name}] built in {time.perf_counter() - t0:.1f}s, max length {max_len}", file=sys.stderr, flush=True)

    # warm-up: compile and capture what the timed runs meet (the conversation's turns, a fresh
    # prefill of it and of a turn's tokens alone, a long reply through both paths)
    t0 = time.perf_counter()
    warm, end = run_conversation(dec, args, vocab, args.method, budget, 2)
    job = dec.job(args.method, budget, SamplingParams(), 8, 0, False, len(warm[-1]["ids"]))
    fresh_ttft(dec, warm[-1]["ids"], job)
    fresh_ttft(dec, chat_rand_ids(warm[-1]["prefilled"], vocab, 7), job, fast=True)
    decode_rates(dec, end, args.method, budget, min(args.decode_tokens, 32), 1)
    print(f"warm-up {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    heap = heap_probe()
    heap["froze"] = freeze_heap(dec.graphs)
    print(f"heap after the warm-up: {heap['tracked_objects']} tracked objects, a full collection "
          f"{heap['full_collection_ms']:.1f} ms (then frozen)", file=sys.stderr, flush=True)

    full = FullCollections()
    passes = [run_conversation(dec, args, vocab, args.method, budget, args.turns, full) for _ in range(args.passes)]
    rows, end = passes[0]
    for i, r in enumerate(rows):
        runs = [p[0][i] for p in passes]
        r["chat_ttft_runs_ms"] = [x["chat_ttft_ms"] for x in runs]
        r["chat_ttft_ms"] = statistics.median(r["chat_ttft_runs_ms"])
        r["full_gc_runs_ms"] = [x["full_gc_ms"] for x in runs]
        r["settle_ms"] = statistics.median(x["settle_ms"] for x in runs)
    for r in rows:
        ids = r.pop("ids")
        job = dec.job(args.method, budget, SamplingParams(), 8, 0, False, len(ids))
        r["reprefill_ttft_ms"] = fresh_ttft(dec, ids, job) * 1e3
        alone = chat_rand_ids(r["prefilled"], vocab, 1000 + r["turn"])
        # alone through the path the chat turn took (a kept state's turn is fast once a fast prefill ran)
        r["alone_path"] = "fast" if dec.target.fast_prefill_ran else "eager"
        r["alone_ms"] = statistics.median(fresh_ttft(dec, alone, job, fast=dec.target.fast_prefill_ran)
                                          for _ in range(3)) * 1e3
        r["target_ms"] = 1.2 * r["alone_ms"] + 20
        r["meets"] = r["chat_ttft_ms"] <= r["target_ms"] if r["turn"] > 1 else None
    decode = decode_rates(dec, end, args.method, budget, args.decode_tokens, args.reps)
    later = [r["chat_ttft_ms"] for r in rows[1:]]

    head = ["turn", "context", "reused", "prefilled", "chat TTFT ms", "(passes)", "re-prefill TTFT ms", "alone ms",
            "target ms", "met", "settle ms (tokens)", "full gc ms"]
    table = [[str(r["turn"]), str(r["prompt_tokens"]), str(r["reused"]), str(r["prefilled"]), f"{r['chat_ttft_ms']:.1f}",
              "/".join(f"{x:.0f}" for x in r["chat_ttft_runs_ms"]),
              f"{r['reprefill_ttft_ms']:.1f}", f"{r['alone_ms']:.1f}", f"{r['target_ms']:.1f}",
              "-" if r["meets"] is None else ("yes" if r["meets"] else "NO"),
              f"{r['settle_ms']:.1f} ({r['settle_prefilled']})",
              "/".join(f"{x:.0f}" for x in r["full_gc_runs_ms"])] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *table)]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and devices[0].startswith("cuda") else "cpu"
    print(f"\n{name}, {args.method} {budget if args.method == 'ddtree' else ''}, {gpu}, {datetime.date.today()}, "
          f"commit {git_commit()}: a {args.system_tokens}-token system prompt, {args.turns} turns of {args.turn_tokens} "
          f"user + {args.reply_tokens} reply tokens; chat TTFT the median of {args.passes} passes, alone of 3")
    for line in [head] + table:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    if later:
        print(f"turns 2..{args.turns}: chat TTFT {min(later):.1f} .. {max(later):.1f} ms "
              f"(spread {max(later) - min(later):.1f} ms over {rows[-1]['prompt_tokens'] - rows[1]['prompt_tokens']} "
              "more tokens of context)")
    ratio = decode["ratio"]
    print(f"decode after {decode['context']} tokens, {decode['new_tokens']} new: chat {decode['chat_tok_s']:.1f} tok/s, "
          f"generate {decode['generate_tok_s']:.1f} tok/s, ratio {ratio:.3f} "
          f"({'within' if ratio is not None and abs(ratio - 1) <= 0.03 else 'NOT within'} 3%); "
          f"same tokens: {'yes' if decode['same_tokens'] else 'no'}")
    doc = {"preset": name, "gpu": gpu, "date": str(datetime.date.today()), "commit": git_commit(),
           "args": vars(args), "max_len": max_len, "heap": heap, "turns": rows, "decode": decode,
           "targets": {"ttft_met_all": all(r["meets"] for r in rows[1:]) if rows[1:] else None,
                       "decode_within_3pct": ratio is not None and abs(ratio - 1) <= 0.03}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="part", required=True)
    ld = sub.add_parser("load", help="concurrent openai clients against one server, every reply checked (CPU)")
    ld.add_argument("--clients", type=int, default=8)
    ld.add_argument("--requests", type=int, default=20, help="per client")
    ld.add_argument("--prompts", type=int, default=8, help="distinct prompts of the fixture")
    ld.add_argument("--max-new-tokens", type=int, default=32)
    ld.add_argument("--max-length", type=int, default=1024)
    ld.add_argument("--max-rss-growth", type=float, default=0.05)
    ld.add_argument("--time-limit", type=float, default=180, help="seconds the load may take")
    ld.add_argument("--fixture", default=str(FIXTURE))
    ld.add_argument("--out", default="results/serve-load-cpu.json")
    for name in ("oneoff", "random", "both"):
        p = sub.add_parser(name, help={"oneoff": "fresh generate --server processes against a warm server (codepair)",
                                       "random": "the 27B random shapes served in-process against Decoder.generate",
                                       "both": "oneoff, then random"}[name])
        p.add_argument("--fixture", default=str(REPO / ".fixture" / "codepair"))
        p.add_argument("--drafter", default="drafter-distilled", help="the fixture's drafter folder (oneoff)")
        p.add_argument("--oneoff-tokens", type=int, default=96)
        p.add_argument("--runs", type=int, default=3, help="client processes (and in-process ones with --baseline)")
        p.add_argument("--baseline", action="store_true", help="oneoff: also time the in-process command")
        p.add_argument("--devices", default=None)
        p.add_argument("--preset", default="qwen3.6-27b")
        p.add_argument("--tiny", action="store_true", help="random: a tiny random hybrid on the CPU (checks the script)")
        p.add_argument("--prompts", type=int, default=4)
        p.add_argument("--prompt-tokens", type=int, default=512)
        p.add_argument("--new-tokens", type=int, default=256)
        p.add_argument("--budget", default=str(DEFAULT_BUDGET))
        p.add_argument("--warmup", type=int, default=1)
        p.add_argument("--chat", action="store_true")
        p.add_argument("--system-tokens", type=int, default=16384)
        p.add_argument("--turn-tokens", type=int, default=200)
        p.add_argument("--reply-tokens", type=int, default=64)
        p.add_argument("--passes", type=int, default=3)
        p.add_argument("--out", default="results/serve-bench.json")
    ch = sub.add_parser("chat", help="ddtree chat's kept state against re-prefilling, random full-size weights (GPU)")
    ch.add_argument("--preset", default="qwen3.6-27b", choices=sorted(PRESETS))
    ch.add_argument("--tiny", action="store_true", help="a tiny random hybrid on the CPU, in float32 (tests the script)")
    ch.add_argument("--devices", default=None, help="default: cuda:0 (cpu with --tiny)")
    ch.add_argument("--system-tokens", type=int, default=None, help="default 16384 (--tiny: 256)")
    ch.add_argument("--turns", type=int, default=None, help="default 8 (--tiny: 3)")
    ch.add_argument("--turn-tokens", type=int, default=None, help="user tokens per turn; default 200 (--tiny: 20)")
    ch.add_argument("--reply-tokens", type=int, default=None, help="reply tokens per turn; default 64 (--tiny: 8)")
    ch.add_argument("--decode-tokens", type=int, default=None, help="the long reply's tokens; default 256 (--tiny: 16)")
    ch.add_argument("--method", default="ddtree")
    ch.add_argument("--budget", default=str(DEFAULT_BUDGET))
    ch.add_argument("--reps", type=int, default=2, help="repetitions of the decode-rate pair")
    ch.add_argument("--passes", type=int, default=3, help="runs of the whole conversation (a turn's chat TTFT: their median)")
    ch.add_argument("--out", default="results/chat.json")
    args = ap.parse_args()
    if args.part == "load":
        return part_load(args)
    if args.part == "chat":
        part_chat(args)
        return 0

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    doc = {"gpu": gpu, "date": str(datetime.date.today()), "commit": git_commit(), "args": vars(args)}
    if args.part in ("oneoff", "both"):
        doc["oneoff"] = part_oneoff(args)
    if args.part in ("random", "both"):
        doc["random"] = part_random(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    runs = [r for key in ("in_process", "through_server") for r in doc.get("oneoff", {}).get(key, [])]
    return int(any(r["rc"] for r in runs) or doc.get("oneoff", {}).get("same_text") is False)


if __name__ == "__main__":
    sys.exit(main())
