"""Statistics: hand-computed aggregates, the result document, its validator and JSON I/O."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest

from ddtree.errors import DDTreeError
from ddtree.stats import (
    SCHEMA,
    SCHEMA_VERSION,
    GenerationRecord,
    RoundRecord,
    aggregate,
    config_hash,
    generation_from_dict,
    generation_to_dict,
    make_run_document,
    read_json,
    run_metadata,
    validate_document,
    write_json,
)


def _t(d, t, v, c):
    return {"draft": d, "tree": t, "verify": v, "commit": c}


def ddtree_records() -> list[GenerationRecord]:
    a = GenerationRecord(
        prompt_id="a", prompt_tokens=10, new_tokens=8, token_ids=list(range(8)), text="aaaaaaaa",
        prefill_s=0.5, decode_s=2.0, ttft_s=0.6, method="ddtree", budget=8,
        rounds=[
            RoundRecord(8, 4, 2, [0, 1], 3, _t(1, 0.5, 4, 0.5)),
            RoundRecord(8, 3, 0, [], 1, _t(1, 0.5, 4, 0.5)),
            RoundRecord(6, 5, 4, [0, 0, 2, 0], 3, _t(2, 1, 6, 1)),  # cut by max_new_tokens
        ],
        captures=2,
    )
    b = GenerationRecord(
        prompt_id="b", prompt_tokens=20, new_tokens=3, token_ids=[5, 6, 7], text="bbb",
        prefill_s=0.5, decode_s=1.0, ttft_s=0.4, method="ddtree", budget=8,
        rounds=[RoundRecord(8, 2, 1, [1], 2, _t(1, 0.5, 4, 0.5))],
        captures=1,
    )
    return [a, b]


def ar_records() -> list[GenerationRecord]:
    rounds = [RoundRecord(0, 0, 0, [], 1, {"verify": 3.0, "commit": 1.0}) for _ in range(4)]
    return [
        GenerationRecord("a", 10, 5, [1, 2, 3, 4, 5], "abcde", 0.5, 4.0, 0.6, "ar", None, rounds)
    ]


def test_record_rates():
    a, b = ddtree_records()
    assert a.decode_tok_s == pytest.approx(4.0)
    assert a.e2e_tok_s == pytest.approx(8 / 2.5)
    z = GenerationRecord("z", 1, 0, [], "", 0.0, 0.0, 0.0, "ar")
    assert z.decode_tok_s == 0.0 and z.e2e_tok_s == 0.0 and z.rounds == [] and z.budget is None


def test_aggregate_hand_computed():
    agg = aggregate(ddtree_records())
    assert agg["num_prompts"] == 2
    assert agg["prompt_tokens"] == 30
    assert agg["new_tokens"] == 11
    assert agg["prefill_s"] == pytest.approx(1.0)
    assert agg["decode_s"] == pytest.approx(3.0)
    assert agg["total_s"] == pytest.approx(4.0)
    assert agg["decode_tok_s"] == pytest.approx(11 / 3)
    assert agg["e2e_tok_s"] == pytest.approx(2.75)
    assert agg["mean_ttft_s"] == pytest.approx(0.5)
    assert agg["rounds"] == 4
    assert agg["captures"] == 3
    assert agg["committed_tokens"] == 9
    assert agg["mean_committed_per_round"] == pytest.approx(2.25)
    # vLLM counters
    assert agg["num_drafts"] == 4
    assert agg["num_draft_tokens"] == 30
    assert agg["num_accepted_tokens"] == 7
    assert agg["num_accepted_tokens_per_pos"] == [3, 2, 1, 1, 0]
    assert agg["mean_acceptance_length"] == pytest.approx(2.75)
    assert agg["draft_acceptance_rate"] == pytest.approx(7 / 30)
    assert agg["acceptance_length_histogram"] == {"1": 1, "2": 1, "3": 1, "5": 1}
    assert agg["per_depth_acceptance_rate"] == pytest.approx([0.75, 0.5, 1 / 3, 0.5, 0.0])
    assert agg["accepted_rank_histogram"] == {"0": 4, "1": 2, "2": 1}
    assert agg["tree_size"] == {"mean": pytest.approx(7.5), "min": 6, "max": 8, "histogram": {"6": 1, "8": 3}}
    st = agg["stage_times_ms"]
    assert list(st) == ["draft", "tree", "verify", "commit"]
    assert st["draft"] == {"total": pytest.approx(5.0), "mean": pytest.approx(1.25)}
    assert st["tree"] == {"total": pytest.approx(2.5), "mean": pytest.approx(0.625)}
    assert st["verify"] == {"total": pytest.approx(18.0), "mean": pytest.approx(4.5)}
    assert st["commit"] == {"total": pytest.approx(2.5), "mean": pytest.approx(0.625)}
    # the histogram's weighted mean is the mean acceptance length
    h = agg["acceptance_length_histogram"]
    assert sum(int(k) * v for k, v in h.items()) / sum(h.values()) == pytest.approx(2.75)


def test_aggregate_block_size_pads_per_pos():
    agg = aggregate(ddtree_records(), block_size=16)
    assert agg["block_size"] == 16
    assert agg["num_accepted_tokens_per_pos"] == [3, 2, 1, 1] + [0] * 11
    assert agg["per_depth_acceptance_rate"] == pytest.approx([0.75, 0.5, 1 / 3, 0.5, 0.0])


def test_aggregate_ar_and_empty():
    agg = aggregate(ar_records(), block_size=16)
    assert agg["num_drafts"] == 0 and agg["num_draft_tokens"] == 0
    assert agg["mean_acceptance_length"] == 1.0
    assert agg["acceptance_length_histogram"] == {}
    assert agg["num_accepted_tokens_per_pos"] == []
    assert agg["per_depth_acceptance_rate"] == []
    assert agg["rounds"] == 4
    assert agg["tree_size"] == {"mean": 0.0, "min": 0, "max": 0, "histogram": {"0": 4}}
    assert agg["stage_times_ms"]["verify"] == {"total": 12.0, "mean": 3.0}
    assert agg["stage_times_ms"]["draft"] == {"total": 0.0, "mean": 0.0}
    assert agg["decode_tok_s"] == pytest.approx(1.25)

    empty = aggregate([])
    assert empty["num_prompts"] == 0 and empty["decode_tok_s"] == 0.0 and empty["mean_ttft_s"] == 0.0
    assert empty["mean_acceptance_length"] == 1.0


def test_generation_to_dict_compact_and_roundtrip():
    rec = ddtree_records()[0]
    d = generation_to_dict(rec)
    assert d["prompt_id"] == "a" and d["budget"] == 8 and d["method"] == "ddtree"
    assert d["num_rounds"] == 3 and d["num_accepted_tokens"] == 6 and d["captures"] == 2
    assert d["mean_acceptance_length"] == pytest.approx(3.0)
    assert d["rounds"]["tree_size"] == [8, 8, 6]
    assert d["rounds"]["accepted"] == [2, 0, 4]
    assert d["rounds"]["committed"] == [3, 1, 3]
    assert d["rounds"]["accepted_ranks"] == [[0, 1], [], [0, 0, 2, 0]]
    assert d["rounds"]["times_ms"]["verify"] == [4, 4, 6]
    back = generation_from_dict(json.loads(json.dumps(d)))
    assert back == rec


def _document():
    ar = ar_records()
    tree = ddtree_records()
    meta = run_metadata(target="Qwen/Qwen3.6-27B", dtype="bfloat16", seed=0, temperature=0.0)
    runs = [
        {"method": "ar", "budget": None, "records": ar, "speedup_vs_ar": 1.0},
        {"method": "ddtree", "budget": 8, "records": tree, "speedup_vs_ar": 2.9, "block_size": 16},
    ]
    return make_run_document(meta, runs)


def test_run_metadata():
    meta = run_metadata(seed=3, devices=["cuda:0", "cuda:1"])
    for k in ("timestamp", "ddtree_version", "python_version", "torch_version", "transformers_version", "gpus"):
        assert k in meta
    assert meta["timestamp"].endswith("+00:00")
    assert meta["gpus"] and all(isinstance(g, str) for g in meta["gpus"])
    assert meta["seed"] == 3 and meta["devices"] == ["cuda:0", "cuda:1"]


def test_document_validates_and_roundtrips(tmp_path):
    doc = _document()
    assert doc["schema"] == SCHEMA_VERSION == "ddtree.stats/1"
    assert [r["method"] for r in doc["runs"]] == ["ar", "ddtree"]
    assert doc["runs"][1]["aggregate"]["num_accepted_tokens"] == 7
    assert len(doc["runs"][1]["prompts"]) == 2
    validate_document(doc)
    p = write_json(doc, tmp_path / "sub" / "r.json")
    back = read_json(p)
    validate_document(back)
    assert back == json.loads(json.dumps(doc))
    # per-round arrays are written on one line each
    text = p.read_text()
    assert '"tree_size": [8,8,6]' in text
    assert SCHEMA["properties"]["schema"]["const"] == SCHEMA_VERSION


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["runs"][0]["aggregate"].pop("decode_tok_s"), r"runs\[0\]\.aggregate: missing required key 'decode_tok_s'"),
        (lambda d: d["runs"][1].__setitem__("budget", "8"), r"runs\[1\]\.budget: expected integer or null, got string"),
        (lambda d: d.__setitem__("schema", "ddtree.stats/0"), r"ddtree\.stats/1"),
        (lambda d: d.pop("runs"), r"missing required key 'runs'"),
        (lambda d: d["runs"][1]["prompts"][0]["rounds"]["accepted"].__setitem__(0, 1.5), r"rounds\.accepted\[0\]: expected integer, got number"),
        (lambda d: d["runs"][1]["aggregate"].__setitem__("rounds", True), r"aggregate\.rounds: expected integer, got boolean"),
    ],
)
def test_broken_document_fails_clearly(mutate, message):
    doc = copy.deepcopy(_document())
    mutate(doc)
    with pytest.raises(ValueError, match=message):
        validate_document(doc)


def test_validate_rejects_non_dict():
    with pytest.raises(ValueError, match="expected object"):
        validate_document([1, 2])


def test_write_json_replaces_nan(tmp_path):
    doc = _document()
    doc["runs"][0]["speedup_vs_ar"] = float("nan")
    back = read_json(write_json(doc, tmp_path / "r.json"))
    assert back["runs"][0]["speedup_vs_ar"] is None


def test_read_json_errors(tmp_path):
    with pytest.raises(DDTreeError, match="not found"):
        read_json(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": \n')
    with pytest.raises(DDTreeError, match="line 2"):
        read_json(bad)


def test_config_hash(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b'{"a": 1}')
    want = hashlib.sha256(b'{"a": 1}').hexdigest()[:16]
    assert config_hash(cfg) == want
    assert config_hash(tmp_path) == want  # a model folder means its config.json
    with pytest.raises(DDTreeError, match="cannot hash"):
        config_hash(tmp_path / "missing.json")


def auto_records() -> list[GenerationRecord]:
    """--budget auto: two drafted rounds and three plain steps (tree_size 0: the bonus alone)."""
    rounds = [
        RoundRecord(32, 5, 3, [0, 0, 1], 4, _t(1, 0, 5, 0)),
        RoundRecord(0, 0, 0, [], 1, _t(0.5, 0, 3, 0)),
        RoundRecord(0, 0, 0, [], 1, _t(0.5, 0, 3, 0)),
        RoundRecord(8, 3, 1, [0], 2, _t(1, 0, 4, 0)),
        RoundRecord(0, 0, 0, [], 1, _t(0.5, 0, 3, 0)),
    ]
    return [GenerationRecord("a", 10, 10, list(range(10)), "x" * 10, 0.1, 1.0, 0.1, "ddtree", None, rounds)]


def test_headline_counts_plain_steps():
    """Tokens per target forward = committed / rounds over every round; the mean acceptance
    length (1 + accepted / drafts) covers the drafted rounds only, so auto's plain steps leave it
    higher."""
    agg = aggregate(auto_records())
    assert agg["rounds"] == 5 and agg["num_drafts"] == 2 and agg["num_plain_steps"] == 3
    assert agg["tokens_per_target_forward"] == pytest.approx(9 / 5)
    assert agg["mean_acceptance_length"] == pytest.approx(1 + 4 / 2)
    assert agg["tree_size"]["histogram"] == {"0": 3, "8": 1, "32": 1}
    d = generation_to_dict(auto_records()[0])
    assert d["tokens_per_target_forward"] == pytest.approx(9 / 5) and d["num_plain_steps"] == 3
    # ar: every round a plain step, one token per forward
    ar = aggregate(ar_records())
    assert ar["tokens_per_target_forward"] == 1.0 and ar["num_plain_steps"] == 4
    # fixed budget, no plain steps: the two agree but for rounds cut short (the last, by max_new_tokens)
    dd = aggregate(ddtree_records())
    assert dd["num_plain_steps"] == 0 and dd["tokens_per_target_forward"] == pytest.approx(9 / 4)
    assert aggregate([])["tokens_per_target_forward"] == 0.0


def test_budget_setting_and_interrupted_in_the_document():
    from ddtree.stats import is_auto

    doc = make_run_document(run_metadata(interrupted=True, interrupted_prompt="b"), [
        {"method": "ddtree", "budget": None, "budget_setting": "auto", "records": auto_records(), "interrupted": True},
        {"method": "ddtree", "budget": 8, "budget_setting": 8, "records": ddtree_records()},
    ])
    validate_document(doc)
    auto, fixed = doc["runs"]
    assert auto["budget_setting"] == "auto" and auto["interrupted"] is True and is_auto(auto)
    assert fixed["budget_setting"] == 8 and fixed["interrupted"] is False and not is_auto(fixed)
    assert doc["metadata"]["interrupted"] is True and doc["metadata"]["interrupted_prompt"] == "b"
    bad = copy.deepcopy(doc)
    bad["runs"][0]["budget_setting"] = 1.5
    with pytest.raises(ValueError, match=r"runs\[0\]\.budget_setting"):
        validate_document(bad)


def _strip_added(doc: dict) -> dict:
    """A ddtree.stats/1 document as written before the added keys existed."""
    old = copy.deepcopy(doc)
    for run in old["runs"]:
        run.pop("budget_setting"), run.pop("interrupted")
        for d in [run["aggregate"], *run["prompts"]]:
            d.pop("tokens_per_target_forward"), d.pop("num_plain_steps")
    return old


def test_documents_written_before_stay_readable(tmp_path):
    from ddtree.stats import is_auto, plain_steps, tokens_per_forward

    new = make_run_document(run_metadata(), [
        {"method": "ddtree", "budget": None, "budget_setting": "auto", "records": auto_records()}])
    old = _strip_added(new)
    validate_document(old)
    (run,) = old["runs"]
    assert is_auto(run)  # an old generate --budget auto document: budget null, no budget_setting
    assert tokens_per_forward(run["aggregate"]) == pytest.approx(new["runs"][0]["aggregate"]["tokens_per_target_forward"])
    assert plain_steps(run["aggregate"]) == 3
    back = read_json(write_json(old, tmp_path / "old.json"))
    validate_document(back)
    # a required key still is one
    del back["runs"][0]["aggregate"]["rounds"]
    with pytest.raises(ValueError, match="missing required key 'rounds'"):
        validate_document(back)


def test_schema_lists_each_field_once():
    """The per-prompt entry's counters and the aggregate's are one list, so they cannot drift."""
    agg = SCHEMA["properties"]["runs"]["items"]["properties"]["aggregate"]
    prompt = SCHEMA["properties"]["runs"]["items"]["properties"]["prompts"]["items"]
    shared = {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length",
              "tokens_per_target_forward", "num_plain_steps", "prompt_tokens", "new_tokens", "decode_tok_s"}
    for k in shared:
        assert agg["properties"][k] is prompt["properties"][k], k
    d = generation_to_dict(ddtree_records()[0])
    assert set(prompt["properties"]) == set(d)  # every key written is described, and nothing else
    assert set(agg["properties"]) == set(aggregate(ddtree_records()))


def test_gzip_round_trip(tmp_path):
    import gzip

    doc = _document()
    p = write_json(doc, tmp_path / "r.json.gz")
    assert p.read_bytes()[:2] == b"\x1f\x8b"
    assert json.loads(gzip.decompress(p.read_bytes())) == json.loads(json.dumps(doc))
    assert read_json(p) == json.loads(json.dumps(doc))
    plain = tmp_path / "gzipped-without-the-suffix.json"
    plain.write_bytes(p.read_bytes())  # told apart by content, not by name
    assert read_json(plain) == read_json(p)
    broken = tmp_path / "broken.json.gz"
    broken.write_bytes(p.read_bytes()[:40])
    with pytest.raises(DDTreeError, match="damaged gzip"):
        read_json(broken)
    with pytest.raises(DDTreeError, match="pick a writable --stats-json path"):
        write_json(doc, tmp_path / "r.json.gz" / "x.json", flag="--stats-json")
