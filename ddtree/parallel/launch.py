"""Starting the tensor-parallel ranks: one process per rank, a process group, a result queue.

`run_tp(world, fn, *args)` runs fn(rank, world, device, *args) in `world` fresh processes
(torch.multiprocessing, TCP rendezvous on a free local port: no launcher is needed), with NCCL
on cuda:rank or gloo on CPU, and returns rank 0's result. `spawn` is the machinery under it (and
under ddtree.parallel.workers.run_generate_tp_jobs): workers report through a queue of pickled
messages (`put_message`), ("error", text) for a DDTreeError, anything else for the caller's
on_message while they run.
"""

from __future__ import annotations

import os
import pickle
import queue as _queue
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddtree.errors import DDTreeError
from ddtree.options import Options
from ddtree.parallel.comm import NCCL_ENV


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _want_cuda(device_type: str | None) -> bool:
    if device_type in (None, "", "auto"):
        return torch.cuda.is_available()
    if device_type == "cuda" and not torch.cuda.is_available():
        raise DDTreeError("--tp asks for CUDA but CUDA is not available here: pass --devices cpu to use gloo on CPU")
    return device_type == "cuda"


def check_world(world: int, device_type: str | None = None) -> None:
    if world < 1:
        raise DDTreeError(f"--tp {world} must be at least 1")
    if _want_cuda(device_type) and world > torch.cuda.device_count():
        raise DDTreeError(f"--tp {world} needs {world} GPUs but only {torch.cuda.device_count()} are visible: lower --tp")


def init_worker(rank: int, world: int, init_method: str | None = None, device_type: str | None = None,
                quiet: bool = True) -> torch.device:
    """Per-process setup: NCCL multicast off, device, process group. Returns the rank's device.

    init_method None: env:// (a launcher such as torchrun set MASTER_ADDR / MASTER_PORT)."""
    for k, v in NCCL_ENV.items():
        os.environ[k] = v
    if quiet and rank > 0:  # ranks > 0 print nothing
        sys.stdout = open(os.devnull, "w")
        try:
            from loguru import logger

            logger.remove()
        except ImportError:
            pass
        import warnings

        warnings.filterwarnings("ignore")
    cuda = _want_cuda(device_type)
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if not dist.is_initialized():
        kw: dict[str, Any] = {"backend": "nccl" if cuda else "gloo", "rank": rank, "world_size": world,
                              "init_method": init_method or "env://"}
        if cuda:
            kw["device_id"] = device
        dist.init_process_group(**kw)
    return device


def close_worker() -> None:
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        # Every collective has completed (each rank synced on its last round) and the worker ends
        # with os._exit next. `generate --tp 2` was seen to hang at exit under NCCL on 2x H200
        # (cause not located yet); barrier and destroy are the two calls here that can block.
        return
    try:
        dist.barrier()
    except Exception:
        pass
    dist.destroy_process_group()


# forkserver: torch is imported once into the server process, later worker starts take ~0.1 s
# instead of a fresh interpreter importing torch. DDTREE_TP_START=spawn picks plain spawn.
START_METHOD = Options.from_env().tp_start
_PRELOAD = ["ddtree.parallel.workers", "ddtree.decode.decoder", "ddtree.model.checkpoint"]


def _entry(rank, fn, args, q):
    """Worker process body: fn(rank, *args, q); report a DDTreeError; skip the slow interpreter
    teardown on success (the queue is flushed first)."""
    try:
        fn(rank, *args, q)
    except DDTreeError as e:
        put_message(q, "error", str(e))
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    q.close()
    q.join_thread()
    os._exit(0)


def spawn(world: int, fn: Callable, args: tuple, on_message: Callable[[tuple], None]):
    """Start `world` processes running fn(rank, *args, queue); pass each queued message to
    on_message while they run. Raises DDTreeError if a worker reported one."""
    import torch.multiprocessing as mp

    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    q = ctx.Queue()
    errors: list[str] = []

    def drain(wait: float):
        while True:
            try:
                msg = pickle.loads(q.get(timeout=wait) if wait else q.get_nowait())
            except _queue.Empty:
                return
            if msg[0] == "error":
                errors.append(msg[1])
            else:
                on_message(msg)
            wait = 0

    pc = mp.start_processes(_entry, args=(fn, args, q), nprocs=world, join=False, start_method=START_METHOD)
    try:
        while True:
            drain(0)
            if pc.join(timeout=0.05):
                break
        drain(0.2)
    except Exception:
        drain(0.2)
        if errors:
            raise DDTreeError(errors[0]) from None
        raise
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.terminate()
    if errors:
        raise DDTreeError(errors[0])


def put_message(q, *msg):
    q.put(pickle.dumps(msg))  # plain pickle: no shared-memory tensors outliving their sender


def _run_tp_worker(rank, world, init_method, device_type, fn, args, all_ranks, q):
    device = init_worker(rank, world, init_method, device_type)
    res = fn(rank, world, device, *args)
    if rank == 0 or all_ranks:
        put_message(q, "result", rank, res)
    close_worker()


def run_tp(world: int, fn: Callable, *args, device_type: str | None = None, all_ranks: bool = False):
    """Run fn(rank, world, device, *args) in `world` fresh processes with a process group set up
    (NCCL on cuda:rank, or gloo on CPU). Returns rank 0's result (all ranks' list if all_ranks).

    fn must be importable (module level) and its result picklable."""
    check_world(world, device_type)
    results: dict[int, Any] = {}

    def on_message(msg):
        if msg[0] == "result":
            results[msg[1]] = msg[2]

    spawn(world, _run_tp_worker, (world, f"tcp://127.0.0.1:{free_port()}", device_type, fn, args, all_ranks), on_message)
    if all_ranks:
        return [results.get(r) for r in range(world)]
    return results.get(0)
