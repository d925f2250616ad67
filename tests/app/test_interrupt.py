"""Ctrl-C keeps what finished: generate prints the summary of what it generated and writes the
statistics of the finished prompts; bench writes every finished run and prompt; both exit 130.

One test sends SIGINT to a `python -m ddtree` process mid-run; the others interrupt a chosen
generation in-process (deterministic: which prompt, after how many tokens), one of them with a
real SIGINT to this process."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from app_helpers import interrupt_when, tiny_pair_fixture
from ddtree.app.cli import app
from ddtree.stats import read_json, validate_document

tiny_pair = tiny_pair_fixture()


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _prompts(tmp_path, n: int):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"id": chr(ord("a") + i), "prompt": f"prompt number {i}"}) + "\n" for i in range(n)))
    return p


def _models(tiny_pair, method="dflash"):
    tdir, ddir = tiny_pair
    return ["--target", tdir, "--drafter", ddir, "--devices", "cpu", "--method", method]


# ------------------------------------------------------------------------------------------ SIGINT


def test_sigint_generate_keeps_finished_prompts(tiny_pair, tmp_path):
    stats = tmp_path / "s.json"
    n = 240  # prompt b runs ~2 s on the tiny pair: the signal lands inside it even on a loaded machine
    rc, out, err = interrupt_when(["generate", *_models(tiny_pair), "--prompts", _prompts(tmp_path, 2), "-n", str(n),
                                   "--stats-json", stats], ready=lambda e: "prompt b (2/2" in e)
    assert rc == 130, err
    assert "Traceback" not in err
    doc = read_json(stats)
    validate_document(doc)
    assert doc["metadata"]["interrupted"] is True and doc["metadata"]["interrupted_prompt"] == "b"
    (run,) = doc["runs"]
    assert run["interrupted"] is True and [p["prompt_id"] for p in run["prompts"]] == ["a"]
    assert run["prompts"][0]["new_tokens"] == n
    assert f"a (dflash): {n} new tokens" in err  # prompt a's summary, when it finished
    assert "dflash: interrupted " in err  # what prompt b generated
    assert err.rstrip().endswith("interrupted")
    assert out.startswith(run["prompts"][0]["text"] + "\n")


# ------------------------------------------------------------------------------------------ in-process


def _interrupt_call(monkeypatch, at: int, tokens: int = 0, signal_it: bool = False):
    """Decoder.generate is interrupted on its `at`-th call (1-based), after streaming `tokens`
    tokens of it: KeyboardInterrupt raised, or (signal_it) a SIGINT sent to this process, which
    Python's handler turns into KeyboardInterrupt at the next bytecode."""
    import os
    import signal

    from ddtree.decode import decoder

    real = decoder.Decoder.generate
    calls = []

    def gen(self, *a, **k):
        calls.append(k.get("prompt_id"))
        if len(calls) == at:
            if tokens and k.get("on_tokens"):
                k["on_tokens"]([65] * tokens)
            if signal_it:
                os.kill(os.getpid(), signal.SIGINT)
                real(self, *a, **k)  # not reached: the handler raises first
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(decoder.Decoder, "generate", gen)
    return calls


def test_generate_interrupt_jsonl_and_stats(tiny_pair, tmp_path, monkeypatch):
    calls = _interrupt_call(monkeypatch, at=2, tokens=3)
    stats = tmp_path / "s.json.gz"
    r = CliRunner().invoke(app, ["generate", *map(str, _models(tiny_pair, "ar")), "--prompts", str(_prompts(tmp_path, 3)),
                                 "-n", "5", "--jsonl", "--stats-json", str(stats)])
    assert r.exit_code == 130, r.stderr
    assert calls == ["a", "b"]
    a, b = (json.loads(line) for line in r.stdout.splitlines())
    assert a["id"] == "a" and a["interrupted"] is False and a["new_tokens"] == 5
    assert b == {"id": "b", "text": b["text"], "interrupted": True, "prompt_tokens": 15, "new_tokens": 3}
    assert "ar: interrupted after 3 new tokens from a 15-token prompt" in r.stderr
    assert "prompt 'b' unfinished" in r.stderr
    doc = read_json(stats)
    validate_document(doc)
    assert [p["prompt_id"] for p in doc["runs"][0]["prompts"]] == ["a"]
    assert doc["metadata"]["interrupted_prompt"] == "b" and doc["runs"][0]["interrupted"] is True


def test_generate_interrupt_before_anything_finished(tiny_pair, tmp_path, monkeypatch):
    _interrupt_call(monkeypatch, at=1)
    stats = tmp_path / "s.json"
    r = CliRunner().invoke(app, ["generate", *map(str, _models(tiny_pair, "ar")), "-n", "5", "--stats-json", str(stats),
                                 "hello"])
    assert r.exit_code == 130
    assert "interrupted before the first token of the prompt" in r.stderr
    assert "no prompt finished before the interrupt: --stats-json not written" in r.stderr
    assert not stats.exists() and r.stdout == "\n"


def test_bench_sigint_keeps_runs_and_prompts(tiny_pair, tmp_path, monkeypatch):
    calls = _interrupt_call(monkeypatch, at=4, signal_it=True)  # ar a, ar b, dflash a, then SIGINT in dflash b
    out_json = tmp_path / "b.json"
    r = CliRunner().invoke(app, ["bench", *map(str, _models(tiny_pair)[:6]), "--prompts", str(_prompts(tmp_path, 2)),
                                 "--methods", "ar,dflash,ddtree", "--budgets", "4", "-n", "4", "--warmup", "0",
                                 "--out", str(out_json)])
    assert r.exit_code == 130, r.stderr
    assert calls == ["a", "b", "a", "b"]
    doc = read_json(out_json)
    validate_document(doc)
    assert [(x["method"], x["interrupted"], len(x["prompts"])) for x in doc["runs"]] == [("ar", False, 2), ("dflash", True, 1)]
    assert doc["runs"][1]["exact_match_vs_ar"] is True  # checked on the prompts it finished
    assert doc["metadata"]["interrupted"] is True
    assert "dflash*" in r.stdout and "* dflash: interrupted, 1 prompt finished" in r.stdout


def test_bench_interleave_sigint_keeps_every_runs_finished_prompts(tiny_pair, tmp_path, monkeypatch):
    """--interleave: the runs take the prompts in turn (ar a, dflash a, ddtree a, ar b, ...); an
    interrupt keeps each run's finished prompts, every run marked interrupted but ar, which finished
    prompt b just before."""
    calls = _interrupt_call(monkeypatch, at=6, signal_it=True)  # ar a, dflash a, ddtree a, ar b, dflash b, then SIGINT in ddtree b
    out_json = tmp_path / "b.json"
    r = CliRunner().invoke(app, ["bench", *map(str, _models(tiny_pair)[:6]), "--prompts", str(_prompts(tmp_path, 3)),
                                 "--methods", "ar,dflash,ddtree", "--budgets", "4", "-n", "4", "--warmup", "0",
                                 "--interleave", "--out", str(out_json)])
    assert r.exit_code == 130, r.stderr
    assert calls == ["a", "a", "a", "b", "b", "b"]
    doc = read_json(out_json)
    validate_document(doc)
    assert doc["metadata"]["interleave"] is True
    assert [(x["method"], x["interrupted"], [p["prompt_id"] for p in x["prompts"]]) for x in doc["runs"]] == [
        ("ar", True, ["a", "b"]), ("dflash", True, ["a", "b"]), ("ddtree", True, ["a"])]
    assert doc["runs"][1]["exact_match_vs_ar"] is True and doc["runs"][2]["exact_match_vs_ar"] is True
