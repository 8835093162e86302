"""`pagedserve serve MODEL` with vLLM's flag names, `up` with its own as aliases, and every
process's flags derived from its Config (one check per setting, the same words everywhere)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from pagedserve.services.kvstore import service as kvstore_service
from pagedserve.services import launcher
from pagedserve.services.cli import main
from pagedserve.services.engine_config import EngineConfig
from pagedserve.services.flags import ConfigError, from_args
from pagedserve.services.process import OneLineParser
from pagedserve.services.router import service as router_service
from pagedserve.services.router.options import API_KEY_ENV
from pagedserve.services.scheduler import service as scheduler_service
from pagedserve.services.worker import service as worker_service

VLLM_FLAGS = ["--host", "--port", "--api-key", "--served-model-name", "--max-model-len", "--dtype", "--block-size",
              "--swap-space", "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--num-gpu-blocks-override",
              "--max-num-seqs", "--max-num-batched-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching",
              "--preemption-mode", "--tensor-parallel-size", "--max-queued-requests", "--shutdown-timeout",
              "--routers", "--redis-url", "--max-request-body-mb", "--max-queued-tokens", "--request-timeout",
              "--kv-offloading-size", "--stream-interval"]
UP_ALIASES = ["--model", "--tensor-parallel", "--num-device-blocks", "--kv-cache-memory", "--no-prefix-caching",
              "--device"]


def serve(*argv: str) -> launcher.Config:
    parser = OneLineParser(prog="pagedserve serve")
    launcher.add_serve_arguments(parser)
    return launcher.config_from_args(parser.parse_args(list(argv)))


def up(*argv: str) -> launcher.Config:
    parser = OneLineParser(prog="pagedserve up")
    launcher.Config.add_arguments(parser)
    return launcher.config_from_args(parser.parse_args(list(argv)))


def test_serve_takes_vllms_flags_and_up_its_aliases():
    parser = OneLineParser(prog="pagedserve serve")
    launcher.add_serve_arguments(parser)
    known = set(parser._option_string_actions)
    missing = [f for f in VLLM_FLAGS + UP_ALIASES if f not in known]
    assert not missing, missing


def test_the_two_spellings_give_one_config(tmp_path):
    vllm = serve(str(tmp_path), "--tensor-parallel-size", "1", "--num-gpu-blocks-override", "64",
                 "--no-enable-prefix-caching", "--dtype", "float32", "--api-key", "k1", "--api-key", "k2",
                 "--served-model-name", "m", "--max-model-len", "512", "--swap-space", "0.5")
    ours = up("--model", str(tmp_path), "--tensor-parallel", "1", "--num-device-blocks", "64",
              "--no-prefix-caching", "--dtype", "float32", "--api-key", "k1", "k2",
              "--served-model-name", "m", "--max-model-len", "512", "--swap-space", "0.5")
    assert vllm == ours
    assert vllm.model == str(tmp_path) and vllm.num_device_blocks == 64 and not vllm.enable_prefix_caching
    assert vllm.api_keys == ["k1", "k2"]


def test_sizes_in_bytes_take_units():
    assert serve("--kv-cache-memory-bytes", "512M").kv_cache_memory_bytes == 512 * 10**6
    assert serve("--kv-cache-memory-bytes", "1GiB").kv_cache_memory_bytes == 1 << 30
    assert serve("--kv-cache-memory-bytes", "4096").kv_cache_memory_bytes == 4096


def test_api_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "sk-a,sk-b")
    assert serve().api_keys == ["sk-a", "sk-b"]
    assert serve("--api-key", "sk-c").api_keys == ["sk-c"]      # a flag wins over the variable
    monkeypatch.setenv(API_KEY_ENV, ",")
    with pytest.raises(ConfigError, match="may not be empty"):
        serve()


@pytest.mark.parametrize("argv, needle", [
    (["--bogus"], "--bogus"),
    (["--block-size", "12"], "--block-size"),
    (["--dtype", "float64"], "--dtype"),
    (["--num-gpu-blocks-override", "8", "--kv-cache-memory-bytes", "1G"], "both size the device KV pool"),
    (["--routers", "2"], "--redis-url"),
    (["--max-num-seqs", "64", "--max-num-batched-tokens", "32"], "--max-num-batched-tokens"),
    (["--batching", "request"], "orca-max"),
    (["--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes"),
    (["--max-request-body-mb", "0"], "--max-request-body-mb"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["m1", "--model", "m2"], "the model is given twice"),
    (["--port", "70000"], "--port"),
    (["--max-queued-requests", "0"], "--max-queued-requests"),
    (["--api-key", ""], "--api-key"),                 # was dropped: a server without auth
    (["--api-key", "k1", "--api-key", " "], "--api-key"),
    (["--rate-limit-window", "inf"], "--rate-limit-window"),   # was a 500 at the first 429
    (["--request-timeout", "inf"], "--request-timeout"),
    (["--swap-space", "1e30"], "--swap-space"),      # was a traceback in the kvstore
    (["--kv-offloading-size", "inf"], "--kv-offloading-size"),
    (["--kv-offloading-size", "-1"], "--kv-offloading-size"),
    (["--stream-interval", "0"], "--stream-interval"),
])
def test_bad_or_contradictory_flags_exit_2_with_one_line(capsys, argv, needle):
    code = main(["serve", *argv]) if "--bogus" not in argv else _exit_code(["serve", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err


def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


CONFIGS = [launcher.Config, router_service.Config, scheduler_service.Config, worker_service.Config,
           kvstore_service.Config, EngineConfig]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__module__)
def test_every_setting_is_a_flag_with_help(cls):
    for f in dataclasses.fields(cls):
        if "help" in f.metadata:
            assert f.metadata["help"], f.name
    parser = argparse.ArgumentParser()
    from pagedserve.services.flags import add_flags
    add_flags(parser, cls)      # no clash between a field's flag and another's alias


def _block_size_error(cls, value) -> str:
    base = {"model": "m", "block_bytes": 1} if cls is kvstore_service.Config else {"model": "m"}
    names = {f.name for f in dataclasses.fields(cls)}
    with pytest.raises(ConfigError) as e:
        from_args(cls, {"block_size": str(value)}, **{k: v for k, v in base.items() if k in names})
    return str(e.value)


@pytest.mark.parametrize("value", [0, 12, 512])
def test_one_block_size_check_everywhere(value):
    """The configs used to disagree (>= 1 in one, a power of two in another)."""
    classes = [c for c in CONFIGS if "block_size" in {f.name for f in dataclasses.fields(c)}]
    assert len(classes) >= 4
    assert len({_block_size_error(c, value) for c in classes}) == 1


def test_the_launcher_passes_its_router_settings_down(tmp_path, tiny_llama):
    cfg = serve(tiny_llama, "--api-key", "sk-secret", "--max-queued-requests", "5", "--request-timeout", "30",
                "--allowed-origins", '["https://a.example"]', "--served-model-name", "tiny-x",
                "--max-request-body-mb", "2", "--rate-limit", "9", "--stream-interval", "4")
    procs = dict(launcher.process_commands(cfg, tiny_llama, str(tmp_path)))
    argv = procs["router0"]
    assert "sk-secret" not in " ".join(argv)          # keys travel in the environment, not in `ps`
    parser = OneLineParser(prog="router")
    router_service.Config.add_arguments(parser)
    env = dict(os.environ, **launcher.passed_down(cfg)[1])
    old = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)
        rcfg = router_service.Config.from_args(parser.parse_args(argv[3:]))
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert (rcfg.api_keys, rcfg.max_queued_requests, rcfg.request_timeout_s, rcfg.allowed_origins,
            rcfg.served_model_name, rcfg.max_request_body_mb, rcfg.rate_limit, rcfg.stream_interval) == \
        (["sk-secret"], 5, 30.0, ["https://a.example"], "tiny-x", 2.0, 9, 4)


def test_cpu_workers_leave_a_core_to_a_small_model_and_take_every_core_for_a_large_one(monkeypatch, tmp_path, tiny_llama):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    big = launcher.ALL_CORES_WEIGHT_BYTES
    assert launcher.worker_threads_auto("cpu", 1, big - 1) == 3
    assert launcher.worker_threads_auto("cpu", 1, big) == 4
    assert launcher.worker_threads_auto("cpu", 2, big - 1) == 1 and launcher.worker_threads_auto("cpu", 2, big) == 2
    assert launcher.worker_threads_auto("cpu", 8, big) == 1          # at least one each
    assert launcher.worker_threads_auto("cuda", 1, big) == 1
    assert launcher.worker_threads(serve(tiny_llama), tiny_llama) == 3          # the tiny model's weights are small
    assert launcher.worker_threads(serve(tiny_llama, "--worker-threads", "2"), tiny_llama) == 2
    argv = dict(launcher.process_commands(serve(tiny_llama), tiny_llama, str(tmp_path)))["worker0"]
    assert argv[argv.index("--torch-threads") + 1] == "3"


@pytest.mark.parametrize("flags,tier", [((), "whole"), (("--kv-offloading-size", "0"), 0),
                                        (("--kv-offloading-size", "0.001"), "size"),
                                        (("--kv-offloading-size", "100"), "whole")])
def test_the_host_tier_is_the_swap_space_unless_kv_offloading_size_says_less(tmp_path, tiny_llama, flags, tier):
    cfg = serve(tiny_llama, "--swap-space", "0.01", *flags)
    argv = dict(launcher.process_commands(cfg, tiny_llama, str(tmp_path)))["kvstore"]
    parser = OneLineParser(prog="kvstore")
    kvstore_service.Config.add_arguments(parser)
    kcfg = kvstore_service.Config.from_args(parser.parse_args(argv[3:])).validate()
    assert kcfg.num_host_blocks == int(0.01 * (1 << 30)) // kcfg.block_bytes > 0
    want = {"whole": kcfg.num_host_blocks, "size": int(0.001 * (1 << 30)) // kcfg.block_bytes, 0: 0}[tier]
    assert kcfg.host_cache_blocks == want


def test_each_process_refuses_a_bad_flag_in_one_line():
    for module, argv, needle in [("pagedserve.services.router.service", ["--model", "m", "--port", "-1"], "--port"),
                                 ("pagedserve.services.scheduler.service", ["--model", "m", "--max-num-seqs", "0"], "--max-num-seqs"),
                                 ("pagedserve.services.kvstore.service", ["--block-size", "3", "--block-bytes", "8"], "--block-size"),
                                 ("pagedserve.services.worker.service", ["--model", "m", "--block-size", "3"], "--block-size")]:
        r = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (module, r.stderr)


def test_a_context_longer_than_the_models_is_refused_before_anything_starts(tiny_llama):
    """vLLM refuses it; cutting it quietly would serve a context the operator did not ask for."""
    from router_fakes import free_port
    r = subprocess.run([sys.executable, "-m", "pagedserve.services.cli", "serve", tiny_llama, "--max-model-len", "999999",
                        "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--max-model-len 999999" in lines[0], r.stderr


def test_cpu_binding_gives_the_workers_cores_of_their_own():
    """--cpu-binding auto on CPU: the workers' threads take the last cores, the other processes
    the rest; nothing is bound when the workers take every core, on CUDA, or with off."""
    cfg = up("--routers", "2", "--redis-url", "redis://127.0.0.1:6379")
    assert launcher.cpu_sets(cfg, 1, [0, 1]) == {"worker0": {1}, "kvstore": {0}, "scheduler": {0},
                                                  "router0": {0}, "router1": {0}}
    assert launcher.cpu_sets(cfg, 3, [0, 2, 4, 6])["worker0"] == {2, 4, 6}
    tp = up("--tensor-parallel", "2")
    sets = launcher.cpu_sets(tp, 3, list(range(8)))
    assert sets["worker0"] == {2, 3, 4} and sets["worker1"] == {5, 6, 7} and sets["router0"] == {0, 1}
    assert launcher.cpu_sets(cfg, 2, [0, 1]) == {}
    assert launcher.cpu_sets(up("--cpu-binding", "off"), 1, [0, 1]) == {}
    assert launcher.cpu_sets(dataclasses.replace(cfg, device="cuda"), 1, [0, 1]) == {}


def test_a_bound_child_runs_on_its_cores_and_its_threads_inherit_them(tmp_path):
    from pagedserve.services.supervisor import Child, Supervisor
    out = tmp_path / "cpus"
    code = ("import os, threading; t = threading.Thread(target=lambda: None); t.start(); t.join(); "
            f"open({str(out)!r}, 'w').write(repr(sorted(os.sched_getaffinity(0))))")
    sup = Supervisor(hang_timeout_s=5, start_timeout_s=5)
    first = sorted(os.sched_getaffinity(0))[0]
    child = Child("worker0", [sys.executable, "-c", code], cpus=frozenset({first}))
    sup.add(child)
    assert child.proc.wait(30) == 0 and out.read_text() == repr([first])
