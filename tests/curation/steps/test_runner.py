"""The Step contract's runner: receipts, resume, fingerprint changes and done records, on a real local Ray."""

from __future__ import annotations

import json
import os

import pytest
import ray

from common.layout import LAYOUT
from curation.steps.output import Output
from curation.steps.runner import Step, StepRunner


@ray.remote(num_cpus=0.25)
def _square(root: str, unit: str, value: int) -> dict:
    os.makedirs(f"{root}/squares", exist_ok=True)
    path = f"{root}/squares/{unit}.txt"
    with open(path, "w") as f:
        f.write(str(value * value))
    return {"value": value * value, "name": unit}


class Squares(Step):
    name = "squares"
    unit_name = "numbers"

    def __init__(self, output: Output, values: list[int], salt: str = ""):
        self.output, self.values, self.salt = output, values, salt
        self.ran: list[str] = []

    def fingerprint(self):
        return {"salt": self.salt}

    def outputs(self):
        return ["squares"]

    def units(self):
        return [f"n-{v:03d}" for v in self.values]

    def run_unit(self, unit):
        self.ran.append(unit)
        return _square.remote(self.output.root, unit, int(unit[2:]))


class Doubled(Squares):
    name = "doubled"

    def fingerprint(self):
        return None


def _runner(output: Output, phase_fp: str = "settings-a") -> StepRunner:
    return StepRunner(output, "dedup", phase_fp, window=2)


def test_runner_records_resumes_and_skips(tmp_path, ray_local):
    out = Output.at(str(tmp_path))
    step = Squares(out, [1, 2, 3])
    stats = _runner(out).run(step)
    assert stats == {"value": 14}
    assert sorted(step.ran) == ["n-001", "n-002", "n-003"]
    done = json.loads((tmp_path / LAYOUT.step_done("dedup", "squares")).read_text())
    assert done["stats"] == {"value": 14}

    # done with this fingerprint: nothing runs, the recorded stats come back
    again = Squares(out, [1, 2, 3])
    assert _runner(out).run(again) == stats and again.ran == []

    # a kill after unit 1 finished: its receipt stands, the others run
    (tmp_path / LAYOUT.step_done("dedup", "squares")).unlink()
    (tmp_path / LAYOUT.step_unit("dedup", "squares", "n-002")).unlink()
    (tmp_path / LAYOUT.step_unit("dedup", "squares", "n-003")).unlink()
    resumed = Squares(out, [1, 2, 3])
    assert _runner(out).run(resumed) == stats
    assert sorted(resumed.ran) == ["n-002", "n-003"]


def test_fingerprint_change_clears_outputs_and_later_steps(tmp_path, ray_local):
    out = Output.at(str(tmp_path))
    runner = _runner(out)
    runner.run(Squares(out, [2]))
    runner.run(Doubled(out, [5]))
    stray = tmp_path / "squares" / "stray.txt"
    stray.write_text("from an earlier run")

    # the step's own setting changed: its outputs are cleared and every unit runs again
    runner = _runner(out)
    changed = Squares(out, [2], salt="b")
    assert runner.run(changed) == {"value": 4} and changed.ran == ["n-002"]
    assert not stray.exists()
    # the step after it is fingerprinted by it: it runs again though its own settings did not change
    later = Doubled(out, [5])
    runner.run(later)
    assert later.ran == ["n-005"]

    # the phase's settings changed: every step runs again
    first = Squares(out, [2], salt="b")
    _runner(out, "settings-b").run(first)
    assert first.ran == ["n-002"]


def test_damaged_record_names_the_file_and_the_fix(tmp_path, ray_local):
    out = Output.at(str(tmp_path))
    _runner(out).run(Squares(out, [1, 2]))
    record = tmp_path / LAYOUT.step_unit("dedup", "squares", "n-001")
    (tmp_path / LAYOUT.step_done("dedup", "squares")).unlink()
    record.write_text("{not json")
    with pytest.raises(Exception, match=r"n-001\.json.*Delete it and rerun the same command: that unit is done again"):
        _runner(out).run(Squares(out, [1, 2]))


def test_a_receipt_deleted_from_a_done_step_reopens_it(tmp_path, ray_local, caplog):
    out = Output.at(str(tmp_path))
    _runner(out).run(Squares(out, [1, 2, 3]))
    done = json.loads((tmp_path / LAYOUT.step_done("dedup", "squares")).read_text())
    assert done["units"] == 3
    # as a damaged receipt's advice says: delete it and rerun; only that unit runs again
    (tmp_path / LAYOUT.step_unit("dedup", "squares", "n-002")).unlink()
    caplog.set_level("INFO", logger="curation")
    again = Squares(out, [1, 2, 3])
    assert _runner(out).run(again) == {"value": 14}
    assert again.ran == ["n-002"]
    assert "[dedup] squares: 1 of 3 receipts gone: runs them again" in caplog.messages
