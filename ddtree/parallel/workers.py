"""What the tensor-parallel ranks run: `ddtree generate --tp N` and the benchmark worker.

Every rank runs the same host loop (Decoder.generate) with the same seed on its shard plus the
replicated drafter; the gathered logits are bit-identical on every rank, so their trees and walks
agree and only rank 0 reports. `run_generate_tp_jobs(opts, jobs)` loads the shards once and runs
several generates (the CLI's entry); `run_generate_tp(opts)` runs one. `bench_worker` is the
random-weight twin for benchmarks (through ddtree.parallel.launch.run_tp).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from ddtree.model.config import TargetConfig
from ddtree.parallel.launch import check_world, close_worker, free_port, init_worker, put_message, spawn
from ddtree.parallel.sharding import load_target_shard, random_drafter, random_target_shard, shard_config


def gen_kwargs(opts: dict, job: dict) -> dict:
    """Decoder.generate's keyword arguments from opts overridden by one job's keys."""
    from ddtree.decode.sampling import SamplingParams

    o = {**opts, **job}
    return dict(
        prompt_ids=list(o["prompt_ids"]),
        method=o.get("method", "ddtree"),
        budget=o.get("budget", 32) if o.get("budget") == "auto" else int(o.get("budget", 32)),
        sampling=SamplingParams(float(o.get("temperature", 0.0) or 0.0), float(o.get("top_p", 1.0) or 1.0),
                                int(o.get("top_k", 0) or 0)),
        max_new_tokens=int(o.get("max_new_tokens", 128)),
        stop_ids=set(o.get("stop_ids") or ()),
        seed=o.get("seed", 0),
        top1_first=bool(o.get("top1_first", False)),
        prompt_id=str(o.get("prompt_id", "")),
    )


def _max_len(opts: dict, jobs: list[dict]) -> int:
    if opts.get("max_length"):
        return int(opts["max_length"])
    need = 0
    for job in jobs:
        o = {**opts, **job}
        tree = max(int(o.get("budget", 32)), 64) + 1
        need = max(need, len(o["prompt_ids"]) + int(o.get("max_new_tokens", 128)) + tree)
    return need


def _decoder_kw(opts: dict) -> dict:
    """Decoder arguments of a worker: the engine switches from its environment (inherited from the
    parent), and `use_graphs` (False = eager on CUDA) and `compile` when the caller gives them."""
    from ddtree.options import Options

    kw = {k: opts[k] for k in ("use_graphs", "compile") if opts.get(k) is not None}
    return dict(kw, options=Options.from_env())


def bench_worker(rank: int, world: int, device, target_raw: dict, drafter_raw: dict | None, dtype, jobs: list[dict],
                 max_len: int, seed: int = 0, use_graphs: bool | None = None) -> list:
    """For run_tp: random-weight target shard (+ replicated random drafter), then one
    Decoder.generate per job (kwargs as for gen_kwargs: method, budget, prompt_ids,
    max_new_tokens, ...). Returns the GenerationRecords (every rank computes them; run_tp hands
    back rank 0's). world=1 gives the single-GPU baseline through the same code."""
    from ddtree.decode.decoder import Decoder

    target = random_target_shard(target_raw, rank, world, device, dtype, max_len, seed)
    drafter = random_drafter(drafter_raw, target, device, dtype, max_len, seed + 1) if drafter_raw else None
    dec = Decoder(target, drafter, max_len, **_decoder_kw({"use_graphs": use_graphs}))
    return [dec.generate(**gen_kwargs({}, job)) for job in jobs]


def tp_worker_generate(rank: int, world: int, opts: dict, result_queue=None) -> list:
    """One TP rank: set up, load the shard + replicated drafter, run every job of opts (or the one
    generate opts describes) with the same seed as the other ranks. Rank 0 sends ("tokens", job,
    ids) as they are decoded and ("record", job, GenerationRecord) to result_queue. Returns the
    records (rank 0) or [].

    opts: target, drafter, method, budget, max_new_tokens, temperature, top_p, top_k, seed, dtype,
    max_length, prompt_ids, stop_ids, tp; optional: jobs (list of per-generate overrides, e.g.
    {'method': 'ar', 'prompt_ids': [...], 'prompt_id': 'p1'}), init_method (default env://),
    device_type ('cuda' | 'cpu' | None = auto), top1_first, prompt_id, stream (send tokens),
    use_graphs (Decoder's; None = its default)."""
    from ddtree.model.checkpoint import load_drafter, parse_dtype, resolve_model_dir
    from ddtree.decode.decoder import Decoder

    device = init_worker(rank, world, opts.get("init_method"), opts.get("device_type"))
    jobs = opts.get("jobs") or [{}]
    dtype = parse_dtype(opts.get("dtype") or "bfloat16")
    max_len = _max_len(opts, jobs)
    target = load_target_shard(resolve_model_dir(str(opts["target"]), "target"), rank, world, device, dtype, max_len)
    drafter = None
    if opts.get("drafter"):
        drafter, _ = load_drafter(str(opts["drafter"]), target, dtype, max_len, device=device)
    dec = Decoder(target, drafter, max_len, **_decoder_kw(opts))  # after the hooks: it copies target.gather_logits
    records = generate_jobs(dec, opts, jobs, rank, result_queue)
    close_worker()
    return records


def generate_jobs(dec, opts: dict, jobs: list[dict], rank: int = 0, result_queue=None) -> list:
    """One rank's generations, in order (rank 0 keeps the records and sends them, and the tokens
    where opts stream, to result_queue). The worker keeps this decoder for its life: from the
    second job on, what the jobs before compiled or captured is frozen first (freeze_heap, as
    `generate --prompts` and chat do), every rank at the same point, so no full collection of it
    lands inside a generation (a bench's timed ones among them)."""
    from ddtree.decode.startup import freeze_heap

    records = []
    for i, job in enumerate(jobs):
        if i:
            freeze_heap(dec.graphs)
        kw = gen_kwargs(opts, job)
        on_tokens = None
        if rank == 0 and result_queue is not None and opts.get("stream", True):
            on_tokens = partial(_put_tokens, result_queue, i)
        rec = dec.generate(on_tokens=on_tokens, **kw)
        if rank == 0:
            records.append(rec)
            if result_queue is not None:
                put_message(result_queue, "record", i, rec)
    return records


def _put_tokens(q, job: int, toks: list[int]):
    put_message(q, "tokens", job, list(toks))


def _prepare(opts: dict) -> tuple[dict, int]:
    """Validate in the parent (one clear error before any process starts) and resolve references."""
    from ddtree.model.checkpoint import parse_dtype, resolve_model_dir

    world = int(opts.get("tp") or 1)
    check_world(world, opts.get("device_type"))
    o = dict(opts)
    tdir = resolve_model_dir(str(o["target"]), "target")
    shard_config(TargetConfig.from_file(tdir / "config.json"), world)
    o["target"] = str(tdir)
    if o.get("drafter"):
        o["drafter"] = str(resolve_model_dir(str(o["drafter"]), "drafter"))
    parse_dtype(o.get("dtype") or "bfloat16")
    o["init_method"] = f"tcp://127.0.0.1:{free_port()}"
    return o, world


def run_generate_tp_jobs(opts: dict, jobs: list[dict], on_tokens: Callable[[int, list[int]], None] | None = None,
                         decode_text: Callable[[list[int]], str] | None = None) -> list:
    """Load the shards once and run several generates (per-job overrides of opts) under TP.
    on_tokens(job_index, ids) streams rank 0's tokens in this process. Returns the records."""
    o, world = _prepare(opts)
    o["jobs"] = [dict(j) for j in jobs]
    o["stream"] = on_tokens is not None
    records: dict[int, Any] = {}

    def on_message(msg):
        if msg[0] == "tokens" and on_tokens is not None:
            on_tokens(msg[1], msg[2])
        elif msg[0] == "record":
            records[msg[1]] = msg[2]

    spawn(world, tp_worker_generate, (world, o), on_message)
    if len(records) != len(jobs):
        raise RuntimeError(f"tensor-parallel workers returned {len(records)} of {len(jobs)} generation records")
    out = [records[i] for i in range(len(jobs))]
    if decode_text is not None:
        for rec in out:
            rec.text = decode_text(rec.token_ids)
    return out


def run_generate_tp(opts: dict, on_tokens: Callable[[list[int]], None] | None = None,
                    decode_text: Callable[[list[int]], str] | None = None):
    """`ddtree generate --tp N`: spawn N ranks, generate once, return rank 0's GenerationRecord.

    Tokens are streamed to on_tokens(ids) in this process as rank 0 decodes them; decode_text
    (the tokenizer's decode) fills record.text. Same opts as tp_worker_generate."""
    cb = None if on_tokens is None else (lambda _i, toks: on_tokens(toks))
    return run_generate_tp_jobs(opts, [{}], on_tokens=cb, decode_text=decode_text)[0]
