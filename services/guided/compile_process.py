"""The router's grammar compiles, in a child process: xgrammar imports torch, and the router
process imports none (docs/ARCHITECTURE.md); and a child can be stopped, where a compile on a
thread runs to its end.

The router compiles a constraint only to answer one that cannot compile with a 400 before it is
queued (the worker compiles it again, in its own process, to build matchers), so what comes back
is the verdict and the compiled form's size, not the form. The child starts on the first
constraint (a router that never sees one never pays torch's import), loads the model's tokenizer,
and compiles one constraint at a time: its one caller is the compile cache's one thread
(services/guided/cache.py). A compile that outlasts --grammar-compile-timeout stops the child
(killed; the next constraint starts a new one) and is refused like one that took too long; a child
that dies under a compile is started again and the compile tried once more. The child exits when
its router does, even by SIGKILL and in the middle of a compile.

Frames both ways: 4 bytes of length (big-endian), then JSON (a constraint is JSON from the
request; JSON keeps its big integers and escaped surrogates as they came).

    python -m pagedserve.services.guided.compile_process MODEL_DIR VOCAB_SIZE EOS_IDS_JSON
"""
from __future__ import annotations

import json
import os
import selectors
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from pagedserve.services.guided.limits import GrammarError

START_TIMEOUT_S = 120.0   # torch, xgrammar and the tokenizer on a loaded 2-core machine: ~5 s
KILL_GRACE_S = 1.0        # past the compile deadline, before the child is stopped
_HEADER = struct.Struct(">I")


class CompilerUnavailable(RuntimeError):
    """The compile process could not start (a server fault, not the request's)."""


@dataclass(frozen=True)
class Compiled:
    """What the router keeps of a compiled constraint: its size where it is held (the worker)."""
    size: int


class CompileProcess:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...],
                 compile_timeout_s: float):
        self.argv = [sys.executable, "-m", __name__, str(model_dir), str(vocab_size),
                     json.dumps(list(eos_token_ids))]
        self.compile_timeout_s = compile_timeout_s
        self._proc: subprocess.Popen | None = None
        self._ready: Future | None = None
        # Two locks: the router's event loop asks ready() while a compile may hold the child for
        # seconds, so the child's life (_life: who it is, its start) is never held across a compile
        # (_io: one round trip at a time).
        self._life = threading.Lock()
        self._io = threading.Lock()
        self.starts = 0                    # children started (tests, logs)

    def backend(self, name: str) -> "RemoteBackend":
        return RemoteBackend(self, name)

    def ready(self) -> Future:
        """Done once a child is up (its exception: it could not start). Starts one, on a thread of
        its own, if none runs: a router awaits this before its compile deadline starts. Never
        waits on a compile in progress."""
        with self._life:
            if self._ready is None or (self._ready.done() and not self._alive()):
                self._ready = Future()
                threading.Thread(target=self._start, args=(self._ready,), name="grammar-compile-start",
                                 daemon=True).start()
            return self._ready

    def compile(self, name: str, constraint: dict) -> int:
        """The compiled size of a wire-form constraint; GrammarError if it does not compile.
        A child that dies under a compile (killed, or out of memory) is replaced and the compile
        tried once more: the second death is the constraint's verdict, the first may be anyone's."""
        kind = constraint.get("kind")
        for attempt in (1, 2):
            self.ready().result()           # raises CompilerUnavailable
            with self._io:
                with self._life:
                    proc = self._proc
                if proc is None:
                    raise CompilerUnavailable("the grammar compiler is closed")
                try:
                    _write(proc.stdin, {"backend": name, "constraint": constraint})
                    reply = _read(proc.stdout, self.compile_timeout_s + KILL_GRACE_S)
                except (OSError, EOFError, ValueError) as e:   # ValueError: a pipe closed under us
                    self._stop(proc)
                    if attempt == 2:
                        raise GrammarError(f"the {kind} constraint stopped the grammar compiler twice "
                                           f"({e or 'it exited'})") from None
                    continue
                if reply is None:
                    self._stop(proc)
                    raise GrammarError(f"the {kind} constraint did not compile within "
                                       f"{self.compile_timeout_s:g} s (--grammar-compile-timeout)")
            break
        if "error" in reply:
            raise GrammarError(reply["error"])
        if "fault" in reply:                # the compiler's own failure, not the constraint's
            raise RuntimeError(f"the grammar compiler failed: {reply['fault']}")
        return int(reply["size"])

    def close(self) -> None:
        with self._life:
            proc = self._proc
        if proc is not None:
            self._stop(proc)

    # ---- the child's life ----------------------------------------------------------------------
    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _start(self, ready: Future) -> None:
        try:
            proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
            hello = _read(proc.stdout, START_TIMEOUT_S)
        except (OSError, EOFError) as e:
            ready.set_exception(CompilerUnavailable(f"the grammar compiler did not start: {e or 'it exited'}"))
            return
        if hello is None or "error" in hello:
            proc.kill()
            proc.wait()
            why = "no answer within %g s" % START_TIMEOUT_S if hello is None else hello["error"]
            ready.set_exception(CompilerUnavailable(f"the grammar compiler did not start: {why}"))
            return
        with self._life:
            self._proc = proc
            self.starts += 1
        ready.set_result(True)

    def _stop(self, proc: subprocess.Popen) -> None:
        """Kill this child (if it is still ours, the next ready() starts another)."""
        with self._life:
            if self._proc is proc:
                self._proc, self._ready = None, None
        proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            f.close()


class RemoteBackend:
    """A backend for the compile cache whose compile runs in the child; it keeps only the size."""

    def __init__(self, process: CompileProcess, name: str):
        self.process, self.name = process, name

    def compile(self, constraint: dict) -> Compiled:
        return Compiled(self.process.compile(self.name, constraint))

    def size_of(self, compiled: Compiled) -> int:
        return compiled.size


# ---- frames -------------------------------------------------------------------------------------

def _write(f, obj: dict) -> None:
    body = json.dumps(obj).encode()
    f.write(_HEADER.pack(len(body)) + body)
    f.flush()


def _read(f, timeout_s: float | None) -> dict | None:
    """One frame; None when timeout_s passes first; EOFError when the other side closed."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    header = _read_exactly(f, _HEADER.size, deadline)
    if header is None:
        return None
    body = _read_exactly(f, _HEADER.unpack(header)[0], deadline)
    return None if body is None else json.loads(body)


def _read_exactly(f, n: int, deadline: float | None) -> bytes | None:
    fd, out = f.fileno(), bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while len(out) < n:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and (left <= 0 or not sel.select(left)):
                return None
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError("the other side closed")
            out += chunk
    return bytes(out)


# ---- the child ----------------------------------------------------------------------------------

def _exit_with_parent(parent: int) -> None:
    """Exit when the router is gone, even in the middle of a compile (stdin's EOF is read only
    between compiles, and a compile may run for minutes). The compile releases the GIL, so this
    thread runs beside it."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str]) -> int:
    model_dir, vocab_size, eos = argv[0], int(argv[1]), tuple(json.loads(argv[2]))
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    # Frames go on the real stdout; anything a library prints goes to stderr, not into a frame.
    frames_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    frames_in = os.fdopen(os.dup(0), "rb", buffering=0)
    try:
        from transformers import AutoTokenizer

        from pagedserve.services.guided.backends import make_backend
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # the router loaded this folder already: a fault here is the machine's
        _write(frames_out, {"error": f"{type(e).__name__}: {e}"})
        return 1
    backends: dict = {}
    _write(frames_out, {"ready": True})
    while True:
        try:
            job = _read(frames_in, None)
        except EOFError:             # the router closed our stdin: it has exited
            return 0
        try:
            name = job["backend"]
            backend = backends.get(name) or backends.setdefault(name, make_backend(name, tokenizer, vocab_size, eos))
            compiled = backend.compile(job["constraint"])
            _write(frames_out, {"size": int(backend.size_of(compiled))})
            del compiled
        except GrammarError as e:
            _write(frames_out, {"error": str(e)})
        except Exception as e:       # not the constraint's fault: the router answers 500, caches nothing
            _write(frames_out, {"fault": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
