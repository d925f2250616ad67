"""Our compact target model: the Qwen3.5/3.6 Gated-DeltaNet hybrid text stack and dense Qwen3.

Two kinds of forward:
  * `forward`: T new tokens arranged as a tree over the committed prefix (a decode step is a tree
    of one node; a verify is the DDTree tree, node 0 = the bonus token). Attention layers see the
    prefix plus the node's ancestors; GDN layers run the tree convolution and the tree-WY
    recurrence (ddtree.ops.gdn). `commit` then keeps one root-to-node path: K/V moved to
    contiguous slots, GDN conv and recurrent states set to the path's last node. Everything that
    depends on what was accepted stays on the device, so a round needs no host sync here.
  * `prefill`: the prompt as a chain in large chunks, committed as it goes: causal attention
    through flash-class kernels (ddtree.ops.attention.prefill_attention: cuDNN, else SDPA's
    FlashAttention-2) and the GDN chain recurrence through fla's chunk kernel (or its torch
    twin), with no tree scratch or masks; the rest of each layer compiled (`prefill_layer`).

State lives in buffers allocated once (`allocate_state`), stacked per stage so that a commit is
a handful of kernels: K/V [attention layers, max_len, kv_heads, head_dim]; GDN conv states
[GDN layers, width-1, conv_dim] and fp32 recurrent states [GDN layers, v_heads, dk, dv] (each
layer holds views). A split target is a list of stages (ddtree.model.stages: contiguous layers,
each on a device, two may share one); every piece calls `enter` at each stage boundary, which
moves the tensors it hands over (eagerly) or ends a graph segment (ddtree.decode.graphs).
Parameter names mirror the HF checkpoints (after the prefix) so loading is a rename.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddtree.ops import commit as commit_kernels
from ddtree.ops import attention, fla, gated_norm, gdn, gdn_step, gdn_tree
from ddtree.ops.eager import eager, eager_name
from ddtree.ops.dispatch import REFERENCE, Kernels, apply_blas, resolve
from ddtree.model.config import TargetConfig
from ddtree.model.stages import Stage, StageHook, stages_of
from ddtree.options import Options
from ddtree.model.layers import MLP, RMSNorm, GatedRMSNorm, _identity, apply_rope, compiled, fused, residual


@dataclass
class Step:
    """Per-forward inputs shared by all layers (one copy per stage).

    positions [T]; path_mask [T, T] bool; window [T, width] conv rows; attn_mask [T, kv_len] bool
    (the SDPA twin only; None when the attention kernel serves the device); cos/sin [T, rd];
    start: 0-dim long (committed length); kv_len: host int >= start + T; floor: host int <= start
    that the caller guarantees (0: none): the attention's fused prefix reads [0, B <= floor)
    (ddtree.ops.attention.tree_attention), where the device's kernels take it.
    """

    positions: torch.Tensor
    path_mask: torch.Tensor
    window: torch.Tensor
    attn_mask: torch.Tensor | None
    cos: torch.Tensor
    sin: torch.Tensor
    start: torch.Tensor
    kv_len: int
    kernels: Kernels = REFERENCE  # the fast paths this stage's device takes (ddtree.ops.dispatch)
    floor: int = 0


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.h, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.gated = cfg.attn_output_gate
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.hd * (2 if self.gated else 1), bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kvh * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_eps, cfg.norm_plus_one)
        self.k_norm = RMSNorm(self.hd, cfg.rms_eps, cfg.norm_plus_one)
        self.k_cache: torch.Tensor | None = None  # [max_len, kvh, hd], a view of the stage's stack
        self.v_cache: torch.Tensor | None = None

    def _qkv(self, x: torch.Tensor, cos, sin):
        """-> q [T, h, hd] (normed, roped), the output gate [T, h*hd] | None, k, v [T, kvh, hd]."""
        T = x.shape[0]
        qkv = F.linear(x, fused(self, "_wqkv", self.q_proj, self.k_proj, self.v_proj))
        q, k, v = qkv.split([self.q_proj.weight.shape[0], self.kvh * self.hd, self.kvh * self.hd], dim=-1)
        if self.gated:  # per head: [query | gate]
            q, gate = q.view(T, self.h, 2 * self.hd).chunk(2, dim=-1)
            gate = gate.reshape(T, -1)
        else:
            q, gate = q.view(T, self.h, self.hd), None
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k.reshape(T, self.kvh, self.hd)), cos, sin)
        return q, gate, k, v.reshape(T, self.kvh, self.hd)

    def forward(self, x: torch.Tensor, s: Step) -> torch.Tensor:
        T = x.shape[0]
        q, gate, k, v = self._qkv(x, s.cos, s.sin)
        slots = s.start + torch.arange(T, device=x.device)
        self.k_cache.index_copy_(0, slots, k)
        self.v_cache.index_copy_(0, slots, v)
        if s.attn_mask is None:  # the split-KV kernel: each K/V row read once for every node and query head
            o = tree_attention(q, self.k_cache, self.v_cache, s.start, s.path_mask, s.kv_len, floor=s.floor).reshape(T, -1)
        else:  # the twin: SDPA with the dense [T, kv_len] mask
            S = s.attn_mask.shape[-1]  # = s.kv_len, read from a shape so that compiled code keeps it symbolic
            kk = self.k_cache[:S].transpose(0, 1)[None]  # [1, kvh, S, hd]
            vv = self.v_cache[:S].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], kk, vv, attn_mask=s.attn_mask[None, None], enable_gqa=self.h != self.kvh
            )  # [1, h, T, hd]
            o = o[0].transpose(0, 1).reshape(T, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def prefill(self, x: torch.Tensor, c: "Chunk") -> torch.Tensor:
        """A prefill chunk x [T, hidden] at host offset c.start: its K/V into the cache, causal
        attention over the prefix and itself through flash-class kernels (no mask tensor)."""
        T = x.shape[0]
        q, gate, k, v = self._qkv(x, c.cos, c.sin)
        o = cache_and_attend(self, q, k, v, c).reshape(T, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def commit(self, path_nodes: torch.Tensor, start: torch.Tensor):
        """Move the K/V of path_nodes [P] (tree indices) to slots start..start+P-1.

        Per-layer reference twin of the stacked commit in TargetModel.commit."""
        src = start + path_nodes
        dst = start + torch.arange(path_nodes.shape[0], device=path_nodes.device)
        self.k_cache.index_copy_(0, dst, self.k_cache.index_select(0, src))
        self.v_cache.index_copy_(0, dst, self.v_cache.index_select(0, src))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.hk, self.hv = cfg.gdn_num_k_heads, cfg.gdn_num_v_heads
        self.dk, self.dv = cfg.gdn_k_dim, cfg.gdn_v_dim
        self.width = cfg.conv_kernel
        self.conv_dim = cfg.gdn_conv_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.width, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, cfg.hidden_size, bias=False)
        self.conv_state: torch.Tensor | None = None  # [width-1, conv_dim], oldest first (view of group.conv)
        self.rec_state: torch.Tensor | None = None  # [hv, dk, dv] fp32 (view of group.state)
        self.group: GDNGroup | None = None  # stacked state + commit scratch of this stage's GDN layers
        self.wy_bufs = self.ext_buf = None  # this layer's views of the group's scratch

    def _consts(self):
        """Per-layer constants computed once: conv weight as fp32 [width, C], -exp(A_log) fp32, and
        the conv weight [width, C] in the model dtype (the tree prologues' loads: as the conv
        inputs' dtype, both take one register layout, so no conversion between them)."""
        c = self.__dict__.get("_c")
        if c is None or c[0].device != self.A_log.device:
            w = self.conv1d.weight[:, 0, :].t().contiguous()
            c = self.__dict__["_c"] = (w.float(), -self.A_log.float().exp(), w)
        return c

    def in_proj(self, x: torch.Tensor) -> torch.Tensor:
        """The fused input projection: [T, hidden] -> [T, C + hv*dv + 2 hv] (qkv | z | b | a)."""
        return F.linear(x, fused(self, "_win", self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))

    def project(self, x: torch.Tensor):
        """-> (the input projection [T, N], ext [width-1+T, C]: the conv state rows, then the new qkv
        rows, in the layer's scratch, where the convolution and the commit read them)."""
        proj = self.in_proj(x)
        ext = torch.cat([self.conv_state, proj[:, : self.conv_dim]], out=self.ext_buf[: self.width - 1 + x.shape[0]])
        return proj, ext

    def qkvgb(self, x: torch.Tensor, s: Step):
        """Projections + tree convolution -> q, k (normalised, per value head), v, g, beta, z, ext."""
        T = x.shape[0]
        proj, ext = self.project(x)
        _, z, b, a = proj.split([self.conv_dim, self.hv * self.dv, self.hv, self.hv], dim=-1)
        mixed = gdn.tree_conv(ext, s.window, self._consts()[0])  # [T, C]
        kd = self.hk * self.dk
        qk, v = mixed.split([2 * kd, self.hv * self.dv], dim=-1)  # q and k are adjacent channels
        qk = gdn.l2norm_qk(qk.view(T, 2, self.hk, self.dk), self.dk)  # [T, 2, hk, dk] fp32
        qk = qk.repeat_interleave(self.hv // self.hk, dim=2)  # k head j serves v heads j*rep..
        q, k = qk[:, 0], qk[:, 1]  # [T, hv, dk]
        v = v.view(T, self.hv, self.dv)
        g, beta = gdn.gdn_gates(a, b, self.A_log, self.dt_bias, neg_A=self._consts()[1])
        z = z.reshape(T, self.hv, self.dv)
        return q, k, v, g, beta, z, ext

    def forward(self, x: torch.Tensor, s: Step) -> torch.Tensor:
        # No Python side effects and no per-layer ints here: the same compiled code serves every
        # GDN layer (ddtree.model.target.compiled_layer). What a commit needs is in the group's scratch.
        T, kn = x.shape[0], s.kernels
        if T == 1 and kn.triton:  # decode step: one fused kernel
            return self.out_proj(gdn_step.gdn_step(self, self.in_proj(x).view(-1)).view(1, -1))
        if kn.prologue(T, self.dk):
            return self._tree_fused(x, s)  # the mixer between the projections in Triton kernels + the norm
        q, k, v, g, beta, z, ext = self.qkvgb(x, s)
        kb, ub, cb = self.wy_bufs
        scratch = (kb[:, :T], ub[:, :T], cb[:, :T])
        if kn.tree(T, self.dk):  # one kernel per layer (small trees; ddtree.ops.dispatch)
            o = gdn_tree.gdn_tree(q, k, v, g, beta, self.rec_state, s.path_mask, scratch, kn.tree_precision)
        elif kn.blocked(T, self.dk):  # larger trees: by blocks, in two passes
            o = gdn_tree.gdn_tree_blocked(q, k, v, g, beta, self.rec_state, s.path_mask, scratch, kn.tree_precision)
        else:
            o, _ = gdn.tree_wy(q, k, v, g, beta, self.rec_state, s.path_mask, out=scratch)
        o = self.norm(o.to(x.dtype), z)  # [T, hv, dv]
        return self.out_proj(o.reshape(T, -1))

    def _tree_fused(self, x: torch.Tensor, s: Step) -> torch.Tensor:
        """A tree's verify with the mixer in Triton kernels (twin: the qkvgb path of forward):
        tree_mixer between the projections."""
        T = x.shape[0]
        proj, ext = self.project(x)
        kb, ub, cb = self.wy_bufs
        o = tree_mixer(self, proj, ext, s.window, s.path_mask, (kb[:, :T], ub[:, :T], cb[:, :T]), s.kernels)
        return self.out_proj(o)

    def prefill(self, x: torch.Tensor, c: "Chunk") -> torch.Tensor:
        """A prefill chunk x [T, hidden], committed as it goes: the causal conv over [conv_state;
        the chunk's inputs], the chain recurrence (fla's chunk kernel when usable, else
        gdn.chain_chunked), and the new conv and recurrent states. No tree scratch is touched, so
        a chunk can be thousands of tokens."""
        T = x.shape[0]
        proj = self.in_proj(x)
        qkv, z, b, a = proj.split([self.conv_dim, self.hv * self.dv, self.hv, self.hv], dim=-1)
        xc = torch.cat([self.conv_state, qkv])  # [hist + T, C]
        w = self._consts()[0]  # [width, C] fp32
        acc = w[0] * xc[:T].float()
        for j in range(1, self.width):  # row t's window is xc[t .. t + width - 1] (oldest first)
            acc += w[j] * xc[j : j + T].float()
        mixed = F.silu(acc).to(x.dtype)  # as gdn.tree_conv rounds
        self.conv_state.copy_(xc[T:])  # the newest width - 1 inputs
        kd = self.hk * self.dk
        qk, v = mixed.split([2 * kd, self.hv * self.dv], dim=-1)
        qk = gdn.l2norm_qk(qk.view(T, 2, self.hk, self.dk), self.dk).repeat_interleave(self.hv // self.hk, dim=2)
        g, beta = gdn.gdn_gates(a, b, self.A_log, self.dt_bias, neg_A=self._consts()[1])
        o, final = chain_final(qk[:, 0], qk[:, 1], v.view(T, self.hv, self.dv), g, beta, self.rec_state,
                                   use_fla=c.kernels.fla)
        self.rec_state.copy_(final)
        o = self.norm(o.to(x.dtype), z.reshape(T, self.hv, self.dv))
        return self.out_proj(o.reshape(T, -1))

    def commit(self, last: torch.Tensor):
        """Set conv and recurrent state to those after tree node `last` (0-dim device tensor).

        Per-layer reference twin of GDNGroup.commit (which does all layers of a stage at once)."""
        T, window, path_mask = self.group.step
        ext = self.ext_buf[: self.width - 1 + T]
        rows = window.index_select(0, last.view(1))[0, 1:]  # the last width-1 inputs on its path
        self.conv_state.copy_(ext.index_select(0, rows))
        kb, ub, cb = (b[:, :T] for b in self.wy_bufs)
        self.rec_state.copy_(gdn.commit_state(self.rec_state, kb, ub, cb, last, path_mask))


class GDNGroup:
    """The GDN layers of one stage: their states stacked, so a commit is one set of kernels
    for all of them (not ~a dozen per layer), and the scratch the tree recurrence writes for it.

    state [L, hv, dk, dv] fp32; conv [L, width-1, C]; scratch for up to `cap` tree nodes: k, U, c
    (fp32) [L, hv, cap, *] and the conv inputs ext [L, width-1+cap, C]. Each layer holds views of
    its rows (so its forward needs no layer index); a forward of T nodes uses [..., :T, ...].
    """

    def __init__(self, layers: list, device, dtype, cap: int):
        m = layers[0]
        L = self.L = len(layers)
        self.h, self.dk, self.dv, self.hist, self.C = m.hv, m.dk, m.dv, m.width - 1, m.conv_dim
        f32 = dict(device=device, dtype=torch.float32)
        self.state = torch.zeros(L, m.hv, m.dk, m.dv, **f32)
        self.conv = torch.zeros(L, self.hist, self.C, device=device, dtype=dtype)
        self.kbuf = torch.zeros(L, m.hv, cap, m.dk, **f32)
        self.ubuf = torch.zeros(L, m.hv, cap, m.dv, **f32)
        self.cbuf = torch.zeros(L, m.hv, cap, **f32)
        self.ebuf = torch.zeros(L, self.hist + cap, self.C, device=device, dtype=dtype)
        # (T, window, path_mask) of the last tree forward: set by TargetModel.forward
        self.step = None
        for j, layer in enumerate(layers):
            layer.group = self
            layer.rec_state, layer.conv_state = self.state[j], self.conv[j]
            layer.wy_bufs = (self.kbuf[j], self.ubuf[j], self.cbuf[j])
            layer.ext_buf = self.ebuf[j]

    def wy(self, T: int):
        return self.kbuf[:, :, :T], self.ubuf[:, :, :T], self.cbuf[:, :, :T]

    def ext(self, T: int):
        return self.ebuf[:, : self.hist + T]

    def commit(self, path_nodes: torch.Tensor, n_nodes: torch.Tensor, kernels: Kernels = REFERENCE):
        """State after tree node last = path_nodes[n_nodes - 1] ([P] / 0-dim, on the device)."""
        T, window, path_mask = self.step
        if kernels.triton:  # two kernels: the state pass (path rows only), the conv rows
            commit_kernels.gdn_commit_(self.state, *self.wy(T), path_nodes, n_nodes)
            commit_kernels.conv_commit_(self.conv, self.ext(T), window, path_nodes, n_nodes)
            return
        last = path_nodes.gather(0, (n_nodes - 1).view(1))[0]
        gdn.commit_states_(self.state, *self.wy(T), last, path_mask)
        rows = window.index_select(0, last.view(1))[0, 1:]  # the last width-1 inputs on its path
        self.conv.copy_(self.ext(T).index_select(1, rows))

    def reset(self):
        self.state.zero_()
        self.conv.zero_()


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_plus_one)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_plus_one)
        self.reduce = _identity  # ddtree.parallel installs an all-reduce here

    @property
    def mixer(self):
        return self.linear_attn if self.kind == "linear_attention" else self.self_attn

    def forward(self, x: torch.Tensor, s: Step) -> torch.Tensor:
        # `reduce` sums the partial outputs of row-parallel projections under tensor parallelism.
        x = residual(x, self.reduce(self.mixer(self.input_layernorm(x), s)))
        return residual(x, self.reduce(self.mlp(self.post_attention_layernorm(x))))

    def prefill(self, x: torch.Tensor, c: "Chunk") -> torch.Tensor:
        x = residual(x, self.reduce(self.mixer.prefill(self.input_layernorm(x), c)))
        return residual(x, self.reduce(self.mlp(self.post_attention_layernorm(x))))


@dataclass
class Chunk:
    """A prefill chunk's inputs shared by all layers of a stage: host offset, rope rows, kernels."""

    start: int
    cos: torch.Tensor  # [T, rd] model dtype
    sin: torch.Tensor
    kernels: Kernels
    compiled: bool = False  # through the compiled layer (TargetModel._prefill_layer)


# The kernel's grid comes from host ints (T, kv_len): it runs between compiled pieces.
tree_attention = attention.tree_attention
eager_name(globals(), "tree_attention")
# The prefill's own kernels (flash-class attention, fla's chunk recurrence) choose backends and
# shapes on the host: compiled prefill layers run them eagerly between their fused pieces.
chain_final = fla.chain_final
eager_name(globals(), "chain_final")


@eager
def tree_mixer(layer: GatedDeltaNet, proj: torch.Tensor, ext: torch.Tensor, window: torch.Tensor,
               path_mask: torch.Tensor, scratch: tuple, kn: Kernels) -> torch.Tensor:
    """GDN layer `layer`'s mixer for a tree verify from its projection, in Triton kernels: the
    one-tile tree kernel with the prologue inside (gdn_tree.gdn_tree_prologue), or for larger
    trees the prologue kernel ahead of the blocked recurrence, then the gated norm
    (ddtree.ops.gated_norm). One eager call between the compiled projections: the tree's sizes
    are host ints here, and nothing between the kernels is left to a resume frame's compile.
    -> [T, hv * dv] in the model dtype."""
    T = proj.shape[0]
    if kn.tree(T, layer.dk):
        o = gdn_tree.gdn_tree_prologue(layer, proj, ext, window, layer.rec_state, path_mask, scratch, kn.tree_precision)
    else:
        o = gdn_tree.gdn_tree_blocked(*gdn_tree.gdn_prologue(layer, proj, ext, window), layer.rec_state, path_mask,
                                      scratch, kn.tree_precision)
    z = proj[:, layer.conv_dim : layer.conv_dim + layer.hv * layer.dv]
    return gated_norm.gated_norm(o, z, layer.norm.weight, layer.norm.eps, proj.dtype)


@eager
def cache_and_attend(attn: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Chunk) -> torch.Tensor:
    """A prefill chunk's K/V into the cache at its host offset c.start, then its attention over
    the prefix and itself. Eager, and handed the chunk whole, so that compiled prefill layers
    never read c.start: they would specialise on it and recompile for every chunk's offset."""
    T = q.shape[0]
    attn.k_cache[c.start : c.start + T] = k
    attn.v_cache[c.start : c.start + T] = v
    return attention.prefill_attention(q, attn.k_cache, attn.v_cache, c.start, backend=c.kernels.prefill_attention)


def _prefill_layer(layer: DecoderLayer, x: torch.Tensor, c: Chunk) -> torch.Tensor:
    return layer.prefill(x, c)


def prefill_layer():
    """DecoderLayer.prefill through torch.compile. Why: eager, the prefill's norms, conv, gates,
    rope and casts are ~40% of an 8K prefill's kernel time on the 27B (scripts/profile_round.py
    --prefill); inductor fuses them. One compiled function serves every layer of a kind (the
    chunk's length is marked dynamic; its offset is never traced: cache_and_attend); the eager
    `_prefill_layer` is the twin (tests/model/test_compile.py)."""
    return compiled(_prefill_layer)


def _mark_dynamic(s: Step) -> None:
    """Compile once for every context length, and once for every tree size T > 1 (T = 1, the
    decode step, keeps its own specialised code): without the marks dynamo first compiles static
    shapes and recompiles on the second value, mid-generation."""
    mark = torch._dynamo.maybe_mark_dynamic
    if s.attn_mask is not None:
        mark(s.attn_mask, 1)
    if s.positions.shape[0] > 1:
        for t in (s.positions, s.window, s.attn_mask, s.cos, s.sin):
            if t is not None:
                mark(t, 0)
        mark(s.path_mask, 0)
        mark(s.path_mask, 1)


def _call_layer(layer: DecoderLayer, x: torch.Tensor, s: Step) -> torch.Tensor:
    return layer(x, s)


def _mixer_half(layer: DecoderLayer, x: torch.Tensor, s: Step) -> torch.Tensor:
    return layer.mixer(layer.input_layernorm(x), s)


def _mlp_half(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    return layer.mlp(layer.post_attention_layernorm(x))


def _call_layer_split(layer: DecoderLayer, x: torch.Tensor, s: Step) -> torch.Tensor:
    """Under tensor parallelism: the two halves compiled, the all-reduces between them eager
    (collectives stay out of the compiled graphs; the CUDA graph captures them all the same)."""
    x = x + layer.reduce(compiled(_mixer_half)(layer, x, s))
    return x + layer.reduce(compiled(_mlp_half)(layer, x))


def compiled_layer(layer: DecoderLayer):
    return compiled(_call_layer) if layer.reduce is _identity else _call_layer_split


def rope_tables(cfg: TargetConfig, max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    rd = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd))
    freqs = torch.arange(max_len, dtype=torch.float32, device=device)[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_len, rd]
    return emb.cos(), emb.sin()


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, t) for t in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, cfg.norm_plus_one)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tap_layers: list[int] = []  # residual stream after these layers is returned (drafter context)
        self.layer_devices: list[torch.device] = []
        # one stage index per layer, set by the loaders before allocate_state (placement.Split.layer_stages);
        # None: a stage per run of equal layer devices
        self.layer_stages: list[int] | None = None
        self.stages: list[Stage] = []
        self.hook = StageHook([])  # what `enter` does: eager moves, or the graph runner's segments
        self.max_len = 0
        self._rope: dict = {}
        self.gather_logits = _identity  # ddtree.parallel installs a vocab all-gather here (vocab-parallel lm_head)
        self.kernels: dict[int, Kernels] = {}  # per stage: its device's fast paths (use)
        self.compile_layers = False  # run decoder layers through torch.compile (see compiled_layer)
        self._prefill_compile_failed = False  # a compile error in the prefill: eager prefill layers from then on
        self.fast_prefill_ran = False  # a fast prefill ran (compiled where compile_layers): nothing of it is left to compile

    # ------------------------------------------------------------------ placement and state
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def out_device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def home(self) -> int:
        """The round's home stage: the last (lm_head, logits; the decoder's slots and packet)."""
        return len(self.stages) - 1

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def enter(self, j: int, *tensors) -> list:
        """Work from here on is stage j's; -> `tensors` on its device (see ddtree.model.stages)."""
        return self.hook.enter(j, tensors)

    def allocate_state(self, max_len: int, tree_capacity: int = 256):
        """Allocate every state buffer once, on each stage's device.

        Per stage: attention K/V stacked [L_attn, max_len, kvh, hd]; a GDNGroup for the GDN
        layers. tree_capacity bounds the nodes of one forward (tree size or prefill chunk).
        """
        self.max_len, self.tree_capacity = max_len, tree_capacity
        self.layer_devices = [layer.input_layernorm.weight.device for layer in self.layers]
        self.stages = stages_of(self.layer_devices, self.layer_stages)
        if self.device != self.stages[0].device or self.out_device != self.stages[-1].device:
            raise ValueError(f"the embedding ({self.device}) must be on the first stage's device ({self.stages[0].device}) "
                             f"and the lm_head ({self.out_device}) on the last's ({self.stages[-1].device})")
        self.hook = StageHook(self.stages)
        self.gdn_groups, self.kv_stacks = {}, {}
        for st in self.stages:
            on = self.layers[st.start : st.end]
            gdns = [layer.linear_attn for layer in on if layer.kind == "linear_attention"]
            attns = [layer.self_attn for layer in on if layer.kind == "full_attention"]
            if gdns:
                self.gdn_groups[st.index] = GDNGroup(gdns, st.device, self.dtype, tree_capacity)
            if attns:
                a0 = attns[0]
                kc = torch.zeros(len(attns), max_len, a0.kvh, a0.hd, device=st.device, dtype=self.dtype)
                vc = torch.zeros_like(kc)
                for j, att in enumerate(attns):
                    att.k_cache, att.v_cache = kc[j], vc[j]
                self.kv_stacks[st.index] = (kc, vc)
        # constants: one table per device (stages on one device read the same one)
        self._rope = {d: rope_tables(self.cfg, max_len, d) for d in dict.fromkeys(st.device for st in self.stages)}
        if not self.kernels:  # the default fast paths until a Decoder sets its options (use)
            self.use(Options())
        self.prepare()

    def use(self, options: Options):
        """Take the fast paths `options` allows on each stage's device (the attention kernel needs
        a power-of-two head dim of at least 16; SDPA's dense mask serves others)."""
        hd = self.cfg.head_dim
        fits = hd >= 16 and hd & (hd - 1) == 0
        self.kernels = {st.index: resolve(options, st.device) for st in self.stages}
        apply_blas(options, [st.device for st in self.stages])
        if not fits:
            self.kernels = {j: dataclasses.replace(k, attention="sdpa") for j, k in self.kernels.items()}

    def prepare(self):
        """Inference-time constants derived from the weights: fused projection weights (views,
        so they follow in-place edits), (1 + w) norm weights, GDN conv weight / -exp(A_log)
        (copies: call prepare() again after editing those weights in place)."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.prepare()
            elif isinstance(m, MLP):
                fused(m, "_wgu", m.gate_proj, m.up_proj)
            elif isinstance(m, Attention):
                fused(m, "_wqkv", m.q_proj, m.k_proj, m.v_proj)
            elif isinstance(m, GatedDeltaNet):
                fused(m, "_win", m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a)
                m.__dict__.pop("_c", None)
                m._consts()

    def reset(self):
        for group in self.gdn_groups.values():
            group.reset()

    # ------------------------------------------------------------------ forward
    def make_step(self, positions, path_mask, parents, start, kv_len: int, stage: int | torch.device = 0,
                  floor: int = 0) -> Step:
        """The Step of a stage (an index, or a device: its first stage) from inputs on its device.
        floor: a host lower bound on start (Step.floor), kept where the stage's kernels take it."""
        if not isinstance(stage, int):
            stage = next((st.index for st in self.stages if st.device == torch.device(stage)), 0)
        device = self.stages[stage].device if self.stages else positions.device
        T = positions.shape[0]
        kernels = self.kernels.get(stage, REFERENCE)
        attn_mask = None
        if kernels.attention != "kernel":  # the SDPA twin's dense mask: prefix, then the tree's ancestors
            key = torch.arange(kv_len, device=device)
            local = key[None, :] - start  # [1, kv_len] index inside the tree
            in_tree = (local >= 0) & (local < T)
            tree_vis = path_mask.gather(1, local.clamp(0, T - 1).expand(T, -1)) & in_tree
            attn_mask = (key[None, :] < start) | tree_vis  # [T, kv_len]
        cos, sin = self._rope[device]
        return Step(
            positions=positions,
            path_mask=path_mask,
            window=gdn.conv_window_index(parents, self.cfg.conv_kernel),
            attn_mask=attn_mask,
            cos=cos[positions].to(self.dtype),  # cast once here, not in every layer
            sin=sin[positions].to(self.dtype),
            start=start,
            kv_len=kv_len,
            kernels=kernels,
            floor=floor if kernels.fused_prefix else 0,
        )

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        path_mask: torch.Tensor,
        parents: torch.Tensor,
        start: torch.Tensor,
        kv_len: int,
        logit_rows: torch.Tensor | None = None,
        want_taps: bool = True,
        floor: int = 0,
    ):
        """tokens/positions/parents [T] long, path_mask [T, T] bool, start 0-dim long (any stage's
        device; each stage gets them at its boundary); floor: a host lower bound on start (Step.floor).

        Returns logits [R, vocab] (R = T, or len(logit_rows)) and the tap hidden states
        [T, len(tap_layers) * hidden] on the last stage (None if not wanted).
        """
        # Tree and decode forwards go through the compiled layer when enabled (fewer, fused kernels);
        # prefill chunks (TargetModel.prefill) stay eager: their shapes vary.
        fast = self.compile_layers
        T = tokens.shape[0]
        inputs = (positions, path_mask, parents, start)
        last = self.home
        x, taps = tokens, []
        for st in self.stages:
            j = st.index
            # the boundary: the residual stream (the tokens on stage 0), the step's inputs, and into
            # the last stage the logit rows and earlier stages' taps
            moved = self.enter(j, x, *inputs, *((logit_rows, *taps) if j == last else ()))
            x, step_in = moved[0], moved[1:5]
            if j == last:
                logit_rows, taps = moved[5], list(moved[6:])
            if j == 0:
                x = self.embed_tokens(x)
                if fast and T > 1:
                    torch._dynamo.maybe_mark_dynamic(x, 0)
            s = self.make_step(*step_in, kv_len, j, floor)
            if fast:
                _mark_dynamic(s)
            if j in self.gdn_groups:  # what the commit will need
                self.gdn_groups[j].step = (T, s.window, s.path_mask)
            for i in range(st.start, st.end):
                x = (compiled_layer(self.layers[i]) if fast else _call_layer)(self.layers[i], x, s)
                if want_taps and i in self.tap_layers:
                    taps.append(x)
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        logits = self.gather_logits(self.lm_head(self.norm(x)))
        tap = torch.cat(taps, -1) if taps else None
        return logits, tap

    @torch.no_grad()
    def commit(self, path_nodes: torch.Tensor, n_nodes: torch.Tensor, start: torch.Tensor,
               embed: torch.Tensor | None = None):
        """Keep the path path_nodes[:n_nodes] of the last forward (root first; padding repeats the last).

        path_nodes [P] long and n_nodes, start 0-dim long; no host sync. A few kernels per stage,
        stage by stage (it ends on the last): stacked K/V moves and one batched GDN state update.
        embed (tokens [B], optional): their embedding rows are looked up while on stage 0, which
        a split's draft would otherwise cross to on its own. -> those rows [B, hidden] (or None).
        """
        rows = None
        for st in self.stages:
            j = st.index
            p, n_, s0, blk = self.enter(j, path_nodes, n_nodes, start, embed if j == 0 else None)
            kn = self.kernels.get(j, REFERENCE)
            if j in self.gdn_groups:
                self.gdn_groups[j].commit(p, n_, kn)
            if j in self.kv_stacks and kn.triton:
                commit_kernels.kv_commit_(*self.kv_stacks[j], p, s0)  # one kernel for all layers' K and V
            elif j in self.kv_stacks:
                src = s0 + p
                dst = s0 + torch.arange(p.shape[0], device=st.device)
                for cache in self.kv_stacks[j]:
                    cache.index_copy_(1, dst, cache.index_select(1, src))
            if blk is not None:
                rows = self.embed_tokens(blk)
        return rows

    @torch.no_grad()
    def commit_reference(self, path_nodes: torch.Tensor, n_nodes: torch.Tensor, start: torch.Tensor):
        """Layer-by-layer twin of `commit` (tests compare them)."""
        last = path_nodes.gather(0, (n_nodes - 1).view(1))[0]
        for st in self.stages:
            p, l_, s0 = self.enter(st.index, path_nodes, last, start)
            for layer in self.layers[st.start : st.end]:
                if layer.kind == "linear_attention":
                    layer.linear_attn.commit(l_)
                else:
                    layer.self_attn.commit(p, s0)

    # ------------------------------------------------------------------ convenience (host-driven)
    def prefill_chunk(self, free_bytes: int | None = None) -> int:
        """Tokens per prefill forward: as many as ~a quarter of the free memory holds in the
        activations of one layer (bounded to 256..8192; 4096 on a GPU when free_bytes is unknown,
        512 on the CPU)."""
        if self.device.type != "cuda":
            return 512
        if free_bytes is None:
            free_bytes = torch.cuda.mem_get_info(self.device)[0]
        c = self.cfg
        # per token, fp32 worst case: MLP gate/up/act, the GDN projection, conv and recurrence inputs, logits-free
        per_token = 4 * (3 * c.intermediate_size + 3 * max(c.gdn_conv_dim, 1) + 4 * c.hidden_size
                         + 3 * c.num_heads * c.head_dim)
        return int(max(256, min(8192, free_bytes // 4 // per_token)) // 256 * 256)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, start: int = 0, chunk: int | None = None, want_taps: bool = True,
                on_taps=None, fast: bool = True):
        """Run `tokens` [N] as a chain from committed length `start` and commit all of them, `chunk`
        tokens per forward (default: prefill_chunk()). on_taps(taps [T, taps*hidden]) receives each
        chunk's tap rows (the drafter's context); without it they are returned, concatenated.
        fast=False: the eager layers and the torch GDN chain (their twins), whatever compile_layers
        and the kernels say: no compile and no fla autotuning for a short prompt.
        -> (the last row's logits [vocab], taps [N, taps*hidden] | None)."""
        chunk = chunk or self.prefill_chunk()
        taps, logits = [], None
        want = want_taps and bool(self.tap_layers)
        for s0 in range(0, tokens.shape[0], chunk):
            t = tokens[s0 : s0 + chunk].to(self.device)
            logits, tap = self._prefill_chunk(t, start + s0, want, fast)
            if tap is not None:
                on_taps(tap) if on_taps is not None else taps.append(tap)
        self.fast_prefill_ran |= fast
        return logits, (torch.cat(taps) if taps else None)

    def _prefill_chunk(self, tokens: torch.Tensor, start: int, want_taps: bool, fast: bool = True):
        """One chunk through every stage, committed (fast: see prefill). -> (last logits, taps)."""
        T = tokens.shape[0]
        x, taps, last = tokens, [], self.home
        for st in self.stages:
            moved = self.enter(st.index, x, *(taps if st.index == last else ()))
            x = moved[0]
            if st.index == last:
                taps = list(moved[1:])
            if st.index == 0:
                x = self.embed_tokens(x)
            cos, sin = self._rope[st.device]
            kernels = self.kernels.get(st.index, REFERENCE)
            c = Chunk(start, cos[start : start + T].to(self.dtype), sin[start : start + T].to(self.dtype),
                      kernels if fast else dataclasses.replace(kernels, fla=False), compiled=fast and self.compile_layers)
            if c.compiled:  # one compiled prefill for every chunk length (no static first graph)
                for t in (x, c.cos, c.sin):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            for i in range(st.start, st.end):
                x = self._prefill_layer(i, x, c)
                if want_taps and i in self.tap_layers:
                    taps.append(x)
        logits = self.gather_logits(self.lm_head(self.norm(x[-1:])))[0]
        tap = torch.cat(taps, -1) if taps else None
        return logits, tap

    def _prefill_layer(self, i: int, x: torch.Tensor, c: Chunk) -> torch.Tensor:
        """Layer i's prefill, compiled when compile_layers is on (not under tensor parallelism:
        collectives stay out of compiled graphs). A compile error (dynamo's or inductor's) falls
        back to the eager layer for the rest of this model's life, with a warning, as the graphed
        rounds do. It can come after a compiled piece ran (the piece after a graph break compiles
        on arrival), so the GDN states are restored first (the K/V rows are rewritten whole); any
        other error propagates."""
        layer = self.layers[i]
        if not c.compiled or self._prefill_compile_failed or layer.reduce is not _identity:
            return _prefill_layer(layer, x, c)
        live = [t for t in (getattr(layer.mixer, n, None) for n in ("conv_state", "rec_state")) if t is not None]
        saved = [t.clone() for t in live]  # [width-1, C] and [hv, dk, dv]: ~3 MB a GDN layer, ~0.1 ms a chunk
        try:
            return prefill_layer()(layer, x, c)
        except torch._dynamo.exc.TorchDynamoException as e:
            from loguru import logger

            logger.warning(f"torch.compile failed in the prefill ({type(e).__name__}: {str(e)[:200]}); "
                           "using the eager prefill layers (DDTREE_NO_COMPILE=1 skips compiling)")
            self._prefill_compile_failed = True
            for t, v in zip(live, saved):
                t.copy_(v)
            return _prefill_layer(layer, x, c)

    @torch.no_grad()
    def forward_chain(self, tokens: torch.Tensor, start: int):
        """Logits for every position of a chain (no commit). For tests and transformers parity.

        It continues from the current state: call reset() first for an empty prefix."""
        dev = self.device
        T = tokens.shape[0]
        tril = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        return self.forward(
            tokens.to(dev), start + torch.arange(T, device=dev), tril, torch.arange(T, device=dev) - 1,
            torch.tensor(start, device=dev), start + T,
        )


def layer_bytes(cfg: TargetConfig, dtype_bytes: int = 2) -> list[int]:
    """Weight bytes of every decoder layer (placement and roofline accounting)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    mlp = 3 * h * inter
    attn = h * cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1) + 2 * h * cfg.num_kv_heads * cfg.head_dim
    attn += cfg.num_heads * cfg.head_dim * h
    vdim = cfg.gdn_num_v_heads * cfg.gdn_v_dim
    lin = h * cfg.gdn_conv_dim + h * vdim + 2 * h * cfg.gdn_num_v_heads + vdim * h + cfg.gdn_conv_dim * cfg.conv_kernel
    return [dtype_bytes * (mlp + (lin if t == "linear_attention" else attn)) for t in cfg.layer_types]


def weight_bytes_per_token(cfg: TargetConfig, dtype_bytes: int = 2) -> int:
    """Bytes a decode step must read: all layers + lm_head (the embedding row is negligible)."""
    return sum(layer_bytes(cfg, dtype_bytes)) + dtype_bytes * cfg.vocab_size * cfg.hidden_size


def split_layers(cfg: TargetConfig, devices: list[torch.device]) -> list[torch.device]:
    """Contiguous layer split with about equal weight bytes per device (embedding on the first,
    lm_head on the last device count towards their shares)."""
    if len(devices) == 1:
        return [devices[0]] * cfg.num_layers
    lb = layer_bytes(cfg)
    head = 2 * cfg.vocab_size * cfg.hidden_size
    total = sum(lb) + head  # the embedding is read one row a token: it does not count
    share = total / len(devices)
    out, acc, d = [], 0.0, 0
    for b in lb:
        if acc + b / 2 > share * (d + 1) and d < len(devices) - 1:
            d += 1
        out.append(devices[d])
        acc += b
    return out
