"""A tiny random target + DFlash drafter written as released checkpoints, with a byte-level
tokenizer built by the tokenizers library: the CLI end to end in well under a second per
prompt, without the codepair fixture. No stop token (generations always run to the end)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import REPO, cli_env
from helpers import VOCAB, write_random_pair


def write_tiny_pair(root: Path) -> tuple[Path, Path]:
    """-> (target dir, drafter dir) under root (written once per root)."""
    from ddtree.model.synthetic import tiny_hybrid_config

    if (root / "drafter" / "config.json").is_file():
        return root / "target", root / "drafter"
    raw = tiny_hybrid_config(vocab=VOCAB)
    raw["text_config"].pop("eos_token_id")  # no stop token: every generation runs to --max-new-tokens
    return write_random_pair(root, raw)


def sigint_default() -> None:
    """Popen's preexec_fn: the child takes SIGINT as from a terminal. A suite started as a
    background job of a non-interactive shell (`pytest &`) runs with SIGINT ignored, and its
    children inherit that: Python then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_when(args: list[str], ready, timeout: float = 120):
    """Run `python -m ddtree ARGS`, send SIGINT once ready(stderr so far) is true; returns
    (returncode, stdout, stderr). stderr is read as it comes (progress bars end lines with \\r)."""
    proc = subprocess.Popen([sys.executable, "-m", "ddtree", *map(str, args)], cwd=str(REPO), env=cli_env(),
                            preexec_fn=sigint_default,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = bytearray()
    out = bytearray()
    done = threading.Event()

    def pump(stream, buf):
        while chunk := os.read(stream.fileno(), 4096):
            buf.extend(chunk)
        if buf is err:
            done.set()

    threads = [threading.Thread(target=pump, args=(proc.stderr, err), daemon=True),
               threading.Thread(target=pump, args=(proc.stdout, out), daemon=True)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    sent = False
    while proc.poll() is None and time.monotonic() - t0 < timeout:
        if not sent and ready(err.decode(errors="replace")):
            proc.send_signal(signal.SIGINT)
            sent = True
        time.sleep(0.01)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for t in threads:
        t.join(5)
    assert sent, f"never became ready to interrupt:\n{err.decode(errors='replace')}"
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def tiny_pair_fixture():
    """A pytest fixture (import it into a test module): the tiny pair, written once per test run."""
    import pytest

    @pytest.fixture(scope="session")
    def tiny_pair(tmp_path_factory):
        return write_tiny_pair(tmp_path_factory.getbasetemp() / "tiny_pair")

    return tiny_pair


def heap_frozen_at_each_generate(monkeypatch) -> list[bool]:
    """Unfreeze the heap, then record, at every Decoder.generate from here on, whether it was frozen
    (gc.freeze; ddtree.decode.startup): the list fills as generations start."""
    import gc

    from ddtree.decode import decoder

    frozen: list[bool] = []
    real = decoder.Decoder.generate

    def generate(self, *a, **k):
        frozen.append(gc.get_freeze_count() > 0)
        return real(self, *a, **k)

    monkeypatch.setattr(decoder.Decoder, "generate", generate)
    gc.unfreeze()
    return frozen
