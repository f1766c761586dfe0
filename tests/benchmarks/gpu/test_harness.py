"""What every part of the GPU check shares: a report file that tells what was measured at every change, the part's
deadline, and the GPU's utilisation over a window."""

import json
import time

from benchmarks.gpu.harness import Deadline, GpuSampler, PartReport


def test_a_report_is_on_disk_at_every_change(tmp_path):
    path = tmp_path / "part.json"
    report = PartReport(path)
    assert json.loads(path.read_text()) == {"status": "running"}  # a part killed before its first figure says so
    report.set(device="CPU")
    report.append("runs", {"step_s": 0.5})
    report.append("runs", {"step_s": 0.4})
    assert json.loads(path.read_text()) == {"status": "running", "device": "CPU", "runs": [{"step_s": 0.5},
                                                                                           {"step_s": 0.4}]}  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["part.json"]  # written whole, through a file beside it


def test_a_deadline_counts_down():
    deadline = Deadline(time.monotonic() + 60)
    first = deadline.left()
    assert 59 < first <= 60 and deadline.left() <= first


def test_utilisation_is_the_mean_of_the_samples_in_the_window():
    sampler = GpuSampler()
    sampler.samples = [(1.0, 10.0, 100.0), (2.0, 20.0, 100.0), (3.0, 60.0, 100.0), (9.0, 90.0, 100.0)]
    assert sampler.mean_between(1.5, 3.0) == 40.0
    assert sampler.mean_between(4.0, 8.0) is None


def test_the_sampler_samples_where_there_is_a_gpu_and_stays_empty_where_there_is_none():
    with GpuSampler(every_s=0.01) as sampler:
        time.sleep(0.2)
    assert bool(sampler.samples) == (GpuSampler.query() is not None)
