"""Takedown lists: a list that cannot be read is refused before anything is written, and the lists recorded on an
output keep their images out of every later write, even a new run's."""

from conftest import REPO

from common import schema
from common.layout import LAYOUT
from curation.audit.verify import audit
from curation.steps.output import Output, claim_output
from jobs import curate
from jobs import takedown as job


def test_a_later_write_phase_keeps_taken_down_images_out(out, three_entries, takedown_list, rows_of, ledger_of):
    entries, sources = three_entries(out)
    assert job.main(["--output", str(out), "--list", str(takedown_list(*entries)), "--grace-minutes", "0"]) == 0
    pool = next(iter(ledger_of(out))).split(".tar#")[0].rsplit("/", 1)[0]
    argv = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", pool, "--output", str(out)]
    assert curate.main([*argv, "--phases", "write", "write.rows_per_shard=2"]) == 0
    assert not sources & {r["source"] for r in rows_of(out)}
    assert all(ledger_of(out)[s]["status"] == schema.TAKEN_DOWN for s in sources)
    result = audit(str(out))
    assert result.ok, result.summary()
    # a new run on the output discards its results, never its takedowns
    records = sorted(p.name for p in (out / LAYOUT.takedowns).iterdir())
    claim_output(Output.at(str(out)), "another-config", pool, new_run=True)
    assert sorted(p.name for p in (out / LAYOUT.takedowns).iterdir()) == records and not (out / LAYOUT.scored).exists()


def test_a_bad_list_is_refused_before_anything_is_written(out, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    for listed, message in ((tmp_path / "missing.txt", "no such list"), (tmp_path / "empty.txt", "holds no entries")):
        assert job.main(["--output", str(out), "--list", str(listed)]) == 2
        assert message in capsys.readouterr().err
    assert not (out / LAYOUT.takedowns).exists() and not (out / LAYOUT.lease).exists()
