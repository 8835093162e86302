"""`pagedserve` command line: one subcommand per job, each a thin shell over a core.

Every expected failure (bad folder, bad flag, too-long prompt) prints one line on stderr and
exits non-zero; tracebacks are for bugs only.
"""
from __future__ import annotations

import argparse
import json
import sys


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.flags import add_flags
    add_flags(p, EngineConfig)


def _engine_config(args):
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.flags import from_args
    from pagedserve.services.tiny_model import resolve_model
    config = from_args(EngineConfig, args)
    config.model = resolve_model(config.model)   # 'tiny' as `serve tiny` takes it
    return config


def cmd_tiny_model(args) -> int:
    from pagedserve.services.tiny_model import build_tiny_model
    out = build_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(f"wrote a tiny {args.arch} model to {out}")
    return 0


def cmd_keys(args) -> int:
    from pagedserve.services.curve import make_keys
    if make_keys(args.dir):
        print(f"wrote CURVE keys to {args.dir} (server, client, authorized/client.key)")
    else:
        print(f"{args.dir} has CURVE keys already: kept")
    return 0


def cmd_generate(args) -> int:
    from pagedserve.services.engine import Engine
    from pagedserve.services.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, n=args.n, beam_width=args.beam_width,
                            ignore_eos=args.ignore_eos).validate()
    config = _engine_config(args)
    with Engine(config) as engine:
        outputs = engine.generate(args.prompt, params)
        stats = engine.stats()
    if args.json:
        print(json.dumps({"outputs": [{"prompt": p, **o.to_dict()} for p, o in zip(args.prompt, outputs)],
                          "stats": stats}, indent=2))
    else:
        for prompt, out in zip(args.prompt, outputs):
            for choice in out.outputs:
                print(f"--- {prompt!r} [{choice.index}]\n{choice.text}")
    return 0


def cmd_demo(args) -> int:
    """What `make serve` runs until the services exist: build the tiny model, generate, show stats."""
    from pathlib import Path
    from pagedserve.services.engine import Engine
    from pagedserve.services.engine_config import EngineConfig
    from pagedserve.services.sampling_params import SamplingParams
    from pagedserve.services.tiny_model import build_tiny_model

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").exists():
        print(f"building a tiny llama model in {model_dir} ...", file=sys.stderr)
        build_tiny_model(model_dir, arch="llama")
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Scheduler:", "# A paged KV cache"]
    with Engine(EngineConfig(model=str(model_dir)).validate()) as engine:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
        for prompt, out in zip(prompts, outputs):
            print(f"--- prompt {prompt!r}\n{out.outputs[0].text!r}")
        print(json.dumps(engine.stats(), indent=2))
    return 0


# name: (module, help[, the module's own flag adder]); the module has `Config` and `run`, and parses
# with its `config_from_args` where the command line is more than Config's flags (serve's MODEL).
SERVICES = {
    "serve": ("pagedserve.services.launcher", "serve MODEL with vLLM's flags: the whole stack (kvstore, workers, scheduler, "
                                   "routers), until SIGTERM", "add_serve_arguments"),
    "up": ("pagedserve.services.launcher", "the same as serve, the model given by --model (default: tiny)"),
    "router": ("pagedserve.services.router.service", "one HTTP router (OpenAI-compatible API)"),
    "scheduler": ("pagedserve.services.scheduler.service", "the scheduler of one engine replica"),
    "worker": ("pagedserve.services.worker.service", "one model worker (one per device / tensor-parallel rank)"),
    "kvstore": ("pagedserve.services.kvstore.service", "the KV block-store service of one engine replica"),
}


def _add_service_commands(sub) -> None:
    # Listed for --help only; main() hands these commands to their own module's parser, so that
    # `pagedserve tiny-model` does not import the router's web stack and so on.
    for name, (_, help_text, *_) in SERVICES.items():
        sub.add_parser(name, help=help_text, add_help=False)


def _service_args(argv: list[str]):
    import importlib
    from pagedserve.services.process import OneLineParser
    module_name, help_text, *adder = SERVICES[argv[0]]
    module = importlib.import_module(module_name)
    parser = OneLineParser(prog=f"pagedserve {argv[0]}", description=help_text)
    (getattr(module, adder[0]) if adder else module.Config.add_arguments)(parser)
    args = parser.parse_args(argv[1:])
    args.command = argv[0]
    parse = getattr(module, "config_from_args", module.Config.from_args)
    args.func = lambda a: module.run(parse(a))
    return args


def build_parser() -> argparse.ArgumentParser:
    from pagedserve.services.process import OneLineParser
    from pagedserve.services.tiny_model import TINY_DIR
    parser = OneLineParser(prog="pagedserve", description="LLM serving on PagedAttention")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny-model", help="write a tiny random-weight model and a locally trained tokenizer",
                       description="Write a tiny random-weight model (2 layers, hidden 128) and a byte-level BPE "
                                   "tokenizer trained here on Python's own sources: nothing is downloaded. "
                                   "transformers and pagedserve both load the folder.")
    p.add_argument("dir", help="the folder to write (new or empty: nothing of yours is overwritten)")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "opt"],
                   help="the model's architecture [default: %(default)s]")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights [default: %(default)s]")
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser("generate", help="offline generation with the paged engine")
    _add_engine_flags(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat the flag for several)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per sequence [default: %(default)s]")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy [default: %(default)s]")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass [default: %(default)s]")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all [default: %(default)s]")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling [default: none, a random one]")
    p.add_argument("--n", type=int, default=1,
                   help="parallel samples per prompt (they share its blocks) [default: %(default)s]")
    p.add_argument("--beam-width", type=int, default=1, help="beam search width; 1 = none [default: %(default)s]")
    p.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token [default: off]")
    p.add_argument("--json", action="store_true", help="print ids, text and engine stats as JSON [default: off]")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("keys", help="write CURVE keys for the internal sockets (kept if present)")
    p.add_argument("dir", help="the folder for the server and client keypairs and authorized/")
    p.set_defaults(func=cmd_keys)

    _add_service_commands(sub)

    p = sub.add_parser("demo", help="offline engine demo on a tiny model (built on first use)")
    p.add_argument("--model-dir", default=str(TINY_DIR), help="the tiny model's folder (built there if empty) [default: %(default)s]")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _service_args(argv) if argv and argv[0] in SERVICES else build_parser().parse_args(argv)
    from pagedserve.services.tiny_model import TinyModelError
    from pagedserve.services.model_dir import ModelLoadError
    from pagedserve.services.sampling_params import SamplingParamsError
    # ValueError covers every config's validate() (ConfigError, SchedulerError are ValueErrors) and
    # the engine's PromptTooLongError (not imported here: the engine loads torch, `up` does not).
    expected = (ValueError, TinyModelError, ModelLoadError, SamplingParamsError)
    try:
        return args.func(args)
    except expected as e:
        print(f"pagedserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
