"""The command line: generate --json, tiny-model, and one clear stderr line for every bad input."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


from pagedserve.services.cli import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, needle: str) -> None:
    assert code != 0
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_generate_json(capsys, tiny_llama):
    code, out, _ = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt", "def f(x):",
                           "--prompt", "import os", "--max-tokens", "5", "--json")
    assert code == 0
    data = json.loads(out)
    assert len(data["outputs"]) == 2
    for o in data["outputs"]:
        assert 1 <= len(o["outputs"][0]["token_ids"]) <= 5 and isinstance(o["outputs"][0]["text"], str)
    assert data["stats"]["device_blocks_used"] == 0


def test_generate_model_tiny_as_serve_takes_it(capsys, tiny_llama, tmp_path, monkeypatch):
    """'tiny' names .cache/tiny-llama under the working folder (built there on first use)."""
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "tiny-llama").symlink_to(tiny_llama)
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny", "--prompt", "x", "--max-tokens", "3", "--json")
    assert code == 0 and len(json.loads(out)["outputs"]) == 1


def test_generate_sampling_flags(capsys, tiny_llama):
    code, out, _ = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt", "x", "--max-tokens", "4",
                           "--n", "2", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "1",
                           "--num-device-blocks", "16", "--block-size", "8", "--preemption-mode", "swap",
                           "--swap-space", "0.01", "--json")
    assert code == 0 and len(json.loads(out)["outputs"][0]["outputs"]) == 2


def test_missing_files(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt", "x")
    assert_one_line_error(code, err, "safetensors")
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert_one_line_error(code, err, "does not exist")


def test_unsupported_architecture(capsys, tiny_llama, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    code, _, err = run_cli(capsys, "generate", "--model", str(folder), "--prompt", "x")
    assert_one_line_error(code, err, "unsupported architecture")


def test_prompt_longer_than_model(capsys, tiny_llama):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt", "word " * 3000)
    assert_one_line_error(code, err, "maximum context")


def test_block_size_not_power_of_two(capsys, tiny_llama):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt", "x", "--block-size", "12")
    assert_one_line_error(code, err, "power of two")


def test_bad_sampling_flag(capsys, tiny_llama):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt", "x", "--temperature", "-1")
    assert_one_line_error(code, err, "temperature")


def test_pool_too_small_for_one_request(capsys, tiny_llama):
    code, _, err = run_cli(capsys, "generate", "--model", tiny_llama, "--prompt", "word " * 40,
                           "--num-device-blocks", "1")
    assert_one_line_error(code, err, "device pool")


def test_tiny_model_refuses_non_empty_folder(capsys, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "tiny-model", str(tmp_path), "--arch", "llama")
    assert_one_line_error(code, err, "not an empty folder")
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_console_script_tiny_model_loads_in_transformers(tmp_path):
    """The installed `pagedserve` entry point, in a fresh process, writes a folder transformers reads offline."""
    exe = Path(sys.executable).with_name("pagedserve")
    out = tmp_path / "opt"
    subprocess.run([str(exe), "tiny-model", str(out), "--arch", "opt", "--seed", "3"], check=True,
                   capture_output=True, timeout=180)
    code = ("from transformers import AutoModelForCausalLM, AutoTokenizer; import sys; "
            f"t = AutoTokenizer.from_pretrained({str(out)!r}); m = AutoModelForCausalLM.from_pretrained({str(out)!r}); "
            "c = t.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True, tokenize=False); "
            "assert '<|assistant|>' in c; print(m.config.model_type)")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "opt", res.stderr


def test_up_refuses_bad_settings_before_starting_anything(capsys, tiny_llama):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_cli(capsys, "up", "--model", tiny_llama, "--port", str(port))
        assert_one_line_error(code, err, "cannot listen")
    import torch
    cases = [(["--log-level", "loud"], "--log-level"), (["--worker-threads", "-1"], "--worker-threads")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "CUDA"))
    for flags, needle in cases:
        try:
            code, _, err = run_cli(capsys, "up", "--model", tiny_llama, *flags)
        except SystemExit as e:     # argparse-style refusals exit 2
            code, err = e.code, capsys.readouterr().err
        assert_one_line_error(code, err, needle)


def test_make_demo_runs():
    """`make demo` as a newcomer runs it, in the repository (it builds .cache/tiny-llama on first
    use, as `make serve` does). STAMP= skips the venv set-up: the interpreter running the tests is
    the venv; PYTHONPATH makes its console script import this checkout."""
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), HF_HUB_OFFLINE="1")
    res = subprocess.run(["make", "-s", "demo", "STAMP=", f"BIN={Path(sys.executable).parent}"], cwd=repo,
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert res.stdout.count("--- prompt ") == 4
    stats = json.loads(res.stdout[res.stdout.index("\n{") + 1:])
    assert stats["device_blocks_peak_used"] > 0


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser: pagedserve's, its services' and loadgen's."""
    import importlib
    from pagedserve.loadgen.cli import parser as loadgen_parser
    from pagedserve.services.cli import SERVICES, build_parser
    from pagedserve.services.process import OneLineParser
    subs = lambda p: p._subparsers._group_actions[0].choices.items()
    parsers = {f"pagedserve {n}": p for n, p in subs(build_parser())}
    for name, (module, _, *adder) in SERVICES.items():
        parsers[f"pagedserve {name}"] = p = OneLineParser(prog=name)
        mod = importlib.import_module(module)
        (getattr(mod, adder[0]) if adder else mod.Config.add_arguments)(p)
    parsers.update({f"loadgen {n}": p for n, p in subs(loadgen_parser())})
    return parsers


def test_every_argument_is_described_and_every_optional_flag_shows_its_default():
    for command, parser in all_parsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = action.option_strings[0] if action.option_strings else action.dest
            assert action.help, f"{command} {name} has no help"
            if action.option_strings and not action.required:
                assert "default" in action.help, f"{command} {name}: no default in {action.help!r}"


def test_output_paths_print_normalized(tmp_path, capsys):
    """`--out r/` prints r/compare.md, not r//compare.md."""
    from pagedserve.loadgen.cli import main as loadgen_main
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"label": "x", "completed": 0, "failed": 0, "request_throughput": 0,
                                                  "output_throughput": 0, "request_rate": None,
                                                      "trace": "sharegpt", "server": {"model": "m"}}))
    assert loadgen_main(["compare", str(run), "--out", f"{tmp_path}/cmp/"]) == 0
    assert capsys.readouterr().out == f"comparison in {tmp_path}/cmp/compare.md\n"
