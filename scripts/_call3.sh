#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
(timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/decode/test_split_gpu.py tests/ops/test_tree_kernel.py 2>&1 | tail -15) | tee $OUT/gpu-tests.log
timeout 170 python3 scripts/bench_chat.py --out $OUT/chat-h200.json 2>&1 | tail -22
timeout 150 python3 scripts/bench_auto.py --fixture .fixture/codepair --drafters drafter-distilled --out-dir $OUT 2>&1 | tail -14
timeout 100 python3 scripts/bench_startup.py --cases generate,selftest --states cold,warm --logs /tmp/sl --out $OUT/startup-codepair-h200.json 2>&1 | tail -5
ls $OUT
