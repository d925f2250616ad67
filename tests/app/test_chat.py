"""`ddtree chat`: replies equal `ddtree generate`'s for the same rendered conversation (ar, dflash,
ddtree; the codepair fixture's plain transcript, and a random hybrid with a Qwen3-style chat
template that drops earlier replies' thinking, with and without thinking, so that turns roll
back); a message past --max-length is refused in one line with the conversation kept; a real
terminal (tmux) and a pipe: two messages, /stats, Ctrl-C in a reply, Ctrl-D / end of input,
exit status 0."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from app_helpers import sigint_default, write_tiny_pair
from conftest import FIXTURE_DIR, REPO, cli_env, skip_without_fixture
from ddtree.app.cli import app

# Qwen3.5-style: a reply in the history keeps only its text after </think>, and the generation
# prompt opens a think block (or an empty one without thinking): the next turn's rendering
# parts from the committed tokens right after the last "assistant\n"
QWEN_STYLE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set c = m.content -%}{%- if '</think>' in c -%}{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}{%- endif -%}"
)
MESSAGES = ["def fibonacci(n):", "def main():", "class Stack:"]


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


@pytest.fixture(scope="module")
def templated_pair(tmp_path_factory):
    """The tiny random pair of app_helpers with QWEN_STYLE as its chat template."""
    root = tmp_path_factory.mktemp("chat_pair")
    tdir, ddir = write_tiny_pair(root)
    cfg_path = tdir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = QWEN_STYLE
    cfg_path.write_text(json.dumps(cfg))
    return tdir, ddir


def invoke(*args, input: str | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def fixture_model_args(method: str, n: int = 12) -> list:
    args = ["--target", FIXTURE_DIR / "target", "--method", method, "--max-new-tokens", n, "--dtype", "float32",
            "--devices", "cpu", "--max-length", 1024]
    return args + (["--drafter", FIXTURE_DIR / "drafter", "--budget", 8] if method != "ar" else [])


def chat_then_generate(model_args: list, tmp_path: Path, extra: list = (), plain: bool = False, system=None) -> list:
    """Three turns through `chat` (piped), saved; then `generate --prompts` on every turn's
    rendered conversation. -> [(chat's reply, generate's text)] per turn."""
    saved = tmp_path / "chat.json"
    lines = MESSAGES + [f"/save {saved}"]
    r = invoke("chat", *model_args, *extra, *(["--system", system] if system else []), input="\n".join(lines) + "\n")
    assert r.exit_code == 0, r.output
    doc = json.loads(saved.read_text())
    assert doc["schema"] == "ddtree.chat/1" and len(doc["turns"]) == 3
    msgs = doc["messages"]
    rows, replies = [], []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before = msgs[:i]
        # the plain transcript: every message on its own line, the reply continuing it
        row = {"id": f"t{i}", "prompt": "".join(x["content"] + "\n" for x in before)} if plain else \
            {"id": f"t{i}", "messages": before}
        rows.append(row)
        replies.append(m["content"])
    prompts = tmp_path / "turns.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    g = invoke("generate", *model_args, *extra, "--prompts", prompts, "--jsonl")
    assert g.exit_code == 0, g.output
    texts = [json.loads(line)["text"] for line in g.stdout.splitlines() if line.startswith("{")]
    return list(zip(replies, texts)), doc


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_replies_equal_generate_on_the_fixture(method, tmp_path):
    skip_without_fixture()
    import gc

    gc.unfreeze()
    pairs, doc = chat_then_generate(fixture_model_args(method), tmp_path, plain=True)
    froze = gc.get_freeze_count()  # the first settle froze the heap (ddtree.decode.startup.freeze_heap)
    gc.unfreeze()
    assert froze > 0
    assert all(a == b for a, b in pairs), pairs
    assert doc["metadata"]["transcript"] == "plain"
    later = doc["turns"][1:]
    assert all(t["reused_tokens"] > 0 and t["prefilled_tokens"] < t["prompt_tokens"] for t in later), later


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize("thinking", ["--thinking", "--no-thinking"])
def test_replies_equal_generate_with_a_template_that_drops_thinking(templated_pair, method, thinking, tmp_path):
    tdir, ddir = templated_pair
    args = ["--target", tdir, "--method", method, "--max-new-tokens", 10, "--dtype", "float32", "--devices", "cpu",
            "--max-length", 1024]
    if method != "ar":
        args += ["--drafter", ddir, "--budget", 4]
    pairs, doc = chat_then_generate(args, tmp_path, extra=[thinking], system="be brief")
    assert all(a == b for a, b in pairs), pairs
    assert doc["messages"][0] == {"role": "system", "content": "be brief"}
    # the template re-renders each reply without its think block: the settle after it rolls back
    # to a boundary inside that turn's prompt, and the next turn prefills only its own message
    for t in doc["turns"]:
        assert t["settle_reused_tokens"] < t["prompt_tokens"] and t["settle_prefilled_tokens"] > 0, t
    for prev, t in zip(doc["turns"], doc["turns"][1:]):
        assert t["reused_tokens"] == prev["settle_reused_tokens"] + prev["settle_prefilled_tokens"], (prev, t)


def test_a_message_past_max_length_is_refused_and_the_conversation_kept(templated_pair, tmp_path):
    tdir, _ = templated_pair
    saved = tmp_path / "c.json"
    r = invoke("chat", "--target", tdir, "--max-new-tokens", 8, "--devices", "cpu", "--max-length", 100,
               input=f"hi\n{'x' * 120}\n/save {saved}\n")
    assert r.exit_code == 0, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "does not fit" in errors[0] and "--max-length 100" in errors[0], r.stderr
    doc = json.loads(saved.read_text())
    assert [m["role"] for m in doc["messages"]] == ["user", "assistant"] and doc["messages"][0]["content"] == "hi"


def test_commands(templated_pair, tmp_path):
    """/method, /budget, /system, /reset, /stats, /load, unknown commands; all in one session."""
    tdir, ddir = templated_pair
    saved = tmp_path / "c.json"
    lines = ["hello", "/method dflash", "/budget 4", "/method ddtree", "second", "/stats", f"/save {saved}",
             "/reset", "/system short", "third", "/load " + str(saved), "fourth", "/nope", "//slash", "/exit", "never"]
    r = invoke("chat", "--target", tdir, "--drafter", ddir, "--method", "ar", "--max-new-tokens", 6, "--devices", "cpu",
               "--max-length", 2048, input="\n".join(lines) + "\n")
    assert r.exit_code == 0, r.output
    err = r.stderr
    assert "method dflash" in err and "budget 4" in err and "method ddtree 4" in err
    assert "ddtree 4: 6 new tokens from a" in err and "tokens reused" in err
    assert "error: unknown command /nope: /help lists them" in err
    assert "loaded 4 messages" in err
    doc = json.loads(saved.read_text())
    assert [t["method"] for t in doc["turns"]] == ["ar", "ddtree"]
    # stdout: the replies, one line each (hello, second, third, fourth, /slash), and nothing after /exit
    assert len([ln for ln in r.stdout.splitlines()]) >= 5


# ------------------------------------------------------------------------------------------ terminals


def chat_command(extra: list = ()) -> list[str]:
    # replies long enough (~3 s here) for a Ctrl-C to land inside one
    return [sys.executable, "-m", "ddtree", "chat", *map(str, fixture_model_args("ddtree", n=96)), *map(str, extra)]


def test_terminal_session_under_tmux(tmp_path):
    """A real terminal: two messages, /stats, Ctrl-C in the middle of the third reply (the partial
    reply is kept), Ctrl-D: exit status 0."""
    skip_without_fixture()
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    sock, name = str(tmp_path / "tmux.sock"), "chat"
    status = tmp_path / "status"
    env = cli_env()
    envs = " ".join(f"{k}={shlex.quote(env[k])}" for k in ("PYTHONPATH", "OMP_NUM_THREADS", "HF_HUB_OFFLINE",
                                                          "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM"))
    # the shell outlives the Ctrl-C sent to the terminal's foreground group (a handler, not an
    # ignore: the chat keeps the default SIGINT), and writes the chat's exit status
    cmd = (f"trap 'true' INT; cd {shlex.quote(str(REPO))} && env {envs} {shlex.join(chat_command())}; "
           f"echo $? > {shlex.quote(str(status))}")

    def tmux(*args):
        return subprocess.run(["tmux", "-S", sock, *args], capture_output=True, text=True, timeout=30)

    def screen() -> str:
        return tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", name).stdout

    def wait_for(pred, timeout=240):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            s = screen()
            if pred(s):
                return s
            time.sleep(0.02)
        raise AssertionError(f"timed out; the screen:\n{screen()}")

    tmux("new-session", "-d", "-s", name, "-x", "160", "-y", "50", "sh", "-c", cmd + "; sleep 600")
    try:
        wait_for(lambda s: s.rstrip().endswith(">>>"))
        for msg in MESSAGES[:2]:
            tmux("send-keys", "-t", name, "-l", msg)
            tmux("send-keys", "-t", name, "Enter")
            wait_for(lambda s, m=msg: m in s and s.rstrip().endswith(">>>"))
        tmux("send-keys", "-t", name, "-l", "/stats")
        tmux("send-keys", "-t", name, "Enter")
        wait_for(lambda s: "tokens reused" in s and s.rstrip().endswith(">>>"))
        tmux("send-keys", "-t", name, "-l", MESSAGES[2])
        tmux("send-keys", "-t", name, "Enter")
        # a reply of 96 tokens streams for a few seconds: Ctrl-C lands inside it (polling the
        # screen for its first text was too slow on a loaded machine)
        wait_for(lambda s: f">>> {MESSAGES[2]}" in s)
        time.sleep(0.7)
        tmux("send-keys", "-t", name, "C-c")
        s = wait_for(lambda s: "the partial reply is kept" in s and s.rstrip().endswith(">>>"))
        tmux("send-keys", "-t", name, "-l", "half a line")
        wait_for(lambda s: s.rstrip().endswith(">>> half a line"))
        tmux("send-keys", "-t", name, "C-c")  # at the prompt: clears the line, a new prompt
        wait_for(lambda s: s.rstrip().endswith(">>>") and "half a line" in s)
        tmux("send-keys", "-t", name, "C-d")
        t0 = time.monotonic()
        while not status.exists() and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        assert status.exists(), screen()
        assert status.read_text().strip() == "0", screen()
        s = screen()
        assert "Traceback" not in s and "ddtree 8:" in s, s
    finally:
        tmux("kill-server")


def test_the_same_session_through_a_pipe(tmp_path):
    """Messages one per line from a pipe: two messages, /stats, SIGINT in the third reply (kept),
    /save, end of input: exit status 0; stdout holds only the replies."""
    skip_without_fixture()
    saved = tmp_path / "c.json"
    proc = subprocess.Popen(chat_command(), cwd=str(REPO), env=cli_env(), stdin=subprocess.PIPE, preexec_fn=sigint_default,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = bytearray(), bytearray()

    def pump(stream, buf):
        while chunk := os.read(stream.fileno(), 4096):
            buf.extend(chunk)

    threads = [threading.Thread(target=pump, args=(s, b), daemon=True) for s, b in ((proc.stdout, out), (proc.stderr, err))]
    for t in threads:
        t.start()

    def send(line: str):
        proc.stdin.write((line + "\n").encode())
        proc.stdin.flush()

    def wait(pred, timeout=240):
        t0 = time.monotonic()
        while not pred() and time.monotonic() - t0 < timeout:
            assert proc.poll() is None, err.decode()
            time.sleep(0.05)
        assert pred(), err.decode()

    try:
        for msg in MESSAGES[:2]:
            send(msg)
        send("/stats")
        wait(lambda: b"tokens reused" in err)
        time.sleep(0.5)
        n = len(out)
        send(MESSAGES[2])
        wait(lambda: len(out) > n)  # the third reply streams
        proc.send_signal(signal.SIGINT)
        wait(lambda: b"the partial reply is kept" in err)
        send(f"/save {saved}")
        proc.stdin.close()
        assert proc.wait(120) == 0, err.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    for t in threads:
        t.join(5)
    text, log = out.decode(), err.decode()
    assert "Traceback" not in log
    doc = json.loads(saved.read_text())
    assert [t["interrupted"] for t in doc["turns"]] == [False, False, True]
    replies = [m["content"] for m in doc["messages"] if m["role"] == "assistant"]
    assert text == "".join(r + "\n" for r in replies)


@pytest.mark.parametrize("args, needle", [
    (["--system", "@/no/such/file.txt"], "--system @/no/such/file.txt: cannot read"),
    (["--method", "dflash"], "--method dflash needs a drafter"),
    (["--budget", "0"], "--budget 0 must be at least 1"),
])
def test_bad_input_is_one_error_line_before_loading(templated_pair, args, needle):
    tdir, _ = templated_pair
    r = invoke("chat", "--target", tdir, "--devices", "cpu", *args, input="hi\n")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert r.stdout == ""
