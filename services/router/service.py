"""The router process: Config, flags, and run() serving the app with uvicorn until SIGTERM/SIGINT.

    python -m services.router.service --model DIR [--port 8000] [--scheduler-endpoint EP]
                                      [--redis-url URL] [--router-id ID] [--require-api-key]

With --scheduler-endpoint the router talks to that scheduler; without it, it needs --redis-url and
sends each request to one of the replicas registered there.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import uuid
from dataclasses import dataclass, field

from services.curve import KEYS_ENV, KeysError
from services.flags import opt
from services.state import redact_url

log = logging.getLogger("pagedserve.router")

LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")


@dataclass
class Config:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    scheduler_endpoint: str | None = "tcp://127.0.0.1:5602"
    redis_url: str | None = None
    router_id: str = ""
    served_model_name: str | None = None
    max_model_len: int | None = None
    require_api_key: bool = False
    api_keys: list[str] = field(default_factory=list)   # added to the store at start (handy without Redis)
    rate_limit: int | None = None                       # requests per window per key; None = unlimited
    rate_limit_window_s: float = 60.0
    ping_interval_s: float = 1.0
    scheduler_timeout_s: float = 10.0                   # silent this long -> in-flight requests get 503
    ready_timeout_s: float = 1.0
    stats_timeout_s: float = 1.0
    log_level: str = "INFO"
    max_stop_strings: int = 4                           # OpenAI's limit
    # CORS, with vLLM's flags and defaults (JSON lists on the command line): no cross-origin
    # browser access unless origins are named.
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    curve_keys: str = opt("", f"folder of CURVE keys for the scheduler sockets (pagedserve keys DIR; "
                              f"else ${KEYS_ENV})")

    def __post_init__(self):
        if not self.router_id:
            self.router_id = f"router-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"

    def validate(self) -> "Config":
        if not self.model:
            raise ValueError("--model is required")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not self.scheduler_endpoint and not self.redis_url:
            raise ValueError("--scheduler-endpoint is required unless --redis-url lists the replicas")
        if self.scheduler_endpoint and not self.scheduler_endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError("--scheduler-endpoint must be a tcp:// or ipc:// endpoint")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("--redis-url must be a redis://, rediss:// or unix:// URL")
        if not self.router_id or len(self.router_id) > 200:
            raise ValueError("--router-id must be 1-200 characters")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("--max-model-len must be at least 2")
        if self.rate_limit is not None and self.rate_limit < 1:
            raise ValueError("--rate-limit must be at least 1 request per window")
        if self.rate_limit_window_s <= 0:
            raise ValueError("--rate-limit-window must be positive")
        if self.require_api_key and not self.redis_url and not self.api_keys:
            raise ValueError("--require-api-key without --redis-url needs at least one --api-key")
        for name in ("ping_interval_s", "scheduler_timeout_s", "ready_timeout_s", "stats_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name[:-2].replace('_', '-')} must be positive")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        if self.max_stop_strings < 0:
            raise ValueError("--max-stop-strings must be at least 0")
        for name in CORS_LISTS:
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"--{name.replace('_', '-')} must be a JSON list of strings, got {value!r}")
        return self


CORS_LISTS = ("allowed_origins", "allowed_methods", "allowed_headers")


def add_cors_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's CORS flags; `pagedserve up` takes the same and passes them to its routers."""
    for name in CORS_LISTS:
        default = json.dumps(Config.__dataclass_fields__[name].default_factory())
        p.add_argument(f"--{name.replace('_', '-')}", type=json.loads, default=None,
                       help=f"a JSON list (default {default})")
    p.add_argument("--allow-credentials", action="store_true")


def cors_fields(args) -> dict:
    """The Config fields the CORS flags set (absent flags keep the defaults)."""
    out = {name: getattr(args, name) for name in CORS_LISTS if getattr(args, name) is not None}
    return {**out, "allow_credentials": args.allow_credentials}


def cors_argv(args) -> list[str]:
    """The CORS flags given to `pagedserve up`, as a router's command line."""
    argv = [a for name in CORS_LISTS if getattr(args, name) is not None
            for a in (f"--{name.replace('_', '-')}", json.dumps(getattr(args, name)))]
    return argv + (["--allow-credentials"] if args.allow_credentials else [])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face folder (tokenizer and config are read)")
    p.add_argument("--host", default=Config.host)
    p.add_argument("--port", type=int, default=Config.port)
    p.add_argument("--curve-keys", default="", help=f"folder of CURVE keys (else ${KEYS_ENV})")
    p.add_argument("--scheduler-endpoint", default=Config.scheduler_endpoint,
                   help="the scheduler to send requests to; 'none' to pick replicas from --redis-url")
    p.add_argument("--redis-url", default=None, help="shared state for several routers (else in process)")
    p.add_argument("--router-id", default="", help="this router's ZeroMQ identity (default: host-pid-random)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--require-api-key", action="store_true")
    p.add_argument("--api-key", action="append", default=[], dest="api_keys",
                   help="add this key to the store at start (repeatable)")
    p.add_argument("--rate-limit", type=int, default=None, help="requests per window per API key")
    p.add_argument("--rate-limit-window", type=float, default=Config.rate_limit_window_s)
    p.add_argument("--scheduler-timeout", type=float, default=Config.scheduler_timeout_s)
    p.add_argument("--log-level", default=Config.log_level)
    p.add_argument("--max-stop-strings", type=int, default=Config.max_stop_strings,
                   help="stop strings a request may send (OpenAI's limit is 4)")
    add_cors_arguments(p)


def config_from_args(args) -> Config:
    endpoint = args.scheduler_endpoint
    if endpoint is not None and endpoint.lower() in ("", "none"):
        endpoint = None
    return Config(model=args.model, host=args.host, port=args.port, scheduler_endpoint=endpoint,
                  redis_url=args.redis_url, router_id=args.router_id, served_model_name=args.served_model_name,
                  max_model_len=args.max_model_len, require_api_key=args.require_api_key,
                  api_keys=list(args.api_keys), rate_limit=args.rate_limit,
                  rate_limit_window_s=args.rate_limit_window, scheduler_timeout_s=args.scheduler_timeout,
                  log_level=args.log_level.upper(), max_stop_strings=args.max_stop_strings,
                  curve_keys=args.curve_keys, **cors_fields(args)).validate()


def build_app(config: Config, state=None):
    """The app for this config (loads the tokenizer; the state defaults to what the config says)."""
    from services.router.app import create_app
    from services.router.model_info import load_model_info
    from services.state import make_state

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


def run(config: Config) -> int:
    """Serve until SIGTERM/SIGINT (uvicorn handles both and drains); returns the exit code."""
    import uvicorn

    from services.worker.model_loader import ModelLoadError

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
    except Exception as e:   # redis-py raises ConnectionError, TimeoutError, AuthenticationError...
        if type(e).__module__.startswith("redis"):
            print(f"router: cannot use Redis at {redact_url(config.redis_url)}: {e}", file=sys.stderr)
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
    from services.process import service_main
    return service_main("router", add_arguments, config_from_args, run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
