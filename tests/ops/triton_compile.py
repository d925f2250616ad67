"""Compile Triton kernels for a GPU target without a GPU (Triton's bundled ptxas), report their
resources. Run as a script, outside the test process: tests/conftest.py sets TRITON_INTERPRET=1
before triton's import on machines without a GPU, and then `triton.jit` makes interpreted
functions, which do not compile. The caller removes TRITON_INTERPRET from this process's
environment.

stdin: a JSON list of jobs {module, fn, signature {arg: type}, constexprs [[index, value]],
attrs [[index, [[name, value]]]], num_warps, num_stages (or null), cc}. stdout: a JSON list, per
job, {ok, error, shared (bytes of dynamic shared memory per block), regs, stack (bytes of
per-thread local memory: spills), barriers (BAR.SYNC in the SASS), sass (its instructions: the
code each SM fetches, from HBM where a GEMM has swept the L2 just before), tf32_mma and tf32_cvt
(counts in the PTX), seconds}.
Compiled kernels land in Triton's own cache, so a job seen before costs a cache read. Jobs run
on DDTREE_COMPILE_WORKERS processes (default: the CPU count, at most 8).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor


def _resources(cubin: bytes, cc: int) -> dict:
    """REG and STACK of the kernel, from the bundled cuobjdump's resource report, and its block
    barriers (BAR.SYNC in the SASS: each layout conversion through shared memory and each
    reduction across warps waits at one; a latency-bound kernel's count is a cost)."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = os.path.join(os.path.dirname(get_ptxas(cc).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    res = {"regs": int(m.group(1)), "stack": int(m.group(2))} if m else {"regs": None, "stack": None}
    return res | {"barriers": len(re.findall(r"\bBAR\.SYNC", sass)),
                  "sass": len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))}


def compile_one(job: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t0 = time.time()
    out = {"ok": False, "error": None, "shared": None, "regs": None, "stack": None, "barriers": None, "sass": None, "tf32_mma": 0, "tf32_cvt": 0}
    try:
        from ddtree.ops import triton_util

        fn = triton_util._kernel(getattr(importlib.import_module(job["module"]), job["fn"]), interpret=False)
        src = ASTSource(fn, job["signature"], constexprs={tuple(k): v for k, v in job["constexprs"]},
                        attrs={tuple(k): v for k, v in job["attrs"]})
        opts = {"num_warps": job["num_warps"]}
        if job.get("num_stages") is not None:
            opts["num_stages"] = job["num_stages"]
        k = triton.compile(src, target=GPUTarget("cuda", job["cc"], 32), options=opts)
        ptx = k.asm["ptx"]
        out.update(ok=True, shared=int(k.metadata.shared), **_resources(k.asm["cubin"], job["cc"]),
                   tf32_mma=len(re.findall(r"mma\.sync\.aligned\.\S*\.tf32", ptx)), tf32_cvt=ptx.count("cvt.rna.tf32.f32"))
    except Exception as e:  # the caller reports it with the job
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    out["seconds"] = round(time.time() - t0, 2)
    return out


def main() -> None:
    jobs = json.load(sys.stdin)
    workers = int(os.environ.get("DDTREE_COMPILE_WORKERS") or min(8, os.cpu_count() or 1))
    workers = max(1, min(workers, len(jobs)))
    # the 8-warp launches (the large tiles, minutes to compile) first: the last to finish is short
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i]["num_warps"])
    results: list = [None] * len(jobs)
    if workers == 1:
        for i in order:
            results[i] = compile_one(jobs[i])
    else:
        with ProcessPoolExecutor(workers) as pool:
            for i, r in zip(order, pool.map(compile_one, [jobs[i] for i in order])):
                results[i] = r
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
