#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
git log --oneline -1 | tee $OUT/gpu.txt
python3 -X importtime -c "import ddtree.app.cli, torch, transformers; from transformers import AutoTokenizer" 2>&1 | sort -t'|' -k2 -n | tail -6 | tee -a $OUT/gpu.txt
timeout 330 python3 scripts/bench_startup.py --cases generate,selftest --states cold,warm --probe --logs $OUT/startup --out $OUT/startup-codepair.json 2>&1 | tail -6
timeout 330 python3 scripts/bench_startup.py --cases preset --methods ar,ddtree:32 --states cold,warm --logs /tmp/pl --out $OUT/startup-27b.json 2>&1 | tail -4
tail -5 /tmp/pl/preset-cold.log
