"""--budget auto against every fixed method: the trace-driven simulation (scripts/simulate_auto.py)
on fixed small traces and costs, one regime per winner; and greedy exactness of auto with each of
the codepair fixture's drafters."""

import numpy as np
import pytest
import torch

from ddtree.decode.budget import AUTO_BUDGETS
from scripts.simulate_auto import FIXED, FIXED_BUDGETS, Costs, simulate

SIZE = {"chain": 15} | {f"t{b}": b for b in FIXED_BUDGETS} | {f"a{b}": b for b in AUTO_BUDGETS}  # arm -> draft nodes
ARMS = tuple(SIZE)


def traces(strength: float, chain_share: float, prompts: int = 6, n: int = 160, seed: int = 0) -> list[dict]:
    """Synthetic per-position traces: a drafter quality q that wanders along a continuation; E_q(b)
    grows with log(1 + b); accepted tokens are Poisson draws of E_q through one uniform per position
    (so a bigger tree never accepts less); the chain accepts chain_share of the 15-node tree (its
    E_q, eq:c15, likewise)."""
    from scipy.stats import poisson

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        q = np.clip(strength * (1 + 0.5 * np.cumsum(rng.normal(0, 0.15, n)).clip(-1, 1)), 0.02, None)
        u = rng.uniform(size=n)
        tr = {}
        for arm in ARMS:
            eq = q * np.log2(1 + SIZE[arm]) * (chain_share if arm == "chain" else 1.0)
            tr[f"acc:{arm}"] = np.minimum(poisson.ppf(u, eq), 15).astype(int).tolist()
            if arm.startswith("a") or arm == "chain":  # a drafter 20% overconfident
                tr["eq:c15" if arm == "chain" else f"eq:{arm[1:]}"] = (eq * 1.2).tolist()
        out.append(tr)
    return out


def costs(ar: float, per_node: float, beyond: float, chain_beyond: float | None = None) -> Costs:
    """Verify = ar + per_node * (T - 1); a drafting round costs `beyond` past its verify (the chain's: chain_beyond)."""
    verify = {T: ar + per_node * (T - 1) for T in (1, 16, 17, 32, 33, 64, 65)}
    rounds = {"dflash": verify[16] + (beyond if chain_beyond is None else chain_beyond)}
    rounds.update({f"ddtree-{b}": verify[b + 1] + beyond for b in (16, 32, 64)})
    return Costs(ar, verify, rounds, {b: beyond for b in (16, 32, 64)})


REGIMES = {  # name: (traces, costs, the fixed method that must win)
    # the 27B's shapes: verifies nearly flat in T, a good drafter: the biggest tree
    "big tree": (traces(0.45, 0.7), costs(15.0, 0.07, 2.0), "ddtree-64"),
    # a CPU's: every node costs, the drafter too, a weak drafter: plain steps
    "plain": (traces(0.12, 0.7), costs(17.0, 1.0, 13.0), "ar"),
    # a confident drafter whose chain accepts what its 15-node tree does, a chain round a little
    # cheaper to draft (1.8 against 2.0 ms past the verify; the 27B's: 1.99 against 2.07): the chain
    "chain": (traces(0.8, 1.0), costs(15.0, 0.3, 2.0, chain_beyond=1.8), "dflash"),
    # verifies that grow with T: a mid-size tree (16 nodes verified)
    "mid tree": (traces(0.45, 0.7), costs(10.0, 0.2, 1.0), "ddtree-15"),
}


@pytest.mark.parametrize("sync", [False, True], ids=["device clock", "cpu clock"])
@pytest.mark.parametrize("regime", list(REGIMES))
def test_auto_within_3_percent_of_the_best_fixed_method(regime, sync):
    """Each regime with a device's clock (a round read when it ends) and a CPU's (a round runs when
    queued, so the span between two reads holds the next round: auto times only steady runs)."""
    pytest.importorskip("scipy")
    tr, c, winner = REGIMES[regime]
    got = simulate(tr, c, sync=sync)
    tpm = got["tok_per_ms"]
    assert got["best_fixed"] == winner, tpm  # the regime is what it says
    assert set(tpm) == set(FIXED) | {"auto"}
    assert got["auto_vs_best"] >= 0.97, (regime, got)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["drafter", "drafter-distilled", "drafter-large"])
def test_auto_greedy_equals_ar_with_each_fixture_drafter(fixture_dir, drafter, one_thread):
    """float32 on the CPU: --budget auto's tokens equal ar's on two fixture prompts."""
    import json

    from transformers import AutoTokenizer

    from ddtree.decode.decoder import Decoder
    from ddtree.model.checkpoint import load_drafter, load_target

    prompts = [json.loads(x)["prompt"] for x in (fixture_dir / "prompts.jsonl").read_text().splitlines()[:2]]
    tok = AutoTokenizer.from_pretrained(str(fixture_dir / "target"))
    target, _ = load_target(str(fixture_dir / "target"), [torch.device("cpu")], torch.float32, 512)
    d, _ = load_drafter(str(fixture_dir / drafter), target, torch.float32, 512)
    dec = Decoder(target, d)
    for text in prompts:
        ids = tok(text, add_special_tokens=False)["input_ids"][-200:]
        ar = dec.generate(ids, "ar", max_new_tokens=48).token_ids
        auto = dec.generate(ids, "ddtree", budget="auto", max_new_tokens=48)
        assert auto.token_ids == ar, drafter


@pytest.mark.xfail(strict=True, reason="auto has no chain arm: where the chain beats every best-first "
                   "budget by more than 3% (it accepts more than the 15-node tree and drafts cheaper), auto trails it")
def test_auto_trails_a_chain_that_beats_every_tree():
    pytest.importorskip("scipy")
    got = simulate(traces(1.0, 1.05), costs(15.0, 0.3, 2.0, chain_beyond=1.5))
    assert got["best_fixed"] == "dflash"
    assert got["auto_vs_best"] >= 0.97, got


def test_bench_costs_read_a_bench_document():
    """scripts/simulate_auto.py --bench: a round's cost is the median over a run's prompts of decode
    time over rounds, a verify's the median of its rounds' verify stages, a tree's rest the
    difference; one prompt that captured a graph (a slow round) moves neither; tok/s as measured."""
    from scripts.simulate_auto import bench_costs

    def run(method, budget, round_ms, verify_ms, tok_s, setting=None, stalled=False):
        prompts = []
        for i in range(5):  # 10 rounds each; the last prompt's first round captured (+300 ms) if stalled
            slow = stalled and i == 4
            verify = [verify_ms + (300.0 if slow and j == 0 else 0.0) for j in range(10)]
            prompts.append({"num_rounds": 10, "decode_s": (10 * round_ms + (300.0 if slow else 0.0)) / 1e3,
                            "rounds": {"times_ms": {"verify": verify}}})
        return {"method": method, "budget": budget, "budget_setting": setting, "prompts": prompts,
                "aggregate": {"decode_tok_s": tok_s}}

    doc = {"runs": [run("ar", None, 0.4, 0.3, 2500.0), run("dflash", None, 0.9, 0.6, 2200.0, stalled=True)]
           + [run("ddtree", b, 1.0 + b / 100, 0.5 + b / 100, 2400.0 + b) for b in (8, 16, 32, 64)]
           + [run("ddtree", 64, 0.8, 0.4, 2100.0, setting="auto")]}
    costs, live = bench_costs(doc)
    assert costs.ar == pytest.approx(0.4)
    assert costs.verify == pytest.approx({1: 0.3, 16: 0.6, 9: 0.58, 17: 0.66, 33: 0.82, 65: 1.14})
    assert costs.rounds["dflash"] == pytest.approx(0.9)  # the stalled prompt's 30.9 ms a round is not the median
    assert costs.rounds["ddtree-32"] == pytest.approx(1.32)
    assert costs.beyond[32] == pytest.approx(1.32 - 0.82)
    assert live["ddtree-auto"] == 2100.0 and live["ddtree-8"] == 2408.0


def test_rounds_against_traces_follow_each_round_to_its_position():
    """scripts/simulate_auto.py --bench: each timed drafting round is compared with the trace at the
    position its root takes in the continuation (plain steps and ar advance it by one token)."""
    from scripts.simulate_auto import rounds_against_traces

    pos = {"p": {"acc:chain": [2, 0, 0, 1, 0, 0, 0], "acc:t8": [3, 0, 0, 0, 1, 0, 0],
                 "acc:a4": [0, 2, 0, 0, 0, 0, 0], "acc:a15": [1, 0, 0, 0, 0, 2, 0]}}

    def run(method, budget, sizes, accepted, setting=None):
        return {"method": method, "budget": budget, "budget_setting": setting,
                "prompts": [{"prompt_id": "p", "rounds": {"tree_size": sizes, "accepted": accepted}}]}

    doc = {"runs": [run("ar", None, [0] * 7, [0] * 7),
                    run("dflash", None, [15, 15, 15], [2, 1, 0]),  # roots at 0, 3, 5: traced 2, 1, 0
                    run("ddtree", 8, [8, 8, 8], [3, 0, 0]),  # roots at 0, 4, 5: traced 3, 1, 0
                    run("ddtree", 64, [0, 4, 0, 15, 15], [0, 2, 0, 2, 0], setting="auto")]}  # plain, a4@1, plain, a15@5 (traced 2), a15@ past
    got = rounds_against_traces(doc, pos)
    assert got["dflash"] == {"rounds": 3, "equal": 3, "accepted_live": 1.0, "accepted_traced": 1.0}
    assert got["ddtree-8"]["rounds"] == 3 and got["ddtree-8"]["equal"] == 2 and got["ddtree-8"]["accepted_traced"] == 4 / 3
    assert got["ddtree-auto"] == {"rounds": 2, "equal": 2, "accepted_live": 2.0, "accepted_traced": 2.0}
    assert "ar" not in got


@pytest.mark.parametrize("devices", [["cpu"], ["cuda:0"]])
def test_bench_replay_takes_the_clock_of_the_documents_device(tmp_path, devices, monkeypatch):
    """scripts/simulate_auto.py --bench: a CPU document is replayed with a CPU's clock (a round runs
    when it is queued), a GPU's with the device's; each gives what simulate gives with that clock."""
    pytest.importorskip("scipy")
    import json

    from scripts.simulate_auto import bench_costs, main

    tr = traces(0.8, 0.7, prompts=2, n=64)  # trees pay in some rounds: the clocks time them differently

    def run(method, budget, round_ms, verify_ms, setting=None):
        prompts = [{"prompt_id": f"p{i}", "num_rounds": 10, "decode_s": round_ms / 100, "new_tokens": 64,
                    "rounds": {"times_ms": {"verify": [verify_ms] * 10}, "tree_size": [], "accepted": []}}
                   for i in range(2)]
        return {"method": method, "budget": budget, "budget_setting": setting, "prompts": prompts,
                "aggregate": {"decode_tok_s": 100.0, "num_prompts": 2}}

    doc = {"metadata": {"devices": devices},
           "runs": [run("ar", None, 10.0, 9.3), run("dflash", None, 29.0, 21.7)]
           + [run("ddtree", b, 28.0 + b / 4, 19.0 + b / 4) for b in (8, 16, 32, 64)]
           + [run("ddtree", 64, 12.0, 9.5, setting="auto")]}
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "codepair-drafter-float32.json").write_text(json.dumps(doc))
    trace_file = tmp_path / "traces.json.gz"
    import gzip

    with gzip.open(trace_file, "wt") as f:
        f.write(json.dumps({"drafters": {"drafter": [{"prompt": f"p{i}", "positions": t} for i, t in enumerate(tr)]}}))
    out = tmp_path / "sim.json"
    import scripts.simulate_auto as sim

    clocks = []
    real = sim.simulate
    monkeypatch.setattr(sim, "simulate", lambda *a, **kw: clocks.append(kw.get("sync")) or real(*a, **kw))  # a spy
    assert main(["--bench", str(bench), "--traces", str(trace_file), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    cpu = devices == ["cpu"]
    assert row["clock"] == ("cpu" if cpu else "device")
    assert clocks == [cpu]  # the replay ran with the document's clock
    ran = ("ar", "dflash", "ddtree-8", "ddtree-16", "ddtree-32", "ddtree-64")  # the bench's fixed methods alone
    want = simulate(tr, bench_costs(doc)[0], n=64, sync=cpu, fixed=ran)
    assert row["tok_per_ms"] == pytest.approx(want["tok_per_ms"]) and set(want["tok_per_ms"]) == {*ran, "auto"}


def test_auto_verifies_what_its_step_staged(monkeypatch):
    """Each round verifies the arm the step before it staged, or takes a plain step: never a prefix
    of a staged tree (each prefix new to a context bucket was a graph key of its own, and on the
    H200 its first capture cost 13 to 15 ms inside a timed prompt). Replayed on every regime above."""
    pytest.importorskip("scipy")
    import ddtree.decode.budget as B

    seen = []
    real = B.Auto.plan

    def plan(self, r, dec):
        staged = self.staged[r - 1]
        p = real(self, r, dec)
        seen.append((p.arm, staged))
        return p

    monkeypatch.setattr(B.Auto, "plan", plan)
    for tr, c, _ in REGIMES.values():
        simulate(tr, c)
    assert len(seen) > 1000 and all(arm in (0, staged) for arm, staged in seen)
    assert {arm for arm, _ in seen} >= {0, B.CHAIN, 15, 31, 63}  # the regimes take every kind of arm
