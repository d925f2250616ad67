"""ddtree.ops.eager: the functions compiled code calls eagerly are marked without importing dynamo,
and become torch.compiler.disable wrappers before the first compile."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from conftest import REPO
from ddtree.ops import eager


def test_a_short_eager_generation_never_imports_dynamo():
    """Importing the decoder and a generation that compiles nothing leave torch._dynamo unimported
    (it costs about as much as torch itself)."""
    code = textwrap.dedent("""
        import sys
        import torch
        from ddtree.decode.random_pair import build_random_pair
        dec, _ = build_random_pair("hybrid", 5, device="cpu")
        dec.generate(list(range(3, 20)), "ddtree", 8, max_new_tokens=6)
        print("torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(REPO), "DDTREE_NO_COMPILE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_marked_functions_are_disabled_once_applied():
    """Every function the model's compiled layers call eagerly is a torch.compiler.disable wrapper
    after apply() (as ddtree.model.layers.compiled calls it), where its callers look it up."""
    from ddtree.model import drafter, target
    from ddtree.ops import gdn_tree

    eager.apply()
    names = [(target, "tree_attention"), (target, "chain_final"), (target, "cache_and_attend"), (drafter, "tree_attention")]
    names += [(gdn_tree, n) for n in ("gdn_tree", "gdn_tree_blocked", "gdn_prologue", "gdn_tree_prologue")]
    for module, name in names:
        assert getattr(getattr(module, name), "_torchdynamo_disable", False), f"{module.__name__}.{name} is not disabled"


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


eager.eager_name(globals(), "_doubled")


def test_a_marked_function_stays_out_of_the_traced_graphs():
    """The rebound name is what dynamo meets: the caller's graphs hold its own ops, never the
    marked function's (it runs eagerly between them)."""
    import operator

    import torch._dynamo

    eager.apply()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def caller(x):
        return _doubled(x + 1) - 1

    torch._dynamo.reset()
    x = torch.randn(4)
    torch.testing.assert_close(torch.compile(caller, backend=backend)(x), (x + 1) * 2 - 1)
    ops = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert operator.add in ops and operator.sub in ops, ops  # the caller's own ops were traced
    assert operator.mul not in ops, ops  # _doubled's was not
