"""The memory plan (ddtree.app.plan) on the exact Qwen3.6-27B + DFlash configs, `ddtree plan`, and
the check `generate` / `bench` run before loading. CPU only, configs only.

Figures these tests state (bf16, --budget 32, CUDA context and workspace reserved; the prefill in
chunks the engine picks from the first GPU's free memory, its GDN chain through fla's kernel):
  2 x 48 GiB, the split-KV attention kernel (the engine's verify and draft wherever Triton runs,
    and the default with --gpu-memory): the model's whole 262144 fits.
  2 x 48 GiB, torch's math SDPA for the verify's and draft's masked attention (its fallback, e.g.
    DDTREE_ATTENTION=sdpa on an RTX A6000), the eager split (DDTREE_EAGER_SPLIT=1): 128K fits, up to
    --max-length 149504 (past it, the verify's fp32 K/V expanded to the query heads outgrow a GPU:
    ~10 GiB at 128K). The graphed split (the default) keeps a verify's and a draft's transients per
    captured context bucket: up to 53248 on the math path; 262144 still on the kernel's and fused paths.
  2 x 48 GiB, a fused SDPA kernel (cuDNN attention: H100/H200): the model's whole 262144 fits.
  1 x 80 GB (74.5 GiB, CUDA graphs): up to 35840 with the math path, 153600 with a fused one.
  1 x H200 (141 GB = 131.3 GiB): up to 167936 with the math path; 262144 with a fused one.
  2 x 24 GB: the weights alone (53.33 GiB) do not fit; 3 such GPUs hold 32K.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from conftest import REPO, cli_env
from ddtree.app import plan as planmod
from ddtree.app.cli import app
from ddtree.app.plan import check_fits, format_plan, parse_gpu_memory, plan_for_devices, plan_memory
from ddtree.errors import DDTreeError
from ddtree.model import memory as mem
from ddtree.model.config import DrafterConfig, TargetConfig
from ddtree.model.placement import EXACT_ROWS, GiB, WEIGHT_ROWS, Workload, place
from ddtree.model.presets import qwen36_27b_config, qwen36_27b_dflash_config

T = TargetConfig.from_dict(qwen36_27b_config())
D = DrafterConfig.from_dict(qwen36_27b_dflash_config(), T.num_layers)
NAME = "Qwen/Qwen3.6-27B"


def qplan(gpu_memory: str, max_len: int, attention: str, **kw):
    caps = parse_gpu_memory(gpu_memory)
    return plan_memory(T, D, [f"cuda:{i}" for i in range(len(caps))], caps, max_len, "bfloat16",
                       attention=attention, name=NAME, **kw)


def error_of(plan) -> str:
    with pytest.raises(DDTreeError) as e:
        check_fits(plan)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_weights_of_the_27b_pair():
    """53.33 GiB of weights (50.10 target + 3.22 drafter), whatever the split."""
    plan = qplan("2x48GiB", 4096, "fused", search=False)
    weights = sum(r[k] for r in plan.split.gpus.values() for k in WEIGHT_ROWS)
    fp32_copies = sum(mem.layer_prepared_bytes(T, k, "bfloat16") for k in T.layer_types) + mem.head_prepared_bytes(T)
    assert weights == mem.target_weight_bytes(T, "bfloat16") + mem.drafter_weight_bytes(D, "bfloat16") + fp32_copies
    assert round(weights / GiB, 2) == 53.33


def test_2x48gib_fits_128k_with_the_math_sdpa_path():
    """The A6000 case (and --gpu-memory's default path) on the eager split: 128K fits, up to 149504."""
    plan = qplan("2x48GiB", 131072, "math", graphs=False)
    check_fits(plan)
    assert plan.fits and plan.largest == 149504  # how far it fits: 1.14x the 128K asked for
    split = plan.split
    assert split.drafter_device == "cuda:1"
    assert split.stages[0].start == 0 and split.stages[1].end == T.num_layers
    for g, rows in split.gpus.items():
        assert rows["total"] <= 48 * GiB
        assert split.peak_phase(g) == "verify"  # the math SDPA of a 33-node verify over 128K keys
    # the K/V of 128K: 16 attention layers x 131072 x 4 heads x 256 x 2 (K, V) x 2 bytes = 8 GiB
    assert sum(r["K/V cache"] for r in split.gpus.values()) == 8 * GiB
    # the prefill: the chunk the engine would pick from cuda:0's free memory, its taps per chunk
    assert split.prefill_chunk == mem.prefill_chunk_tokens(T, 48 * GiB - GiB // 2 - sum(
        split.gpus["cuda:0"][r] for r in EXACT_ROWS)) == 7424
    # the bound found is the boundary: one step further does not fit
    over = place(T, D, ["cuda:0", "cuda:1"], Workload(**{**split.workload.__dict__, "max_len": 149504 + 1024}),
                 plan.capacities)
    assert not over.fits


def test_2x48gib_with_a_fused_attention_kernel_fits_the_models_maximum():
    plan = qplan("2x48GiB", T.max_position_embeddings, "fused")
    check_fits(plan)
    assert plan.fits and plan.largest == T.max_position_embeddings == 262144
    assert {plan.split.peak_phase(g) for g in plan.split.gpus} == {"prefill"}


def test_2x48gib_refuses_the_models_maximum_with_the_math_path_and_names_149504():
    plan = qplan("2x48GiB", 262144, "math", graphs=False)
    assert not plan.fits and plan.largest == 149504
    msg = error_of(plan)
    assert msg.startswith(f"{NAME} at --max-length 262144 needs ")
    assert "the largest --max-length that fits these devices is 149504" in msg and "--max-length 149504" in msg
    assert "DDTREE_EAGER_SPLIT" not in msg  # already the eager split
    check_fits(qplan("2x48GiB", 149504, "math", search=False, graphs=False))


def test_2x48gib_graphed_split_holds_graph_pools_and_names_the_eager_split():
    """The graphed split (the default: graph pools on both GPUs): the kernel's path still holds the
    model's whole 262144; the math path up to 53248, and where only the eager split fits, the
    error names its switch."""
    for attention in ("kernel", "fused"):
        plan = qplan("2x48GiB", 262144, attention, graphs=True)
        assert plan.fits and plan.largest == 262144
        assert all(rows["graph pools"] > 0 for rows in plan.split.gpus.values())
    plan = qplan("2x48GiB", 131072, "math", graphs=True)
    assert not plan.fits and plan.largest == 53248
    msg = error_of(plan)
    assert "fits these devices is 53248" in msg and msg.endswith("with DDTREE_EAGER_SPLIT=1")
    assert qplan("2x48GiB", 131072, "math").largest == 53248  # graphed is what the environment's default plans


def test_1x80gb():
    """80 GB = 74.5 GiB, one GPU (CUDA graphs and their pools): the model's full 262144 refuses."""
    for attention, largest in (("math", 35840), ("fused", 153600)):
        plan = qplan("80GB", T.max_position_embeddings, attention)
        assert plan.largest == largest
        assert f"the largest --max-length that fits these devices is {largest}" in error_of(plan)
        assert plan.split.gpus["cuda:0"]["graph pools"] > 0
    check_fits(qplan("80GB", 32768, "fused"))


def test_1x_h200():
    """141 GB = 131.3 GiB: the model's whole context with a fused SDPA kernel (as an H200 runs
    cuDNN attention), up to 167936 on the math path."""
    plan = qplan("141GB", T.max_position_embeddings, "fused")
    check_fits(plan)
    assert plan.largest == 262144 and plan.split.prefill_chunk == 8192
    plan = qplan("141GB", T.max_position_embeddings, "math")
    assert plan.largest == 167936
    assert "the largest --max-length that fits these devices is 167936" in error_of(plan)


def test_2x24gb_refuses_naming_how_many_gpus():
    msg = error_of(qplan("2x24GB", 32768, "fused"))
    assert "the weights alone (53.33 GiB) exceed 2 x 22.35 GiB" in msg
    assert "3 x 22.35 GiB would hold it at this --max-length (--devices cuda:0,cuda:1,cuda:2)" in msg
    msg = error_of(qplan("2x24GB", 1024, "math"))
    assert "3 x 22.35 GiB would hold it" in msg and "--devices cuda:0,cuda:1,cuda:2)" in msg


def test_budget_auto_plans_the_deferred_context_on_the_drafters_gpu():
    plan = qplan("2x48GiB", 131072, "math", search=False, deferred=True, verify_nodes=65)
    rows = {g: r["deferred context"] for g, r in plan.split.gpus.items()}
    assert rows == {"cuda:0": 0, "cuda:1": mem.deferred_context_bytes(T, D, "bfloat16")}
    assert rows["cuda:1"] == 64 * 5 * 5120 * 2 + 8 + 64 * 8  # [64, taps x hidden] bf16, count, index
    assert "deferred drafter context (auto)" in format_plan(plan)


def test_chat_plans_its_gdn_snapshots_on_every_gdn_gpu():
    """ddtree chat (plan --chat) keeps mem.CHAT_SNAPSHOTS copies of each GPU's GDN states: 4 x 154 MB
    over the 27B target's 48 GDN layers, split as the layers are."""
    plain = qplan("2x48GiB", 131072, "math", search=False)
    plan = qplan("2x48GiB", 131072, "math", search=False, snapshots=mem.CHAT_SNAPSHOTS)
    rows = {g: r["GDN snapshots"] for g, r in plan.split.gpus.items()}
    assert {g: r["GDN snapshots"] for g, r in plain.split.gpus.items()} == {g: 0 for g in rows}
    assert all(rows[g] == mem.CHAT_SNAPSHOTS * plan.split.gpus[g]["GDN states"] for g in rows)
    assert sum(rows.values()) == mem.CHAT_SNAPSHOTS * mem.gdn_snapshot_bytes(T, 48, "bfloat16", 1)
    assert round(sum(rows.values()) / mem.CHAT_SNAPSHOTS / 1e6) == 154  # 151 MB of fp32 recurrent states, 3 of conv rows
    assert "GDN snapshots (chat's turn boundaries)" in format_plan(plan)


def test_format_plan_table():
    plan = qplan("2x48GiB", 131072, "math", graphs=False)
    text = format_plan(plan)
    lines = text.splitlines()
    assert lines[0].startswith(f"memory plan: {NAME} (64 layers: 48 GDN + 16 attention) + 5-layer DFlash drafter")
    assert lines[1].startswith("verify / draft attention: torch's math SDPA")
    assert lines[2].startswith("prefill: chunks of 7424 tokens (the engine's pick from cuda:0's free memory), flash attention")
    header = next(ln for ln in lines if ln.split() == ["cuda:0", "cuda:1"])
    assert header
    for label in ("layers", "K/V cache", "GDN states", "GDN tree-verify scratch", "drafter K/V cache + rope",
                  "~ activations", "~ CUDA-graph pools", "~ workspace", "total", "capacity (total)", "free after",
                  "read per step (at 131072)"):
        assert any(ln.startswith(label) for ln in lines), label
    kv = next(ln for ln in lines if ln.startswith("K/V cache")).split()
    n_attn = [T.layer_types[s.start:s.end].count("full_attention") for s in plan.split.stages]
    assert kv[2:] == [f"{n / 2:.2f}" if i % 2 == 0 else "GiB" for n in n_attn for i in range(2)]  # 0.5 GiB a layer
    layers = next(ln for ln in lines if ln.startswith("layers")).split()
    assert layers[1:] == [f"{s.start}-{s.end - 1}" for s in plan.split.stages]
    peak = next(ln for ln in lines if ln.strip().startswith("peak in")).split()
    assert peak[2:] == ["verify", "verify"]
    assert lines[-1].startswith("fits: ") and "the largest --max-length that fits is 149504 (1.14x the requested 131072)" in lines[-1]
    assert "peak in" in format_plan(qplan("2x48GiB", 262144, "fused", search=False)) and "prefill chunk" in format_plan(
        qplan("2x48GiB", 262144, "fused", search=False))


@pytest.mark.parametrize("spec,sizes", [("2x48GiB", [48 * GiB] * 2), ("48GiB,48GiB", [48 * GiB] * 2),
                                        ("80GB", [80 * 10**9]), ("47.5GiB", [int(47.5 * GiB)]),
                                        ("1x24GB, 2 x 16GiB", [24 * 10**9, 16 * GiB, 16 * GiB])])
def test_parse_gpu_memory(spec, sizes):
    assert parse_gpu_memory(spec) == sizes


@pytest.mark.parametrize("spec", ["48G", "48", "0GiB", "", "2x", "fast"])
def test_parse_gpu_memory_errors(spec):
    with pytest.raises(DDTreeError):
        parse_gpu_memory(spec)


# ------------------------------------------------------------------------------------------ ddtree plan


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("q36")
    for sub, cfg in (("target", qwen36_27b_config()), ("drafter", qwen36_27b_dflash_config())):
        (root / sub).mkdir()
        (root / sub / "config.json").write_text(json.dumps(cfg))
    return root


def invoke(*args):
    return CliRunner().invoke(app, ["plan", *map(str, args)])


def one_error_line(r) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_cli_plan_prints_the_table(models, monkeypatch):
    """--gpu-memory plans for the engine's split-KV attention kernel (the verify and the draft take
    no mask) unless --attention says otherwise: 2 x 48 GiB holds the model's whole 262144; with
    the math SDPA fallback (DDTREE_ATTENTION=sdpa, or no Triton) on the eager split up to 149504."""
    r = invoke("--target", models / "target", "--drafter", models / "drafter", "--gpu-memory", "2x48GiB",
               "--max-length", 131072)
    assert r.exit_code == 0, r.stderr
    assert "cuda:0" in r.stdout and "cuda:1" in r.stdout and "K/V cache" in r.stdout and "free after" in r.stdout
    assert "the largest --max-length that fits is 262144" in r.stdout and "split-KV attention kernel" in r.stdout
    assert r.stderr.strip() == ""
    monkeypatch.setenv("DDTREE_EAGER_SPLIT", "1")
    r = invoke("--target", models / "target", "--drafter", models / "drafter", "--gpu-memory", "2x48GiB",
               "--max-length", 131072, "--attention", "math")
    assert r.exit_code == 0, r.stderr
    assert "the largest --max-length that fits is 149504" in r.stdout and "torch's math SDPA" in r.stdout
    monkeypatch.delenv("DDTREE_EAGER_SPLIT")
    r = invoke("--target", models / "target", "--drafter", models / "drafter", "--gpu-memory", "2x48GiB",
               "--max-length", 131072, "--attention", "fused", "--budget", "auto")
    assert r.exit_code == 0, r.stderr
    assert "the model's maximum" in r.stdout and "deferred drafter context (auto)" in r.stdout


def test_cli_plan_for_gpus_elsewhere_takes_their_attention_without_triton_here(models, monkeypatch):
    """On a machine without Triton (a laptop, a CPU build of torch) --gpu-memory plans for what those
    CUDA GPUs run: the split-KV kernel (Triton ships with CUDA builds of torch), and the header says
    so. 2 x 48 GiB holds 131072 for Qwen3.6-27B + DFlash with room to spare; 2 x 24 GiB is refused."""
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    for switch in ("DDTREE_ATTENTION", "DDTREE_NO_TRITON"):
        monkeypatch.delenv(switch, raising=False)
    assert planmod.engine_attention() == "math"  # what this machine's own GPUs would take
    r = invoke("--target", models / "target", "--drafter", models / "drafter", "--gpu-memory", "2x48GiB",
               "--max-length", 131072, "--budget", 32)  # (a 33-node verify: the figure below)
    assert r.exit_code == 0, r.stdout + r.stderr
    head = r.stdout.splitlines()[1]
    assert head.startswith("verify / draft attention: the split-KV attention kernel"), head
    assert "Triton ships with CUDA builds of torch" in head
    assert "fits: 8.81 GiB to spare on cuda:0" in r.stdout
    line = one_error_line(invoke("--target", models / "target", "--drafter", models / "drafter", "--gpu-memory",
                                 "2x24GiB", "--max-length", 131072))
    assert "the weights alone (53.33 GiB) exceed 2 x 24.00 GiB" in line, line
    monkeypatch.setenv("DDTREE_ATTENTION", "sdpa")  # an engine switch still holds the plan to SDPA
    r = invoke("--target", models / "target", "--drafter", models / "drafter", "--gpu-memory", "2x48GiB",
               "--max-length", 131072)
    assert "torch's math SDPA" in r.stdout and "as DDTREE_ATTENTION=sdpa asks" in r.stdout


def test_cli_plan_that_does_not_fit(models, monkeypatch):
    """The table on stdout, then one error line: exit 2 (as generate would fail)."""
    monkeypatch.setenv("DDTREE_EAGER_SPLIT", "1")
    r = invoke("--target", models / "target", "--drafter", models / "drafter", "--gpu-memory", "2x48GiB",
               "--max-length", 262144, "--attention", "math")
    line = one_error_line(r)
    assert "the largest --max-length that fits these devices is 149504" in line
    assert "K/V cache" in r.stdout and "does not fit" in r.stdout


def test_cli_plan_defaults_to_the_models_max_positions(models):
    r = invoke("--target", models / "target", "--drafter", models / "drafter", "--gpu-memory", "8x80GB")
    assert r.exit_code == 0, r.stderr
    assert "--max-length 262144" in r.stdout.splitlines()[0]
    assert "the model's maximum" in r.stdout
    header = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == ["cuda:0"])
    assert header.split() == [f"cuda:{i}" for i in range(8)]


@pytest.mark.parametrize("args,needle", [
    (["--gpu-memory", "48G"], "--gpu-memory entry '48G' is not a size"),
    (["--gpu-memory", "2x48GiB", "--devices", "cpu"], "pass cuda:N entries"),
    (["--gpu-memory", "3x48GiB", "--devices", "cuda:0,cuda:1"], "gives 3 sizes for 2 GPUs"),
    (["--gpu-memory", "48GiB", "--attention", "flash"], "unknown --attention 'flash'"),
    (["--gpu-memory", "48GiB", "--budget", "many"], "--budget 'many'"),
    (["--gpu-memory", "48GiB", "--dtype", "int8"], "unknown --dtype 'int8'"),
    (["--gpu-memory", "48GiB", "--max-length", "-5"], "'--max-length'"),  # the command line's own range check
])
def test_cli_plan_bad_input_is_one_line(models, args, needle):
    line = one_error_line(invoke("--target", models / "target", *args))
    assert needle in line, line


def test_cli_plan_bad_model_references(models, tmp_path, monkeypatch):
    assert "no target model" in one_error_line(invoke("--gpu-memory", "48GiB"))
    assert "not found" in one_error_line(invoke("--target", tmp_path / "nope", "--gpu-memory", "48GiB"))
    assert "has no config.json" in one_error_line(invoke("--target", tmp_path, "--gpu-memory", "48GiB"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = one_error_line(invoke("--target", "no-such-org-xyz/no-such-model", "--gpu-memory", "48GiB"))
    assert "not in the local Hugging Face cache" in line and "hf download no-such-org-xyz/no-such-model config.json" in line
    bad = tmp_path / "wrong"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**qwen36_27b_dflash_config(), "hidden_size": 4096}))
    assert "not trained for this target" in one_error_line(
        invoke("--target", models / "target", "--drafter", bad, "--gpu-memory", "48GiB"))


def test_cli_plan_without_gpus_or_sizes(models):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the plan would use it")
    assert "no GPU is visible here: pass --gpu-memory" in one_error_line(invoke("--target", models / "target"))


def test_cli_plan_imports_no_torch(models):
    """From the configs alone: a plan imports no torch; a bad argument fails before torch and
    transformers are imported (fast)."""
    head = "import sys\nfrom typer.testing import CliRunner\nfrom ddtree.app.cli import app\n"
    target = str(models / "target")
    ok = f"r = CliRunner().invoke(app, ['plan', '--target', {target!r}, '--gpu-memory', '80GB', '--max-length', '4096'])\n"
    bad = f"r = CliRunner().invoke(app, ['plan', '--target', {target!r}, '--gpu-memory', '80'])\n"
    tail = "print(r.exit_code, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    for body, want in ((ok, "0 False"), (bad, "2 False False")):
        r = subprocess.run([sys.executable, "-c", head + body + tail], capture_output=True, text=True, cwd=str(REPO),
                           env=cli_env(), timeout=120)
        assert r.stdout.startswith(want), r.stdout + r.stderr


# ------------------------------------------------------------------------------------------ before loading


def test_plan_for_devices_skips_cpu():
    assert plan_for_devices(T, D, ["cpu"], 4096, "float32") is None


def test_plan_for_devices_against_free_memory(monkeypatch):
    """The check generate / bench run: free memory per GPU (no CUDA context reserved: it exists),
    the SDPA path the GPUs take; one line naming what fits, or the split to load with."""
    seen = {}

    def free(devices, kind):
        seen["kind"] = kind
        return {"cuda:0": 40 * GiB, "cuda:1": 40 * GiB}

    monkeypatch.setattr(planmod, "gpu_capacities", free)
    monkeypatch.setattr(planmod, "attention_path", lambda *a: "math")
    devs = ["cuda:0", "cuda:1"]
    with pytest.raises(DDTreeError) as e:
        plan_for_devices(T, D, devs, 131072, "bfloat16", room=33, name=NAME)
    msg = str(e.value)
    assert seen["kind"] == "free" and "(40.00 GiB free)" in msg and "the largest --max-length that fits these devices is" in msg
    split = plan_for_devices(T, D, devs, 8192, "bfloat16", room=33)
    assert len(split.layer_devices) == T.num_layers and split.drafter_device == "cuda:1"
    assert split.workload.context == 0 and split.workload.attention == "math" and split.workload.verify_nodes == 33
    assert split.workload.fla == planmod.fla_in_use(devs) and not split.workload.deferred
    # the prefill chunk the engine picks from cuda:0's free memory once the weights and state are in
    assert split.prefill_chunk == mem.prefill_chunk_tokens(T, 40 * GiB - sum(split.gpus["cuda:0"][r] for r in EXACT_ROWS))
    monkeypatch.setattr(planmod, "fla_in_use", lambda *a: False)
    split = plan_for_devices(T, D, devs, 8192, "bfloat16", room=65, auto=True)
    assert split.workload.deferred and not split.workload.fla and split.gpus["cuda:1"]["deferred context"] > 0


def test_load_models_plans_before_reading_weights(monkeypatch, tmp_path):
    from ddtree.app import setup as bench
    from ddtree.model import checkpoint

    calls = []
    monkeypatch.setattr(planmod, "plan_for_devices", lambda *a, **k: calls.append((a, k)) or (_ for _ in ()).throw(
        DDTreeError("does not fit")))
    monkeypatch.setattr(checkpoint, "load_target", lambda *a, **k: pytest.fail("weights read before the plan"))
    spec = bench.ModelSpec(target_ref=NAME, target_dir=tmp_path, target_cfg=T, drafter_cfg=D, devices=["cuda:0"])
    with pytest.raises(DDTreeError, match="does not fit"):
        bench.load_models(spec, 4096, True, room=33, auto=True)
    (args, kw), = calls
    assert args[1] is D and args[3] == 4096 and kw["auto"] is True  # --budget auto: its deferred context planned


def test_load_models_makes_auto_deferred_context_before_the_weights(monkeypatch, tmp_path):
    """On GPUs (a split planned) --budget auto's deferred context is made after the plan and before
    any weight, on the drafter's device: a fresh allocator segment is split to its size there, while
    made after the weights it may be handed a free tail up to 1 MiB larger whole (the 32K memory
    plan's 1.108). Without --budget auto none is made at load."""
    from types import SimpleNamespace

    from ddtree.app import setup as bench
    from ddtree.decode.round import DeferredContext
    from ddtree.model import checkpoint

    order = []
    split = SimpleNamespace(drafter_device="cuda:1", layer_stages=[0] * T.num_layers, drafter_stage=1)
    monkeypatch.setattr(planmod, "plan_for_devices", lambda *a, **k: order.append("plan") or split)
    monkeypatch.setattr(DeferredContext, "for_models", classmethod(
        lambda cls, cfg, dcfg, dev, dtype: order.append(("deferred", cfg, dcfg, dev)) or object()))

    def weights(*a, **k):
        order.append("weights")
        raise DDTreeError("stop before the weights")

    monkeypatch.setattr(checkpoint, "load_target", weights)
    spec = bench.ModelSpec(target_ref=NAME, target_dir=tmp_path, target_cfg=T, drafter_cfg=D, devices=["cuda:0", "cuda:1"],
                           drafter_dir=tmp_path)
    for auto, made in ((True, [("deferred", T, D, "cuda:1")]), (False, [])):
        order.clear()
        with pytest.raises(DDTreeError, match="stop before the weights"):
            bench.load_models(spec, 4096, True, room=33, auto=auto)
        assert order == ["plan", *made, "weights"], order
