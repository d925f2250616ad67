#!/usr/bin/env python3
"""`ddtree chat`'s kept state against re-prefilling the whole conversation every turn, with
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
figures and the chat rows of docs/PERFORMANCE.md's targets (results/chat-h200.json). Examples:
    python scripts/bench_chat.py --out results/chat-h200.json          # 27B shapes, cuda:0, bf16
    python scripts/bench_chat.py --tiny --out /tmp/chat-tiny.json      # a tiny random pair on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.decode.conversation import Conversation  # noqa: E402
from ddtree.decode.decoder import Decoder  # noqa: E402
from ddtree.decode.sampling import SamplingParams  # noqa: E402
from ddtree.decode.startup import freeze_heap  # noqa: E402
from ddtree.model.presets import PRESETS  # noqa: E402
from ddtree.model.synthetic import build_random_on_devices, tiny_drafter_config, tiny_hybrid_config  # noqa: E402
from ddtree.options import Options  # noqa: E402

from bench_engine import git_commit  # noqa: E402  (scripts/ is on the path when a script runs)


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


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
    ids = rand_ids(args.system_tokens, vocab, 1) + rand_ids(args.turn_tokens, vocab, 100)
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
        ids = done + rand_ids(args.turn_tokens, vocab, 101 + n)
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-27b", choices=sorted(PRESETS))
    ap.add_argument("--tiny", action="store_true", help="a tiny random hybrid on the CPU, in float32 (tests the script)")
    ap.add_argument("--devices", default=None, help="default: cuda:0 (cpu with --tiny)")
    ap.add_argument("--system-tokens", type=int, default=None, help="default 16384 (--tiny: 256)")
    ap.add_argument("--turns", type=int, default=None, help="default 8 (--tiny: 3)")
    ap.add_argument("--turn-tokens", type=int, default=None, help="user tokens per turn; default 200 (--tiny: 20)")
    ap.add_argument("--reply-tokens", type=int, default=None, help="reply tokens per turn; default 64 (--tiny: 8)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="the long reply's tokens; default 256 (--tiny: 16)")
    ap.add_argument("--method", default="ddtree")
    ap.add_argument("--budget", default="32")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of the decode-rate pair")
    ap.add_argument("--passes", type=int, default=3, help="runs of the whole conversation (a turn's chat TTFT: their median)")
    ap.add_argument("--out", default="results/chat.json")
    args = ap.parse_args()
    from ddtree.app.cli import setup_logging

    setup_logging(False)  # INFO: loguru's default sink would time auto's per-round debug lines
    small = dict(system_tokens=256, turns=3, turn_tokens=20, reply_tokens=8, decode_tokens=16)
    full = dict(system_tokens=16384, turns=8, turn_tokens=200, reply_tokens=64, decode_tokens=256)
    for k, v in (small if args.tiny else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    budget = args.budget if args.budget == "auto" else int(args.budget)
    devices = (args.devices or ("cpu" if args.tiny else "cuda:0")).split(",")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        raw_t = tiny_hybrid_config(vocab=97)
        raw_d = tiny_drafter_config(raw_t)
        name = "tiny-hybrid"
    else:
        mk_t, mk_d = PRESETS[args.preset]
        raw_t, raw_d = mk_t(), mk_d()
        name = args.preset
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
    fresh_ttft(dec, rand_ids(warm[-1]["prefilled"], vocab, 7), job, fast=True)
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
        alone = rand_ids(r["prefilled"], vocab, 1000 + r["turn"])
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


if __name__ == "__main__":
    main()
