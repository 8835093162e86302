"""The offline engine: block store, model runner and (soon) scheduler cores in one process.

Owns the pools it creates (and unlinks them on close), the tokenizer and the model. The same cores
run in separate processes in the served stack; here they are plain objects called in turn.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass


from pagedserve.kernels import ops
from pagedserve.kvstore.allocator import make_policy
from pagedserve.kvstore.pool import BlockPool, unique_pool_name
from pagedserve.kvstore.store import BlockStore
from pagedserve.services import config_fields as cf
from pagedserve.services.engine_config import ConfigError, EngineConfig
from pagedserve.services.router.detokenizer import without_cut_character
from pagedserve.services.scheduler.request import Request
from pagedserve.services.scheduler.scheduler import Scheduler, SchedulerConfig
from pagedserve.services.sampling_params import SamplingParams
from pagedserve.services.worker.model_loader import (context_length, inspect_model_dir, load_model, load_tokenizer,
                                          serving_dtype)
from pagedserve.services.worker.cuda_graphs import capture_decode_graphs
from pagedserve.services.worker.model_runner import ModelRunner
from pagedserve.services.worker.guides import Guides
from pagedserve.services.worker.worker_core import WorkerCore


class PromptTooLongError(ValueError):
    """A prompt that does not fit the model's context (or the whole KV pool)."""


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    cumulative_logprob: float
    logprobs: list[float]
    top_logprobs: list | None
    finish_reason: str | None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    error: str | None = None
    num_preemptions: int = 0
    # With params.prompt_logprobs: entry i = [logprob of prompt token i + 1, its rank, [[id, logprob], ...]].
    prompt_logprobs: list | None = None

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                "outputs": [o.to_dict() for o in self.outputs], "error": self.error,
                "num_preemptions": self.num_preemptions, "prompt_logprobs": self.prompt_logprobs}


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config.validate()
        _, spec = inspect_model_dir(config.model)   # fail on a bad folder before loading anything
        self.tokenizer = load_tokenizer(config.model)
        self.dtype = serving_dtype(config.dtype, config.device, spec)
        self.model, self.spec = load_model(config.model, self.dtype, config.device)
        self.max_model_len = context_length(config.max_model_len, spec)
        block_bytes = spec.block_bytes(config.block_size, self.dtype)
        num_device, num_host = config.device_blocks(block_bytes), config.host_blocks(block_bytes)
        if num_device < 1:
            raise ConfigError("the KV cache budget is smaller than one block")
        self.device_pool = BlockPool.create(unique_pool_name("device"), num_device, block_bytes, config.device)
        try:
            self.host_pool = BlockPool.create(unique_pool_name("host"), num_host, block_bytes, "cpu")
        except BaseException:
            _release(self.device_pool)   # never leave a named segment behind in /dev/shm
            raise
        self.store = BlockStore(num_device, num_host, config.block_size,
                                enable_prefix_caching=config.enable_prefix_caching,
                                device_pools=[self.device_pool], host_pools=[self.host_pool],
                                policy=make_policy(config.allocation, self.max_model_len),
                                host_cache_blocks=cf.host_cache_blocks(config, num_host, block_bytes))
        self.runner = ModelRunner(self.model, spec, self.device_pool.blocks, config.block_size,
                                  self.dtype, config.device, max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_model_len=self.max_model_len)
        # CUDA: every attention kernel compiles now, and the decode graphs are captured.
        ops.warm_up(self.dtype, spec.head_dim, spec.num_attention_heads or spec.num_kv_heads,
                    spec.num_kv_heads, config.block_size, config.device)
        capture_decode_graphs(self.runner, config.max_num_seqs, config.enforce_eager)
        tokenizer = self.tokenizer
        self.guides = Guides(lambda: tokenizer, spec.vocab_size, spec.eos_token_ids)
        self.worker = WorkerCore(self.runner, spec.eos_token_ids, seed=config.seed, guides=self.guides)
        self.scheduler = Scheduler(SchedulerConfig.of(config, max_model_len=self.max_model_len,
                                                      eos_token_ids=spec.eos_token_ids, vocab_size=spec.vocab_size),
                                   self.store, clock=time.monotonic)
        self._request_ids = itertools.count()
        self._ahead = None   # async scheduling: (the step planned while the last one ran, its launch)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        ids = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise PromptTooLongError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; this model's maximum context is "
                                     f"{self.max_model_len} tokens including at least one generated")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, true_output_len: int | None = None) -> str:
        request_id = request_id or f"req-{next(self._request_ids)}"
        self.scheduler.add_request(request_id, self.tokenize(prompt), params, true_output_len=true_output_len)
        return request_id

    def step(self) -> list[Request]:
        """One iteration: schedule, run the model, apply the results -> requests that finished.

        With async scheduling, in the served stack's order: the next step is planned and launched
        before this one's tokens are read (on a GPU the device runs on from one step to the next)."""
        if self._ahead is not None:
            (scheduled, launched), self._ahead = self._ahead, None
        else:
            scheduled = self.scheduler.schedule()
            launched = self._launch(scheduled)
        if self.config.async_scheduling:
            ahead = self.scheduler.schedule_ahead(scheduled)
            if ahead is not None:
                self._ahead = (ahead, self._launch(ahead))
        prompt_logprobs, launched = launched
        results = self.worker.finish(launched) if launched is not None else []
        finished = self.scheduler.update(scheduled, results, prompt_logprobs)
        for req in finished:   # their grammar matchers go with them
            self.guides.forget_seqs([s.seq_id for s in (*req.seqs, *req.finished)])
        return finished

    def _launch(self, scheduled) -> tuple[dict, object]:
        """-> (its prompt logprobs, filled when the step runs; the launched step, or None: no work)."""
        prompt_logprobs: dict = {}
        if not scheduled.steps:
            return prompt_logprobs, None
        return prompt_logprobs, self.worker.launch(scheduled.steps, scheduled.samples, prompt_logprobs)

    def generate(self, prompts: list[str | list[int]],
                 params: SamplingParams | list[SamplingParams],
                 true_output_lens: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. true_output_lens: each request's
        true output length, for the allocations that reserve it (orca-pow2, orca-oracle).

        A bad request (sampling params out of range, prompt too long) raises before any is queued."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        lens = true_output_lens if true_output_lens is not None else [None] * len(prompts)
        if len(plist) != len(prompts) or len(lens) != len(prompts):
            raise ValueError("one SamplingParams (and true output length) per prompt, or one for all")
        ids = [self.tokenize(p) for p in prompts]
        for i, p, n in zip(ids, plist, lens):
            self.scheduler.check_request(i, p, n)
        for p in plist:   # a constraint that cannot compile raises GrammarError (a ValueError) here
            if p.structured_outputs is not None:
                self.guides.cache.compile(p.structured_outputs)
        order = [self.add_request(i, p, true_output_len=n) for i, p, n in zip(ids, plist, lens)]
        while self.has_work():
            self.step()
        return [self.output_of(self.scheduler.pop_finished(rid)) for rid in order]

    def has_work(self) -> bool:
        """Requests not finished, or a step planned ahead still to run (its blocks to release)."""
        return self.scheduler.has_unfinished() or self._ahead is not None

    def output_of(self, req: Request) -> RequestOutput:
        p = req.params
        seqs = req.finished
        if req.beam is None:
            seqs = sorted(seqs, key=lambda s: s.seq_index)
        outs = [CompletionOutput(i, s.output_token_ids,
                                 without_cut_character(self.tokenizer.decode(s.output_token_ids,
                                                                             skip_special_tokens=p.skip_special_tokens)),
                                 s.cum_logprob, s.logprobs, s.top_logprobs if p.logprobs is not None else None,
                                 s.finish_reason)
                for i, s in enumerate(seqs[:p.n])]
        return RequestOutput(req.request_id, req.prompt_token_ids, outs, req.error, req.num_preemptions,
                             req.prompt_logprobs if p.prompt_logprobs is not None else None)

    def stats(self) -> dict:
        """Block-store counts plus the scheduler's (preemptions and why, swaps, recomputed tokens) and
        the time-averaged KV split (kv_breakdown)."""
        return {**self.store.stats(), **dict(self.scheduler.stats), "kv_breakdown": self.scheduler.kv_breakdown()}

    def close(self) -> None:
        self.guides.close()
        self.runner = self.worker = None   # drop the views of the pool before unmapping it
        for pool in (self.device_pool, self.host_pool):
            _release(pool)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _release(pool: BlockPool) -> None:
    pool.close()
    pool.unlink()
