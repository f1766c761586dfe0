"""curation.score.read_folder: loose files as rows; links out of the pool and over-large files are never read."""

from __future__ import annotations

import os

from curation.score.inputs import InputShard
from curation.score.read_folder import FolderReading
from curation.settings import InputSettings


def test_files_links_sizes_and_sidecars(tmp_path):
    pool, outside = tmp_path / "pool", tmp_path / "outside.jpg"
    pool.mkdir()
    outside.write_bytes(b"secret")
    (pool / "a.jpg").write_bytes(b"picture")
    (pool / "a.txt").write_text("a caption")
    (pool / "big.jpg").write_bytes(b"x" * 100)
    os.symlink(outside, pool / "link.jpg")
    paths = tuple(str(pool / n) for n in ("a.jpg", "a.txt", "big.jpg", "link.jpg"))
    reader = FolderReading(str(pool), InputSettings(), max_file_bytes=50)
    rows = {os.path.basename(r["source"]): r for r in reader._files(InputShard("files-000000", "files", paths))}
    assert set(rows) == {"a.jpg", "big.jpg", "link.jpg"}  # the caption is a.jpg's metadata, not an input
    assert rows["a.jpg"]["image"]["bytes"] == b"picture" and "a caption" in rows["a.jpg"]["metadata_json"]
    assert rows["big.jpg"]["reason"].startswith("file_too_large: 100 bytes > 50")
    assert rows["link.jpg"]["reason"].startswith("link_outside_pool:") and rows["link.jpg"]["image"] is None
