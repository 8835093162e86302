"""The router process: Config, flags, and run() serving the app with uvicorn until SIGTERM/SIGINT.

    python -m pagedserve.services.router.service --model DIR [--port 8000] [--scheduler-endpoint EP]
                                      [--redis-url URL] [--router-id ID] [--require-api-key]

With --scheduler-endpoint the router talks to that scheduler; without it, it needs --redis-url and
sends each request to one of the replicas registered there.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from dataclasses import dataclass

from pagedserve.services import config_fields as cf
from pagedserve.services.config_fields import positive
from pagedserve.services.flags import ProcessConfig, opt
from pagedserve.services.curve import KeysError
from pagedserve.services.router.options import RouterOptions
from pagedserve.services.state import redis_start_failure

log = logging.getLogger("pagedserve.router")

@dataclass
class Config(RouterOptions, ProcessConfig):
    model: str = cf.model("a local Hugging Face folder (the tokenizer and config are read)")
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on", check=lambda v: 0 <= v < 65536 or "must be in [0, 65535]")
    scheduler_endpoint: str | None = opt("tcp://127.0.0.1:5602", "the scheduler to send requests to; 'none' to "
                                                                 "pick replicas from --redis-url",
                                         check=cf.endpoint_check)
    redis_url: str | None = cf.redis_url("shared state for several routers (else in process)")
    router_id: str = opt("", "this router's ZeroMQ identity (default: host-pid-random)",
                         check=lambda v: len(v) <= 200 or "must be at most 200 characters")
    max_model_len: int | None = cf.max_model_len()
    scheduler_timeout_s: float = opt(10.0, "seconds a scheduler may stay silent before in-flight requests get 503",
                                     flag="--scheduler-timeout", check=positive)
    log_level: str = cf.log_level()
    curve_keys: str = cf.curve_keys("for the scheduler sockets")
    ping_interval_s: float = 1.0                        # set by code (tests), not by a flag
    ready_timeout_s: float = 1.0
    stats_timeout_s: float = 1.0

    def __post_init__(self):
        if not self.router_id:
            self.router_id = f"router-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.log_level = self.log_level.upper()

    def cross_check(self) -> str | None:
        if not self.scheduler_endpoint and not self.redis_url:
            return "--scheduler-endpoint is required unless --redis-url lists the replicas"
        if self.require_api_key and not self.redis_url and not self.api_keys:
            return "--require-api-key without --redis-url needs at least one --api-key"
        for name in ("ping_interval_s", "ready_timeout_s", "stats_timeout_s"):
            if getattr(self, name) <= 0:
                return f"{name} must be positive"
        return None



def build_app(config: Config, state=None):
    """The app for this config (loads the tokenizer; the state defaults to what the config says)."""
    from pagedserve.services.router.app import create_app
    from pagedserve.services.router.model_info import load_model_info
    from pagedserve.services.state import make_state

    info = load_model_info(config.model, config.max_model_len)
    if state is None:
        state = make_state(config.redis_url)
        if config.redis_url:
            state.ping()     # fail at start, in one line, rather than on every request
    for key in config.api_keys:
        state.add_api_key(key, {"name": "cli"})
    return create_app(config, info, state)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # Drain and return on SIGTERM/SIGINT; uvicorn's own version re-raises the signal after
            # draining, which would end the process with -15 instead of exit code 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        def handle_exit(self, sig, frame):
            # Requests still in flight shortly before the drain times out end with a 503 (an SSE
            # error event for streams) instead of being cut. Until then they may finish: a router
            # restarted alone drains; when the whole stack stops, the scheduler fails them first.
            ctx = getattr(getattr(self.config.app, "state", None), "ctx", None)
            if ctx is not None and not self.should_exit:
                grace = max(0.0, (self.config.timeout_graceful_shutdown or 5) - 1.0)
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:   # no loop running yet
                    loop = None
                if loop is not None:   # from a signal handler: only call_soon_threadsafe is safe here
                    loop.call_soon_threadsafe(loop.call_later, grace, ctx.fail_in_flight, "the router is shutting down")
            super().handle_exit(sig, frame)
    return Server


def keep_torch_out() -> None:
    """The router computes nothing, so torch stays out of its process (a few hundred MB and seconds
    of import each start). transformers imports torch whenever it is installed, for models the
    router never builds; None in sys.modules is Python's own "not importable" (find_spec answers
    None), so transformers loads the tokenizer alone, and an import of torch here fails at once.
    Grammar compiles, which need torch through xgrammar, run in a child (guided/compile_process.py)."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")   # "PyTorch was not found"


def run(config: Config) -> int:
    """Serve until SIGTERM/SIGINT (uvicorn handles both and drains); returns the exit code."""
    keep_torch_out()
    import uvicorn

    from pagedserve.services.model_dir import ModelLoadError

    logging.basicConfig(level=config.log_level, format="%(asctime)s router %(levelname)s %(message)s")
    try:   # a taken port fails here, in one line, before the model loads and the app starts
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds
            probe.bind((config.host, config.port))
    except OSError as e:
        print(f"router: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 1
    server_cls = _server_class()
    try:
        app = build_app(config)
    except ModelLoadError as e:
        print(f"router: {e}", file=sys.stderr)
        return 1
    except KeysError as e:
        print(f"router: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if redis_start_failure("router", config.redis_url, e):
            return 1
        raise
    server = server_cls(uvicorn.Config(app, host=config.host, port=config.port,
                                       log_level=config.log_level.lower(), access_log=False,
                                       timeout_graceful_shutdown=5))
    try:
        server.run()
    except OSError as e:
        print(f"router: cannot listen on {config.host}:{config.port}: {e}", file=sys.stderr)
        return 1
    # uvicorn exits the process itself if it cannot bind; a started server that stops is a clean stop.
    return 0 if server.started else 1


def main(argv=None) -> int:
    from pagedserve.services.process import service_main
    return service_main("router", Config, run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
