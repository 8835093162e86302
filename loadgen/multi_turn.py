"""The multi-turn chat workload (issue 27): what each user will say and when, drawn from a seed.

U users arrive as a Poisson process; each holds a conversation of T turns. Turn k sends the whole
conversation so far (the shared system prompt, the user's earlier messages and the server's own
earlier answers, as assistant messages) plus a new user message, after a think time (exponential)
since the previous answer. This is the load a chat product puts on a prefix cache: every turn's
prompt starts with the previous turn's prompt and answer, and more conversations wait between
turns than the device pool can keep, which is where the host tier earns its keep.

The script (Conversation) is a pure function of the seed and the options; only the answers come
from the server. Each user draws from its own stream (seeded by (seed, user)), so a run with more
users or turns keeps the first ones as they were. Texts are whole-word pieces of the tokenizer
(text_prompts.TextCodec), so a message of n pieces is n tokens.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from pagedserve.loadgen.lengths import WORKLOADS

TURN_LENGTHS = ("sharegpt", "fixed")


@dataclass(frozen=True)
class Turn:
    think: float          # seconds after the previous answer before this turn is sent (0 for the first)
    user_len: int         # tokens of the new user message
    output_len: int       # tokens asked of the answer
    text: str             # the new user message


@dataclass(frozen=True)
class Conversation:
    user: int
    arrival: float        # seconds after the run's start when its first turn is sent
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class ScriptOptions:
    users: int
    turns: int
    user_rate: float      # users per second (Poisson); inf: all at once
    think_time: float     # mean seconds between an answer and the next turn (exponential); 0: none
    turn_lengths: str     # sharegpt: log-normal per turn (lengths.WORKLOADS), or fixed
    user_len: int         # fixed: tokens per user message
    output_len: int       # fixed: tokens per answer
    length_scale: float   # sharegpt: every drawn length divided by this (small contexts)
    seed: int


def draw_lengths(opts: ScriptOptions, rng: random.Random) -> tuple[int, int]:
    """(user message tokens, answer tokens) of one turn."""
    if opts.turn_lengths == "fixed":
        return opts.user_len, opts.output_len
    if opts.turn_lengths != "sharegpt":
        raise ValueError(f"--turn-lengths must be one of {', '.join(TURN_LENGTHS)}, got {opts.turn_lengths!r}")
    # The paper's ShareGPT fit (a request is one turn of a ShareGPT conversation), without its
    # 2048-token filter: the context check happens per turn, when the conversation is known.
    w = WORKLOADS["sharegpt"]
    draw = (lambda median, sigma: max(1, round(rng.lognormvariate(math.log(median), sigma) / opts.length_scale)))
    return draw(w.median_prompt, w.sigma_prompt), draw(w.median_output, w.sigma_output)


def words(rng: random.Random, pool: list[int], n: int) -> list[int]:
    return [rng.choice(pool) for _ in range(n)]


def system_prompt(pool: list[int], n: int, seed: int) -> list[int]:
    """The ids of the one system prompt every conversation starts with (a product's prompt)."""
    return words(random.Random(f"system/{seed}"), pool, n)


def build_script(opts: ScriptOptions, pool: list[int], text) -> list[Conversation]:
    """Every user's conversation: arrivals from one stream, each user's turns from its own.
    `text` turns pool ids into the message text (TextCodec.text)."""
    arrivals = random.Random(f"arrivals/{opts.seed}")
    t, out = 0.0, []
    for u in range(opts.users):
        if u and not math.isinf(opts.user_rate):
            t += arrivals.expovariate(opts.user_rate)
        rng = random.Random(f"user/{opts.seed}/{u}")
        turns = []
        for k in range(opts.turns):
            think = rng.expovariate(1 / opts.think_time) if k and opts.think_time > 0 else 0.0
            user_len, output_len = draw_lengths(opts, rng)
            turns.append(Turn(think, user_len, output_len, text(words(rng, pool, user_len))))
        out.append(Conversation(u, t, tuple(turns)))
    return out


def turn_messages(system: str | None, history: list[dict], turn: Turn) -> list[dict]:
    """The messages of a turn: the conversation so far (history: earlier user messages and the
    server's answers, in order) and the new user message."""
    head = [{"role": "system", "content": system}] if system else []
    return head + history + [{"role": "user", "content": turn.text}]

