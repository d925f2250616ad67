"""`ddtree serve`: checks, the listening socket, start-up, uvicorn, signals.

The option checks and the port come first (a mistake or a busy port: one error line, exit 2, in
well under a second), then the configs and the tokenizer. The socket listens from then on:
`/health` answers 503 while the engine thread loads the weights, compiles and captures what
requests use (one warm-up conversation), 200 once it is ready (one log line gives the start-up
breakdown). SIGINT / SIGTERM: the server stops taking requests, the waiting ones get a 503, the
generation in progress ends after its round, and the command exits 0 (uvicorn's own handler
would raise the signal again after its shutdown).
"""

from __future__ import annotations

import signal
import socket
import time
from typing import Callable

import uvicorn
from loguru import logger

from ddtree.errors import DDTreeError


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything heavy (port 0: a free one)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise DDTreeError(f"--host {host}: not an address of this machine ({e.strerror}): pass e.g. 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)  # proto IPPROTO_TCP: asyncio sets TCP_NODELAY on its connections
    # (without it a stream's first small write waits ~40 ms for the client's delayed ACK)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise DDTreeError(f"cannot listen on {host}:{port} ({e.strerror or e}): pass another --port (0 picks a free "
                          "one) or stop what holds it") from None
    sock.set_inheritable(True)
    return sock


def run_serve(opts: dict, given: frozenset, stage: Callable[[str], None]) -> int:
    """`ddtree serve` after option merging."""
    from ddtree.app import setup as S
    from ddtree.app.chat import CHAT_MAX_LENGTH
    from ddtree.app.serve.api import create_app
    from ddtree.app.serve.engine import Engine
    from ddtree.app.serve.metrics import Metrics
    from ddtree.decode.startup import process_age_s

    t_entry, age = time.perf_counter(), process_age_s() or 0.0
    method, budget = S.check_model_options(opts)
    S.precheck_model(opts["target"], "target")
    if opts["drafter"]:
        S.precheck_model(opts["drafter"], "drafter")
    if "budget" in given and method != "ddtree":
        S.warn_ignored("--budget", f"it sizes ddtree's trees, and the default method is {method} (a request's "
                       "\"ddtree\": {\"method\": \"ddtree\"} uses it)")
    sock = bind(str(opts["host"]), int(opts["port"]))
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    stage("reading the configs and the tokenizer")
    spec = S.inspect_models(opts["target"], opts["drafter"], opts["devices"], opts["dtype"],
                            need_drafter=bool(opts["drafter"]))
    S.warn_template(spec, opts, given)
    template = S.has_chat_template(spec) and not opts["raw"]
    max_len = opts["max_length"] or min(spec.target_cfg.max_position_embeddings, CHAT_MAX_LENGTH)
    room = max(S.tree_room(method, budget, spec.block_size),
               S.tree_room("dflash", None, spec.block_size) if spec.drafter_cfg is not None else 1)
    S.check_length(8, int(opts["max_new_tokens"]), room, max_len, what="a short prompt")

    metrics = Metrics()
    engine = Engine(spec, opts, method, budget, max_len, room, template, metrics, stage, t_entry, age)
    app = create_app(engine, metrics, spec.target_ref, opts["api_key"])
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", log_config=None,
                            timeout_graceful_shutdown=10)
    server = _Server(config, engine)
    engine.start(on_fail=server.stop)
    logger.info(f"listening on {url} (model '{spec.target_ref}'; /health answers 503 until the models are ready)")
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        engine.join(60)
        sock.close()
    if engine.error is not None:
        raise engine.error
    logger.info("stopped")
    return 0


class _Server(uvicorn.Server):
    """uvicorn's Server whose signal handler also stops the engine, and does not raise the signal
    again once the server has stopped (the command exits 0)."""

    def __init__(self, config, engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame):
        self.engine.shutdown()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    def stop(self):
        self.should_exit = True
