"""`ddtree bench` and `ddtree plot` on the codepair fixture: the JSON validates, its counters agree
with the per-prompt rounds and with the decoders themselves, greedy outputs match ar, plots are PNGs."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from conftest import FIXTURE_DIR, have_fixture, FIXTURE_REASON
from ddtree.options import DEFAULT_BUDGET
from ddtree.app.bench import format_table
from ddtree.app.setup import parse_budgets, parse_methods
from ddtree.app.cli import app
from ddtree.errors import DDTreeError
from ddtree.stats import aggregate, generation_from_dict, read_json, validate_document

N_NEW = 24
BUDGETS = (4, 8)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One bench run (2 prompts; ar, dflash, ddtree 4 and 8; 24 new tokens) shared by the tests."""
    if not have_fixture():
        pytest.skip(FIXTURE_REASON)
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("bench") / "results.json"
    try:
        r = CliRunner().invoke(app, [
            "bench", "--target", str(FIXTURE_DIR / "target"), "--drafter", str(FIXTURE_DIR / "drafter"),
            "--prompts", str(FIXTURE_DIR / "prompts.jsonl"), "--limit", "2", "--methods", "dflash,ddtree",
            "--budgets", ",".join(map(str, BUDGETS)), "--max-new-tokens", str(N_NEW), "--warmup", "1",
            "--devices", "cpu", "--dtype", "float32", "--raw", "--out", str(out),
        ])
    finally:
        torch.set_num_threads(n)
    assert r.exit_code == 0, (r.stdout, r.stderr, r.exception)
    return r, out


def test_bench_document_validates(bench_run):
    r, out = bench_run
    doc = read_json(out)
    validate_document(doc)
    labels = [(run["method"], run["budget"]) for run in doc["runs"]]
    assert labels == [("ar", None), ("dflash", None)] + [("ddtree", b) for b in BUDGETS]  # ar added, first
    assert doc["runs"][0]["speedup_vs_ar"] == pytest.approx(1.0)
    meta = doc["metadata"]
    assert meta["dtype"] == "float32" and meta["devices"] == ["cpu"] and meta["max_new_tokens"] == N_NEW
    assert meta["target_config_sha256"] and meta["drafter_config_sha256"]
    for run in doc["runs"]:
        a = run["aggregate"]
        assert a["num_prompts"] == 2
        assert run["speedup_vs_ar"] == pytest.approx(a["decode_tok_s"] / doc["runs"][0]["aggregate"]["decode_tok_s"])
        assert a["block_size"] == (None if run["method"] == "ar" else 16)
        assert [p["prompt_id"] for p in run["prompts"]] == ["dev-000", "dev-001"]
    # the table: one row per run, after the header
    for label in ("ar", "dflash", "ddtree  4", "ddtree  8", "speedup", "accept len", "TTFT ms"):
        assert label in r.stdout
    assert "tok/s" in r.stderr  # progress bars on stderr


def test_bench_counters_agree_with_rounds(bench_run):
    _, out = bench_run
    doc = read_json(out)
    for run in doc["runs"]:
        a = run["aggregate"]
        rounds = [p["rounds"] for p in run["prompts"]]
        drafts = sum(1 for rd in rounds for s in rd["tree_size"] if s > 0)
        accepted = sum(x for rd in rounds for x, s in zip(rd["accepted"], rd["tree_size"]) if s > 0)
        assert a["num_drafts"] == drafts
        assert a["num_accepted_tokens"] == accepted
        assert a["num_draft_tokens"] == sum(sum(rd["tree_size"]) for rd in rounds)
        assert a["rounds"] == sum(len(rd["tree_size"]) for rd in rounds)
        if drafts:
            assert a["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
        for p in run["prompts"]:
            assert p["num_accepted_tokens"] == sum(p["rounds"]["accepted"])
            assert sum(p["rounds"]["committed"]) + 1 == p["new_tokens"] == len(p["token_ids"])
        # the document's aggregate is the aggregate of its own records
        recs = [generation_from_dict(p) for p in run["prompts"]]
        again = aggregate(recs, block_size=a["block_size"])
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
                  "acceptance_length_histogram", "accepted_rank_histogram", "new_tokens", "rounds"):
            assert again[k] == a[k], k
        if run["method"] == "ar":
            assert a["num_drafts"] == 0 and a["mean_acceptance_length"] == 1.0
        else:
            assert all(s > 0 for rd in rounds for s in rd["tree_size"])
        if run["method"] == "ddtree":
            assert max(s for rd in rounds for s in rd["tree_size"]) <= run["budget"]


def test_bench_greedy_matches_ar(bench_run):
    _, out = bench_run
    doc = read_json(out)
    ar = {p["prompt_id"]: p["token_ids"] for p in doc["runs"][0]["prompts"]}
    for run in doc["runs"][1:]:
        assert run["exact_match_vs_ar"] is True, run["mismatched_prompts"]
        for p in run["prompts"]:
            assert p["token_ids"] == ar[p["prompt_id"]]
            assert p["exact_match_vs_ar"] is True


def test_bench_counters_agree_with_decoder(bench_run, one_thread):
    """The decoder run directly on prompt dev-001 (ddtree, budget 8) gives the rounds the JSON holds."""
    import torch

    from ddtree.app.setup import encode_prompt, inspect_models, load_models
    from ddtree.app.prompts import load_prompts

    _, out = bench_run
    doc = read_json(out)
    run = next(r for r in doc["runs"] if r["method"] == "ddtree" and r["budget"] == 8)
    want = run["prompts"][1]
    spec = inspect_models(str(FIXTURE_DIR / "target"), str(FIXTURE_DIR / "drafter"), "cpu", "float32", True)
    prompt = load_prompts(str(FIXTURE_DIR / "prompts.jsonl"), 2)[1]
    ids = encode_prompt(spec, prompt, raw=True, thinking=True)
    assert len(ids) == want["prompt_tokens"]
    dec = load_models(spec, doc["metadata"]["max_length"], True).decoder
    rec = dec.generate(ids, method="ddtree", budget=8, max_new_tokens=N_NEW, stop_ids=spec.stop_ids, seed=0)
    assert rec.token_ids == want["token_ids"]
    assert [r.accepted for r in rec.rounds] == want["rounds"]["accepted"]
    assert [r.tree_size for r in rec.rounds] == want["rounds"]["tree_size"]
    assert [r.accepted_ranks for r in rec.rounds] == want["rounds"]["accepted_ranks"]
    assert torch.get_num_threads() == 1


def test_plot_writes_pngs(bench_run, tmp_path):
    _, out = bench_run
    r = CliRunner().invoke(app, ["plot", str(out), "--out", str(tmp_path / "plots")])
    assert r.exit_code == 0, (r.stderr, r.exception)
    paths = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(paths) == 3
    for p in paths:
        data = open(p, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_rejects_non_document(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"schema": "something/else"}')
    r = CliRunner().invoke(app, ["plot", str(bad)])
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------ units


def test_parse_methods_puts_ar_first():
    assert parse_methods("ddtree,dflash") == ["ar", "ddtree", "dflash"]
    assert parse_methods("dflash, ar ,dflash") == ["ar", "dflash"]
    assert parse_methods(["ar"]) == ["ar"]
    with pytest.raises(DDTreeError, match="unknown method"):
        parse_methods("ar,eagle")
    with pytest.raises(DDTreeError):
        parse_methods(" , ")


def test_parse_budgets():
    assert parse_budgets("8,16, 32") == [8, 16, 32]
    assert parse_budgets(64) == [64]
    assert parse_budgets([4, "auto"]) == [4, "auto"]
    for bad in ("0", "x", "8,-1", ""):
        with pytest.raises(DDTreeError):
            parse_budgets(bad)


def test_format_table_shapes():
    doc = {"runs": [
        {"method": "ar", "budget": None, "speedup_vs_ar": 1.0, "exact_match_vs_ar": None,
         "aggregate": {"decode_tok_s": 10.0, "e2e_tok_s": 9.0, "mean_ttft_s": 0.01, "mean_acceptance_length": 1.0}},
        {"method": "ddtree", "budget": 32, "speedup_vs_ar": 2.5, "exact_match_vs_ar": False,
         "aggregate": {"decode_tok_s": 25.0, "e2e_tok_s": 20.0, "mean_ttft_s": 0.02, "mean_acceptance_length": 3.1}},
    ]}
    lines = format_table(doc).splitlines()
    assert len(lines) == 4
    assert "2.50x" in lines[3] and "NO" in lines[3] and "3.10" in lines[3]
    # --budget auto: a line saying which budgets it chose, and how often
    doc["runs"].append({"method": "ddtree", "budget": None, "budget_setting": "auto", "speedup_vs_ar": 2.0,
                        "exact_match_vs_ar": True,
                        "aggregate": {"decode_tok_s": 20.0, "e2e_tok_s": 18.0, "mean_ttft_s": 0.02,
                                      "mean_acceptance_length": 3.0, "tree_size": {"histogram": {"32": 3, "15": 1}}}})
    lines = format_table(doc).splitlines()
    assert len(lines) == 6 and lines[4].startswith("ddtree  auto")
    assert lines[5] == "ddtree auto chose 15 (25%), 32 (75%)"


def test_divergence_reports_first_difference_and_logit_gap(one_thread):
    """The bench's near-tie diagnosis: first differing index, and logit(ar's token) - logit(other)
    after the common prefix, which for ar's own greedy choice is >= 0."""
    import torch

    from ddtree.app.bench import divergence
    from ddtree.decode.random_pair import build_random_pair

    dec, _ = build_random_pair("hybrid", 3)
    prompt = [5, 9, 11, 40, 2]
    ar = dec.generate(prompt, "ar", max_new_tokens=12).token_ids
    other = ar[:7] + [(ar[7] + 1) % 97] + ar[8:]
    d = divergence(dec, prompt, ar, other)
    assert (d["index"], d["ar_token"], d["other_token"]) == (7, ar[7], other[7])
    dec.target.reset()
    logits, _ = dec.target.prefill(torch.tensor(prompt + ar[:7]), want_taps=False)
    assert d["logit_gap"] == pytest.approx(float(logits[ar[7]] - logits[other[7]]), abs=1e-6)
    assert d["logit_gap"] >= 0 and 0 < d["logit_ulp"] < 1e-5  # fp32: eps * 2^floor(log2 |logit|)
    assert divergence(dec, prompt, ar, ar[:5])["logit_gap"] is None  # a shorter output: no logit question


def test_warmup_prefills_every_prompt_length_for_every_method(monkeypatch, tmp_path, one_thread):
    """Before any timed prompt, each method has prefilled every distinct prompt length once, so no
    first-call cost of a prefill shape lands in a timed prompt of whichever method runs first (on the
    H200 the first method's TTFT showed ~150 ms outliers on half the prompts until this warm-up)."""
    if not have_fixture():
        pytest.skip(FIXTURE_REASON)
    import json

    from ddtree.decode import decoder as decoding
    from ddtree.app.bench import run_bench

    src = [json.loads(line) for line in (FIXTURE_DIR / "prompts.jsonl").read_text().splitlines()[:3]]
    prompts = tmp_path / "prompts.jsonl"  # three lengths (the fixture's prompts are all 160 tokens)
    prompts.write_text("".join(json.dumps({"id": p["id"], "prompt": p["prompt"][: 40 * (i + 1)]}) + "\n"
                               for i, p in enumerate(src)))
    calls = []  # (method, prompt length, max_new_tokens), in order
    real = decoding.Decoder.generate

    def spy(self, ids, *a, **k):
        calls.append((k["method"], len(ids), k["max_new_tokens"]))
        return real(self, ids, *a, **k)

    monkeypatch.setattr(decoding.Decoder, "generate", spy)
    n_new = 3
    run_bench(FIXTURE_DIR / "target", FIXTURE_DIR / "drafter", str(prompts), methods="ar,dflash",
              max_new_tokens=n_new, devices="cpu", dtype="float32", raw=True, warmup=1, out=None,
              progress=False, print_table=False)
    lengths = {L for _, L, _ in calls}
    assert len(lengths) == 3
    timed, warm = calls[-6:], calls[:-6]  # timed: 2 methods x 3 prompts, in prompt order
    assert [m for m, _, _ in timed] == ["ar"] * 3 + ["dflash"] * 3 and all(n == n_new for *_, n in timed)
    for m in ("ar", "dflash"):
        assert {L for mm, L, n in warm if mm == m and n == 1} == lengths


def test_auto_warms_up_on_every_prompt_then_forgets(monkeypatch, tmp_path, one_thread):
    """--budget auto's first warm-up round goes over every prompt at full length (its graph keys
    depend on its choices), and what it learnt there is dropped before the timed prompts: the
    first timed auto generation calibrates afresh."""
    if not have_fixture():
        pytest.skip(FIXTURE_REASON)
    import json

    from ddtree.decode import auto as auto_budget
    from ddtree.decode import decoder as decoding
    from ddtree.app.bench import run_bench

    src = [json.loads(line) for line in (FIXTURE_DIR / "prompts.jsonl").read_text().splitlines()[:3]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": p["id"], "prompt": p["prompt"][: 30 * (i + 1)]}) + "\n"
                               for i, p in enumerate(src)))
    calls, fresh = [], []  # (method, budget, prompt length, max_new_tokens); calibrations that found no memory
    real_gen, real_cal = decoding.Decoder.generate, auto_budget.calibrate

    def spy(self, ids, *a, **k):
        calls.append((k["method"], k["budget"], len(ids), k["max_new_tokens"]))
        return real_gen(self, ids, *a, **k)

    def cal(dec, start, greedy, plain=False):
        fresh.append((len(calls), not dec._verify_cost))
        return real_cal(dec, start, greedy, plain)

    monkeypatch.setattr(decoding.Decoder, "generate", spy)
    monkeypatch.setattr(auto_budget, "calibrate", cal)
    n_new = 4
    run_bench(FIXTURE_DIR / "target", FIXTURE_DIR / "drafter", str(prompts), methods="ar,ddtree", budgets="8,auto",
              max_new_tokens=n_new, devices="cpu", dtype="float32", raw=True, warmup=1, out=None,
              progress=False, print_table=False)
    lengths = {L for *_, L, _ in calls}
    assert len(lengths) == 3
    warm, timed = calls[:-9], calls[-9:]  # timed: ar, ddtree 8, auto x 3 prompts
    for i, method in enumerate([("ar", DEFAULT_BUDGET), ("ddtree", 8), ("ddtree", "auto")]):  # each over every prompt
        run = timed[3 * i: 3 * i + 3]
        assert {(m, b) for m, b, *_ in run} == {method} and {L for *_, L, n in run if n == n_new} == lengths, timed
    assert {L for m, b, L, n in warm if b == "auto" and n == n_new} == lengths  # auto: every prompt
    assert len({L for m, b, L, n in warm if b == 8 and n == n_new}) == 2  # a fixed budget: shortest, longest
    first_timed_auto = len(calls) - 2  # calls counted when the first timed auto generation calibrates
    assert (first_timed_auto, True) in fresh, fresh  # it found no memory: the warm-up's was dropped


def test_settle_auto_repeats_passes_until_nothing_new(monkeypatch):
    """Where rounds are graphed, --budget auto's warm-up repeats a pass over every prompt (each from
    a forgotten start) until one captures nothing new, at most AUTO_SETTLE_PASSES of them; then
    forgets. Fixed methods and ungraphed decoders get no extra pass."""
    from types import SimpleNamespace

    from ddtree.app import bench as B
    from ddtree.decode import auto as auto_budget

    forgets = []
    monkeypatch.setattr(auto_budget, "forget", lambda dec: forgets.append(dec.graphs.new_keys))
    encoded = [(SimpleNamespace(id=f"p{i}"), [1] * (i + 3)) for i in range(3)]

    def run(new_per_pass: list[int], use_graphs=True, plan=(("ddtree", 8), ("ddtree", "auto"))):
        dec = SimpleNamespace(use_graphs=use_graphs, graphs=SimpleNamespace(new_keys=0))
        calls = []

        def gen(method, budget, ids, pid, n_new):
            calls.append((method, budget, pid, n_new))
            if len(calls) % len(encoded) == 0:  # the end of a pass: its captures
                n = len(calls) // len(encoded) - 1
                dec.graphs.new_keys += new_per_pass[n] if n < len(new_per_pass) else 0

        forgets.clear()
        done = B.settle_auto(dec, gen, list(plan), encoded, 5)
        return done, calls

    done, calls = run([4, 1, 0, 0])
    assert done == 3 and len(calls) == 9  # two passes captured, the third did not
    assert {(m, b, n) for m, b, _, n in calls} == {("ddtree", "auto", 5)}
    assert [pid for _, _, pid, _ in calls[:3]] == ["p0", "p1", "p2"]
    assert len(forgets) == 4  # before each pass, and after the last
    done, calls = run([1, 1, 1, 1, 1])
    assert done == B.AUTO_SETTLE_PASSES and len(calls) == 3 * B.AUTO_SETTLE_PASSES
    assert run([3], use_graphs=False) == (0, []) and forgets == [0]
    assert run([3], plan=(("ar", None), ("ddtree", 8)))[0] == 0


def test_capture_ahead_covers_each_run_and_prompt_length(monkeypatch):
    """The warm-up's last part captures what each run can reach after one prefill per distinct
    prompt length (buckets follow the length), then forgets auto's calibrations; only where rounds
    are graphed."""
    from types import SimpleNamespace

    from ddtree.app import bench as B
    from ddtree.decode import auto as auto_budget

    calls = []
    monkeypatch.setattr(auto_budget, "capture_ahead", lambda dec, job, L: calls.append(("ahead", job.budget, L)) or 2)
    monkeypatch.setattr(auto_budget, "forget", lambda dec: calls.append(("forget",)))
    encoded = [(SimpleNamespace(id=f"p{i}"), [1] * n) for i, n in enumerate((5, 9, 5, 12))]
    dec = SimpleNamespace(use_graphs=True,
                          job=lambda m, b, sp, n, seed, t1, L: SimpleNamespace(budget=b, L=L, n=n, top1=t1),
                          prefill=lambda ids, job: calls.append(("prefill", job.budget, len(ids), job.L, job.n, job.top1)))
    plan = [("ar", None), ("ddtree", "auto")]
    assert B.capture_ahead(dec, plan, encoded, None, 7) == 12
    assert calls == [x for b in (B.DEFAULT_BUDGET, "auto") for L in (5, 9, 12)
                     for x in (("prefill", b, L, L, 7, False), ("ahead", b, L))] + [("forget",)]
    calls.clear()
    dec.use_graphs = False
    assert B.capture_ahead(dec, plan, encoded, None, 7) == 0 and not calls


# ------------------------------------------------------------------------------------------ --tp

from app_helpers import tiny_pair_fixture  # noqa: E402

tiny_pair = tiny_pair_fixture()


def test_bench_tp2_matches_one_process(tiny_pair, tmp_path, one_thread):
    """bench --tp 2 (gloo on CPU): warm-up and timed generations in one set of tensor-parallel
    workers; same greedy tokens and rounds as the one-process bench, every run exact."""
    tdir, ddir = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "tensor"}\n{"id": "b", "prompt": "parallel bench"}\n')
    common = ["--target", str(tdir), "--drafter", str(ddir), "--prompts", str(prompts), "--methods", "ar,ddtree",
              "--budgets", "4", "--max-new-tokens", "8", "--devices", "cpu", "--dtype", "float32"]
    docs = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        r = CliRunner().invoke(app, ["bench", *common, "--tp", str(tp), "--warmup", "1", "--out", str(out)])
        assert r.exit_code == 0, (r.stderr, r.exception)
        docs[tp] = read_json(out)
        validate_document(docs[tp])
    assert docs[2]["metadata"]["tp"] == 2 and "tensor parallel" in r.stderr
    for one, two in zip(docs[1]["runs"], docs[2]["runs"]):
        assert (one["method"], one["budget"]) == (two["method"], two["budget"])
        for p1, p2 in zip(one["prompts"], two["prompts"]):
            assert p1["token_ids"] == p2["token_ids"] and p1["rounds"]["accepted"] == p2["rounds"]["accepted"]
            assert p2["decode_s"] > 0 and p2["ttft_s"] > 0  # rank 0's timings came back
    assert docs[2]["runs"][1]["exact_match_vs_ar"] is True


@pytest.mark.parametrize("tp", [1, 2])
def test_bench_interleave_times_the_runs_prompt_by_prompt(tiny_pair, tmp_path, one_thread, tp):
    """--interleave: every run on the first prompt, then every run on the second (in one process, and
    in one set of tensor-parallel workers); the document holds the same runs, tokens and rounds as
    the run-by-run bench, in the plan's order, and says it interleaved."""
    from ddtree.decode import decoder

    tdir, ddir = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "interleaved"}\n{"id": "b", "prompt": "bench order"}\n')
    common = ["--target", str(tdir), "--drafter", str(ddir), "--prompts", str(prompts), "--methods", "ar,dflash,ddtree",
              "--budgets", "4", "--max-new-tokens", "6", "--devices", "cpu", "--dtype", "float32", "--warmup", "0",
              "--tp", str(tp)]
    docs, order = {}, []
    real = decoder.Decoder.generate

    def gen(self, *a, **k):
        order.append((k.get("method"), k.get("prompt_id")))
        return real(self, *a, **k)

    for flag in ("--no-interleave", "--interleave"):
        order.clear()
        out = tmp_path / f"{flag}.json"
        with pytest.MonkeyPatch.context() as mp:
            if tp == 1:
                mp.setattr(decoder.Decoder, "generate", gen)
            r = CliRunner().invoke(app, ["bench", *common, flag, "--out", str(out)])
        assert r.exit_code == 0, (r.stderr, r.exception)
        docs[flag] = read_json(out)
        validate_document(docs[flag])
        if tp == 1:
            runs = [("ar", p) for p in "ab"], [("dflash", p) for p in "ab"], [("ddtree", p) for p in "ab"]
            assert order == ([x for run in runs for x in run] if flag == "--no-interleave" else
                             [run[i] for i in range(2) for run in runs])
    assert docs["--interleave"]["metadata"]["interleave"] is True and docs["--no-interleave"]["metadata"]["interleave"] is False
    for seq, inter in zip(docs["--no-interleave"]["runs"], docs["--interleave"]["runs"]):
        assert (seq["method"], seq["budget"]) == (inter["method"], inter["budget"])
        assert [p["prompt_id"] for p in inter["prompts"]] == ["a", "b"]
        for p1, p2 in zip(seq["prompts"], inter["prompts"]):
            assert p1["token_ids"] == p2["token_ids"] and p1["rounds"]["accepted"] == p2["rounds"]["accepted"]
    assert all(run["exact_match_vs_ar"] for run in docs["--interleave"]["runs"][1:])


def test_bench_times_its_prompts_on_a_frozen_heap(tiny_pair, tmp_path, one_thread, monkeypatch):
    """The timed generations run with the heap frozen (one full collection before them, none of the
    compile's and capture's objects rescanned inside a prompt), the warm-up's before it; after the
    bench nothing stays frozen, so its decoder can be collected."""
    import gc

    from app_helpers import heap_frozen_at_each_generate

    tdir, ddir = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "frozen heap"}\n{"id": "b", "prompt": "timed prompts"}\n')
    frozen = heap_frozen_at_each_generate(monkeypatch)
    r = CliRunner().invoke(app, [
        "bench", "--target", str(tdir), "--drafter", str(ddir), "--prompts", str(prompts), "--methods", "ar,ddtree",
        "--budgets", "4", "--max-new-tokens", "4", "--devices", "cpu", "--dtype", "float32", "--warmup", "1",
        "--out", str(tmp_path / "b.json")])
    assert r.exit_code == 0, (r.stderr, r.exception)
    timed = 2 * 2  # two runs over two prompts, the last generations of the bench
    assert len(frozen) > timed and frozen[-timed:] == [True] * timed and not any(frozen[:-timed]), frozen
    assert gc.get_freeze_count() == 0


def test_table_headline_is_tokens_per_forward():
    """--budget auto's plain steps count in tok/fwd; accept len covers the drafted rounds."""
    from ddtree.stats import GenerationRecord, RoundRecord, make_run_document, run_metadata

    t = {"verify": 1.0}
    rounds = [RoundRecord(8, 3, 2, [0, 0], 3, t), RoundRecord(0, 0, 0, [], 1, t), RoundRecord(0, 0, 0, [], 1, t),
              RoundRecord(4, 2, 1, [0], 2, t)]
    rec = GenerationRecord("a", 5, 8, list(range(8)), "", 0.1, 1.0, 0.1, "ddtree", None, rounds)
    doc = make_run_document(run_metadata(), [{"method": "ddtree", "budget": None, "budget_setting": "auto",
                                              "records": [rec], "speedup_vs_ar": 1.3}])
    head, _, row, note = format_table(doc).splitlines()
    cells = row.split()
    assert head.split("  ")[5] == "tok/fwd" and "accept len (drafted)" in head
    assert cells[:2] == ["ddtree", "auto"] and cells[5] == "1.75" and cells[6] == "2.50"  # 7/4 and 1 + 3/2
    assert note == "ddtree auto chose 0 (50%), 4 (25%), 8 (25%)"
    # a round that verified the chain (a path of block - 1 nodes) is counted as the chain too
    D = 15  # a block of 16
    rec.rounds[0] = RoundRecord(D, D, 2, [0, 0], 3, t)
    doc = make_run_document(run_metadata(), [{"method": "ddtree", "budget": None, "budget_setting": "auto",
                                              "records": [rec], "speedup_vs_ar": 1.3, "block_size": 16}])
    assert format_table(doc).splitlines()[3] == f"ddtree auto chose 0 (50%), 4 (25%), {D} (25%); the chain in 25%"


def test_bench_prompt_tokens(tiny_pair, tmp_path, one_thread):
    """--prompt-tokens N: every prompt of the set reaches the decoders at exactly N tokens (short
    ones repeated, long ones cut), the document says N, and greedy runs still match ar."""
    tdir, ddir = tiny_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "tensor"}\n{"id": "b", "prompt": "' + "long prompt " * 40 + '"}\n')
    out = tmp_path / "fit.json"
    r = CliRunner().invoke(app, [
        "bench", "--target", str(tdir), "--drafter", str(ddir), "--prompts", str(prompts), "--methods", "ar,ddtree",
        "--budgets", "4", "--max-new-tokens", "6", "--devices", "cpu", "--dtype", "float32", "--warmup", "0",
        "--prompt-tokens", "150", "--out", str(out)])
    assert r.exit_code == 0, (r.stderr, r.exception)
    doc = read_json(out)
    validate_document(doc)
    assert doc["metadata"]["prompt_tokens"] == 150
    for run in doc["runs"]:
        assert [p["prompt_tokens"] for p in run["prompts"]] == [150, 150]
    assert doc["runs"][1]["exact_match_vs_ar"] is True
    bad = CliRunner().invoke(app, ["bench", "--target", str(tdir), "--prompt-tokens", "0"])
    assert bad.exit_code == 2 and "--prompt-tokens" in bad.stderr


def test_bench_warns_of_captures_inside_timed_prompts():
    """A run whose timed prompts captured or compiled graph pieces says so in one warning (its
    decode time holds them); none, no warning."""
    from types import SimpleNamespace

    from loguru import logger

    from ddtree.app.bench import _Bench
    from ddtree.decode.sampling import SamplingParams
    from ddtree.stats import GenerationRecord

    def rec(pid, captures):
        return GenerationRecord(pid, 4, 2, [1, 2], "", 0.1, 0.2, 0.1, "ddtree", None, [], captures=captures)

    b = _Bench(SimpleNamespace(block_size=16), [], [], SamplingParams(temperature=0.5), 2, 0, False, False,
               lambda s: None)
    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{message}")
    try:
        b.finish_run("ddtree", "auto", [rec("a", 0), rec("b", 0)])
        assert lines == []
        b.finish_run("ddtree", "auto", [rec("a", 2), rec("b", 1)])
    finally:
        logger.remove(sink)
    assert len(lines) == 1 and "3 graph piece(s) captured or compiled inside timed prompts" in lines[0], lines
    assert "ddtree" in lines[0] and "--warmup" in lines[0]
