"""The router's grammar compiles in a child process (services/guided/compile_process.py): the same
verdicts as compiling in process, a compile past its deadline stops the child and the next one
starts a new child, a dead child is replaced, a child that cannot start is a fault that is not
cached, and the child exits when the router's end of its stdin closes."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from pagedserve.services.guided import spec as specs
from pagedserve.services.guided.backends import make_backend
from pagedserve.services.guided.cache import CompileCache
from pagedserve.services.guided.compile_process import CompileProcess, CompilerUnavailable
from pagedserve.services.guided.limits import GrammarError

# 1,500 optional properties: seconds to compile (services/guided/limits.py measured 1,000 at 0.75-5 s).
SLOW = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1500)}}


@pytest.fixture
def process(tiny_llama):
    p = CompileProcess(tiny_llama, 2048, (2,), compile_timeout_s=0.2)
    yield p
    p.close()


def _child_pid(p: CompileProcess) -> int:
    p.ready().result(timeout=120)
    return p._proc.pid     # noqa: SLF001  (the test looks at the child it started)


def test_verdicts_and_sizes_are_those_of_compiling_in_process(process, tiny_llama):
    from pagedserve.services.worker.model_loader import load_tokenizer
    local = make_backend("xgrammar", load_tokenizer(tiny_llama), 2048, (2,))
    for c in (specs.make("regex", "[ab]+"), specs.make("json", {"type": "object", "properties": {"a": {"type": "integer"}}}),
              specs.make("choice", ["yes", "no"])):
        assert process.compile("xgrammar", c) == local.size_of(local.compile(c))
    bad = specs.make("regex", "a(")
    with pytest.raises(GrammarError) as remote_error:
        process.compile("xgrammar", bad)
    with pytest.raises(GrammarError) as local_error:
        local.compile(bad)
    assert str(remote_error.value) == str(local_error.value)
    assert process.starts == 1


def test_a_compile_past_its_deadline_stops_the_child_and_the_next_starts_another(process):
    first = _child_pid(process)
    t0 = time.monotonic()
    with pytest.raises(GrammarError, match="did not compile within 0.2 s"):
        process.compile("xgrammar", specs.make("json", SLOW))
    assert time.monotonic() - t0 < 3.0           # the deadline plus the kill's grace, not the compile
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)
    assert process.compile("xgrammar", specs.make("regex", "x+")) > 0
    assert process.starts == 2 and _child_pid(process) != first


def test_a_child_that_died_is_replaced_before_the_next_compile(process):
    first = _child_pid(process)
    os.kill(first, signal.SIGKILL)
    time.sleep(0.2)
    assert process.compile("xgrammar", specs.make("regex", "y+")) > 0
    assert process.starts == 2


def test_the_child_exits_when_its_stdin_closes(process):
    _child_pid(process)
    process._proc.stdin.close()   # noqa: SLF001  (what the router's exit does to it)
    assert process._proc.wait(timeout=30) == 0    # noqa: SLF001


def test_a_compiler_that_cannot_start_is_a_fault_and_not_cached(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))   # no tokenizer
    p = CompileProcess(str(tmp_path), 2048, (2,), compile_timeout_s=1.0)
    cache = CompileCache(p.backend)
    try:
        with pytest.raises(CompilerUnavailable, match="did not start"):
            p.ready().result(timeout=120)
        c = specs.make("regex", "z+")
        with pytest.raises(CompilerUnavailable):
            cache.compile(c)
        assert len(cache) == 0        # the next request compiles again, once the machine is mended
    finally:
        cache.close()
        p.close()


def slow_regex(n: int, salt: str) -> dict:
    """A valid regex whose compile takes seconds (n=400: ~2 s here) and grows fast with n."""
    return specs.make("regex", salt + "".join("[%s-%s]?" % (chr(97 + i % 20), chr(99 + i % 20)) for i in range(n)))


def test_ready_never_waits_for_a_compile_in_progress(process):
    """The router's event loop asks ready() for every constrained request: it held the lock a
    compile held for seconds, so one slow constraint froze the router until its heartbeat failed."""
    import threading
    process.ready().result(timeout=120)
    t = threading.Thread(target=lambda: pytest.raises(GrammarError, process.compile, "xgrammar", slow_regex(8000, "r")))
    t.start()
    time.sleep(0.3)                            # the compile is in the child now
    t0 = time.monotonic()
    assert process.ready().done()
    assert time.monotonic() - t0 < 0.5             # the freeze lasted the compile: seconds
    t.join(10)


def test_a_child_killed_under_a_compile_is_replaced_and_the_compile_tried_again(tiny_llama):
    """Killed by someone else (or the OOM killer) mid-compile: not the constraint's verdict."""
    import threading
    process = CompileProcess(tiny_llama, 2048, (2,), compile_timeout_s=60.0)
    try:
        first = _child_pid(process)
        threading.Timer(0.5, os.kill, (first, signal.SIGKILL)).start()
        assert process.compile("xgrammar", slow_regex(400, "k")) > 0
        assert process.starts == 2
    finally:
        process.close()


def test_a_busy_child_exits_with_its_router(tiny_llama, tmp_path):
    """stdin's EOF is read only between compiles: a router SIGKILLed during a minutes-long compile
    left its child computing, re-parented, for over ten minutes."""
    import subprocess
    import sys
    script = tmp_path / "router.py"
    script.write_text(
        "import sys, threading, time\n"
        "from pagedserve.services.guided.compile_process import CompileProcess\n"
        "from pagedserve.services.guided import spec\n"
        "slow = spec.make('regex', 'o' + ''.join('[%s-%s]?' % (chr(97 + i % 20), chr(99 + i % 20)) for i in range(8000)))\n"
        f"p = CompileProcess({tiny_llama!r}, 2048, (2,), compile_timeout_s=600)\n"
        "p.ready().result(timeout=120)\n"
        "threading.Thread(target=p.compile, args=('xgrammar', slow), daemon=True).start()\n"
        "time.sleep(0.5)\n"
        "print(p._proc.pid, flush=True)\n"
        "time.sleep(600)\n")
    router = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    try:
        child = int(router.stdout.readline())
        os.kill(router.pid, signal.SIGKILL)
        router.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the compile child outlived its router by 5 s")
    finally:
        router.kill()
