"""What `ddtree generate` reads and prints, shared by the in-process command and the client of a
running server (ddtree.app.serve.client): the prompts, the stderr summary line of a generation,
the line of one cut short, and the --jsonl objects. Imports no torch (the client must not)."""

from __future__ import annotations

import json
import sys

from ddtree.errors import DDTreeError


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def run_label(method: str, budget) -> str:
    return f"ddtree {budget}" if method == "ddtree" else method


def summary_line(rec, label: str) -> str:
    """The stderr line after a generation: the headline is tokens per target forward over all
    rounds; the mean acceptance length over the drafted rounds stands beside it, named so."""
    from ddtree.stats import aggregate

    a = aggregate([rec])
    line = (f"{label}: {rec.new_tokens} new tokens from a {rec.prompt_tokens}-token prompt, "
            f"{rec.decode_tok_s:.1f} tok/s decode, time to first token {rec.ttft_s * 1e3:.0f} ms")
    if not a["rounds"]:
        return line + ", no decode rounds (prefill made the only token)"
    line += f", {a['tokens_per_target_forward']:.2f} tokens per target forward over {plural(a['rounds'], 'round')}"
    if rec.method != "ar":
        line += f" (mean acceptance length {a['mean_acceptance_length']:.2f} over {plural(a['num_drafts'], 'drafted round')}"
        if a["num_plain_steps"]:
            line += f", {plural(a['num_plain_steps'], 'plain step')}"
        line += ")"
    return line


def partial_line(p, n_prompt: int, s, label: str) -> str:
    n = len(s.ids)
    if n == 0:
        return f"{label}: interrupted before the first token of {p.label}"
    rate = (n - 1) / (s.t_last - s.t_first) if n > 1 and s.t_last > s.t_first else 0.0
    return (f"{label}: interrupted after {n} new tokens from a {n_prompt}-token prompt, {rate:.1f} tok/s decode, "
            f"time to first token {(s.t_first - s.t0) * 1e3:.0f} ms ({p.label} unfinished: not in the statistics)")


def jsonl_record(p, rec=None, streamer=None, n_prompt: int = 0) -> dict:
    """--jsonl: one object per prompt (documented in the README)."""
    from ddtree.stats import aggregate

    if rec is None:  # cut short by Ctrl-C
        return {"id": p.id, "text": streamer.text() if streamer else "", "interrupted": True,
                "prompt_tokens": n_prompt, "new_tokens": len(streamer.ids) if streamer else 0}
    a = aggregate([rec])
    return {"id": p.id, "text": rec.text, "interrupted": False, "method": rec.method, "budget": rec.budget,
            "prompt_tokens": rec.prompt_tokens, "new_tokens": rec.new_tokens,
            "decode_tok_s": rec.decode_tok_s, "ttft_s": rec.ttft_s, "rounds": a["rounds"],
            "tokens_per_target_forward": a["tokens_per_target_forward"],
            "mean_acceptance_length": a["mean_acceptance_length"], "num_drafts": a["num_drafts"],
            "num_plain_steps": a["num_plain_steps"]}


def print_jsonl(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def read_prompts(prompt: str | None, prompts_spec: str | None, limit: int | None):
    from ddtree.app.prompts import Prompt, load_prompts
    from ddtree.app.setup import stdin_text

    if prompt is not None:
        from_stdin = prompt == "-"
        text = stdin_text() if from_stdin else prompt
        if not text.strip():
            raise DDTreeError("empty prompt: pass a non-empty prompt (argument, '-' for stdin, or --prompts FILE|SUITE)")
        return [Prompt(id="stdin" if from_stdin else "cli", text=text, from_cli=True)]
    if prompts_spec:
        return load_prompts(str(prompts_spec), limit)
    raise DDTreeError("no prompt: pass PROMPT as an argument, '-' to read it from stdin, or --prompts FILE|SUITE")
