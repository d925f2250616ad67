"""Decoders: greedy `ddtree` / `dflash` equal `ar` token for token; stop tokens, max_new_tokens,
mask-id tokens, top1_first, the walk, per-round records and user errors."""

from __future__ import annotations

import pytest
import torch

from ddtree.decode.decoder import Decoder, walk
from ddtree.errors import DDTreeError
from ddtree.decode.random_pair import build_random_pair
from ddtree.model.synthetic import build_random_drafter, build_random_target, tiny_drafter_config, tiny_hybrid_config
from ddtree.ops.tree import Tree, ancestor_mask_from_parents
from helpers import Oracle

BUDGETS = (1, 2, 7, 32, 128)
NEW = 36


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py: tiny models run on one thread
    yield


def _prompt(seed: int, n: int, vocab: int = 97) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def _all_methods(dec: Decoder, prompt, max_new=NEW, budgets=BUDGETS, **kw):
    out = {"dflash": dec.generate(prompt, "dflash", max_new_tokens=max_new, **kw)}
    for b in budgets:
        out[f"ddtree-{b}"] = dec.generate(prompt, "ddtree", budget=b, max_new_tokens=max_new, **kw)
    return out


def _check_records(rec, method: str, block_size: int, budget: int | None = None, vocab: int | None = 97):
    """Per-round records are consistent with the output."""
    rounds = rec.rounds
    assert sum(r.committed for r in rounds) == rec.new_tokens - 1  # the first token is the prefill's
    assert rec.new_tokens == len(rec.token_ids)
    for r in rounds:
        assert 0 <= r.accepted <= r.tree_depth
        assert len(r.accepted_ranks) == r.accepted
        assert all(x >= 0 for x in r.accepted_ranks)
        assert 1 <= r.committed <= r.accepted + 1
        assert r.tree_depth <= max(block_size - 1, 0)
        if method == "ar":
            assert r.tree_size == 0 and r.tree_depth == 0 and r.accepted == 0
        elif method == "dflash":
            assert r.tree_size == block_size - 1 == r.tree_depth
            assert r.accepted_ranks == [0] * r.accepted
        else:
            assert r.tree_size <= budget and r.tree_depth <= min(budget, block_size - 1)
            if vocab is not None:  # N = budget + 1 unless the tree holds every rank prefix
                K, D = min(budget, vocab), block_size - 1
                assert r.tree_size == min(budget, sum(K**d for d in range(1, D + 1)))
            assert all(x < min(budget, vocab or budget) for x in r.accepted_ranks)
    # every round but the last commits accepted + 1 tokens
    for r in rounds[:-1]:
        assert r.committed == r.accepted + 1


# --------------------------------------------------------------------------------------------
# an oracle drafter: proposes the known greedy continuation (with deliberate slips), so that
# long paths are accepted and stop / length cuts land inside accepted paths
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hybrid0():
    dec, raw = build_random_pair("hybrid", 0)
    return dec


def _oracle_run(dec, prompt, n_full=80):
    ar = dec.generate(prompt, "ar", max_new_tokens=n_full)
    return prompt + ar.token_ids, ar


# --------------------------------------------------------------------------------------------
# greedy exactness
# --------------------------------------------------------------------------------------------

PAIRS = [("hybrid", 0, 6), ("hybrid", 1, 23), ("hybrid", 2, 1), ("dense", 0, 11), ("dense", 3, 40)]


@pytest.mark.parametrize("kind,seed,plen", PAIRS)
def test_greedy_ddtree_and_dflash_equal_ar(kind, seed, plen):
    dec, raw = build_random_pair(kind, seed)
    prompt = _prompt(seed, plen)
    ar = dec.generate(prompt, "ar", max_new_tokens=NEW)
    assert ar.new_tokens == NEW
    _check_records(ar, "ar", 1)
    for name, rec in _all_methods(dec, prompt).items():
        assert rec.token_ids == ar.token_ids, f"{kind} seed {seed}: {name} differs from ar"
        method, budget = ("dflash", None) if name == "dflash" else ("ddtree", int(name.split("-")[1]))
        _check_records(rec, method, dec.block_size, budget)


def test_greedy_exact_with_long_accepted_paths(hybrid0):
    """Oracle drafts (long acceptances, sibling branches) still give exactly ar's tokens, and the
    decoder hands the drafter the right bonus at the right position every round."""
    dec = hybrid0
    prompt = _prompt(7, 9)
    full, ar = _oracle_run(dec, prompt)
    o = Oracle(dec, full)
    try:
        recs = _all_methods(dec, prompt, max_new=60, budgets=(1, 2, 7, 32))
    finally:
        o.restore()
    assert o.bad_bonus == 0
    for name, rec in recs.items():
        assert rec.token_ids == ar.token_ids[:60], name
        _check_records(rec, "dflash" if name == "dflash" else "ddtree", dec.block_size,
                       None if name == "dflash" else int(name.split("-")[1]))
    # the oracle really made the trees accept long paths, through rank-1 siblings too
    acc = {n: sum(r.accepted for r in rec.rounds) / len(rec.rounds) for n, rec in recs.items()}
    assert acc["ddtree-32"] > 3.0 and acc["ddtree-32"] > acc["dflash"]
    assert any(1 in r.accepted_ranks for r in recs["ddtree-7"].rounds)


def test_top1_first_keeps_exactness(hybrid0):
    dec = hybrid0
    prompt = _prompt(4, 13)
    ar = dec.generate(prompt, "ar", max_new_tokens=NEW)
    for b in (1, 7, 32):
        rec = dec.generate(prompt, "ddtree", budget=b, max_new_tokens=NEW, top1_first=True)
        assert rec.token_ids == ar.token_ids, b
        _check_records(rec, "ddtree", dec.block_size, b)
    full = prompt + ar.token_ids + [0] * 16
    o = Oracle(dec, full)
    try:
        for b in (3, 16):
            rec = dec.generate(prompt, "ddtree", budget=b, max_new_tokens=NEW, top1_first=True)
            assert rec.token_ids == ar.token_ids, b
    finally:
        o.restore()


# --------------------------------------------------------------------------------------------
# max_new_tokens and stop tokens
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 5, 9, 17])
def test_max_new_tokens_is_exact(hybrid0, n):
    dec = hybrid0
    prompt = _prompt(2, 8)
    full, ar = _oracle_run(dec, prompt, 40)
    o = Oracle(dec, full)
    try:
        for name, rec in _all_methods(dec, prompt, max_new=n, budgets=(2, 32)).items():
            assert rec.new_tokens == n == len(rec.token_ids), name
            assert rec.token_ids == ar.token_ids[:n], name
            assert sum(r.committed for r in rec.rounds) == n - 1
    finally:
        o.restore()
    assert dec.generate(prompt, "ar", max_new_tokens=n).new_tokens == n


def _first_new_token_at(tokens: list[int], lo: int) -> tuple[int, int]:
    """(index, token) of the first token at index >= lo that does not occur before it."""
    for i in range(lo, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i, tokens[i]
    raise AssertionError("no fresh token")


def test_stop_token_inside_accepted_path(hybrid0):
    dec = hybrid0
    prompt = _prompt(5, 10)
    full, ar = _oracle_run(dec, prompt, 60)
    cut_inside = 0
    for lo in (4, 9, 15, 22):
        i, stop = _first_new_token_at(ar.token_ids, lo)
        expect = ar.token_ids[: i + 1]
        r_ar = dec.generate(prompt, "ar", max_new_tokens=60, stop_ids={stop})
        assert r_ar.token_ids == expect
        o = Oracle(dec, full)
        try:
            recs = _all_methods(dec, prompt, max_new=60, budgets=(1, 7, 32), stop_ids={stop})
        finally:
            o.restore()
        for name, rec in recs.items():
            assert rec.token_ids == expect, f"{name}: stop {stop} at {i}"
            assert rec.token_ids[-1] == stop and rec.new_tokens == i + 1
            assert sum(r.committed for r in rec.rounds) == i
            last = rec.rounds[-1]
            cut_inside += last.committed <= last.accepted  # stop inside the accepted draft tokens
    assert cut_inside >= 3  # the cases above really cut inside accepted paths


def test_on_tokens_streams_exactly_the_output(hybrid0):
    dec = hybrid0
    prompt = _prompt(5, 10)
    full, ar = _oracle_run(dec, prompt, 60)
    i, stop = _first_new_token_at(ar.token_ids, 9)
    o = Oracle(dec, full)
    try:
        for method, budget, n in (("ar", 1, 25), ("dflash", 1, 25), ("ddtree", 7, 25), ("ddtree", 32, 60)):
            chunks: list[list[int]] = []
            rec = dec.generate(prompt, method, budget=budget, max_new_tokens=n, stop_ids={stop},
                               on_tokens=lambda t: chunks.append(list(t)))
            assert [t for c in chunks for t in c] == rec.token_ids
            assert len(chunks) == len(rec.rounds) + 1  # the prefill's token, then one chunk a round
            assert [len(c) for c in chunks[1:]] == [r.committed for r in rec.rounds]
    finally:
        o.restore()


@pytest.mark.parametrize("host_rounds", [False, True])
def test_on_tokens_returning_true_ends_the_generation_after_that_round(hybrid0, host_rounds):
    """A caller ends a generation (a stop string, a cancelled request) by returning True from
    on_tokens: the rounds stop there, and what came is a prefix of the whole generation, with
    its rounds recorded."""
    dec = hybrid0
    dec.options = dec.options.replace(host_rounds=host_rounds)
    prompt = _prompt(5, 10)
    try:
        for method, budget in (("ar", 1), ("dflash", 1), ("ddtree", 7)):
            whole = dec.generate(prompt, method, budget=budget, max_new_tokens=30).token_ids
            for calls in (1, 3):
                chunks: list[list[int]] = []
                rec = dec.generate(prompt, method, budget=budget, max_new_tokens=30,
                                   on_tokens=lambda t: chunks.append(list(t)) or len(chunks) >= calls)
                # host rounds book a round while the next one runs: one more chunk comes (not after the first token)
                assert calls <= len(chunks) <= calls + (1 if host_rounds and calls > 1 else 0), (method, chunks)
                assert [t for c in chunks for t in c] == rec.token_ids == whole[:len(rec.token_ids)]
                assert len(rec.token_ids) < len(whole) and len(rec.rounds) == len(chunks) - 1
    finally:
        dec.options = dec.options.replace(host_rounds=False)


def test_first_token_streams_before_the_drafters_first_block(hybrid0):
    """The prefill hands the first token to on_tokens as soon as the target chose it: the drafter's
    first block (as long as several rounds) runs after it. The record's ttft_s is that moment;
    prefill_s the whole prefill, block included. Without a callback nothing changes."""
    dec = hybrid0
    prompt = _prompt(6, 12)
    events: list = []
    draft = dec.draft_topk

    def spy(*a, **k):
        events.append("draft")
        return draft(*a, **k)

    dec.draft_topk = spy
    try:
        for method, budget in (("dflash", 1), ("ddtree", 8), ("ddtree", "auto")):
            events.clear()
            rec = dec.generate(prompt, method, budget=budget, max_new_tokens=12,
                               on_tokens=lambda t: events.append(list(t)))
            assert events[0] == [rec.token_ids[0]] and events[1] == "draft", (method, events[:3])
            assert [t for e in events if e != "draft" for t in e] == rec.token_ids
            assert 0 < rec.ttft_s < rec.prefill_s
            plain = dec.generate(prompt, method, budget=budget, max_new_tokens=12)
            assert plain.token_ids == rec.token_ids and plain.ttft_s == plain.prefill_s
    finally:
        del dec.draft_topk


def test_a_generation_counts_the_graph_pieces_its_rounds_ran_first(hybrid0, monkeypatch):
    """GenerationRecord.captures: the pieces that the rounds (not the prefill) ran for the first
    time, each a capture or a compile whose time is in decode_s (bench warns when a timed prompt
    has any). Here every key's first run counts, as under graphs."""
    from ddtree.decode import auto as auto_budget

    dec = hybrid0
    runner, real = dec.graphs, dec.graphs._run
    seen: set = set()

    def first_runs(key, fn, keep):
        if key not in seen:
            seen.add(key)
            runner.new_keys += 1
        return real(key, fn, keep)

    mark = {}

    def calibrate(*a, **k):  # auto's calibration runs before the rounds' clock starts: not counted
        out = real_calibrate(*a, **k)
        mark["rounds"] = len(seen)
        return out

    monkeypatch.setattr(runner, "_run", first_runs)
    real_calibrate = auto_budget.calibrate
    monkeypatch.setattr(auto_budget, "calibrate", calibrate)
    prompt = _prompt(7, 12)
    counts = []
    for method, budget in (("ar", 1), ("ddtree", 8), ("ddtree", 8), ("ddtree", "auto")):
        job = dec.job(method, budget, max_new_tokens=10, prompt_len=len(prompt))
        pre = dec.prefill(prompt, job)
        mark["rounds"] = len(seen)
        rec = dec.decode(pre, job)
        assert rec.captures == len(seen) - mark["rounds"], (method, budget)
        counts.append(rec.captures)
    assert counts[0] > 0 and counts[1] > 0 and counts[2] == 0, counts  # the same run again finds every key
    assert dec.generate(prompt, "ddtree", budget=8, max_new_tokens=10).captures == 0


def test_stop_token_as_first_token(hybrid0):
    dec = hybrid0
    prompt = _prompt(3, 7)
    first = dec.generate(prompt, "ar", max_new_tokens=1).token_ids[0]
    for method in ("ar", "dflash", "ddtree"):
        rec = dec.generate(prompt, method, budget=8, max_new_tokens=20, stop_ids={first})
        assert rec.token_ids == [first] and rec.rounds == []


def test_stop_on_eos_and_several_stop_ids(hybrid0):
    dec = hybrid0
    prompt = _prompt(6, 12)
    ar = dec.generate(prompt, "ar", max_new_tokens=40).token_ids
    i1, s1 = _first_new_token_at(ar, 6)
    i2, s2 = _first_new_token_at(ar, i1 + 1)
    for method in ("ar", "dflash", "ddtree"):
        rec = dec.generate(prompt, method, budget=16, max_new_tokens=40, stop_ids=frozenset({s2, s1}))
        assert rec.token_ids == ar[: i1 + 1], method


# --------------------------------------------------------------------------------------------
# a token whose id equals the mask id is a real token
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_mask_id_tokens_are_never_dropped(kind):
    from ddtree.model.synthetic import tiny_dense_config

    raw = tiny_hybrid_config() if kind == "hybrid" else tiny_dense_config()
    target = build_random_target(raw, seed=0)
    prompt = _prompt(8, 9)
    ar = Decoder(target).generate(prompt, "ar", max_new_tokens=NEW)
    counts = torch.bincount(torch.tensor(ar.token_ids), minlength=97)
    mask_id = int(counts.argmax())  # the token ar emits most often
    assert counts[mask_id] >= 2
    d = build_random_drafter(tiny_drafter_config(raw, mask_token_id=mask_id), target, seed=1)
    dec = Decoder(target, d)
    assert dec.drafter.cfg.mask_token_id == mask_id
    for name, rec in _all_methods(dec, prompt, budgets=(1, 7, 32)).items():
        assert rec.token_ids == ar.token_ids, name
        assert rec.token_ids.count(mask_id) == counts[mask_id]
    # and inside long accepted paths
    o = Oracle(dec, prompt + dec.generate(prompt, "ar", max_new_tokens=60).token_ids, slip_every=0)
    try:
        for name, rec in _all_methods(dec, prompt, budgets=(7, 32)).items():
            assert rec.token_ids == ar.token_ids, name
            assert sum(r.accepted for r in rec.rounds) >= NEW // 2
    finally:
        o.restore()


# --------------------------------------------------------------------------------------------
# the walk on hand-made trees
# --------------------------------------------------------------------------------------------

# Docstring tree of ddtree.ops.tree: tokens a b d f e c (10..15), parents -1 0 1 2 1 0
A, Bt, Dt, Ft, Et, Ct, Z = 10, 11, 12, 13, 14, 15, 99
TOK = torch.tensor([A, Bt, Dt, Ft, Et, Ct])
PAR = torch.tensor([-1, 0, 1, 2, 1, 0])
DEP = torch.tensor([0, 1, 2, 3, 2, 1])
MASK = ancestor_mask_from_parents(PAR)


def _walk(choice, P=4, tok=TOK, par=PAR, dep=DEP, mask=MASK):
    last, n, path = walk(tok, par, dep, mask, torch.tensor(choice), P)
    return int(last), int(n), path.tolist()


def test_walk_root_only():
    assert _walk([Z, Bt, Dt, Ft, Z, Z]) == (0, 1, [0, 0, 0, 0])  # root's choice matches no child


def test_walk_full_depth():
    assert _walk([Bt, Dt, Ft, Z, Z, Z]) == (3, 4, [0, 1, 2, 3])


def test_walk_mismatch_in_the_middle():
    assert _walk([Bt, Et, Z, Z, Z, Z]) == (4, 3, [0, 1, 4, 4])  # sibling branch, then stop
    assert _walk([Bt, Z, Ft, Z, Z, Z]) == (1, 2, [0, 1, 1, 1])  # node 2 rejected; node 3 matches its parent but is cut off
    assert _walk([Ct, Dt, Ft, Z, Z, Z]) == (5, 2, [0, 5, 5, 5])  # the other subtree's matches do not count


def test_walk_padding_and_path_length():
    assert _walk([Bt, Dt, Z, Z, Z, Z], P=6) == (2, 3, [0, 1, 2, 2, 2, 2])
    assert _walk([Bt, Dt, Ft, Z, Z, Z], P=4)[2] == [0, 1, 2, 3]
    assert _walk([Z], P=1, tok=TOK[:1], par=PAR[:1], dep=DEP[:1], mask=MASK[:1, :1]) == (0, 1, [0])


def test_walk_on_a_chain_and_built_tree():
    t = Tree.chain(torch.tensor([5, 6, 7, 8, 9]))
    last, n, path = walk(t.tokens, t.parents, t.depths, t.ancestor_mask, torch.tensor([6, 7, 1, 9, 9]), 5)
    assert (int(last), int(n), path.tolist()) == (2, 3, [0, 1, 2, 2, 2])
    # a random tree: the walk equals a plain host-side walk from the root
    from ddtree.ops.tree import build_tree

    g = torch.Generator().manual_seed(0)
    lp, ids = torch.log_softmax(torch.randn(6, 30, generator=g), -1).topk(5, -1)
    tree = build_tree(3, lp, ids, 40)
    kids: dict[int, dict[int, int]] = {}
    for i in range(1, tree.num_nodes):
        kids.setdefault(int(tree.parents[i]), {})[int(tree.tokens[i])] = i
    for trial in range(50):
        choice = torch.randint(0, 30, (tree.num_nodes,), generator=g)
        # steer often into the tree
        for i in range(tree.num_nodes):
            if i in kids and torch.rand(1, generator=g) < 0.8:
                choice[i] = list(kids[i])[int(torch.randint(0, len(kids[i]), (1,), generator=g))]
        node, path = 0, [0]
        while int(choice[node]) in kids.get(node, {}):
            node = kids[node][int(choice[node])]
            path.append(node)
        last, n, pn = walk(tree.tokens, tree.parents, tree.depths, tree.ancestor_mask, choice, 7)
        assert int(last) == node and int(n) == len(path)
        assert pn.tolist() == path + [node] * (7 - len(path))


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------

def test_errors(hybrid0):
    dec = hybrid0
    with pytest.raises(DDTreeError, match="empty prompt"):
        dec.generate([], "ar")
    with pytest.raises(DDTreeError, match="unknown method"):
        dec.generate([1, 2], "beam")
    with pytest.raises(DDTreeError, match="drafter"):
        Decoder(dec.target).generate([1, 2, 3], "dflash")
    with pytest.raises(DDTreeError, match="drafter"):
        Decoder(dec.target).generate([1, 2, 3], "ddtree")
    with pytest.raises(DDTreeError, match="budget"):
        dec.generate([1, 2, 3], "ddtree", budget=0)
    too_long = _prompt(0, 500)
    for method in ("ar", "dflash", "ddtree"):
        with pytest.raises(DDTreeError, match="maximum length"):
            dec.generate(too_long, method, budget=32, max_new_tokens=40)
    with pytest.raises(DDTreeError, match="maximum length"):
        dec.generate([1, 2, 3], "ar", max_new_tokens=600)
    with pytest.raises(DDTreeError) as e:
        dec.generate([], "ar")
    assert "\n" not in str(e.value)  # one line: what is wrong and the fix
    # the decoder still works after the errors
    assert dec.generate([1, 2, 3], "ddtree", budget=4, max_new_tokens=5).new_tokens == 5


@pytest.mark.parametrize("max_len", [64, 100, 160])
def test_any_max_length_works(max_len):
    """A target allocated with any max length (not only multiples of an internal bucket) decodes
    every method up to its limit."""
    dec, _ = build_random_pair("hybrid", 0, max_len=max_len)
    prompt = _prompt(9, 5)
    new = max_len - len(prompt) - 40  # leaves room for a 32-node tree / a 7-node chain
    ar = dec.generate(prompt, "ar", max_new_tokens=new)
    assert ar.new_tokens == new
    for method, budget in (("dflash", 1), ("ddtree", 4), ("ddtree", 32)):
        rec = dec.generate(prompt, method, budget=budget, max_new_tokens=new)
        assert rec.token_ids == ar.token_ids, (method, budget)


def test_sampling_is_reproducible_with_a_seed(hybrid0):
    from ddtree.decode.sampling import SamplingParams

    sp = SamplingParams(temperature=1.0, top_p=0.95)
    prompt = _prompt(1, 6)
    for method in ("ar", "dflash", "ddtree"):
        a = hybrid0.generate(prompt, method, budget=8, sampling=sp, max_new_tokens=20, seed=11)
        b = hybrid0.generate(prompt, method, budget=8, sampling=sp, max_new_tokens=20, seed=11)
        assert a.token_ids == b.token_ids and a.new_tokens == 20
        _check_records(a, method, hybrid0.block_size, 8)


def test_prefill_taps_only_for_the_drafter(monkeypatch):
    """Decoder.prefill asks the target for taps only where a drafter takes them, chunk by chunk:
    `ar` with a drafter loaded (bench runs it beside the others) keeps no taps of the prompt."""
    dec, _ = build_random_pair("hybrid", 5)
    seen = []
    prefill = dec.target.prefill

    def spy(tokens, *a, **k):
        seen.append((k.get("want_taps", True), k.get("on_taps") is not None))
        logits, taps = prefill(tokens, *a, **k)
        assert taps is None  # never the whole prompt's
        return logits, taps

    monkeypatch.setattr(dec.target, "prefill", spy)
    a = dec.generate(_prompt(4, 9), "ar", max_new_tokens=4)
    d = dec.generate(_prompt(4, 9), "dflash", max_new_tokens=4)
    assert seen == [(False, False), (True, True)] and a.token_ids == d.token_ids


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_ar_launch_ahead_equals_round_loop(kind):
    """`ar` in the pipeline queues step r + 1 before reading step r (ddtree.decode.round); its
    reference twin is the host-tree loop (host_rounds): same tokens, greedy and sampled with a
    seed, with a stop token mid-way and at every max_new_tokens."""
    from ddtree.decode.sampling import SamplingParams

    dec, _ = build_random_pair(kind, 5)
    prompt = _prompt(4, 9)
    runs = {}
    for ahead in (True, False):
        dec.options = dec.options.replace(host_rounds=not ahead)
        greedy = dec.generate(prompt, "ar", max_new_tokens=30)
        sampled = dec.generate(prompt, "ar", sampling=SamplingParams(temperature=1.0), max_new_tokens=30, seed=3)
        i, stop = _first_new_token_at(greedy.token_ids, 12)
        chunks = []
        stopped = dec.generate(prompt, "ar", max_new_tokens=30, stop_ids={stop}, on_tokens=chunks.append)
        assert stopped.token_ids == greedy.token_ids[: i + 1] and [t for c in chunks for t in c] == stopped.token_ids
        short = [dec.generate(prompt, "ar", max_new_tokens=n).token_ids for n in (1, 2, 3)]
        _check_records(greedy, "ar", 1)
        runs[ahead] = (greedy.token_ids, sampled.token_ids, stopped.token_ids, short, len(greedy.rounds))
    dec.options = dec.options.replace(host_rounds=False)
    assert runs[True] == runs[False]


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_rounds_ahead_equal_host_tree_loop(kind):
    """dflash / ddtree with the tree built on the device and round r + 1 queued before round r is
    read (ddtree.decode.round) against the host-tree round loop (host_rounds): the same
    tokens and per-round records, greedy and sampled with a seed, with a stop token and short
    max_new_tokens; and a tree size shared by a chain (block 16 / budget 15) cannot leak shapes."""
    from ddtree.decode.sampling import SamplingParams

    dec, _ = build_random_pair(kind, 7)
    prompt = _prompt(8, 11)
    sp = SamplingParams(temperature=0.9, top_p=0.95)
    runs = {}
    for ahead in (True, False):
        dec.options = dec.options.replace(host_rounds=not ahead)
        got = []
        for method, budget in (("dflash", None), ("ddtree", 4), ("ddtree", dec.block_size - 1), ("ddtree", 32)):
            for sampling in (SamplingParams(), sp):
                rec = dec.generate(prompt, method, budget=budget or 8, sampling=sampling, max_new_tokens=40, seed=5)
                got.append((method, budget, rec.token_ids,
                            [(r.tree_size, r.tree_depth, r.accepted, r.accepted_ranks, r.committed) for r in rec.rounds]))
            greedy = got[-2][2]
            i, stop = _first_new_token_at(greedy, 15)
            chunks = []
            rec = dec.generate(prompt, method, budget=budget or 8, max_new_tokens=40, stop_ids={stop},
                               on_tokens=chunks.append)
            assert rec.token_ids == greedy[: i + 1] and [t for c in chunks for t in c] == rec.token_ids
            got.append([dec.generate(prompt, method, budget=budget or 8, max_new_tokens=n).token_ids for n in (1, 2, 5)])
        runs[ahead] = got
    dec.options = dec.options.replace(host_rounds=False)
    assert runs[True] == runs[False]


def test_compile_failure_in_eager_rounds_falls_back(monkeypatch):
    """Eager rounds with compiled layers (what a layer split over GPUs runs): if compiling fails on
    a piece's first run, the state is restored, that piece reruns with the eager layers, compiling
    stays off, and the output is unchanged."""
    import ddtree.model.target as target_mod

    def broken(layer):
        raise RuntimeError("inductor cannot compile here")

    dec, _ = build_random_pair("hybrid", 7)
    prompt = _prompt(3, 12)
    ref = {m: dec.generate(prompt, m, budget=8, max_new_tokens=24).token_ids for m in ("ar", "ddtree")}
    monkeypatch.setattr(target_mod, "compiled_layer", broken)
    for method in ("ddtree", "ar"):
        dec.compile = True
        assert dec.generate(prompt, method, budget=8, max_new_tokens=24).token_ids == ref[method]
        assert dec.compile is False and dec.target.compile_layers is False
