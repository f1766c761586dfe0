"""Pack the packages the GPU check needs into one archive, for a GPU machine that reaches no package index.

    python benchmarks/offline_site.py --python 3.12 --out .whl/site312.tar.xz
    GPU_CHECK_SITE=.whl/site312.tar.xz bash benchmarks/gpu_check.sh --value-data DIR   # there: unpacked, on PYTHONPATH

A CUDA image usually brings torch, numpy, pyarrow, pandas, OpenCV, onnxruntime and scikit-learn, but not Ray, the
full profile's model libraries or this project's smaller dependencies. This downloads the wheels of those (``NEEDED``,
at the versions installed here, so the GPU runs what the tests ran) for the target Python and x86-64 Linux, unpacks
them into one folder and writes it as a .tar.xz. Ray's wheel alone is ~80 MB, over what some transfer limits allow,
so what the check never runs is left out (``UNUSED``: the Java jars, RLlib, Serve, LLM serving, the dashboard's source
maps, test folders) and Ray's native binaries lose their symbol tables (``strip``): ~45 MB in all. The lite profile's
runtimes (OpenVINO, LiteRT, RapidOCR) are not in it: part ``value`` takes its curated data made ahead
(``gpu_check.py --prepare-value-data``), and parts ``curation`` and ``pretrain`` do not use them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

NEEDED = (
    "ray",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "tensorboardX",
    "open-clip-torch",
    "ftfy",
    "wcwidth",
    "ultralytics-opencv-headless",
    "ultralytics-thop",
    "imagehash",
    "PyWavelets",
    "faiss-cpu",  # the frozen-feature probes' k-NN
)
UNUSED = ("ray/jars", "ray/rllib", "ray/serve", "ray/llm")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64")  # fmt: skip


def download(specs: list[str], python: str, into: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--implementation",
           "cp", "--python-version", python, "-d", str(into)]  # fmt: skip
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, *specs], check=True)
    return sorted(into.glob("*.whl"))


def prune(site: Path) -> None:
    for rel in UNUSED:
        shutil.rmtree(site / rel, ignore_errors=True)
    for path in [*site.rglob("__pycache__"), *site.glob("ray/**/tests"), *site.glob("ray/dashboard/**/*.js.map")]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
    strip = shutil.which("strip")
    if strip is None:
        print("strip not found: Ray's binaries keep their symbols (the archive is ~15 MB larger)")
        return
    binaries = [
        site / "ray/_raylet.so",
        site / "ray/core/src/ray/raylet/raylet",
        site / "ray/core/src/ray/gcs/gcs_server",
    ]
    subprocess.run([strip, "--strip-unneeded", *map(str, binaries)], check=True)  # dynamic symbols stay


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    ap.add_argument("--out", default=".whl/site312.tar.xz")
    args = ap.parse_args(argv)
    specs = []
    for name in NEEDED:
        try:
            specs.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            specs.append(name)  # not installed here: the newest the index has
    with tempfile.TemporaryDirectory(prefix="offline-site-") as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        for wheel in download(specs, args.python, wheels):
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(site)
        for binary in site.glob("ray/core/src/ray/*/*"):  # zip members lose their exec bits
            if binary.is_file() and binary.suffix == "":
                binary.chmod(0o755)
        prune(site)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:xz", preset=6) as tar:
            for path in sorted(site.iterdir()):
                tar.add(path, arcname=path.name)
    print(f"written: {out} ({out.stat().st_size / 2**20:.1f} MiB, {len(specs)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
