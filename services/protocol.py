"""Every message between pagedserve processes, declared once: typed, versioned, msgpack on the wire.

This file declares the messages and registers them with the codec, services/protocol_codec.py
(the wire form, frames, rows and columns, and the typed decode that raises ProtocolError). It
re-exports encode, decode, ProtocolError and Columns: callers import all of the protocol from here.

Sockets and who talks (tcp or ipc endpoints, all on loopback in tests):
  router    --DEALER--> scheduler ROUTER   AddRequest, AbortRequest, GetStats, Ping
  scheduler --ROUTER--> router             RequestUpdates (one per router per step), Error, StatsReply, Pong
  scheduler --DEALER--> kvstore ROUTER     ResumeStore, ResetStore, ApplyOps, GetPoolInfo, GetStats, Ping
                                           -> StoreSnapshot, Pong, ApplyOpsReply, PoolInfo, StatsReply, Pong
  scheduler --DEALER--> worker ROUTER      ExecuteStep, Ping -> StepResult, Pong (rank 0 answers for the group)
  worker    --DEALER--> kvstore ROUTER     GetPoolInfo, ReportMemory -> PoolInfo (or a 503 while it sizes), Pong
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.services.protocol_codec import (  # noqa: F401  (re-exported: callers import them here)
    Columns, ProtocolError, decode, encode, register)

VERSION = 9   # 2: ExecuteStep.seqs and StepResult.results as columns, nested messages as rows;
#             3: prompt logprobs (ExecuteStep, StepResult, RequestUpdate)
#             4: ReportMemory, PoolInfo.step_event_handles (the GPU path)
#             5: sampling params carry structured_outputs (AddRequest, ExecuteStep.new_params)
#             6: RequestUpdate's final phases (queued_s, ..., num_preemptions), GetStats.router_id,
#                Pong.sender names the scheduler's replica; the host tier (PoolInfo.host_cache_blocks),
#                ResumeStore -> StoreSnapshot
#             7: async scheduling: SeqWork.token_ids may be [PENDING_TOKEN]; the kvstore's set_tokens op
#             8: sampling params carry allowed_token_ids (AddRequest, ExecuteStep.new_params)
#             9: RequestUpdate.unservable (an error no retry can mend: the router answers 400, not 503)


# ---- messages ----------------------------------------------------------------------------------

@dataclass
class Ping:
    sender: str = ""
    time: float = 0.0


@dataclass
class Pong:
    sender: str = ""
    time: float = 0.0
    role: str = ""
    ready: bool = True


@dataclass
class Error:
    message: str
    code: int = 400                      # HTTP-like: 400 bad request, 404 unknown, 503 unavailable
    type: str = "invalid_request_error"
    param: str | None = None
    request_id: str | None = None


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict                         # SamplingParams.to_dict()
    arrival_time: float = 0.0
    true_output_len: int | None = None   # a benchmark's true output length (the Orca baselines reserve it)


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class CompletionDelta:
    index: int
    token_ids: list[int]                 # new tokens since the last update
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list | None = None     # per new token: [[id, logprob], ...]
    finish_reason: str | None = None
    cumulative_logprob: float = 0.0


@dataclass
class RequestUpdate:
    request_id: str
    outputs: list[CompletionDelta]
    finished: bool = False
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Once, when asked for: an entry [logprob, rank, [[id, logprob], ...]] per prompt token after the first.
    prompt_logprobs: list | None = None
    # On the final update only: the request's phases in seconds on the engine's clock, as vLLM's
    # per-request histograms take them (queued: arrival to first scheduled; prefill: to the first
    # token; decode: first to last token; inference: scheduled to last token; a preemption stays
    # inside the phase it interrupted).
    queued_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    inference_s: float = 0.0
    num_preemptions: int = 0
    num_host_cached_tokens: int = 0      # of num_cached_tokens, those the host tier gave back
    # With error: the request can never be served as asked (it does not fit the KV cache even
    # alone), so no retry can mend it; the router answers 400 instead of 503.
    unservable: bool = False


@dataclass(slots=True)
class TokenDelta:
    """The update of nearly every request in nearly every step, sent as columns: one new token for
    the only choice (index 0) of a request still running, without top logprobs. The router reads it
    as RequestUpdate(request_id, [CompletionDelta(0, [token_id], [logprob], None, None,
    cumulative_logprob)])."""
    request_id: str
    token_id: int
    logprob: float = 0.0
    cumulative_logprob: float = 0.0


@dataclass
class RequestUpdates:
    """All of one step's updates for one router, in one message; a request is in one list or the other."""
    updates: list[RequestUpdate]
    tokens: list[TokenDelta] = field(default_factory=list)


@dataclass
class GetStats:
    # A router asking for its /metrics: a candidate to export the engine's own series
    # (services/scheduler/exporter.py). Empty for anyone else (tools, the kvstore's callers).
    router_id: str = ""


@dataclass
class StatsReply:
    stats: dict


@dataclass
class GetPoolInfo:
    pass


@dataclass
class ReportMemory:
    """A worker rank's profile, for a kvstore that sizes its pools from free GPU memory
    (services/kvstore/sizing.py): the activation bytes its largest step needs beyond what stays allocated."""
    rank: int
    reserve_bytes: int


@dataclass
class PoolInfo:
    block_size: int
    block_bytes: int                     # per worker rank (each rank's pool holds its KV heads)
    num_device_blocks: int
    num_host_blocks: int
    device_pool_names: list[str]         # one per tensor-parallel rank
    host_pool_names: list[str]
    device: str = "cpu"
    enable_prefix_caching: bool = True   # the scheduler's mirror must run the same policy
    allocation: str = "paged"            # kvstore.allocator.make_policy(allocation, max_model_len)
    max_model_len: int = 0               # what orca-max reserves per request
    ipc_handles: list = field(default_factory=list)   # CUDA only: pickled IPC handles per rank
    event_handles: list = field(default_factory=list) # CUDA only: the copies_done event per rank
    step_event_handles: list = field(default_factory=list)   # CUDA only: the step_done event per rank
    host_cache_blocks: int = 0           # the host tier's most blocks (0: none); the mirror runs it too


@dataclass
class ResetStore:
    """A scheduler whose mirror diverged from the replica: forget every sequence, the cache and the
    step number. Its mirror starts empty, so the replica must too; pools, and the workers'
    mappings, stay."""
    sender: str = ""


@dataclass
class ResumeStore:
    """A (re)started scheduler's first word to its kvstore: free every sequence of the scheduler
    before it (their full hashed blocks stay cached), forget step numbers, and answer with the
    store's state, from which the new scheduler builds its mirror: the cache outlives it."""
    sender: str = ""


@dataclass
class StoreSnapshot:
    snapshot: dict                       # kvstore.store.BlockStore.snapshot(): no bytes
    released: int = 0                    # sequences of the scheduler before that were freed


@dataclass
class ApplyOps:
    """One step's block operations, in the order the scheduler's mirror applied them."""
    step: int
    ops: list[list]                      # [op name, *args]; see kvstore.replay.OPS


@dataclass
class ApplyOpsReply:
    step: int
    results: list                        # one per op: see kvstore.replay.encode_result
    num_free_device_blocks: int = 0
    num_free_host_blocks: int = 0
    error: str | None = None


@dataclass(slots=True)
class SeqWork:
    """One sequence's share of a step, as the worker needs it."""
    seq_id: int
    token_ids: list[int]
    start_pos: int
    # Draws wanted from this sequence's last logits: [seq_id, params_key, seq_index,
    # beam_candidates, num_output_tokens] each (several for the n samples of a fresh prompt).
    # num_output_tokens counts the outputs the scheduler holds: with token_ids [PENDING_TOKEN] the
    # draw is one further on (the one in flight comes first).
    samples: list[list] = field(default_factory=list)


@dataclass
class ExecuteStep:
    step: int
    seqs: list[SeqWork]
    # Block-table changes since the last step, not whole tables: {seq_id: [start, *blocks]} sets
    # table[start:] = blocks; `freed` drops tables the worker no longer needs.
    table_updates: dict = field(default_factory=dict)
    freed: list[int] = field(default_factory=list)
    # Sampling params travel once per request: {params_key: SamplingParams.to_dict()}, dropped when done.
    new_params: dict = field(default_factory=dict)
    dropped_params: list[str] = field(default_factory=list)
    # Only for requests whose params use penalties: {seq_id: [prompt ids, output ids]}.
    histories: dict = field(default_factory=dict)
    # Only for prefill chunks that want prompt logprobs: {seq_id: [k, the prompt token after the
    # chunk or -1 at the prompt's end]}.
    prompt_logprobs: dict = field(default_factory=dict)


# SampleResult.token_id of a draw not made: its grammar is still compiling. The scheduler takes the
# step's last token back (computes it again next step) and the request waits; the others go on.
WAITS_FOR_GRAMMAR = -2

# A token not drawn yet (async scheduling: services/scheduler/scheduler.py, schedule_ahead). As a
# SeqWork's only token it means "the token this sequence draws in the step before this one", which the
# worker takes from its own last draw; in the block store it holds that token's slot until set_tokens.
PENDING_TOKEN = -3


@dataclass(slots=True)
class SampleResult:
    """One draw from a step's logits (the worker's answer for one wanted sample)."""
    seq_id: int
    token_id: int = -1
    logprob: float = 0.0
    top_logprobs: list | None = None     # [[id, logprob], ...] when the request asked for logprobs
    candidates: list = field(default_factory=list)   # beam search: [[id, logprob], ...]


@dataclass
class StepResult:
    step: int
    results: list[SampleResult]
    error: str | None = None
    elapsed: float = 0.0
    # For the chunks of ExecuteStep.prompt_logprobs: {seq_id: [start position, entries]}, an entry
    # [logprob, rank, [[id, logprob], ...]] per position whose next prompt token it scores.
    prompt_logprobs: dict = field(default_factory=dict)
    # Bytes of the worker's compiled grammars (services/guided/cache.py), for the metrics: carried
    # by every step rather than asked for, so that no stats call comes between a step and its reply.
    grammar_cache_bytes: int = 0


MESSAGES: dict[str, type] = {cls.__name__: cls for cls in (
    Ping, Pong, Error, AddRequest, AbortRequest, RequestUpdate, RequestUpdates, GetStats, StatsReply,
    GetPoolInfo, ReportMemory, PoolInfo, ResetStore, ResumeStore, StoreSnapshot, ApplyOps, ApplyOpsReply, ExecuteStep, StepResult)}
_NESTED = {"outputs": CompletionDelta, "updates": RequestUpdate}
_COLUMNS = {(ExecuteStep, "seqs"): SeqWork, (StepResult, "results"): SampleResult,   # sent as columns
            (RequestUpdates, "tokens"): TokenDelta}

register(VERSION, MESSAGES, _NESTED, _COLUMNS)
