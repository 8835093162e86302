"""What every pagedserve process does the same way: stop on SIGTERM/SIGINT, and a `main` that turns
bad flags and start-up failures into one line on stderr and a non-zero exit (never a bare traceback)."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Callable


def on_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM and SIGINT set `stop` (main thread only); returns a function restoring the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    return lambda: [signal.signal(s, h) for s, h in old.items()]


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line naming the cause (no usage block): the launcher shows the first line of a failure.
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def service_main(name: str, config_cls, run, argv=None, description: str = "") -> int:
    """Parse flags, validate the config, run; an invalid setting or model folder exits 2 with one line."""
    from pagedserve.services.model_dir import ModelLoadError

    parser = OneLineParser(prog=f"pagedserve {name}", description=description)
    config_cls.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = config_cls.from_args(args)
    except (ValueError, ModelLoadError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    try:
        return run(config)
    except ModelLoadError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2


class PeerWatch:
    """Notices a peer that stopped talking: the scheduler pings the kvstore and the workers every
    second, so a long silence from it (after it was heard once) means it is gone or stuck."""

    def __init__(self, name: str, log, silent_after_s: float = 5.0, clock=None):
        import time
        self.name, self.log, self.silent_after_s = name, log, silent_after_s
        self.clock = clock or time.monotonic
        self.last_seen: float | None = None
        self.reported = False

    def seen(self) -> None:
        if self.reported:
            self.log.info("the %s is back", self.name)
            self.reported = False
        self.last_seen = self.clock()

    def check(self) -> bool:
        """False (and one log line) once the peer has been silent too long."""
        if self.last_seen is None or self.clock() - self.last_seen < self.silent_after_s:
            return True
        if not self.reported:
            self.log.warning("the %s has been silent for %.0f s", self.name, self.clock() - self.last_seen)
            self.reported = True
        return False


def answer_requests(sock, answer: Callable[[list], list], stop: threading.Event, log,
                    poll_ms: int, between: Callable[[], None] | None = None) -> None:
    """The loop of a process that answers the scheduler on a ROUTER socket: block in poll (never
    spin; a stop signal is seen within poll_ms), reply to each request with answer(frames) -> reply
    frames, log when the scheduler falls silent, and run between() after every poll."""
    import zmq
    scheduler = PeerWatch("scheduler", log)
    while not stop.is_set():
        if not sock.poll(poll_ms, zmq.POLLIN):
            scheduler.check()
        else:
            scheduler.seen()
            identity, *frames = sock.recv_multipart()   # copying small frames beats tracking zero-copy ones
            sock.send_multipart([identity, *answer(frames)])
        if between is not None:
            between()
