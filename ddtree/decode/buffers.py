"""Static buffers of the round: tree slots, the packet the host reads, constants, the host ring.

Graph replays read and write these in place (their addresses are captured), so every buffer a
round touches is allocated once here, and none is sized by the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.ops.tree import Tree


class Slot:
    """A tree of T nodes on the device (graph inputs are written in place).

    tokens, depths and parents share one [3, T] buffer and the ancestor mask has its own, so a
    host tree goes up in two copies; on CUDA from pinned host buffers, so the copies are
    asynchronous. Trees the device builds write these buffers directly.
    """

    chain = False  # --budget auto's staged chain (Decoder.stage)

    def __init__(self, T: int, dev):
        self.T = T
        self.ints = torch.zeros(3, T, dtype=torch.long, device=dev)  # [3, T]: tokens, depths, parents
        self.tokens, self.depths, self.parents = self.ints[0], self.ints[1], self.ints[2]
        self.mask = torch.zeros(T, T, dtype=torch.bool, device=dev)  # [T, T] ancestor-or-self
        self.choice = torch.zeros(T, dtype=torch.long, device=dev)  # [T] the target's token at each node
        self.ranks = torch.zeros(T, dtype=torch.long, device=dev)  # [T] drafter ranks (device-built trees)
        pin = torch.device(dev).type == "cuda"
        self.host_ints = torch.zeros(3, T, dtype=torch.long, pin_memory=pin)
        self.host_mask = torch.zeros(T, T, dtype=torch.bool, pin_memory=pin)
        self._ints_np, self._mask_np = self.host_ints.numpy(), self.host_mask.numpy()  # views: ~1 us writes
        self._shape = (None, None)  # (parents, mask) of the last host tree loaded (compared by identity)

    def load(self, tree: Tree):
        """Upload a host tree. The previous round's sync has completed every copy from the host buffers."""
        self._ints_np[0] = tree.tokens.numpy()
        if tree.parents is self._shape[0] and tree.ancestor_mask is self._shape[1]:
            # same shape tensors (chains share theirs: Tree.chain): only the tokens go up
            self.ints[:1].copy_(self.host_ints[:1], non_blocking=True)
            return
        self._ints_np[1] = tree.depths.numpy()
        self._ints_np[2] = tree.parents.numpy()
        self._mask_np[:] = tree.ancestor_mask.numpy()
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.mask.copy_(self.host_mask, non_blocking=True)
        self._shape = (tree.parents, tree.ancestor_mask)

    def load_with_ranks(self, tree: Tree):
        self.load(tree)
        self.ranks.copy_(tree.ranks.to(self.ranks.device))
        self.device_written()

    def device_written(self):
        """The device rewrites this slot's shape: the next host load must upload it whole."""
        self._shape = (None, None)

    def copy_prefix_(self, src: "Slot"):
        """This slot's tree = the first T nodes of `src` (a best-first tree's prefix is the
        best-first tree of that budget)."""
        T = self.T
        self.ints.copy_(src.ints[:, :T])
        self.ranks.copy_(src.ranks[:T])
        self.mask.copy_(src.mask[:T, :T])


@dataclass(frozen=True)
class RoundOut:
    """What the host reads of a round."""

    n: int  # accepted path length, root included
    bonus: int  # the target's token after the path: the next root
    tokens: list[int]  # the path's tokens, root first [n]
    ranks: list[int]  # drafter ranks of the accepted draft nodes [n - 1]
    extra: list[float]  # the policy's part (ddtree.decode.budget)


class Packet:
    """The round's one device-to-host copy, fp32:

        [n, bonus, path tokens (P), path ranks (P), extra (E)]

    The walk writes the header (first 2 + 2P floats, zeros past n) into a static buffer; the
    policy's extra floats (the next tree's depth, or --budget auto's per-prefix summary) follow.
    """

    def __init__(self, P: int, E: int):
        self.P, self.E = P, E
        self.size = 2 + 2 * P + E

    def read(self, h: list[float]) -> RoundOut:
        n, P = int(h[0]), self.P
        return RoundOut(n=n, bonus=int(h[1]), tokens=[int(x) for x in h[2 : 2 + n]],
                        ranks=[int(x) for x in h[2 + P + 1 : 2 + P + n]], extra=h[2 + 2 * P :])


class Statics:
    """Per-device static tensors the pieces share: walk outputs, packet headers, constants."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        self._bufs: dict = {}

    def walk(self, P: int):
        """(path_nodes [P], n 0-dim, bonus 0-dim) that the walk writes and the commit reads."""
        key = ("walk", P)
        if key not in self._bufs:
            self._bufs[key] = (torch.zeros(P, dtype=torch.long, device=self.dev),
                               torch.ones((), dtype=torch.long, device=self.dev),
                               torch.zeros((), dtype=torch.long, device=self.dev))
        return self._bufs[key]

    def header(self, P: int) -> torch.Tensor:
        """fp32 [2 + 2P]: a packet's header (Packet), written by the walk."""
        key = ("header", P)
        if key not in self._bufs:
            self._bufs[key] = torch.zeros(2 + 2 * P, device=self.dev)
        return self._bufs[key]

    def full(self, n: int, x: float) -> torch.Tensor:
        """A static fp32 [n] holding x: graphs read it and nothing writes it, so a packed constant
        (a chain's depth, zero padding) costs no fill kernel per replay."""
        key = ("full", n, x)
        if key not in self._bufs:
            self._bufs[key] = torch.full((n,), x, device=self.dev)
        return self._bufs[key]


class HostRing:
    """Two pinned host buffers and their events: round r's packet is copied out right after its
    graphs (`put`) and read after round r + 1 is queued (`get`: the round's one sync)."""

    def __init__(self, n: int, dev: torch.device):
        cuda = dev.type == "cuda"
        self.bufs = [torch.zeros(n, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]

    def put(self, r: int, packet: torch.Tensor):
        self.bufs[r % 2].copy_(packet, non_blocking=True)  # on the packet's device's current stream
        if self.events[r % 2] is not None:
            self.events[r % 2].record(torch.cuda.current_stream(packet.device))

    def get(self, r: int) -> list[float]:
        if self.events[r % 2] is not None:
            self.events[r % 2].synchronize()
        return self.bufs[r % 2].tolist()
