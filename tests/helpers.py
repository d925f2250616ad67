"""Shared helpers for the model / GDN / verify / checkpoint tests (tiny random models, random trees)."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import pytest
import torch

from ddtree.model.synthetic import build_random_target
from ddtree.ops.tree import Tree, ancestor_mask_from_parents


class MaxErrors(dict):
    """Worst relative error seen per check in a test module (printed by its report test, -s)."""

    def note(self, key: str, e: float) -> float:
        self[key] = max(self.get(key, 0.0), e)
        return e

    def report(self, tag: str) -> None:
        print(f"\n[{tag}] max relative errors:", {k: f"{v:.2e}" for k, v in self.items()})


@pytest.fixture(autouse=True)
def tiny_cpu_each_test():
    """Autouse in the modules that import it: every test runs under tiny_cpu()."""
    with tiny_cpu():
        yield


@contextlib.contextmanager
def tiny_cpu():
    """no_grad + one intra-op thread + torch.manual_seed(0) for the duration of a test (threads restored after).

    The models here are a few KB: threads buy nothing, and on a loaded 2-core runner OpenMP
    spin-waiting made each tiny matmul ~50x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(n)


def kernel_device() -> torch.device:
    """Where the Triton kernel tests run: the GPU, else the CPU under Triton's interpreter. Called at
    a test module's import: the module is skipped when the interpreter was not switched on before
    triton's import (tests/conftest.py does that on machines without a GPU)."""
    from ddtree.ops import triton_util

    dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not triton_util.interpreter_on():
        pytest.skip("TRITON_INTERPRET=1 was not set before triton's import (tests/conftest.py sets it without a GPU)",
                    allow_module_level=True)
    return dev


def tensors_in(x):
    """Every tensor inside nested lists, tuples and dict values."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors_in(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors_in(y)


# ----------------------------------------------------------------------------- comparisons
def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (in float64)."""
    got, ref = got.double(), ref.double()
    scale = ref.abs().max().clamp_min(1e-30)
    return float((got - ref).abs().max() / scale)


def assert_rel(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> float:
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    e = rel_err(got, ref)
    assert e < tol, f"{what}: max abs diff / max abs ref = {e:.3g} >= {tol:g}"
    return e


# ----------------------------------------------------------------------------- models
def tame_decay_(model, seed: int, lo: float = 0.05, hi: float = 1.0):
    """Redraw every GDN layer's A (decay rate, A = exp(A_log)) uniformly in [lo, hi].

    ddtree.model.synthetic.randomize_ draws A in [1, 16]: per-token decays down to e^-30, so the state is
    wiped every step and o_t ~ b_t (q_t . k_t) v_t is often ~1e-5 of its typical size; the gated
    RMSNorm after it (and the q/k l2norm on tiny dk) then amplify float32 rounding so much that two
    correct float32 implementations (ours and transformers') differ by up to ~2e-4 of the logit
    scale on a 4-layer tiny model (condition number ~1e3, measured). With A in [0.05, 1] the same
    comparison sits at ~1e-5, so a 1e-4 tolerance tests the math, not the rounding. Strong decay
    is covered by tests/test_gdn.py on the bare recurrence."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    for layer in model.layers:
        if layer.kind == "linear_attention":
            a = layer.linear_attn.A_log
            a.data.copy_(torch.empty(a.shape).uniform_(lo, hi, generator=gen).log().to(a.dtype))
    model.prepare()  # refresh the inference constants derived from the weights
    return model


def build_target(raw: dict, seed: int = 0, dtype=torch.float32, max_len: int = 512, tame: bool = True):
    """build_random_target (+ tame_decay_ for hybrids)."""
    torch.manual_seed(seed)
    model = build_random_target(raw, seed=seed, dtype=dtype, max_len=max_len)
    if tame and model.cfg.is_hybrid:
        tame_decay_(model, seed)
    return model


# ----------------------------------------------------------------------------- random trees
TREE_KINDS = ("chain", "star", "deep", "bushy", "random")


def random_parents(kind: str, n: int, rng: random.Random, max_depth: int | None = None) -> list[int]:
    """Parents of a random tree of n nodes (parents[0] = -1, parents[i] < i), depth <= max_depth.

    chain: a path; star: every node under the root; deep: a few long branches; bushy: wide and
    shallow; random: uniform earlier parent.
    """
    max_depth = n if max_depth is None else max_depth
    parents, depths = [-1], [0]
    for i in range(1, n):
        if kind == "chain":
            p = i - 1
        elif kind == "star":
            p = 0
        elif kind == "deep":  # mostly extend the newest node; branch off an earlier one now and then
            p = i - 1 if rng.random() < 0.8 else rng.randrange(i)
        elif kind == "bushy":  # prefer shallow parents
            shallow = [j for j in range(i) if depths[j] <= 2] or list(range(i))
            p = rng.choice(shallow)
        elif kind == "random":
            p = rng.randrange(i)
        else:
            raise ValueError(kind)
        if depths[p] + 1 > max_depth:  # respect the depth cap: pick among nodes that still may grow
            ok = [j for j in range(i) if depths[j] < max_depth]
            p = rng.choice(ok)
        parents.append(p)
        depths.append(depths[p] + 1)
    return parents


def make_tree(parents: list[int], tokens: torch.Tensor) -> Tree:
    par = torch.tensor(parents, dtype=torch.int64)
    depths = [0] * len(parents)
    for i, p in enumerate(parents):
        if p >= 0:
            depths[i] = depths[p] + 1
    return Tree(tokens=torch.as_tensor(tokens, dtype=torch.int64), parents=par,
                depths=torch.tensor(depths, dtype=torch.int64), ranks=torch.zeros(len(parents), dtype=torch.int64),
                ancestor_mask=ancestor_mask_from_parents(par))


def random_tree(kind: str, n: int, rng: random.Random, vocab: int, max_depth: int = 16) -> Tree:
    parents = random_parents(kind, n, rng, max_depth)
    tokens = torch.tensor([rng.randrange(vocab) for _ in range(n)], dtype=torch.int64)
    return make_tree(parents, tokens)


def leaves(tree: Tree) -> list[int]:
    par = set(tree.parents.tolist())
    return [i for i in range(tree.num_nodes) if i not in par]


# ----------------------------------------------------------------------------- engine driving
def verify_tree(model, tree: Tree, start: int, kv_extra: int = 0, logit_rows=None):
    """ONE target forward over the whole tree on top of committed length `start`."""
    return model.forward(
        tree.tokens, start + tree.depths, tree.ancestor_mask, tree.parents, torch.tensor(start),
        start + tree.num_nodes + kv_extra, logit_rows=logit_rows, want_taps=bool(model.tap_layers),
    )


def commit_path(model, path: list[int], start: int, pad_to: int | None = None):
    """target.commit(path_nodes padded to P with the last node, n_nodes, start)."""
    P = max(len(path), pad_to or 0)
    nodes = list(path) + [path[-1]] * (P - len(path))
    model.commit(torch.tensor(nodes, dtype=torch.int64), torch.tensor(len(path)), torch.tensor(start))


def decode_step(model, token: int, pos: int):
    """One autoregressive step = a one-node tree at `pos`, then commit it. Returns (logits [V], taps [1, .] or None)."""
    logits, taps = model.forward(
        torch.tensor([int(token)]), torch.tensor([pos]), torch.ones(1, 1, dtype=torch.bool),
        torch.tensor([-1]), torch.tensor(pos), pos + 1, want_taps=bool(model.tap_layers),
    )
    model.commit(torch.tensor([0]), torch.tensor(1), torch.tensor(pos))
    return logits[0], taps


def state_tensors(model, upto: int) -> dict[str, torch.Tensor]:
    """Everything a committed prefix of length `upto` lives in: GDN conv/rec state, K/V slots < upto."""
    out = {}
    for i, layer in enumerate(model.layers):
        if layer.kind == "linear_attention":
            out[f"{i}.conv_state"] = layer.linear_attn.conv_state
            out[f"{i}.rec_state"] = layer.linear_attn.rec_state
        else:
            out[f"{i}.k"] = layer.self_attn.k_cache[:upto]
            out[f"{i}.v"] = layer.self_attn.v_cache[:upto]
    return out


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state_tensors(model, model.max_len).items()}


def restore(model, snap: dict[str, torch.Tensor]):
    for k, v in state_tensors(model, model.max_len).items():
        v.copy_(snap[k])


def compare_states(a, b, upto: int, tol: float) -> float:
    """Relative max error over all committed state of two models (each tensor against its own scale)."""
    sa, sb = state_tensors(a, upto), state_tensors(b, upto)
    worst = 0.0
    for k in sa:
        worst = max(worst, assert_rel(sa[k].float(), sb[k].float(), tol, f"state {k}"))
    return worst


AUTO_CYCLE = [15, 4, 63, 8, 31, 63, 4]  # --budget auto forced to switch every round, both directions


def forced_chooser(cycle: list[int] = AUTO_CYCLE, probe_every: int | None = None):
    """A BudgetChooser class whose pick_eq returns the budgets of `cycle` in turn (0: a plain step,
    CHAIN the chain arm: pipeline rounds only),
    so a test sees every switch, and whose build_for stages each round the tree the next choice
    truncates (the cycle's next tree budget: the staged trees change size every round too). With
    probe_every, plain runs are probed at that fixed interval. Set it as `decoder.chooser_class`."""
    from ddtree.decode.budget import CHAIN, BudgetChooser

    class Forced(BudgetChooser):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.calls = -1
            if probe_every is not None:
                self.probe_every = probe_every

        def pick_eq(self, eq):
            self.calls += 1
            b = cycle[self.calls % len(cycle)]
            assert not b or b in eq, f"forced {b}, not among the arms at hand {sorted(eq)}"
            staged_chain = set(eq) == {CHAIN}  # (Auto offers a staged chain alone)
            assert not b or (b == CHAIN) == staged_chain, f"forced {b} with {'a chain' if staged_chain else 'a tree'} staged"
            return (b, eq.get(b, 0.0)) if b else (0, 0.0)

        def build_for(self, b, r):
            i = self.calls % len(cycle)
            return next(x for x in cycle[i + 1:] + cycle if x)  # the next tree budget after this one

        def probe_answered(self, b):
            if probe_every is None:
                super().probe_answered(b)

        def wants_tree(self, eq):  # plain runs end only where the cycle or the probe interval says
            return False

    return Forced


def draft_from_logits(logits_fn):
    """A drafter's `draft_topk` whose logits come from logits_fn(bonus, kv_len) -> [B-1, V] (the
    tests' oracle drafters): set it on the drafter instance; the decoder drafts only through
    draft_topk, and this is its unfused path with other logits."""
    from ddtree.model.drafter import topk_logprobs

    return lambda bonus, kv_len, k, temperature=None: topk_logprobs(logits_fn(bonus, kv_len), k, temperature)


def tokenizer_checkpoint(fixture_dir, tmp_path, **cfg_extra):
    """A writable copy of the fixture target's tokenizer files (tmp_path/target), with cfg_extra
    set in its tokenizer_config.json."""
    import json
    import shutil

    d = tmp_path / "target"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fixture_dir / "target" / f, d / f)
        (d / f).chmod(0o644)  # copied read-only from the fixture
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, **cfg_extra)))
    return d


class Oracle:
    """Drafts (drafter.draft_topk) from logits that rank the true continuation first at most
    depths; at some depths a decoy takes rank 0 and the truth rank 1 (a chain stops there, a
    tree continues through the sibling); past `horizon` the truth is absent (drafts are noise)."""

    def __init__(self, dec, full: list[int], slip_every: int = 5, horizon: int | None = None):
        self.d, self.full, self.slip, self.horizon = dec.drafter, full, slip_every, horizon
        self.bad_bonus = 0
        self.calls = 0
        self.d.draft_topk = draft_from_logits(self)

    def __call__(self, bonus, kv_len):
        d = self.d
        B, V = d.cfg.block_size, d.cfg.vocab_size
        p = int(d.ctx_len)  # position of the bonus token
        self.calls += 1
        if p < len(self.full) and int(bonus) != self.full[p]:
            self.bad_bonus += 1
        g = torch.Generator().manual_seed(p)
        logits = torch.randn(B - 1, V, generator=g)
        for j in range(1, B):
            pos = p + j
            if pos >= len(self.full) or (self.horizon is not None and j > self.horizon):
                continue
            t = self.full[pos]
            top = logits[j - 1].max().item()
            if self.slip and (pos % self.slip == 0):
                decoy = (t + 1 + pos) % V
                decoy = decoy if decoy != t else (t + 1) % V
                logits[j - 1, decoy] = top + 4.0
                logits[j - 1, t] = top + 3.0
            else:
                logits[j - 1, t] = top + 4.0
        return logits.to(d.device)

    def restore(self):
        del self.d.draft_topk  # the class's own again


VOCAB = 258  # 256 bytes + two special tokens, neither an end-of-text (even: --tp 2 splits it)


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer (no merges) of VOCAB ids, built by the tokenizers library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|s0|>": 0, "<|s1|>": 1, **{c: i + 2 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|s0|>", "<|s1|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"backend": "tokenizers", "tokenizer_class": "TokenizersBackend"}))


def write_random_pair(root: Path, raw: dict) -> tuple[Path, Path]:
    """A random target of config `raw` (vocab VOCAB) and a 1-layer DFlash drafter for it, written
    as released checkpoints (the target with write_tokenizer's tokenizer) -> (target dir, drafter dir)."""
    from ddtree.model.checkpoint import save_checkpoint
    from ddtree.model.synthetic import build_random_drafter, tiny_drafter_config

    tdir, ddir = root / "target", root / "drafter"
    target = build_random_target(raw, seed=3, max_len=64)
    draft_raw = tiny_drafter_config(raw)
    drafter = build_random_drafter(draft_raw, target, seed=4, max_len=64)
    save_checkpoint(target.state_dict(), raw, tdir)
    write_tokenizer(tdir)
    save_checkpoint(drafter.state_dict(), draft_raw, ddir, layout="drafter")
    return tdir, ddir


def random_chooser(seed: int):
    """A BudgetChooser class that chooses at random wherever auto chooses: a plain step or the arm
    at hand, whether a plain step drafts, what a drafting step stages (seeded: `seed`). Set it as
    `decoder.chooser_class`."""
    import random

    from ddtree.decode.budget import CHAIN, BudgetChooser

    rng = random.Random(seed)

    class Random(BudgetChooser):
        def pick_eq(self, eq):
            b = rng.choice([0, *eq])
            return (b, eq.get(b, 0.0)) if b else (0, 0.0)

        def build_for(self, b, r):
            arms = [a for a in (CHAIN, *self.verify_ms) if self.drafts(a)]
            self.last_build = rng.choice(arms)
            return self.last_build

        def wants_tree(self, eq):
            return rng.random() < 0.3

    return Random
