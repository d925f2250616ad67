"""Less bookkeeping per call in Triton's interpreter (the CPU tests' kernels), the same execution.

Under TRITON_INTERPRET every launch, and every call of a device function inside it (our helpers
and triton.language's own jit'd sum / max / cdiv ...), re-patches triton.language: it lists each
module's members with `inspect.getmembers` to find the builtins to wrap, and sets the same
closures again. Inside a launch the modules a device function sees are already patched (its
patches are never restored either), so the repeat changes nothing: `install` patches only the
modules not yet patched in the running launch, and remembers which names were builtins. And every
op's result built its shape's `tl.tuple` of constexprs, block type and type name afresh: they are
made once per shape and shared (they are only read). Every kernel still runs op by op as before;
the kernel tests compare with the torch twins, so a wrong patch would fail them. A 41-node decode
through the prologue and blocked kernels took 43 s without it, 35-39 s with it, the same tokens.
Triton 3.6's internals only: with another version nothing is installed.
"""

from __future__ import annotations

import inspect


def install() -> bool:
    try:
        import triton
        import triton.language as tl
        from triton.runtime import interpreter as itp
    except ImportError:
        return False
    if not triton.__version__.startswith("3.6.") or getattr(itp, "_ddtree_fast", False):  # the internals patched are 3.6's
        return False
    original_patch_lang, original_launch = itp._patch_lang, itp.GridExecutor.__call__
    builtin_names: dict[object, list[str]] = {}  # module or class -> its builtins' names, listed unpatched
    langs_of: dict[object, frozenset[int]] = {}  # function -> the language modules its globals hold
    patched: list[set[int] | None] = [None]  # the running launch's patched modules (None: no launch)

    def patch_builtin(pkg, builder, scope):
        names = builtin_names.get(pkg)
        if names is None:
            names = builtin_names[pkg] = [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):  # as the original: patched ones are skipped
                itp._patch_attr(pkg, name, member, builder, scope)

    def langs(fn) -> frozenset[int]:
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_of[fn]

    def patch_lang(fn):
        done = patched[0]
        if done is not None:
            mine = langs(fn)
            if mine and mine <= done:  # a device function whose languages this launch patched already
                return itp._LangPatchScope()
            done |= mine
        return original_patch_lang(fn)

    def launch(self, *args, **kwargs):
        outer, patched[0] = patched[0], set()
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            patched[0] = outer

    itp._patch_builtin, itp._patch_lang, itp.GridExecutor.__call__ = patch_builtin, patch_lang, launch
    _share_shapes(tl.core)
    itp._ddtree_fast = True
    return True


def _share_shapes(core) -> None:
    """block_type.__init__ and tensor.__init__ as Triton's, with each shape's `tl.tuple`, element
    count and name made once and shared: every op's result built them afresh (a `tl.tuple` of
    constexprs, its type, its name string), most of a kernel op's time on the CPU. Shapes are only
    read (semantic.py builds new lists from `.values`)."""
    import builtins
    import math

    from triton._utils import validate_block_shape

    blocks: dict = {}
    tensors: dict = {}

    def block_init(self, element_ty, shape):
        self.element_ty = element_ty
        assert isinstance(shape, (list, core.tuple))  # Triton's check (its `tuple` is tl.tuple)
        dims = builtins.tuple(core._unwrap_shape(shape))
        got = blocks.get(dims)
        if got is None:
            if not dims:
                raise TypeError("0d block_type is forbidden")
            t = core.tuple(list(dims))
            got = blocks[dims] = (t, validate_block_shape(dims), str(t))
        self.shape, self.numel, self.name = got[0], got[1], f"<{got[2]}, {element_ty}>"

    def tensor_init(self, handle, type):
        self.handle = handle
        shape = type.shape if type.is_block() else ()
        got = tensors.get(id(shape))
        if got is None or got[0] is not shape:
            got = tensors[id(shape)] = (shape, core.constexpr(math.prod(shape)),
                                        core.tuple([core.constexpr(s) for s in shape]))
        self.numel, self.type, self.dtype, self.shape = got[1], type, type.scalar, got[2]

    core.block_type.__init__ = block_init
    core.tensor.__init__ = tensor_init
