"""The kept state of a conversation (ddtree.decode.conversation): a restored boundary equals a
fresh prefill of the same prefix (GDN states, K/V and drafter context rows, next-token logits;
float32), the committed tokens after a reply are the prompt and every emitted token but the last,
and turns reply exactly what a fresh generate of the same tokens does, roll-backs and Ctrl-C
included."""

from __future__ import annotations

import pytest
import torch

from helpers import rel_err, tiny_cpu_each_test  # noqa: F401 (autouse)
from ddtree.decode.conversation import SNAPSHOTS, Conversation, common_prefix
from ddtree.model import memory as mem
from ddtree.decode.random_pair import build_random_pair

TOL = 5e-5  # a prefill split at other points: float32 rounding of the chunked recurrence apart


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()  # no mask / stop tokens


@pytest.fixture(scope="module")
def hybrid():
    with torch.no_grad():
        dec, raw = build_random_pair("hybrid", seed=5, max_len=256)
    return dec


@pytest.fixture(scope="module")
def codepair(fixture_dir_module):
    from ddtree.decode.decoder import Decoder
    from ddtree.model.checkpoint import load_drafter, load_target

    cpu = torch.device("cpu")
    target, _ = load_target(str(fixture_dir_module / "target"), [cpu], torch.float32, 256)
    drafter, _ = load_drafter(str(fixture_dir_module / "drafter"), target, torch.float32, 256)
    return Decoder(target, drafter)


@pytest.fixture(scope="module")
def fixture_dir_module():
    from conftest import FIXTURE_DIR, have_fixture, FIXTURE_REASON

    if not have_fixture():
        pytest.skip(FIXTURE_REASON)
    return FIXTURE_DIR


def live_state(dec, n: int) -> dict:
    """The state a prefix of n tokens leaves: GDN states, K/V rows [0, n), the drafter's context rows."""
    out = {}
    for j, g in dec.target.gdn_groups.items():
        out[f"gdn{j}"], out[f"conv{j}"] = g.state.clone(), g.conv.clone()
    for j, (kc, vc) in dec.target.kv_stacks.items():
        out[f"k{j}"], out[f"v{j}"] = kc[:, :n].clone(), vc[:, :n].clone()
    for i, layer in enumerate(dec.drafter.layers):
        out[f"dk{i}"] = layer.self_attn.k_cache[:n].clone()
        out[f"dv{i}"] = layer.self_attn.v_cache[:n].clone()
    out["ctx_len"] = dec.drafter.ctx_len.clone()
    return out


def fresh(dec, ids: list[int]):
    """A fresh prefill of ids (with the drafter's context) -> (its state, the last logits)."""
    dec.target.reset()
    dec.drafter.reset()
    logits, _ = dec.target.prefill(torch.tensor(ids), want_taps=True, on_taps=dec.drafter.add_context)
    return live_state(dec, len(ids)), logits


def assert_same(got: dict, want: dict, tol: float = TOL) -> None:
    for k in want:
        if k == "ctx_len":
            assert int(got[k]) == int(want[k])
        else:
            assert rel_err(got[k], want[k]) < tol, (k, rel_err(got[k], want[k]))


def check_rollback(dec, vocab: int) -> None:
    """A turn with boundaries at 12 and 25 (and its prompt's end, 40), decoded; then a rendering
    that shares 30 tokens: the boundary at 25 is restored, and the state and the next logits
    equal a fresh prefill."""
    a = rand_ids(40, vocab, 1)
    conv = Conversation(dec)
    job = dec.job("ddtree", 4, max_new_tokens=8, prompt_len=len(a))
    rec = conv.turn(a, job, marks=(12, 25))
    assert conv.snapshot_positions() == [12, 25, 40]
    b = a[:30] + rand_ids(14, vocab, 2)
    p, common, snap = conv._plan(b, True, len(b))
    assert (p, common, snap.pos) == (25, 30, 25)
    conv._restore(b, p, common, snap)
    got = live_state(dec, p)
    logits, _ = dec.target.prefill(torch.tensor(b[p:]), start=p, want_taps=True, on_taps=dec.drafter.add_context)
    want, want_logits = fresh(dec, b[:p])
    assert_same(got, want)
    _, full_logits = fresh(dec, b)
    assert rel_err(logits, full_logits) < TOL
    assert rec.new_tokens == 8


def test_rollback_equals_fresh_prefill_random_hybrid(hybrid):
    check_rollback(hybrid, hybrid.target.cfg.vocab_size)


def test_rollback_equals_fresh_prefill_codepair(codepair):
    check_rollback(codepair, codepair.target.cfg.vocab_size)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_committed_after_a_reply_is_prompt_and_all_but_the_last_token(hybrid, method):
    """After a reply the K/V rows hold the prompt and every emitted token but the last (the last
    bonus is the next root, unprocessed), while the live GDN state has run past them: a settle
    at those tokens equals a fresh prefill of them."""
    dec = hybrid
    a = rand_ids(20, dec.target.cfg.vocab_size, 3)
    conv = Conversation(dec)
    rec = conv.turn(a, dec.job(method, 4, max_new_tokens=12, prompt_len=len(a)))
    assert conv.tokens == a + rec.token_ids[:-1] and conv.live is None
    assert int(dec.start_d) >= len(conv.tokens)  # the rounds ran ahead (or exactly there)
    n = len(conv.tokens)
    kv = {k: v.clone() for k, v in live_state(dec, n).items() if k[0] in "kv"}
    r = conv.settle(conv.tokens, taps=True)
    p = len(a) if method != "ar" else 0  # from the prompt's end, its boundary (ar kept no drafter context)
    assert (r.reused, r.prefilled) == (p, n - p)
    got = live_state(dec, n)
    want, _ = fresh(dec, conv.tokens)
    assert_same(got, want)
    # the decode's own rows (a verify's attention path, not the prefill's: float32 rounding apart)
    assert_same(kv, {k: v for k, v in want.items() if k[0] in "kv"}, tol=1e-4)


def conversation_turns(dec, method: str, turns, vocab: int, interrupt_at: int | None = None):
    """Three turns on one Conversation; each next prompt keeps the reply, and the second drops
    the first reply's last 3 tokens (a rendering that differs before the reply's end: a roll-back).
    -> [(prompt ids, reply ids)]."""
    conv = Conversation(dec)
    out, ids = [], rand_ids(17, vocab, 10)
    for t in range(turns):
        job = dec.job(method, 4, max_new_tokens=9, prompt_len=len(ids))
        if t == interrupt_at:
            seen = []

            def stop_soon(toks):
                seen.extend(toks)
                if len(seen) >= 3:
                    raise KeyboardInterrupt

            with pytest.raises(KeyboardInterrupt):
                conv.turn(ids, job, on_tokens=stop_soon)
            reply = seen
        else:
            reply = conv.turn(ids, job).token_ids
            out.append((ids, reply))
        keep = reply[:-3] if t == 0 else reply
        ids = ids + keep + rand_ids(6, vocab, 20 + t)
        conv.settle(ids[: len(ids) - 6], taps=method != "ar")  # the settled end: the reply, before the next message
    return out


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_turns_equal_fresh_generate(hybrid, method):
    dec = hybrid
    vocab = dec.target.cfg.vocab_size
    turns = conversation_turns(dec, method, 3, vocab)
    for ids, reply in turns:
        assert dec.generate(ids, method, 4, max_new_tokens=9).token_ids == reply


def test_ctrl_c_mid_reply_loses_nothing(hybrid):
    """A turn cut by Ctrl-C in its reply leaves a state the next turns continue exactly."""
    dec = hybrid
    turns = conversation_turns(dec, "ddtree", 3, dec.target.cfg.vocab_size, interrupt_at=1)
    assert len(turns) == 2
    for ids, reply in turns:
        assert dec.generate(ids, "ddtree", 4, max_new_tokens=9).token_ids == reply


def test_snapshots_keep_the_pinned_head(hybrid):
    dec = hybrid
    vocab = dec.target.cfg.vocab_size
    conv = Conversation(dec)
    ids = rand_ids(10, vocab, 30)
    for t in range(4):
        job = dec.job("ar", 4, max_new_tokens=3, prompt_len=len(ids))
        conv.turn(ids, job, marks=(5,), pin=(5,))
        ids = ids + rand_ids(5, vocab, 31 + t)
    pos = conv.snapshot_positions()
    assert 5 in pos and len(pos) == SNAPSHOTS and pos == sorted(set(pos))
    # a rendering that changes right after the head resumes there
    b = ids[:7] + rand_ids(4, vocab, 40)
    assert conv._plan(b, False, len(b))[0] == 5
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2


def test_snapshot_bytes_are_the_memory_plans(hybrid):
    from ddtree.model.config import TargetConfig

    dec = hybrid
    conv = Conversation(dec)
    assert mem.CHAT_SNAPSHOTS == SNAPSHOTS
    cfg = dec.target.cfg
    assert isinstance(cfg, TargetConfig)
    n_gdn = cfg.layer_types.count(mem.GDN)
    held = sum(t.numel() * t.element_size() for pair in conv.store.values() for t in pair)
    assert held == mem.gdn_snapshot_bytes(cfg, n_gdn, dec.target.dtype, SNAPSHOTS)


def test_a_kept_state_turn_prefills_fast_once_a_fast_prefill_ran(monkeypatch):
    """Decoder.prefill's path: a short fresh prompt takes the eager twins (nothing compiled before
    its first token); a kept conversation's turn takes them too until a fast prefill has run (the
    settle after a reply is one), then the fast path (compiled layers, fla), as a long prompt does."""
    with torch.no_grad():
        dec, _ = build_random_pair("hybrid", seed=6, max_len=256)
    seen = []
    real = dec.target.prefill
    monkeypatch.setattr(dec.target, "prefill", lambda *a, **k: seen.append(k.get("fast", True)) or real(*a, **k))
    vocab = dec.target.cfg.vocab_size
    conv = Conversation(dec)
    ids = rand_ids(20, vocab, 30)
    conv.turn(ids, dec.job("ddtree", 4, max_new_tokens=6, prompt_len=len(ids)))
    assert seen == [False] and not dec.target.fast_prefill_ran  # a short fresh prompt: eager
    ids = conv.tokens + rand_ids(5, vocab, 31)
    conv.turn(ids, dec.job("ddtree", 4, max_new_tokens=6, prompt_len=len(ids)))
    assert seen[-1] is False  # still nothing fast has run
    done = conv.tokens
    conv.settle(done, taps=True)  # the settle prefills through the fast path
    assert seen[-1] is True and dec.target.fast_prefill_ran
    ids = done + rand_ids(5, vocab, 32)
    conv.turn(ids, dec.job("ddtree", 4, max_new_tokens=6, prompt_len=len(ids)))
    assert seen[-1] is True  # a kept state's turn, now fast
    n = len(seen)
    dec.prefill(rand_ids(20, vocab, 33), dec.job("ddtree", 4, max_new_tokens=6, prompt_len=20))
    assert seen[n:] == [False]  # a fresh short prompt stays eager
