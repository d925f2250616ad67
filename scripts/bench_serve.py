#!/usr/bin/env python3
"""`ddtree serve` against the in-process commands, on a GPU (both parts run on a CPU too, slowly).

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
    client against 1.2 x the same number of tokens prefilled alone + 20 ms (scripts/bench_chat.py's
    target).
Writes JSON (--out). Examples:
    python scripts/bench_serve.py --part oneoff --fixture .fixture/codepair --baseline --out results/serve-oneoff-h100.json
    python scripts/bench_serve.py --part random --chat --out results/serve-27b-h100.json
    python scripts/bench_serve.py --part random --tiny --chat --out /tmp/serve-tiny.json   # CPU: the script's own check
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from load_serve import Server, child_env, git_commit  # noqa: E402

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
    if args.baseline:
        doc["same_text"] = all(r["stdout"] == doc["in_process"][0]["stdout"] for r in doc["through_server"])
    for key in ("in_process", "through_server"):
        for r in doc.get(key, []):
            print(f"{key:>14}: first token {r['first_token_s']:.3f} s, command {r['command_s']:.3f} s (exit {r['rc']})")
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

        import torch
        import uvicorn

        from ddtree.app.options import defaults
        from ddtree.app.serve.api import create_app
        from ddtree.app.serve.engine import Engine
        from ddtree.app.serve.metrics import Metrics
        from ddtree.app.setup import ModelSpec
        from ddtree.decode.decoder import Decoder
        from ddtree.options import Options

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


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(10, vocab) for _ in range(n)]


def part_random(args) -> dict:
    import httpx
    import torch

    from ddtree.app.cli import setup_logging
    from ddtree.model.presets import PRESETS
    from ddtree.model.synthetic import build_random_on_devices, tiny_drafter_config, tiny_hybrid_config

    setup_logging(False)
    devices = (args.devices or ("cpu" if args.tiny else "cuda:0")).split(",")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        raw_t = tiny_hybrid_config(vocab=97)
        raw_t["text_config"].pop("eos_token_id", None)
        raw_d = tiny_drafter_config(raw_t)
        name = "tiny-hybrid"
    else:
        mk_t, mk_d = PRESETS[args.preset]
        raw_t, raw_d = mk_t(), mk_d()
        name = args.preset
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
                    srv.generate(ids, method, b or 32, args.new_tokens)
            rows = []
            for i, ids in enumerate(prompts):
                s = srv.request(client, "/v1/completions", body(ids))
                g = srv.generate(ids, method, b or 32, args.new_tokens)
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
    from ddtree.decode.sampling import SamplingParams

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("oneoff", "random", "both"), default="both")
    ap.add_argument("--fixture", default=str(REPO / ".fixture" / "codepair"))
    ap.add_argument("--drafter", default="drafter-distilled", help="the fixture's drafter folder (oneoff)")
    ap.add_argument("--oneoff-tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=3, help="client processes (and in-process ones with --baseline)")
    ap.add_argument("--baseline", action="store_true", help="oneoff: also time the in-process command")
    ap.add_argument("--devices", default=None)
    ap.add_argument("--preset", default="qwen3.6-27b")
    ap.add_argument("--tiny", action="store_true", help="random: a tiny random hybrid on the CPU (checks the script)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--budget", default="32")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--system-tokens", type=int, default=16384)
    ap.add_argument("--turn-tokens", type=int, default=200)
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", default="results/serve-bench.json")
    args = ap.parse_args()
    import torch

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
