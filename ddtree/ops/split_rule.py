"""How tree_attention divides the prefix, from host ints alone: the split-KV ranges of its Triton
kernel (flash-decoding), and the part a fused library kernel takes ahead of them. Torch-free: the
memory plan (ddtree.model.memory) sizes the workspaces by these rules."""

from __future__ import annotations

# A split's range covers at least MIN_SPLIT_KEYS keys of the bound it is sized from (the caller's
# kv_len: a power of two at most twice the keys read, so >= 256 keys are read) and one key per
# query row. At a 1K context (kv_len 2048) that is 4 ranges for every tree of 16 to 65 nodes,
# measured best there (082b8a3:results/verify-paths-h200.json: a 64-node verify's attention 0.029 ms a
# layer with 4 ranges against 0.051 ms unsplit; 4 keys a row, the rule before, left it unsplit).
MIN_SPLIT_KEYS = 512
MAX_SPLITS = 128


def num_splits(read_len: int, rows: int, kv_heads: int, bm: int, sms: int, per_sm: int = 1) -> int:
    """How many ranges the prefix is split into (0: one program per (m-tile, KV head) does the
    prefix and the tree and writes o itself). read_len: a host bound on the prefix keys read
    (kv_len, or the window). As many programs as fit one wave (m-tiles x KV heads x splits <=
    SM count x per_sm, the programs resident per SM): a wave more for a few programs costs a
    whole split's time. No split shorter than MIN_SPLIT_KEYS keys of the bound nor than one key
    per query row (a split's partials, rows x D fp32, written and read back)."""
    units = -(-rows // bm) * kv_heads
    want = sms * per_sm // units
    most = read_len // max(MIN_SPLIT_KEYS, rows)
    ns = min(want, most, MAX_SPLITS)
    return ns if ns >= 2 else 0


# The fused prefix (cuDNN's attention, ddtree.ops.attention): the committed prefix [0, B) as S
# equal ranges of C keys run as one batched call, each KV head's T * G query rows one query block.
# cuDNN's rows come in tiles of FUSED_TILE_ROWS; S fills one wave of programs (S x KV heads x row
# tiles <= SMs), measured best (082b8a3:results/verify-paths-h200.json, 128K: 17 nodes S = 32 0.131 ms
# against S = 16 0.183; 33 nodes S = 16 0.226 against S = 32 0.243).
FUSED_TILE_ROWS = 128
# Query rows per KV head (T * G) below which the split-KV kernel reads the whole prefix. An AR
# step (6 rows) gains nothing: at 128K cuDNN's batched call alone takes its prefix in 0.128 ms a
# layer (`git show 7b04cc0:results/verify-paths-ar-h200.json`), but with the remainder's kernel
# and the merge the whole call takes 0.162 against 0.141 for the split-KV kernel merging in its
# last split (082b8a3:results/verify-merge-h200.json).
FUSED_MIN_ROWS = 64
FUSED_MIN_KEYS = 16384  # a fused prefix shorter than this is left to the split-KV kernel
FUSED_MIN_RANGE = 1024  # keys per range at least
FUSED_ALIGN = 64  # range length multiple


def fused_prefix_plan(floor: int, rows: int, kv_heads: int, sms: int) -> tuple[int, int]:
    """(S, C): the fused prefix is [0, S * C), S ranges of C keys, for a call whose committed length
    is at least `floor` (host int the caller guarantees); (0, 0) when it would be shorter than
    FUSED_MIN_KEYS. The split-KV kernel reads the rest, [S * C, start), and the tree."""
    if floor < FUSED_MIN_KEYS:
        return 0, 0
    S = max(1, sms // (kv_heads * -(-rows // FUSED_TILE_ROWS)))
    S = min(S, floor // FUSED_MIN_RANGE)
    C = floor // S // FUSED_ALIGN * FUSED_ALIGN
    return S, C
