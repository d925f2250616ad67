"""Gated DeltaNet math for chains and trees (fp32 state), with reference twins.

Per value head, state S is [dk, dv] (fp32). Chain step (transformers / fla convention):
    S_t = a_t S_{t-1} + b_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   o_t = S_t^T q_t,   a_t = exp(g_t)
In a tree, node n starts from its parent's state; the root's parent state is the committed S0.

Fast path: `tree_wy` (one masked chunk; no per-node states). With c_n = sum of g over path(n):
    M[n, j] = b_n exp(c_n - c_j) (k_n . k_j)   for j a strict ancestor of n
    (I + M) U = b * (v - exp(c) S0^T k)
    o_n = exp(c_n) S0^T q_n + sum_{j in path(n)} exp(c_n - c_j) (q_n . k_j) U_j
    S_a = exp(c_a) S0 + sum_{j in path(a)} exp(c_a - c_j) k_j U_j^T          (commit)
A chain is the tree whose path mask is lower-triangular, so prefill uses the same code in chunks.

References: `chain_recurrent` (token by token) and `tree_parent_reload` (node by node, loading
the parent's saved state). Tests compare the fast path with both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same form as transformers / fla: x * rsqrt(sum(x^2) + eps).
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2norm_qk(qk: torch.Tensor, dk: int, eps: float = 1e-6) -> torch.Tensor:
    """q and k together: qk [T, 2, H, dk] -> fp32, each head l2-normalised, q also scaled by dk^-0.5.

    Fewer kernels than two l2norm calls: rms_norm with eps/dk is sqrt(dk) * l2norm exactly
    (mean(x^2) + eps/dk = (sum(x^2) + eps) / dk), so one fused norm and one scale do both."""
    key = (qk.device, dk)
    scale = _QK_SCALE.get(key)
    if scale is None:  # made once, outside any CUDA-graph capture (the warm-up run comes first)
        scale = _QK_SCALE[key] = torch.tensor([1.0 / dk, dk**-0.5], device=qk.device).view(1, 2, 1, 1)
    return F.rms_norm(qk.float(), (dk,), eps=eps / dk) * scale  # q: l2 * dk^-0.5; k: l2


_QK_SCALE: dict = {}


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, neg_A=None):
    """a, b: [T, H] projections -> g (log decay, <= 0) and beta, both fp32 [T, H].

    neg_A = -exp(A_log) in fp32 may be passed precomputed (a per-layer constant)."""
    neg_A = -A_log.float().exp() if neg_A is None else neg_A
    g = neg_A * F.softplus(a.float() + dt_bias.float())
    return g, b.float().sigmoid()


# ----------------------------------------------------------------------------- tree-WY (fast)
def tree_wy(q, k, v, g, beta, S0, path_mask, out=None):
    """Exact GDN outputs for every node of a tree in one masked chunk.

    q, k: [T, H, dk] (l2-normalised; q already scaled), v: [T, H, dv], g, beta: [T, H] fp32,
    S0: [H, dk, dv] fp32, path_mask: [T, T] bool, path_mask[n, j] = j on path(n) (diagonal True).
    Returns o [T, H, dv] fp32 and the pieces a commit needs: (k [H,T,dk], U [H,T,dv], c [H,T]),
    written into `out` = (k, U, c) buffers when given (the engine's stacked commit scratch).
    """
    T = q.shape[0]
    kb, Ub, cb = out if out is not None else (None, None, None)
    q, v = (x.float().transpose(0, 1) for x in (q, v))  # [H, T, d]
    k = kb.copy_(k.transpose(0, 1)) if kb is not None else k.float().transpose(0, 1)
    g, beta = g.float().t(), beta.float().t()  # [H, T]
    # q and k against the state in one batched GEMM: S0 (3 MB per layer, fp32) is read once.
    qS, kS = (torch.cat([q, k], 1) @ S0).split(T, 1)  # [H, T, dv] each
    if T == 1:  # one node (autoregressive step): no masks, no solve
        c = cb.copy_(g) if cb is not None else g
        ec = c.exp()[:, :, None]  # [H, 1, 1]
        U = beta[:, :, None] * (v - ec * kS)  # [H, 1, dv]
        if Ub is not None:
            U = Ub.copy_(U)
        o = ec * qS + (q * k).sum(-1, keepdim=True) * U
        return o.transpose(0, 1), (k, U, c)
    # Results are copied into the scratch views (not written through out=): the views are strided,
    # and dynamo cannot trace out= into a non-contiguous tensor (it would break the compiled layer).
    c = g @ path_mask.to(torch.float32).t()  # [H, T]: c[h, n] = sum_{j in path(n)} g[h, j]
    if cb is not None:
        cb.copy_(c)
    diff = c[:, :, None] - c[:, None, :]  # [H, T, T]: c_n - c_j
    # Mask before exp: off-path entries can be large and positive.
    decay = torch.where(path_mask, diff, float("-inf")).exp()
    # The solve reads only the strict lower triangle (unit diagonal assumed): no diagonal mask needed.
    M = (beta[:, :, None] * decay) * (k @ k.transpose(1, 2))  # [H, T, T]
    ec = c.exp()[:, :, None]  # [H, T, 1]
    B = beta[:, :, None] * (v - ec * kS)  # [H, T, dv]
    U = torch.linalg.solve_triangular(M, B, upper=False, unitriangular=True)  # [H, T, dv]
    if Ub is not None:
        Ub.copy_(U)
    o = ec * qS + (decay * (q @ k.transpose(1, 2))) @ U  # [H, T, dv]
    return o.transpose(0, 1), (k, U, c)


def commit_states_(S0, k, U, c, node, path_mask):
    """In place, batched over layers: S0 [L, H, dk, dv] becomes the state after tree node `node`.
    k [L, H, T, dk]; U [L, H, T, dv]; c [L, H, T] (views of the scratch tree_wy wrote).

    Same math as commit_state; the state is the big tensor here (151 MB for Qwen3.6-27B), so it is
    read and written twice (scale, then a beta=1 batched GEMM accumulating into it), not ~5 times."""
    L, H, dk, dv = S0.shape
    T = k.shape[2]
    row = path_mask.index_select(0, node.view(1))  # [1, T]
    c_a = c.index_select(-1, node.view(1))  # [L, H, 1]
    w = torch.where(row, c_a - c, float("-inf")).exp()  # [L, H, T]
    S = S0.view(L * H, dk, dv)
    S.mul_(c_a.exp().view(L * H, 1, 1))
    S.baddbmm_((k * w[..., None]).reshape(L * H, T, dk).transpose(1, 2), U.reshape(L * H, T, dv))
    return S0


def commit_state(S0, k, U, c, node, path_mask):
    """State after tree node `node` (0-dim long tensor, may live on the device; no host sync).

    One layer, written out separately from commit_states on purpose: it is the reference the
    stacked commit is tested against (via TargetModel.commit_reference) and the fla self-check's.
    S0: [H, dk, dv]; k: [H, T, dk]; U: [H, T, dv]; c: [H, T]; path_mask: [T, T] bool.
    """
    row = path_mask.index_select(0, node.view(1))[0]  # [T] path(node)
    c_a = c.index_select(1, node.view(1))  # [H, 1]
    w = torch.where(row[None, :], (c_a - c), torch.full_like(c, float("-inf"))).exp()  # [H, T]
    return c_a.exp()[:, :, None] * S0 + (k * w[:, :, None]).transpose(1, 2) @ U


# ----------------------------------------------------------------------------- references
def chain_recurrent(q, k, v, g, beta, S0):
    """Token-by-token reference. Shapes as tree_wy; returns o [T, H, dv] fp32 and the final state."""
    S = S0.float().clone()
    outs = []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        kt, vt = k[t].float(), v[t].float()
        kv = torch.einsum("hk,hkv->hv", kt, S)
        delta = (vt - kv) * beta[t][:, None]
        S = S + kt[:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t].float(), S))
    return torch.stack(outs), S


def tree_parent_reload(q, k, v, g, beta, S0, parents):
    """Node-by-node reference: load the parent's saved state, do one chain step, save."""
    states, outs = [], []
    for n in range(q.shape[0]):
        p = int(parents[n])
        S_par = S0.float() if p < 0 else states[p]
        o, S = chain_recurrent(q[n : n + 1], k[n : n + 1], v[n : n + 1], g[n : n + 1], beta[n : n + 1], S_par)
        states.append(S)
        outs.append(o[0])
    return torch.stack(outs), states


# ----------------------------------------------------------------------------- short convolution
def conv_window_index(parents: torch.Tensor, width: int) -> torch.Tensor:
    """Rows of ext = [conv_state (width-1 rows, oldest first); node inputs (T rows)] feeding each node.

    parents: [T] long (-1 for nodes whose parent is the committed prefix). Returns [T, width] long,
    oldest first, last column = the node itself. Works on the device without host syncs.
    """
    hist = width - 1
    T = parents.shape[0]
    dev = parents.device
    # virtual parent of every ext row: node n -> its parent's row (or the newest state row);
    # state row r -> r - 1 (row 0 points at itself; it is never read past the window).
    node_vp = torch.where(parents >= 0, parents + hist, torch.full_like(parents, hist - 1))
    state_vp = (torch.arange(hist, device=dev) - 1).clamp(min=0)
    vp = torch.cat([state_vp, node_vp])  # [hist + T]
    cols = [torch.arange(T, device=dev) + hist]
    for _ in range(hist):
        cols.append(vp[cols[-1]])
    return torch.stack(cols[::-1], dim=1)


def tree_conv(ext: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv along tree paths, then SiLU.

    ext: [hist + T, C]; window: [T, width] rows of ext; weight: [C, width] (or, precomputed, the
    fp32 [width, C] transpose). Returns [T, C] (ext dtype).
    """
    x = ext[window].float()  # [T, width, C]
    w = weight if weight.dtype == torch.float32 and weight.shape[0] == window.shape[1] else weight.t().float()
    return F.silu((x * w[None]).sum(1)).to(ext.dtype)


def conv_reference(ext: torch.Tensor, parents: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-path twin of tree_conv: walk each node's ancestors explicitly."""
    hist = weight.shape[1] - 1
    T = parents.shape[0]
    out = []
    for n in range(T):
        rows, cur, state_row = [], n, hist - 1
        for _ in range(hist + 1):
            if cur >= 0:
                rows.append(ext[hist + cur])
                cur = int(parents[cur])
            else:
                rows.append(ext[state_row])
                state_row -= 1
        x = torch.stack(rows[::-1]).float()  # [width, C]
        out.append(F.silu((x * weight.t().float()).sum(0)))
    return torch.stack(out).to(ext.dtype)


def chain_chunked(q, k, v, g, beta, S0, chunk: int = 64):
    """A chain in chunks of `chunk` tokens: tree_wy over each chunk's lower-triangular mask, the
    state carried from chunk to chunk (fla's chunk algorithm in torch ops; memory O(H chunk^2),
    not O(H T^2)). Shapes as tree_wy. -> (o [T, H, dv] fp32, final [H, dk, dv] fp32)."""
    T = q.shape[0]
    tril = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    outs, S = [], S0.float()
    for a in range(0, T, chunk):
        b = min(a + chunk, T)
        o, S = _chain_wy(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], S, tril[: b - a, : b - a])
        outs.append(o)
    return torch.cat(outs), S


def _chain_wy(q, k, v, g, beta, S0, path_mask):
    """tree_wy over a chain's lower-triangular path_mask, and the state after its last node."""
    T = q.shape[0]
    o, (kk, U, c) = tree_wy(q, k, v, g, beta, S0, path_mask)
    return o, commit_state(S0, kk, U, c, torch.full((), T - 1, dtype=torch.long, device=q.device), path_mask)
