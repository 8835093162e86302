#!/usr/bin/env python3
"""Build a tiny random-weight Llama model plus a byte-level BPE tokenizer, offline.

The result is a normal Hugging Face model folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, ...) that any server able to load a local
Llama checkpoint can serve. Nothing is downloaded: the tokenizer is trained on the
Python standard library's own .py files.

Usage:
    python make_tiny_model.py [OUT_DIR] [--dtype float32|bfloat16] [--force]

Idempotent: if OUT_DIR already holds a complete model it does nothing (unless --force).
Needs: torch, transformers, tokenizers (all three come with a vLLM install).
Standalone on purpose, beside pagedserve's own services/tiny_model.py: it runs in the peer's venv,
where pagedserve is not installed, and its model (hidden 256, Llama's special tokens) is the one
the peer figures were measured on.
"""
import argparse
import glob
import json
import os
import sys
import sysconfig
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# A plain chat template so /v1/chat/completions works too (no roles tokens in the vocab).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def corpus_files(max_files: int, max_bytes: int):
    """Sorted, bounded list of stdlib .py files (deterministic corpus)."""
    roots = [sysconfig.get_paths()["stdlib"]] + sorted(glob.glob("/usr/lib/python3*"))
    files = []
    seen = set()
    for root in roots:
        if not os.path.isdir(root):
            continue
        for path in sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*", "*.py"))):
            real = os.path.realpath(path)
            if real in seen or "site-packages" in real or "dist-packages" in real:
                continue
            seen.add(real)
            files.append(real)
    out, total = [], 0
    for f in files:
        try:
            size = os.path.getsize(f)
        except OSError:
            continue
        if total + size > max_bytes or len(out) >= max_files:
            break
        out.append(f)
        total += size
    return out, total


def build_tokenizer(files):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    bos_id = tok.token_to_id("<s>")
    # Prepend <s> to every encoded sequence, like Llama tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, dtype_name: str):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        # the reference sizes; PEER_HIDDEN / PEER_LAYERS / PEER_HEADS / PEER_KV_HEADS / PEER_FFN
        # build a larger model of the same family (e.g. 1024 / 8 / 16 / 4 / 2816)
        hidden_size=int(os.environ.get("PEER_HIDDEN", 256)),
        intermediate_size=int(os.environ.get("PEER_FFN", 512)),
        num_hidden_layers=int(os.environ.get("PEER_LAYERS", 2)),
        num_attention_heads=int(os.environ.get("PEER_HEADS", 4)),
        num_key_value_heads=int(os.environ.get("PEER_KV_HEADS", 2)),
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model = model.to(dtype)
    import transformers
    if int(transformers.__version__.split(".")[0]) >= 5:
        model.config.dtype = dtype  # recorded in config.json
    else:
        model.config.torch_dtype = dtype  # key used by transformers 4.x
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def is_complete(out_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(out_dir, f)) for f in REQUIRED_FILES)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?", default=os.path.join(os.environ.get("PEER_DIR", os.path.expanduser("~/.cache/peer-vllm")), "tiny-llama"))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    ap.add_argument("--max-files", type=int, default=400)
    ap.add_argument("--max-bytes", type=int, default=12_000_000)
    args = ap.parse_args(argv)

    if is_complete(args.out_dir) and not args.force:
        print(f"[make_tiny_model] {args.out_dir} already complete; nothing to do")
        return 0

    t0 = time.time()
    files, nbytes = corpus_files(args.max_files, args.max_bytes)
    if not files:
        print("[make_tiny_model] no corpus files found", file=sys.stderr)
        return 1
    print(f"[make_tiny_model] training BPE (vocab {VOCAB_SIZE}) on {len(files)} files, {nbytes/1e6:.1f} MB")
    tokenizer = build_tokenizer(files)
    print(f"[make_tiny_model] tokenizer: {len(tokenizer)} tokens, bos={tokenizer.bos_token_id} "
          f"eos={tokenizer.eos_token_id} pad={tokenizer.pad_token_id}")

    model = build_model(tokenizer, args.dtype)
    nparams = sum(p.numel() for p in model.parameters())

    tmp_dir = args.out_dir.rstrip("/") + ".tmp"
    if os.path.isdir(tmp_dir):
        import shutil
        shutil.rmtree(tmp_dir)
    os.makedirs(tmp_dir)
    model.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)
    # transformers 5 writes "TokenizersBackend"; the older, still-accepted name keeps the
    # folder loadable by transformers 4.x and by other servers that read this field.
    tc_path = os.path.join(tmp_dir, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2)
    # Atomic-ish swap so a half-written folder is never mistaken for a complete one.
    if os.path.isdir(args.out_dir):
        import shutil
        shutil.rmtree(args.out_dir)
    os.rename(tmp_dir, args.out_dir)

    # Quick self-check: round-trip the tokenizer and run one forward pass.
    from transformers import AutoTokenizer
    tk = AutoTokenizer.from_pretrained(args.out_dir)
    ids = tk("def hello(world):\n    return 42")["input_ids"]
    assert ids[0] == tk.bos_token_id, ids
    assert tk.decode(ids, skip_special_tokens=True) == "def hello(world):\n    return 42"
    print(f"[make_tiny_model] wrote {args.out_dir}: {nparams/1e6:.2f}M params, dtype {args.dtype}, "
          f"{time.time()-t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
