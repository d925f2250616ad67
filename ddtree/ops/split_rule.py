"""How many ranges tree_attention splits the prefix into (flash-decoding), from host ints alone.
Torch-free: the memory plan (ddtree.model.memory) sizes the kernel's workspace by this rule."""

from __future__ import annotations

MIN_SPLIT_KEYS = 256  # a split reads at least this many keys (and 4 per query row: see num_splits)
MAX_SPLITS = 128


def num_splits(read_len: int, rows: int, kv_heads: int, bm: int, sms: int, per_sm: int = 1) -> int:
    """How many ranges the prefix is split into (0: one program per (m-tile, KV head) does the
    prefix and the tree and writes o itself). read_len: a host bound on the prefix keys read
    (kv_len, or the window). As many programs as fit one wave (m-tiles x KV heads x splits <=
    SM count x per_sm, the programs resident per SM): a wave more for a few programs costs a
    whole split's time. No split shorter than MIN_SPLIT_KEYS keys nor than 4 keys per query
    row: a split's partials (rows x D fp32, written and read back) stay a small fraction of the
    K/V it reads (keys x D x 2 x 2 bytes)."""
    units = -(-rows // bm) * kv_heads
    want = sms * per_sm // units
    most = read_len // max(MIN_SPLIT_KEYS, 4 * rows)
    ns = min(want, most, MAX_SPLITS)
    return ns if ns >= 2 else 0
