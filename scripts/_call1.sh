#!/usr/bin/env bash
# device call 1: baselines (start-up cold/warm with compile counters; the failing GPU test; the 27B round profile)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/gpu.txt
(timeout 90 python3 -m pytest -q -x tests/test_gpu.py -k compiled_prefill 2>&1 | tail -30) | tee $OUT/gputest.log
timeout 260 python3 scripts/bench_startup.py --cases generate --states cold,warm --probe --logs $OUT/startup --out $OUT/startup.json 2>&1 | tail -8
timeout 230 python3 scripts/profile_round.py --preset qwen3.6-27b --methods ar,ddtree:32 --graphs --tokens 24 --top 40 --out $OUT/profile-27b.json 2>&1 | grep -v Warn | tee $OUT/profile-27b.log | tail -60
