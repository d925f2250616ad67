"""Tensor parallelism over W ranks (`ddtree generate --tp N`): NCCL on GPUs, gloo on CPU.

Each rank holds a contiguous block of every layer's heads / channels and a vocab block of the
lm_head (Megatron style; the layout is in `sharding`); two all-reduces per layer and one logits
all-gather per forward make every rank see the same logits, so every rank runs the same host
loop with the same seed and their trees and walks agree. The drafter is replicated.

Modules, each importing only the ones above it:

  comm      the collectives installed into a model's hooks (all-reduce, logits all-gather,
            SymmAllReduce, install_tp_hooks, NCCL_ENV) and their one-process stand-ins
  sharding  the slicing plan and one rank's shard (shard_config, shard_plan, shard_tensor,
            shard_state_dict, rank_bytes_per_token, load_target_shard, random_target_shard,
            random_drafter)
  launch    processes and the process group (free_port, check_world, init_worker, close_worker,
            spawn, run_tp)
  workers   what the ranks run (tp_worker_generate, run_generate_tp_jobs, run_generate_tp,
            bench_worker)
  tp        the public names above, re-exported for the CLI (`from ddtree.parallel import tp`)
"""
