"""`--step-log`: one line per engine step, its seconds and what it computed
(services/scheduler/step_log.py), for loadgen profile and loadgen fidelity."""
from __future__ import annotations

import json

import pytest

from pagedserve.services.launcher import Config
from pagedserve.services.flags import ConfigError
from pagedserve.services.scheduler.step_log import StepLog, composition, read
from pagedserve.services.steps import SeqStep


def test_composition_worked_by_hand():
    # Two decode rows (contexts 10 and 30), a prompt chunk of 8 after 16 cached, a whole prompt of 5.
    rows = [(1, 10), (8, 24), (1, 30), (5, 5)]
    assert composition(rows) == (2, 40, 13, 8 * 16 + 5 * 0, 4, 10 + 24 + 30 + 5)
    assert composition([]) == (0, 0, 0, 0, 0, 0)


def test_a_step_is_one_line_and_a_cut_line_is_skipped(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepLog(str(path))
    step = type("Step", (), {"steps": [SeqStep(1, [7], 9, [0]), SeqStep(2, [1, 2, 3], 4, [1])]})()
    log.add(step, 0.0025, 0.002)
    log.add(type("Step", (), {"steps": []})(), 0.001, 0.0)      # a step that computed nothing: no line
    log.flush()
    with open(path, "a") as f:
        f.write('[0.1, 0.0')                                     # a process killed mid-line
    assert read(str(path)) == [[0.0025, 0.002, 1, 10, 3, 12, 2, 17]]
    log.close()
    assert json.loads(path.read_text().splitlines()[0]) == [0.0025, 0.002, 1, 10, 3, 12, 2, 17]


@pytest.mark.parametrize("where, words", [("missing/steps.jsonl", "does not exist"), (".", "a file")])
def test_a_step_log_that_cannot_be_written_is_refused_at_start(tmp_path, where, words):
    with pytest.raises(ConfigError, match=words):
        Config(step_log=str(tmp_path / where)).validate()
