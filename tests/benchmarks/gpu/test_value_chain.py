"""Part value of the GPU check: each pretrained init against random per measure (the whole chain runs in
tests/benchmarks/test_gpu_check.py)."""

from benchmarks.gpu.value_chain import value_cells


def test_each_pretrained_init_is_set_against_random_per_measure():
    results = {
        "inits": ["random", "student", "teacher"],
        "measures": {
            "probe mIoU": {"random": [0.1, 0.12, None], "student": [0.3, 0.32, 0.31], "teacher": [0.12, 0.11, 0.13]},
            "k-NN mIoU": {"random": [0.2], "student": [None], "teacher": [0.25]},
        },
    }
    cells = {(c["measure"], c["init"]): c for c in value_cells(results)}
    assert list(cells) == [("probe mIoU", "student"), ("probe mIoU", "teacher"), ("k-NN mIoU", "student"),
                           ("k-NN mIoU", "teacher")]  # fmt: skip
    student = cells["probe mIoU", "student"]
    assert student["random"] == "0.1100 ± 0.0141" and student["pretrained"] == "0.3100 ± 0.0100"
    assert student["ahead"] and student["beyond_spread"] is True
    teacher = cells["probe mIoU", "teacher"]  # ahead on the mean, within the seed spread
    assert teacher["ahead"] and teacher["beyond_spread"] is False
    # a measure with no value is neither ahead nor judged; one seed has no spread to beat
    assert cells["k-NN mIoU", "student"]["pretrained"] == "n/a" and not cells["k-NN mIoU", "student"]["ahead"]
    assert cells["k-NN mIoU", "teacher"]["ahead"] and cells["k-NN mIoU", "teacher"]["beyond_spread"] is None
