"""Beam search bookkeeping for one request: which beams run, which finished, when the search ends.

Owns the beam-search decisions only; it holds no tensors, touches no blocks and runs no model. The
scheduler drives it once per decoding step and turns its answer into block operations.

It reproduces transformers' `generate(num_beams=k, do_sample=False, length_penalty=lp,
early_stopping=es, max_new_tokens=M, num_return_sequences=n)` (the vectorised `_beam_search` of
transformers >= 4.50 / 5.x, batch size 1) token for token, with its float32 arithmetic:

* Start: one running beam (HF starts k copies of the prompt with beam 0 at score 0 and the rest at
  -1e9, so only beam 0's tokens can be picked at step one).
* Each step, every running beam's cumulative log-probability is added to its raw log_softmax over
  the vocabulary; the best `beams_to_keep = max(2, 1 + len(eos_token_ids)) * k` continuations over
  all beams are kept, ordered by score. Exact float32 ties go to the lower (beam position, token
  id), the flattened index; torch.topk leaves the order of exact ties unspecified, so only there
  can HF pick differently (real models' log-probabilities practically never tie exactly).
* A continuation "hits a stop" when its token is an EOS id or the sequence reaches the maximum
  length (prompt_len + max_new_tokens, capped by max_model_len when given: HF only warns past the
  model's positions, an engine cannot go there, so it ends the search as max_length would).
* The next running beams are the first k continuations (in that order) that hit no stop.
* Only stop-hitting continuations among the first k become finished hypotheses, scored
  cum_logprob / generated_len ** length_penalty (generated_len counts the new token, EOS included,
  and not the prompt); they are merged with the earlier finished ones and the best k are kept
  (earlier ones first on ties). EOS continuations ranked k+1..beams_to_keep are dropped.
* At the maximum length every continuation hits a stop, so the first k of the last step are the
  "running beams considered finished". Running beams are never added when the search ends earlier.
* The search ends after a step when all kept continuations hit a stop (the maximum length), or,
  once k hypotheses finished:
    - early_stopping=True: at once;
    - False: when the best running score / generated_len ** lp is not above the worst finished;
    - "never": the same, but with (max_length - prompt_len) ** lp when lp > 0 (the best length a
      running beam could still reach).
* results(): the best num_return finished hypotheses, best first. HF's output pads shorter ones;
  here each is its own token list, EOS included when it ended with one.

Float arithmetic: HF keeps scores in float32 tensors. Every sum and division here is rounded to
float32 the same way (an IEEE add/divide done in double and rounded once to float32 is the correctly
rounded float32 result), so near-ties order as they do in HF.

API: BeamSearch(beam_width >= 2, length_penalty, early_stopping (True | False | "never"),
max_new_tokens, prompt_len, eos_token_ids, new_beam_id, num_return=1, max_model_len=None);
.candidates_per_beam; start(first_beam_id); running() -> [Beam]; step({beam_id: [(token, logprob)]})
-> BeamStepResult(running=[(new_id, parent_id, token, cum_logprob)], freed=[ids], done);
results() -> [(token_ids, score)]. The log-probabilities must be log_softmax of the beam's last
logits cast to float32 (HF casts before log_softmax), before any sampling transform.

Driving it (the scheduler):
    bs = BeamSearch(beam_width=4, length_penalty=1.0, early_stopping=False, max_new_tokens=32,
                    prompt_len=len(prompt), eos_token_ids=(eos,), new_beam_id=alloc_seq_id)
    bs.start(seq_id_of_prompt)
    while True:
        # run the model on every beam in bs.running(); for each beam give its best
        # bs.candidates_per_beam (token, logprob) from log_softmax of its last logits
        res = bs.step({beam.beam_id: top_candidates(beam) for beam in bs.running()})
        # 1. fork: for each (new_id, parent_id, ...) in res.running with new_id != parent_id,
        #    fork(parent_id, new_id) BEFORE appending anything of this step;
        # 2. append token to new_id for every entry of res.running;
        # 3. free every id in res.freed (parents with no continuation; all of them once done).
        if res.done:
            break
    outputs = bs.results()   # [(generated token ids, score)], best first

The first continuation of a parent keeps the parent's beam id (its blocks need no copy); every
further continuation of the same parent gets a fresh id from new_beam_id(), to be forked from the
parent. Candidates need not be sorted. A vocabulary smaller than beams_to_keep is not supported
(HF would then pick -1e9 filler continuations of the dead initial beams).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Union

EarlyStopping = Union[bool, str]

_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    """Round a Python float to the nearest float32, as a float32 tensor would hold it."""
    return _F32.unpack(_F32.pack(x))[0]


class BeamSearchError(Exception):
    """The beam search was driven out of order or given inconsistent input."""


@dataclass
class Beam:
    beam_id: int            # the sequence id that holds this beam's KV blocks
    token_ids: list[int]    # generated tokens so far (no prompt)
    cum_logprob: float      # float32 sum of the chosen tokens' log-probabilities


@dataclass
class BeamStepResult:
    # (new_beam_id, parent_beam_id, token, cum_logprob), best first; new_beam_id == parent_beam_id
    # for the first continuation of a parent, otherwise a fresh id to fork from the parent.
    running: list[tuple[int, int, int, float]] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)   # parent ids with no continuation: free them
    done: bool = False                               # over: running is empty, read results()


@dataclass
class _Hypothesis:
    token_ids: list[int]
    score: float            # cum_logprob / generated_len ** length_penalty, float32


class BeamSearch:
    """One request's beam search; see the module docstring for the exact semantics."""

    def __init__(self, beam_width: int, length_penalty: float, early_stopping: EarlyStopping,
                 max_new_tokens: int, prompt_len: int, eos_token_ids: tuple[int, ...] = (),
                 new_beam_id: Callable[[], int] | None = None, num_return: int = 1,
                 max_model_len: int | None = None):
        if beam_width < 2:
            # transformers runs num_beams=1 as greedy decoding, which has no length penalty or
            # early stopping: the scheduler's greedy path is the match for it.
            raise BeamSearchError(f"beam_width must be >= 2, got {beam_width}")
        if not 1 <= num_return <= beam_width:
            raise BeamSearchError(f"num_return must be in 1..beam_width ({beam_width}), got {num_return}")
        if not (isinstance(early_stopping, bool) or early_stopping == "never"):
            raise BeamSearchError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        if max_new_tokens < 1:
            raise BeamSearchError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prompt_len < 1:
            raise BeamSearchError(f"prompt_len must be >= 1, got {prompt_len}")
        if new_beam_id is None:
            raise BeamSearchError("new_beam_id is required: the scheduler hands out sequence ids")
        max_length = prompt_len + max_new_tokens
        if max_model_len is not None:
            if max_model_len <= prompt_len:
                raise BeamSearchError(f"prompt_len {prompt_len} leaves no room in max_model_len {max_model_len}")
            max_length = min(max_length, max_model_len)
        self.beam_width = beam_width
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.prompt_len = prompt_len
        self.max_length = max_length           # prompt + generated tokens at which every beam stops
        self.eos_token_ids = frozenset(eos_token_ids)
        self.num_return = num_return
        self._new_beam_id = new_beam_id
        # Keep enough continuations that k of them still run even if every beam picked an EOS.
        self.beams_to_keep = max(2, 1 + len(tuple(eos_token_ids))) * beam_width
        self.candidates_per_beam = self.beams_to_keep
        self._running: list[Beam] = []
        self._finished: list[_Hypothesis] = []  # best first, at most beam_width
        self._started = False
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def start(self, first_beam_id: int) -> None:
        if self._started:
            raise BeamSearchError("start() called twice")
        self._started = True
        self._running = [Beam(first_beam_id, [], 0.0)]

    def running(self) -> list[Beam]:
        """The beams the next step must run, in the order HF keeps them (ties depend on it)."""
        return list(self._running)

    def _penalised(self, cum_logprob: float, length: int) -> float:
        return _f32(cum_logprob / _f32(length ** self.length_penalty))

    def step(self, candidates: dict[int, list[tuple[int, float]]]) -> BeamStepResult:
        """Take each running beam's best (token, logprob) and decide the next beams."""
        if not self._started or self._done:
            raise BeamSearchError("step() needs a started search that is not done")
        missing = [b.beam_id for b in self._running if b.beam_id not in candidates]
        if missing:
            raise BeamSearchError(f"no candidates for running beams {missing}")

        # (score, beam position, token): sorting by (-score, position, token) is topk's order over
        # the flattened [beams * vocab] scores, with ties to the lower flat index.
        pool: list[tuple[float, int, int]] = []
        for pos, beam in enumerate(self._running):
            for token, logprob in candidates[beam.beam_id]:
                pool.append((_f32(beam.cum_logprob + _f32(logprob)), pos, int(token)))
        pool.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = pool[:self.beams_to_keep]

        gen_len = len(self._running[0].token_ids) + 1       # generated tokens after this step
        at_max = self.prompt_len + gen_len >= self.max_length
        hits = [at_max or token in self.eos_token_ids for _, _, token in top]

        # Finished hypotheses: only stop-hitting continuations within the first beam_width.
        new_finished = [
            _Hypothesis(self._running[pos].token_ids + [token], self._penalised(score, gen_len))
            for i, (score, pos, token) in enumerate(top[:self.beam_width]) if hits[i]
        ]
        if new_finished:
            merged = self._finished + new_finished            # earlier ones first: they win ties
            merged.sort(key=lambda h: -h.score)                # stable
            self._finished = merged[:self.beam_width]

        # Next running beams: the first beam_width continuations that hit no stop.
        chosen = [c for c, hit in zip(top, hits) if not hit][:self.beam_width]

        done = not chosen or all(hits) or self._no_improvement_possible(chosen[0][0], gen_len)
        parents = [b.beam_id for b in self._running]
        if done:
            self._done = True
            self._running = []
            return BeamStepResult(running=[], freed=parents, done=True)

        result = BeamStepResult()
        used: set[int] = set()
        next_running: list[Beam] = []
        for score, pos, token in chosen:
            parent = self._running[pos]
            if parent.beam_id in used:
                beam_id = self._new_beam_id()
            else:
                beam_id = parent.beam_id
                used.add(beam_id)
            next_running.append(Beam(beam_id, parent.token_ids + [token], score))
            result.running.append((beam_id, parent.beam_id, token, score))
        result.freed = [p for p in parents if p not in used]
        self._running = next_running
        return result

    def _no_improvement_possible(self, best_running_score: float, gen_len: int) -> bool:
        """HF's stop test once beam_width hypotheses finished (None of it applies before)."""
        if len(self._finished) < self.beam_width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_length - self.prompt_len
        else:
            best_length = gen_len
        worst_finished = min(h.score for h in self._finished)
        return not self._penalised(best_running_score, best_length) > worst_finished

    def results(self) -> list[tuple[list[int], float]]:
        """The best num_return (generated token ids, score), best first; only once done."""
        if not self._done:
            raise BeamSearchError("results() before the search is done")
        return [(list(h.token_ids), h.score) for h in self._finished[:self.num_return]]
