"""The public entry points of tensor parallelism, under the name the CLI imports
(`from ddtree.parallel import tp`). The code lives in the role modules (see ddtree.parallel)."""

from ddtree.parallel.comm import NCCL_ENV, SymmAllReduce, install_rank_stand_ins, install_tp_hooks
from ddtree.parallel.launch import check_world, close_worker, free_port, init_worker, run_tp
from ddtree.parallel.sharding import (load_target_shard, random_drafter, random_target_shard, rank_bytes_per_token,
                                      shard_config, shard_plan, shard_state_dict, shard_tensor)
from ddtree.parallel.workers import bench_worker, run_generate_tp, run_generate_tp_jobs, tp_worker_generate

__all__ = [
    "NCCL_ENV", "SymmAllReduce", "install_rank_stand_ins", "install_tp_hooks",
    "check_world", "close_worker", "free_port", "init_worker", "run_tp",
    "load_target_shard", "random_drafter", "random_target_shard", "rank_bytes_per_token",
    "shard_config", "shard_plan", "shard_state_dict", "shard_tensor",
    "bench_worker", "run_generate_tp", "run_generate_tp_jobs", "tp_worker_generate",
]
