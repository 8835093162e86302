"""Request and sequence state: owned by the scheduler alone.

A Request is what a client asked for (one prompt, its sampling params); it holds one or more
Sequences: n parallel samples or the live beams of a beam search. Preemption, admission and
stopping act on whole requests.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.services.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # not yet admitted, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"      # preempted by swap: its blocks are in the host pool
    FINISHED = "finished"


FINISHED = RequestStatus.FINISHED   # (a module constant: compared per request per step)


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    seq_index: int = 0                     # which of the n samples (seeded samples differ by it)
    num_computed: int = 0                  # tokens whose K/V is in the cache
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_token: int | None = None          # the EOS / stop token id that ended it, if any
    # The scheduler's cached [SampleRequest] for this sequence (its token lists grow in place).
    sample_requests: list | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens known but not yet computed: 1 in decode, more in (re)prefill."""
        return self.num_tokens - self.num_computed

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int | None = None) -> list[int]:
        """all_token_ids()[start:end] without copying the whole sequence (the per-step hot path)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:None if end is None else end - n]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def fork(self, seq_id: int, seq_index: int) -> "Sequence":
        return Sequence(seq_id, self.prompt_token_ids, list(self.output_token_ids), seq_index,
                        self.num_computed, self.cum_logprob, list(self.logprobs),
                        list(self.top_logprobs))


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)       # live sequences
    finished: list[Sequence] = field(default_factory=list)   # done sequences, in finishing order
    status: RequestStatus = RequestStatus.WAITING
    beam: object | None = None                               # BeamSearch when beam_width > 1
    forked: bool = False                                     # n > 1: samples forked from the prompt
    error: str | None = None
    unservable: bool = False      # error is one no retry mends (protocol.RequestUpdate.unservable)
    # The request's phases, on the scheduler's clock (vLLM's queue/prefill/decode/inference times).
    scheduled_time: float | None = None   # first admitted to run (a preemption does not move it)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0                               # prefix-cache hit at first admission
    num_host_cached_tokens: int = 0                          # of those, from the host tier
    cache_salt: tuple = ()
    # params.prompt_logprobs: entry i scores prompt token i + 1 ([logprob, rank, [[id, logprob], ...]]).
    prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Names this admission's params on the worker: a request id can come back (a client's
    # X-Request-Id) before the worker was told to drop the last one's params.
    params_key: str = ""
    final_len: int = 0                 # prompt + true output length (or max_tokens), capped by the context
    plans_blind: bool = False          # a step may be planned before its last tokens are known

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is FINISHED
