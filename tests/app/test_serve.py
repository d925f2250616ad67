"""`ddtree serve` as a subprocess on the codepair fixture (a free loopback port, float32, CPU),
driven by the official openai client: chat and text completions, streamed and not, for ar, dflash
and ddtree, each reply equal token for token to `ddtree generate`'s; a second turn reuses the kept
state and still equals generate; stop strings; the bad-input table (each a 4xx in OpenAI's error
shape in under 50 ms, nothing served or changed, the next request right); a client that leaves
mid-stream; a full queue (429); /metrics through prometheus_client's parser; SIGTERM exits 0;
`generate --server` and `chat --server` print what the in-process commands print, in a process
without torch; a short load (scripts/bench_serve.py load)."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
from urllib.parse import urlparse

import pytest
from typer.testing import CliRunner

from conftest import FIXTURE_DIR, REPO, cli_env, have_fixture, run_ddtree
from ddtree.app.cli import app

pytestmark = pytest.mark.skipif(not have_fixture(), reason=f"codepair fixture not found at {FIXTURE_DIR}")

from scripts.bench_serve import Server, load_rows, model_args, references, run_load  # noqa: E402

KEY = "test-key"
MAX_LEN, N = 512, 16  # the server's --max-length and --max-new-tokens
PROMPT = "def quicksort(xs):"
M1, M2 = "def fibonacci(n):", "def main():"


@pytest.fixture(autouse=True)
def _threads(one_thread):  # the in-process references: one torch thread, as the server has
    yield


@pytest.fixture(scope="module")
def served():
    """One server for the module (--max-queue 2, a key); stopped at the end: it must exit 0."""
    server = Server(model_args(FIXTURE_DIR, MAX_LEN, N) + ["--max-queue", 2, "--api-key", KEY])
    yield server
    assert server.stop() == 0, server.log


@pytest.fixture(scope="module")
def api(served):
    import openai

    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(api):
    return api.models.list().data[0].id


def extra(method: str, **kw) -> dict:
    return {"ddtree": {"method": method, "budget": 8, "record": True, **kw}}


def ddtree_usage(usage) -> dict:
    return usage.model_extra["ddtree"]


def streamed(stream) -> tuple[str, str | None, object]:
    """(text, finish_reason, usage) of an openai stream (chat or text completion)."""
    text, finish, usage = "", None, None
    for ch in stream:
        for c in ch.choices:
            text += (c.delta.content or "") if hasattr(c, "delta") else (c.text or "")
            finish = c.finish_reason or finish
        usage = ch.usage or usage
    return text, finish, usage


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_replies_equal_generate(api, model, method):
    """Completions and chat, streamed and not, a second turn, a stop string: every reply is
    `generate`'s for the same prompt (a chat: its plain transcript), token for token."""
    c1 = api.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, extra_body=extra(method))
    c2 = api.completions.create(model=model, prompt=PROMPT, stream=True, stream_options={"include_usage": True},
                                extra_body=extra(method))  # max_tokens: the server's --max-new-tokens
    h1 = api.chat.completions.create(model=model, messages=[{"role": "user", "content": M1}], max_completion_tokens=N,
                                     extra_body=extra(method))
    h2 = api.chat.completions.create(model=model, messages=[{"role": "user", "content": M1}], max_tokens=N, stream=True,
                                     stream_options={"include_usage": True}, extra_body=extra(method))
    reply = h1.choices[0].message.content
    turn2 = [{"role": "user", "content": M1}, {"role": "assistant", "content": reply}, {"role": "user", "content": M2}]
    t2 = api.chat.completions.create(model=model, messages=turn2, max_tokens=N, extra_body=extra(method))
    refs = references(FIXTURE_DIR, [{"id": "c", "prompt": PROMPT}, {"id": "h", "prompt": M1 + "\n"},
                                    {"id": "t", "prompt": M1 + "\n" + reply + "\n" + M2 + "\n"}], MAX_LEN, N, [method])
    (c_text, c_ids), (h_text, h_ids), (t_text, t_ids) = (refs[method, k] for k in "cht")

    assert c1.choices[0].text == c_text and ddtree_usage(c1.usage)["record"]["token_ids"] == c_ids
    text, finish, usage = streamed(c2)
    assert text == c_text and ddtree_usage(usage)["record"]["token_ids"] == c_ids and finish == "length"
    assert reply == h_text and ddtree_usage(h1.usage)["record"]["token_ids"] == h_ids
    text, finish, usage = streamed(h2)
    assert text == h_text and ddtree_usage(usage)["record"]["token_ids"] == h_ids
    assert t2.choices[0].message.content == t_text and ddtree_usage(t2.usage)["record"]["token_ids"] == t_ids
    for r in (c1, h1, t2):
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == N
        d = ddtree_usage(r.usage)
        assert d["method"] == method and d["budget"] == (8 if method == "ddtree" else None)
        assert {"tokens_per_target_forward", "mean_acceptance_length", "decode_tok_s", "ttft_s", "reused_tokens",
                "prefilled_tokens"} <= set(d)
    d = ddtree_usage(t2.usage)  # the second turn: the first turn's state, settled after its reply
    assert d["reused_tokens"] > len(ddtree_usage(h1.usage)["record"]["token_ids"]) and \
        d["prefilled_tokens"] < t2.usage.prompt_tokens - d["reused_tokens"] + 1
    assert d["reused_tokens"] + d["prefilled_tokens"] == t2.usage.prompt_tokens

    # a stop string: the reply cut where it starts, finish_reason stop
    stop = c_text[len(c_text) // 2:][:3]
    r = api.completions.create(model=model, prompt=PROMPT, max_tokens=N, stop=[stop], extra_body=extra(method))
    assert r.choices[0].text == c_text[:c_text.index(stop)] and r.choices[0].finish_reason == "stop"


_HTTP: list = []


def _post(url: str, body, key: str | None = KEY, path: str = "/v1/chat/completions"):
    """POST through one kept-alive httpx client (a new client's set-up is not the server's time)."""
    import httpx

    if not _HTTP:
        _HTTP.append(httpx.Client(timeout=30))
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.perf_counter()
    r = _HTTP[0].post(url + path, content=content, headers=headers)
    return r, time.perf_counter() - t0


def _big_body(url: str) -> tuple[int, dict, float]:
    """A 20 MB body announced by its Content-Length: the answer comes after its first 64 KiB."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    t0 = time.perf_counter()
    conn.putrequest("POST", "/v1/chat/completions")
    for k, v in (("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
                 ("Content-Length", str(20 * 1024 * 1024))):
        conn.putheader(k, v)
    conn.endheaders()
    conn.send(b"x" * 65536)
    r = conn.getresponse()
    dt = time.perf_counter() - t0
    body = json.loads(r.read())
    conn.close()
    return r.status, body, dt


def _metric(served, name: str, **labels) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(served.url + "/metrics", timeout=10).text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_bad_input_is_a_fast_4xx_in_openais_shape_and_changes_nothing(served, api, model):
    user = [{"role": "user", "content": M1}]
    ok = {"model": model, "messages": user}
    a = api.chat.completions.create(model=model, messages=user, max_tokens=N, extra_body=extra("ar"))
    served_before = _metric(served, "ddtree:request_success_total")
    table = [  # (what, body | bytes | "big", key, path, status, param, code)
        ("malformed JSON", b'{"model": "x", "messages": [', KEY, None, 400, None, "invalid_json"),
        ("not an object", b'[1, 2]', KEY, None, 400, None, "invalid_json"),
        ("wrong type", dict(ok, max_tokens="ten"), KEY, None, 400, "max_tokens", "invalid_value"),
        ("wrong type in a message", dict(ok, messages=[{"role": "user", "content": 5}]), KEY, None, 400,
         "messages.0.content", "invalid_value"),
        ("unknown model", dict(ok, model="gpt-4o"), KEY, None, 404, "model", "model_not_found"),
        ("no model", {"messages": user}, KEY, None, 400, "model", "missing_required_parameter"),
        ("empty messages", dict(ok, messages=[]), KEY, None, 400, "messages", "invalid_value"),
        ("max_tokens 0", dict(ok, max_tokens=0), KEY, None, 400, "max_tokens", "invalid_value"),
        ("max_tokens past --max-length", dict(ok, max_tokens=MAX_LEN), KEY, None, 400, "max_tokens",
         "context_length_exceeded"),
        ("temperature below 0", dict(ok, temperature=-0.5), KEY, None, 400, "temperature", "invalid_value"),
        ("top_p 0", dict(ok, top_p=0), KEY, None, 400, "top_p", "invalid_value"),
        ("top_p past 1", dict(ok, top_p=1.5), KEY, None, 400, "top_p", "invalid_value"),
        ("n 2", dict(ok, n=2), KEY, None, 400, "n", "unsupported_parameter"),
        ("logprobs", dict(ok, logprobs=True), KEY, None, 400, "logprobs", "unsupported_parameter"),
        ("tools", dict(ok, tools=[{"type": "function", "function": {"name": "f"}}]), KEY, None, 400, "tools",
         "unsupported_parameter"),
        ("response_format", dict(ok, response_format={"type": "json_object"}), KEY, None, 400, "response_format",
         "unsupported_parameter"),
        ("a method without a budget's type", dict(ok, ddtree={"budget": "lots"}), KEY, None, 400, "ddtree.budget",
         "invalid_value"),
        ("empty prompt", {"model": model, "prompt": ""}, KEY, "/v1/completions", 400, "prompt", "invalid_value"),
        ("20 MB body", "big", KEY, None, 413, None, "request_too_large"),
        ("missing key", ok, None, None, 401, None, "missing_api_key"),
        ("wrong key", ok, "wrong", None, 401, None, "invalid_api_key"),
    ]
    assert _wait_for(lambda: _metric(served, "ddtree:num_requests_running") == 0)  # (its settle done)
    for what, body, key, path, status, param, code in table:
        times = []
        while len(times) < 10 and min(times, default=1) >= 0.05:  # the server's time, not a busy machine's
            if body == "big":
                got, err, dt = _big_body(served.url)
            else:
                r, dt = _post(served.url, body, key, path or "/v1/chat/completions")
                got, err = r.status_code, r.json()
            times.append(dt)
            assert got == status, (what, got, err)
            assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, (what, err)
            assert err["error"]["param"] == param and err["error"]["code"] == code and err["error"]["message"], (what, err)
        assert min(times) < 0.05, (what, times)
    assert _metric(served, "ddtree:request_success_total") == served_before  # nothing was generated
    # the state is the one the first request left: the next turn reuses it and equals generate
    reply = a.choices[0].message.content
    turn2 = user + [{"role": "assistant", "content": reply}, {"role": "user", "content": M2}]
    b = api.chat.completions.create(model=model, messages=turn2, max_tokens=N, extra_body=extra("ar"))
    want = references(FIXTURE_DIR, [{"id": "t", "prompt": M1 + "\n" + reply + "\n" + M2 + "\n"}], MAX_LEN, N, ["ar"])
    assert b.choices[0].message.content == want["ar", "t"][0]
    assert ddtree_usage(b.usage)["reused_tokens"] > ddtree_usage(a.usage)["prefilled_tokens"]


def test_a_chunked_body_past_the_limit_is_refused(served):
    import httpx

    def chunks():
        for _ in range(20):
            yield b"x" * (1024 * 1024)

    r = httpx.post(served.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def _open_stream(served, max_tokens: int, method: str = "ar"):
    """A streamed chat request through httpx: (client, response, its line iterator)."""
    import httpx

    client = httpx.Client(timeout=60)
    req = client.build_request("POST", served.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                               json={"model": served_model(served), "messages": [{"role": "user", "content": M1}],
                                     "max_tokens": max_tokens, "stream": True, "ddtree": {"method": method}})
    r = client.send(req, stream=True)
    return client, r, r.iter_lines()


def served_model(served) -> str:
    import httpx

    return httpx.get(served.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]


def _wait_for(cond, timeout: float = 20):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_a_client_that_leaves_mid_stream_frees_the_engine(served, api, model):
    cancelled = _metric(served, "ddtree:request_success_total", finished_reason="cancelled")
    tokens = _metric(served, "ddtree:generation_tokens_total")
    client, r, lines = _open_stream(served, 400)
    contents = 0
    for line in lines:
        if line.startswith("data: ") and '"content"' in line and '"content":""' not in line:
            contents += 1
            if contents == 2:
                break
    r.close()
    client.close()
    assert _wait_for(lambda: _metric(served, "ddtree:request_success_total", finished_reason="cancelled")
                     == cancelled + 1), served.log[-2000:]
    assert _metric(served, "ddtree:generation_tokens_total") - tokens < 400  # ended early
    t0 = time.perf_counter()
    h = api.chat.completions.create(model=model, messages=[{"role": "user", "content": M2}], max_tokens=4,
                                    extra_body=extra("ar"))
    assert h.usage.completion_tokens == 4 and time.perf_counter() - t0 < 10


def test_a_full_queue_answers_429_with_retry_after(served):
    opened = []
    try:
        client, r, lines = _open_stream(served, 400)
        opened.append((client, r))
        next(line for line in lines if '"content"' in line)  # generating
        for _ in range(2):  # --max-queue 2: both wait
            c2, r2, _ = _open_stream(served, 400)
            opened.append((c2, r2))
            assert r2.status_code == 200
        assert _wait_for(lambda: _metric(served, "ddtree:num_requests_waiting") == 2)
        times = []
        while len(times) < 10 and min(times, default=1) >= 0.05:  # (the engine decodes on these CPUs meanwhile)
            r4, dt = _post(served.url, {"model": served_model(served), "messages": [{"role": "user", "content": M2}]})
            assert r4.status_code == 429 and int(r4.headers["Retry-After"]) >= 1, r4.text
            assert r4.json()["error"]["code"] == "queue_full"
            times.append(dt)
        assert min(times) < 0.05, times
    finally:
        for c, r in opened:
            r.close()
            c.close()
    assert _wait_for(lambda: _metric(served, "ddtree:num_requests_waiting") == 0
                     and _metric(served, "ddtree:num_requests_running") == 0)


def test_metrics_count_what_was_served(served, api, model):
    names = ["ddtree:request_success_total", "ddtree:prompt_tokens_total", "ddtree:generation_tokens_total",
             "ddtree:time_to_first_token_seconds_count", "ddtree:decode_tokens_per_second_count",
             "ddtree:spec_decode_num_drafts_total", "ddtree:spec_decode_num_draft_tokens_total",
             "ddtree:spec_decode_num_accepted_tokens_total", "ddtree:spec_decode_num_accepted_tokens_per_pos_total",
             "ddtree:prompt_tokens_reused_total", "ddtree:prompt_tokens_prefilled_total"]
    before = {n: _metric(served, n) for n in names}
    http_before = _metric(served, "ddtree:http_requests_total", route="/v1/completions", status="200")
    a = api.chat.completions.create(model=model, messages=[{"role": "user", "content": M2}], max_tokens=N,
                                    extra_body=extra("ar"))
    text, _, b = streamed(api.completions.create(model=model, prompt=PROMPT, max_tokens=N, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extra("ddtree")))
    after = {n: _metric(served, n) for n in names}
    delta = {n: after[n] - before[n] for n in names}
    da, db = ddtree_usage(a.usage), ddtree_usage(b)
    assert delta["ddtree:request_success_total"] == 2
    assert delta["ddtree:prompt_tokens_total"] == a.usage.prompt_tokens + b.prompt_tokens
    assert delta["ddtree:generation_tokens_total"] == a.usage.completion_tokens + b.completion_tokens == 2 * N
    assert delta["ddtree:time_to_first_token_seconds_count"] == 2 == delta["ddtree:decode_tokens_per_second_count"]
    assert delta["ddtree:spec_decode_num_drafts_total"] == db["num_drafts"] > 0 and da["num_drafts"] == 0
    assert delta["ddtree:spec_decode_num_draft_tokens_total"] == db["num_draft_tokens"] == 8 * db["num_drafts"]
    assert delta["ddtree:spec_decode_num_accepted_tokens_total"] == db["num_accepted_tokens"] \
        == delta["ddtree:spec_decode_num_accepted_tokens_per_pos_total"]
    assert delta["ddtree:prompt_tokens_reused_total"] + delta["ddtree:prompt_tokens_prefilled_total"] \
        == delta["ddtree:prompt_tokens_total"]
    assert _metric(served, "ddtree:http_requests_total", route="/v1/completions", status="200") == http_before + 1


def test_health_then_sigterm_ends_the_generation_and_exits_0():
    """A server of its own: /health answers 503 until the models are ready, 200 then; SIGTERM
    during a streamed reply ends it with an error event and [DONE], and the process exits 0."""
    import httpx

    # its warm-up (two turns of 48 tokens) outlasts uvicorn's start: /health is seen loading
    server = Server(model_args(FIXTURE_DIR, MAX_LEN, 48))
    try:
        assert server.health[0] == 503 and server.health[-1] == 200, server.health  # 503 while it loads
        assert httpx.get(server.url + "/health").status_code == 200
        body = {"model": served_model(server), "messages": [{"role": "user", "content": M1}], "max_tokens": 450,
                "stream": True, "ddtree": {"method": "ar"}}
        events = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        server.proc.send_signal(15)
        t0 = time.monotonic()
        rc = server.proc.wait(20)
    finally:
        rc2 = server.stop()
    assert rc == 0 == rc2 and time.monotonic() - t0 < 20, server.log
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down", events[-3:]
    assert "stopped" in server.log


def _mask(text: str) -> str:
    """A summary line without its timings."""
    return re.sub(r"[\d.]+ tok/s decode, time to first token \d+ ms", "T", text)


def test_generate_and_chat_through_the_server_print_what_they_print_in_process(served, tmp_path):
    model_flags = [str(a) for a in model_args(FIXTURE_DIR, MAX_LEN, N)][:-2]  # (without --max-new-tokens)
    gen = ["generate", "-n", "12", "--method", "ddtree", "--budget", "8", "--temperature", "0"]
    local = CliRunner().invoke(app, gen + model_flags + [PROMPT])
    remote = run_ddtree(*gen, "--server", served.url, "--api-key", KEY, PROMPT)
    assert local.exit_code == 0 == remote.returncode, remote.stderr
    assert remote.stdout == local.stdout
    lines = [ln for ln in remote.stderr.splitlines() if ln.strip()]
    want = [ln for ln in local.stderr.splitlines() if ln.startswith("ddtree 8:")]
    assert [_mask(ln) for ln in lines] == [_mask(ln) for ln in want], (lines, want)

    # --prompts, --jsonl, --stats-json: the same objects and token ids
    rows = tmp_path / "p.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": r["prompt"]}) + "\n"
                            for i, r in enumerate(load_rows(FIXTURE_DIR, 2, chars=120))))
    docs = {}
    for where, flags in (("local", model_flags), ("remote", ["--server", served.url])):
        stats = tmp_path / f"{where}.json"
        args = gen + ["--method", "dflash", "--prompts", str(rows), "--jsonl", "--stats-json", str(stats)]
        if where == "local":
            r = CliRunner().invoke(app, args + flags)
            out, rc = r.stdout, r.exit_code
        else:
            env = dict(cli_env(), DDTREE_API_KEY=KEY)
            p = subprocess.run([sys.executable, "-m", "ddtree", *args, *flags], capture_output=True, text=True,
                               env=env, cwd=str(REPO), timeout=120)
            out, rc = p.stdout, p.returncode
        assert rc == 0, out
        objs = [json.loads(line) for line in out.splitlines()]
        timing = {"decode_tok_s", "ttft_s"}
        docs[where] = ([{k: v for k, v in o.items() if k not in timing} for o in objs], json.loads(stats.read_text()))
    assert docs["remote"][0] == docs["local"][0]
    ids = {w: [p["token_ids"] for p in d[1]["runs"][0]["prompts"]] for w, d in docs.items()}
    assert ids["remote"] == ids["local"] and docs["remote"][1]["metadata"]["server"] == served.url

    # chat, piped: the same replies on stdout
    lines = "\n".join([M1, M2, "/stats"]) + "\n"
    chat = ["chat", "-n", "12", "--method", "ddtree", "--budget", "8"]
    local = CliRunner().invoke(app, chat + model_flags, input=lines)
    remote = run_ddtree(*chat, "--server", served.url, "--api-key", KEY, stdin=lines)
    assert local.exit_code == 0 == remote.returncode, remote.stderr
    assert remote.stdout == local.stdout and remote.stdout.count("\n") >= 2
    assert "tokens reused" in remote.stderr


def test_the_client_imports_no_torch_and_fails_fast(served):
    code = ("import sys\nfrom ddtree.app.cli import app\ntry:\n    app(prog_name='ddtree')\nexcept SystemExit as e:\n"
            "    rc = e.code\nprint('HEAVY', rc, [m for m in ('torch', 'transformers', 'httpx._main', 'rich.console')"
            " if sys.modules.get(m)], file=sys.stderr)")  # httpx's own CLI (rich) is start-up the client skips
    p = subprocess.run([sys.executable, "-c", code, "generate", "--server", served.url, "--api-key", KEY, "-n", "4",
                        PROMPT], capture_output=True, text=True, env=cli_env(), cwd=str(REPO), timeout=60)
    assert "HEAVY 0 []" in p.stderr and p.stdout.strip(), p.stderr
    for flags, needle in (([], "no ddtree server answers at http://127.0.0.1:9"),
                          (["--api-key", "wrong"], "--api-key")):
        url = "http://127.0.0.1:9" if not flags else served.url
        t0 = time.monotonic()
        r = run_ddtree("generate", "--server", url, *flags, PROMPT)
        wall = time.monotonic() - t0
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
        assert url in lines[0] and wall < 1.5, (wall, lines)


def test_a_short_load(served):
    """scripts/bench_serve.py load, short: 3 clients x 2 requests, every reply equal to generate's."""
    rows = load_rows(FIXTURE_DIR, 3, chars=120)
    refs = references(FIXTURE_DIR, rows, MAX_LEN, N, ["ar", "dflash", "ddtree"])
    doc = run_load(served, 3, 2, rows, refs, N, api_key=KEY)
    assert doc["errors"] == [] and doc["all_equal"], doc["errors"]
    assert doc["queue_wait_s"]["max"] > 0 and doc["rss_mib"]["growth_after_first_round"] <= 0.05, doc


def test_a_target_with_a_chat_template(tmp_path_factory, tmp_path):
    """A tiny random pair whose chat template drops earlier replies' thinking (tests/app/test_chat.py):
    chat replies, with and without thinking, and a second turn after a system message equal
    `generate`'s for the same messages; `generate --server` sends a text prompt through the template."""
    import openai

    from app_helpers import write_tiny_pair
    from test_chat import QWEN_STYLE

    tdir, ddir = write_tiny_pair(tmp_path_factory.mktemp("templated"))
    cfg = json.loads((tdir / "tokenizer_config.json").read_text())
    (tdir / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=QWEN_STYLE)))
    flags = ["--target", tdir, "--drafter", ddir, "--dtype", "float32", "--devices", "cpu", "--max-length", 256,
             "--budget", 4]
    server = Server(flags + ["--max-new-tokens", 8])
    try:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = api.models.list().data[0].id
        convs, got = [], []
        for thinking in (True, False):
            msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": M1}]
            r = api.chat.completions.create(model=model, messages=msgs, max_tokens=8, extra_body=dict(
                extra("ddtree", budget=4), chat_template_kwargs={"enable_thinking": thinking}))
            msgs2 = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                            {"role": "user", "content": M2}]
            r2 = api.chat.completions.create(model=model, messages=msgs2, max_tokens=8, extra_body=dict(
                extra("ddtree", budget=4), chat_template_kwargs={"enable_thinking": thinking}))
            assert ddtree_usage(r2.usage)["reused_tokens"] > 0  # the system prompt's head at least
            convs.append((thinking, [msgs, msgs2]))
            got.append([ddtree_usage(x.usage)["record"]["token_ids"] for x in (r, r2)])
        for (thinking, msgs), ids in zip(convs, got):
            rows = tmp_path / f"t{thinking}.jsonl"
            rows.write_text("".join(json.dumps({"id": f"m{i}", "messages": m}) + "\n" for i, m in enumerate(msgs)))
            stats = tmp_path / f"t{thinking}.json"
            r = CliRunner().invoke(app, ["generate", *map(str, flags), "-n", "8", "--method", "ddtree", "--prompts",
                                         str(rows), "--stats-json", str(stats), "--jsonl",
                                         "--thinking" if thinking else "--no-thinking"])
            assert r.exit_code == 0, r.output
            assert [p["token_ids"] for p in json.loads(stats.read_text())["runs"][0]["prompts"]] == ids
        local = CliRunner().invoke(app, ["generate", *map(str, flags), "-n", "8", PROMPT])
        remote = run_ddtree("generate", "--server", server.url, "-n", "8", "--budget", "4", PROMPT)
        assert local.exit_code == 0 == remote.returncode and remote.stdout == local.stdout, remote.stderr
    finally:
        assert server.stop() == 0, server.log
