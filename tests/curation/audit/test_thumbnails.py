"""curation.audit.thumbnails: sources read back through the one parser of source names, as the readers wrote them."""

from __future__ import annotations

import io
import tarfile

import pytest

from curation.audit.thumbnails import SourceReader, SourceUnreadable
from curation.score.sources import member_name, unread_name


def test_a_repeated_member_is_read_as_the_one_its_name_counts(tmp_path):
    with tarfile.open(tmp_path / "s.tar", "w") as tar:
        for name, data in (("a#1.jpg", b"first"), ("b.jpg", b"other"), ("a#1.jpg", b"second")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    reader, tar_uri = SourceReader(), str(tmp_path / "s.tar")
    assert reader.read(member_name(tar_uri, "a#1.jpg")) == b"first"
    assert reader.read(member_name(tar_uri, "a#1.jpg") + "#dup=2") == b"second"
    with pytest.raises(SourceUnreadable, match="no member"):
        reader.read(member_name(tar_uri, "a#1.jpg") + "#dup=3")


def test_a_part_that_was_never_read_is_not_opened(tmp_path):
    with pytest.raises(SourceUnreadable, match="could not be read"):
        SourceReader().read(unread_name(str(tmp_path / "gone.tar"), "after 3 members"))
