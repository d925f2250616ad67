"""Sampling is exact: `ddtree` sampling reproduces the target's own distribution.

On a tiny vocabulary the exact joint distribution of the first three generated tokens is
enumerated from the target's probabilities (p(t1) p(t2|t1) p(t3|t1,t2)); empirical distributions
of `ar` and `ddtree` sampling over many seeds are compared with it by a chi-square goodness-of-fit
test (cells with expected count < 5 pooled) and by total variation against a parametric-bootstrap
threshold. Deliberately biased rules, patched into the decoder here, must fail the same test.
Also unit tests of `processed_probs` and `choose`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import ddtree.decode.decoder as decoding
from ddtree.decode.decoder import Decoder
from ddtree.errors import DDTreeError
from ddtree.decode.sampling import SamplingParams, choose, processed_probs
from ddtree.model.synthetic import build_random_drafter, build_random_target, tiny_drafter_config, tiny_hybrid_config
from helpers import draft_from_logits

V = 8
PROMPT = [2, 5, 3, 7, 1]
P_MIN = 1e-3  # exact rules must not be rejected at this level (fixed seeds: deterministic)
P_BIASED = 1e-6  # biased rules must be rejected at least this strongly
RESULTS: dict[str, dict] = {}  # numbers for the report (pytest -s prints them)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py: tiny models run on one thread
    yield


# --------------------------------------------------------------------------------------------
# processed_probs and choose
# --------------------------------------------------------------------------------------------

def _logits(probs):
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_temperature():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 11, generator=g)
    for t in (0.3, 1.0, 1.7):
        torch.testing.assert_close(processed_probs(x, SamplingParams(temperature=t)), torch.softmax(x / t, -1))


def test_top_k_keeps_k():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 12, generator=g)
    for k in (1, 3, 7, 11):
        p = processed_probs(x, SamplingParams(temperature=1.0, top_k=k))
        assert ((p > 0).sum(-1) == k).all()
        top = x.topk(k, -1).indices
        kept = torch.zeros_like(p, dtype=torch.bool).scatter(-1, top, True)
        assert (p[~kept] == 0).all()
        ref = torch.softmax(x.masked_fill(~kept, float("-inf")), -1)
        torch.testing.assert_close(p, ref)
    # top_k 0 or >= V disables it
    for k in (0, 12, 50):
        torch.testing.assert_close(processed_probs(x, SamplingParams(temperature=1.0, top_k=k)), torch.softmax(x, -1))


def test_top_p_keeps_smallest_prefix_reaching_p():
    x = _logits([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    cases = {0.01: [1], 0.4: [1], 0.5 - 1e-4: [1], 0.75: [1, 3], 0.85: [1, 3, 2], 0.97: [0, 1, 2, 3], 1.0: [0, 1, 2, 3]}
    for top_p, keep in cases.items():
        p = processed_probs(x[None], SamplingParams(temperature=1.0, top_p=top_p))[0]
        assert sorted(torch.nonzero(p).flatten().tolist()) == sorted(keep), top_p
        base = torch.tensor([0.05, 0.5, 0.15, 0.3])
        ref = torch.zeros(4)
        ref[keep] = base[keep] / base[keep].sum()
        torch.testing.assert_close(p, ref, atol=1e-6, rtol=1e-5)


def test_top_k_then_top_p_then_temperature_order():
    # HF order: temperature, top-k, top-p (on the renormalised top-k distribution)
    x = _logits([0.4, 0.3, 0.2, 0.1])
    p = processed_probs(x[None], SamplingParams(temperature=1.0, top_k=2, top_p=0.5))[0]
    # top-2 renormalised: 0.571, 0.429 -> top-p 0.5 keeps the first only
    assert torch.nonzero(p).flatten().tolist() == [0]
    p = processed_probs(x[None], SamplingParams(temperature=2.0, top_k=3, top_p=0.6))[0]
    q = torch.softmax(x / 2.0, -1)[:3]
    q = q / q.sum()
    keep = (q.cumsum(0) - q) < 0.6
    ref = torch.zeros(4)
    ref[:3] = torch.where(keep, q, torch.zeros_like(q))
    torch.testing.assert_close(p, ref / ref.sum())


def test_sampling_params_validation():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(DDTreeError):
            SamplingParams(**bad)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


def test_choose_greedy_is_argmax():
    x = torch.randn(9, 13, generator=torch.Generator().manual_seed(2))
    assert torch.equal(choose(x, SamplingParams()), x.argmax(-1))


def test_choose_frequencies():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    x = probs.log()
    n = 20000
    g = torch.Generator().manual_seed(3)
    draws = choose(x[None].expand(n, -1).contiguous(), SamplingParams(temperature=1.0), g)  # rows independent
    counts = torch.bincount(draws, minlength=6).numpy()
    p = stats.chisquare(counts, probs.double().numpy() / float(probs.sum()) * counts.sum()).pvalue
    assert p > P_MIN, (counts, p)
    # with top-k 3 only the 3 best appear, in renormalised proportions
    draws = choose(x[None].expand(n, -1).contiguous(), SamplingParams(temperature=1.0, top_k=3), g)
    counts = torch.bincount(draws, minlength=6).numpy()
    assert counts[3:].sum() == 0
    top3 = probs[:3].double().numpy()
    assert stats.chisquare(counts[:3], top3 / top3.sum() * counts.sum()).pvalue > P_MIN
    # one generator, many calls: consecutive single-row draws are independent
    seq = np.array([int(choose(x[None], SamplingParams(temperature=1.0), g)) for _ in range(3000)])
    pairs = np.zeros((6, 6))
    np.add.at(pairs, (seq[:-1], seq[1:]), 1)
    assert stats.chi2_contingency(pairs[:4, :4]).pvalue > P_MIN
    # seeded generators are reproducible
    a = choose(x[None].expand(50, -1), SamplingParams(temperature=1.0), torch.Generator().manual_seed(7))
    b = choose(x[None].expand(50, -1), SamplingParams(temperature=1.0), torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


# --------------------------------------------------------------------------------------------
# the end-to-end distribution test
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    raw = tiny_hybrid_config(vocab=V, hidden=32, layers=("linear_attention", "full_attention"), heads=2, kv_heads=1,
                             head_dim=16, gdn_k_heads=1, gdn_v_heads=2, gdn_k_dim=8, gdn_v_dim=8, inter=48)
    target = build_random_target(raw, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(3.0)  # sharper distributions: fewer cells carry the mass
    drafter = build_random_drafter(tiny_drafter_config(raw, block_size=4, mask_token_id=1), target, seed=4)
    return Decoder(target, drafter)


def exact_joint(dec: Decoder, sp: SamplingParams) -> np.ndarray:
    """[V**3] exact probabilities of (t1, t2, t3), from the target's own chain forward."""
    tgt = dec.target
    P = torch.zeros(V, V, V, dtype=torch.float64)
    with torch.no_grad():
        for a in range(V):
            for b in range(V):
                tgt.reset()  # forward_chain starts from the committed state: make it empty
                logits, _ = tgt.forward_chain(torch.tensor(PROMPT + [a, b]), 0)
                pr = processed_probs(logits[-3:], sp).double()  # p(t1), p(t2|a), p(t3|a,b)
                P[a, b] = pr[0, a] * pr[1, b] * pr[2]
    tgt.reset()
    assert abs(float(P.sum()) - 1) < 1e-5
    return P.flatten().numpy()


class MarginalDrafter:
    """Draft logits = the exact per-position marginals of t2 and t3 (what DDTree's per-position
    drafter approximates); uniform elsewhere. Any drafter must leave sampling exact; this one
    makes trees accept often, so the test has something to test."""

    def __init__(self, dec: Decoder, P: np.ndarray, flat: float = 1.0):
        J = torch.tensor(P).view(V, V, V)
        self.m = {1: J.sum((0, 2)), 2: J.sum((0, 1))}
        self.d, self.flat = dec.drafter, flat

    def __call__(self, bonus, kv_len):
        B = self.d.cfg.block_size
        p = int(self.d.ctx_len)
        out = torch.zeros(B - 1, V)
        for j in range(1, B):
            i = p + j - len(PROMPT)
            if i in self.m:
                out[j - 1] = self.m[i].clamp_min(1e-6).log().float() * self.flat
        return out


def run_counts(dec, method, budget, sp, seeds):
    counts = np.zeros(V**3)
    accepted = 0
    for s in seeds:
        rec = dec.generate(PROMPT, method, budget=budget, sampling=sp, max_new_tokens=3, seed=s)
        t = rec.token_ids
        assert len(t) == 3
        counts[(t[0] * V + t[1]) * V + t[2]] += 1
        accepted += sum(r.accepted for r in rec.rounds)
    return counts, accepted / len(seeds)


def gof(counts: np.ndarray, probs: np.ndarray):
    """Chi-square goodness of fit, cells with expected count < 5 pooled. -> (stat, df, p)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    o, e = list(counts[big]), list(exp[big])
    if exp[~big].sum() > 0 or counts[~big].sum() > 0:
        o.append(counts[~big].sum())
        e.append(max(exp[~big].sum(), 1e-12))
    o, e = np.array(o), np.array(e)
    stat = float(((o - e) ** 2 / e).sum())
    df = len(o) - 1
    return stat, df, float(stats.chi2.sf(stat, df))


def two_sample(c1: np.ndarray, c2: np.ndarray, probs: np.ndarray):
    """Chi-square homogeneity test of two empirical distributions (cells pooled by the exact
    expected count of the combined sample). -> p-value."""
    big = probs * (c1.sum() + c2.sum()) >= 10
    table = np.stack([np.append(c1[big], c1[~big].sum()), np.append(c2[big], c2[~big].sum())])
    table = table[:, table.sum(0) > 0]
    return float(stats.chi2_contingency(table).pvalue)


def tv(counts, probs):
    return 0.5 * float(np.abs(counts / counts.sum() - probs).sum())


def tv_threshold(probs, n, q=0.999, sims=4000, seed=0):
    """The q-quantile of TV(empirical, exact) for n exact samples (parametric bootstrap)."""
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(n, probs / probs.sum(), size=sims)
    return float(np.quantile(0.5 * np.abs(draws / n - probs).sum(1), q))


def _check_exact(name, counts, probs, acc=None):
    stat, df, p = gof(counts, probs)
    t, thr = tv(counts, probs), tv_threshold(probs, int(counts.sum()))
    RESULTS[name] = dict(n=int(counts.sum()), chi2=round(stat, 2), df=df, p=p, tv=round(t, 4), tv_999=round(thr, 4),
                         accepted_per_run=acc)
    print(f"\n{name}: {RESULTS[name]}")
    assert p > P_MIN, f"{name}: chi-square {stat:.1f} on {df} df, p = {p:.2e}"
    assert t < thr, f"{name}: TV {t:.3f} >= {thr:.3f}"


N_EXACT = 500
N_BIASED = {"threshold": 300, "shared_noise": 500}
BUDGET = 6
T1 = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def exact_t1(pair):
    return exact_joint(pair, T1)


@pytest.fixture(scope="module")
def ar_t1(pair, exact_t1):
    counts, _ = run_counts(pair, "ar", 1, T1, range(0, N_EXACT))
    return counts


def test_ar_sampling_matches_exact(ar_t1, exact_t1):
    _check_exact("ar, T=1", ar_t1, exact_t1)


def test_ddtree_sampling_matches_exact_and_ar(pair, exact_t1, ar_t1, monkeypatch):
    monkeypatch.setattr(pair.drafter, "draft_topk", draft_from_logits(MarginalDrafter(pair, exact_t1)))
    counts, acc = run_counts(pair, "ddtree", BUDGET, T1, range(10_000, 10_000 + N_EXACT))
    assert acc > 0.8  # the trees were accepted into: the first round usually commits t2 and t3
    _check_exact(f"ddtree-{BUDGET}, T=1", counts, exact_t1, acc)
    p2 = two_sample(counts, ar_t1, exact_t1)
    RESULTS[f"ddtree-{BUDGET} vs ar, T=1"] = dict(p=p2)
    print(f"\nddtree vs ar two-sample p = {p2:.3g}")
    assert p2 > P_MIN


def test_dflash_sampling_matches_exact(pair, exact_t1, monkeypatch):
    monkeypatch.setattr(pair.drafter, "draft_topk", draft_from_logits(MarginalDrafter(pair, exact_t1)))
    counts, acc = run_counts(pair, "dflash", 1, T1, range(20_000, 20_000 + 300))
    assert acc > 0.3
    _check_exact("dflash, T=1", counts, exact_t1, acc)


def test_ddtree_top_k_top_p_real_drafter(pair, monkeypatch):
    """The real (random) drafter, flattened so its trees are bushy, with top-k / top-p / T=0.8."""
    sp = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    probs = exact_joint(pair, sp)
    monkeypatch.setattr(pair.drafter.norm, "weight", torch.nn.Parameter(pair.drafter.norm.weight.detach() * 0.3))
    counts, acc = run_counts(pair, "ddtree", 4, sp, range(30_000, 30_000 + 400))
    assert acc > 0.2
    assert counts[probs == 0].sum() == 0  # nothing outside the top-k / top-p support
    _check_exact("ddtree-4, T=0.8 top_k=5 top_p=0.9, real drafter", counts, probs, acc)


# --------------------------------------------------------------------------------------------
# the same test fails on biased rules (implemented here, patched into the decoder)
# --------------------------------------------------------------------------------------------

def _biased_threshold(monkeypatch, tau=0.25):
    """Accept the drafter's top-1 child whenever the target gives it probability > tau, else
    follow the sample. Plausible-looking, and biased towards the draft."""
    stash = {}
    real_choose = decoding.choose

    def spy_choose(logits, p, generator=None):
        stash["probs"] = processed_probs(logits, p)
        return real_choose(logits, p, generator)

    def biased_walk(tokens, parents, depths, path_mask, choice, P):
        probs = stash["probs"]
        kids: dict[int, list[int]] = {}
        for i in range(1, tokens.shape[0]):
            kids.setdefault(int(parents[i]), []).append(i)  # the first child is the rank-0 one
        node, path = 0, [0]
        while node in kids:
            top = kids[node][0]
            if probs[node, tokens[top]] > tau:
                choice[node] = tokens[top]  # the bonus is read from choice after the walk
                node = top
            else:
                match = [c for c in kids[node] if int(tokens[c]) == int(choice[node])]
                if not match:
                    break
                node = match[0]
            path.append(node)
        n = len(path)
        return torch.tensor(node), torch.tensor(n), torch.tensor(path + [node] * (P - n))

    monkeypatch.setattr(decoding, "choose", spy_choose)
    monkeypatch.setattr(decoding, "walk", biased_walk)


def _biased_shared_noise(monkeypatch):
    """One exponential-race noise vector shared by every node of the tree: each node's marginal
    is right, but the tokens along a path are correlated."""
    real_choose = decoding.choose

    def shared_choose(logits, p, generator=None):
        if logits.shape[0] == 1 or p.greedy:
            return real_choose(logits, p, generator)
        probs = processed_probs(logits, p)
        e = torch.empty(1, probs.shape[-1]).exponential_(1.0, generator=generator)
        return (probs / e).argmax(-1)

    monkeypatch.setattr(decoding, "choose", shared_choose)


@pytest.mark.parametrize("rule", ["threshold", "shared_noise"])
def test_biased_rules_fail(pair, exact_t1, ar_t1, monkeypatch, rule):
    monkeypatch.setattr(pair.drafter, "draft_topk", draft_from_logits(MarginalDrafter(pair, exact_t1)))
    (_biased_threshold if rule == "threshold" else _biased_shared_noise)(monkeypatch)
    n = N_BIASED[rule]
    counts, acc = run_counts(pair, "ddtree", BUDGET, T1, range(40_000, 40_000 + n))
    stat, df, p = gof(counts, exact_t1)
    t, thr = tv(counts, exact_t1), tv_threshold(exact_t1, n)
    p2 = two_sample(counts, ar_t1, exact_t1)
    RESULTS[f"biased {rule}"] = dict(n=n, chi2=round(stat, 1), df=df, p=p, tv=round(t, 4), tv_999=round(thr, 4),
                                     p_vs_ar=p2, accepted_per_run=acc)
    print(f"\nbiased {rule}: {RESULTS[f'biased {rule}']}")
    assert p < P_BIASED, f"the test did not catch the biased rule {rule!r}: p = {p:.3g}"
    assert p2 < 1e-4  # two-sample, against ar's empirical distribution
    if rule == "threshold":
        assert t > thr
