"""infra/: cluster configs, KubeRay manifests, the image and the runtime env, checked offline.

Launcher YAMLs against Ray's own cluster schema (shipped in the ray package) and Ray's config preparation; KubeRay
manifests against infra/kuberay/kuberay-fields.schema.json (every object forbids unknown keys); every entrypoint
in the manifests and the runbook against its job's own argument parser and config model; the Dockerfile's install
step against pyproject.toml; the preemption scripts' logic on canned metadata answers. No network, no cluster.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
LAUNCHERS = sorted(INFRA.glob("*/cluster.yaml"))
MANIFESTS = sorted((INFRA / "kuberay").glob("*.yaml"))
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
RAY_SCHEMA = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
KUBERAY_SCHEMA = json.loads((INFRA / "kuberay" / "kuberay-fields.schema.json").read_text())
# Job modules whose --config (plus key=value overrides) is a typed config: the overrides are validated too.
CONFIG_MODELS = {
    "jobs.curate": ("curation.config", "CurateConfig"),
    "jobs.audit": ("curation.config", "CurateConfig"),
    "jobs.pretrain": ("pretrain.config", "PretrainConfig"),
    "jobs.finetune": ("finetune.config", "FinetuneConfig"),
}


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, INFRA / "preemption" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


drain_node = _load_script("drain_node")
spot_watcher = _load_script("spot_watcher")


# ---------------------------------------------------------------- the Dockerfile, parsed once


def _dockerfile() -> dict:
    text = (INFRA / "Dockerfile").read_text()
    lines: list[str] = []
    for raw in text.splitlines():
        if raw.lstrip().startswith("#") and not (lines and lines[-1].endswith("\\")):
            continue
        if lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1] + " " + raw.strip()
        elif raw.strip():
            lines.append(raw.strip())
    args: dict[str, str] = {}
    out: dict = {"copy": [], "run": [], "args": args}
    for line in lines:
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip()
        elif word == "FROM":
            out["from"] = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.strip())
        elif word == "WORKDIR":
            out["workdir"] = rest.strip()
        elif word == "COPY":
            out["copy"].append(rest.split())
        elif word == "RUN":
            out["run"].append(rest)
    return out


DOCKER = _dockerfile()
APP_DIR = DOCKER["workdir"]
EXTRAS = DOCKER["args"]["EXTRAS"]


def _pip_installs(command: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a shell command line."""
    found = []
    for part in re.split(r"&&|;|\|\|", command):
        tokens = shlex.split(part)
        for i in range(len(tokens) - 1):
            if tokens[i].endswith("pip") and tokens[i + 1] == "install":
                found.append(tokens[i + 2 :])
    return found


def test_dockerfile_installs_the_project_from_pyproject_only():
    installs = [args for run in DOCKER["run"] for args in _pip_installs(run)]
    assert installs, "the Dockerfile installs nothing"
    for args in installs:
        targets = [a for a in args if not a.startswith("-")]
        # The project with its extras is the only thing installed: no package list, no requirements file.
        assert targets == [".[${EXTRAS}]"], args
        assert not {"-r", "--requirement", "-c", "--constraint"} & set(args)
    # The dependency layer is resolved from pyproject.toml alone (copied before the first install).
    first_copy = DOCKER["copy"][0]
    assert [a for a in first_copy[:-1] if not a.startswith("--")] == ["pyproject.toml"]
    assert DOCKER["copy"][-1][-2:] == [".", "."]  # then the whole project
    extras = set(EXTRAS.split(","))
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"]), extras


def test_dockerfile_dependency_layer_builds_from_pyproject_alone(tmp_path):
    # Step 1 of the image builds the project from pyproject.toml alone (and an empty README.md): its metadata must
    # already carry every dependency and the extras' ones, as pyproject.toml lists them.
    (tmp_path / "pyproject.toml").write_bytes((REPO / "pyproject.toml").read_bytes())
    (tmp_path / "README.md").touch()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            "wheel",
            ".",
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "wheel").glob("humans1b-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith("METADATA"))).decode()
        assert not [n for n in zf.namelist() if n.endswith(".py")]  # no code in the dependency layer
    requires = {
        Requirement(line.split(":", 1)[1].strip()).name
        for line in meta.splitlines()
        if line.startswith("Requires-Dist:")
    }
    declared = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    for extra in EXTRAS.split(","):
        declared |= {Requirement(r).name for r in PYPROJECT["project"]["optional-dependencies"][extra]}
    assert declared <= requires


def test_image_ray_matches_the_project_and_the_clusters():
    # The tag; tests/hostile/test_infra_policy.py checks the digest that pins it.
    assert DOCKER["from"].split("@")[0] == f"rayproject/ray:{ray.__version__}-py311-gpu"
    ray_req = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == "ray")
    assert ray.__version__ in ray_req.specifier
    ignore = (INFRA / "Dockerfile.dockerignore").read_text().split()
    assert {"sample_pool", "out", ".git"} <= set(ignore)


# ---------------------------------------------------------------- cluster launcher configs


def _launcher(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.parent.name)
def test_launcher_config_validates_against_rays_schema(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = _launcher(path)
    jsonschema.validate(cfg, RAY_SCHEMA)
    # What `ray up` does before touching the cloud: merge Ray's defaults for the provider, validate again.
    validate_config(prepare_config(copy.deepcopy(cfg)))


def test_launcher_configs_cover_both_clouds():
    assert {p.parent.name for p in LAUNCHERS} == {"aws", "gcp"}
    assert {_launcher(p)["provider"]["type"] for p in LAUNCHERS} == {"aws", "gcp"}


def _is_spot(provider: str, node_config: dict) -> bool:
    if provider == "aws":
        return node_config.get("InstanceMarketOptions", {}).get("MarketType") == "spot"
    scheduling = node_config.get("scheduling", {})
    return scheduling.get("provisioningModel") == "SPOT" or scheduling.get("preemptible") is True


def _gpus(provider: str, node_type: dict) -> int:
    if provider == "aws":  # resources are detected from the instance type: G and P families carry GPUs
        return 1 if node_type["node_config"]["InstanceType"].split(".")[0][0] in "gp" else 0
    return node_type["resources"].get("GPU", 0)


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.parent.name)
def test_launcher_on_demand_head_and_spot_cpu_and_gpu_workers(path):
    from ray._private.label_utils import validate_node_label_syntax, validate_node_labels

    cfg = _launcher(path)
    provider = cfg["provider"]["type"]
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert not _is_spot(provider, head["node_config"])
    assert head["resources"].get("CPU") == 0  # no tasks on the head
    workers = {name: t for name, t in types.items() if name != cfg["head_node_type"]}
    assert all(_is_spot(provider, t["node_config"]) for t in workers.values())
    assert any(_gpus(provider, t) == 0 for t in workers.values()), "no CPU worker type"
    assert sum(_gpus(provider, t) > 0 for t in workers.values()) >= 2, "GPU types for model stages and training"
    # Autoscaling bounds: from zero, each type capped, the caps within the global bound.
    assert all(t["min_workers"] == 0 < t["max_workers"] for t in workers.values())
    assert sum(t["max_workers"] for t in workers.values()) <= cfg["max_workers"]
    for name, t in types.items():
        validate_node_label_syntax(t["labels"])
        validate_node_labels(t["labels"])  # no reserved ray.io/ prefix
        assert t["labels"]["humans1b.io/market"] == ("spot" if name in workers else "on-demand")
    assert cfg["provider"].get("cache_stopped_nodes", False) is False


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.parent.name)
def test_launcher_installs_the_project_like_the_image(path):
    cfg = _launcher(path)
    assert cfg["docker"]["image"] == DOCKER["from"]
    assert cfg["file_mounts"]["~/humans1b"] == "."
    assert {"sample_pool", "out"} <= set(cfg["rsync_exclude"])
    installs = [args for cmd in cfg["setup_commands"] for args in _pip_installs(cmd)]
    assert [a for args in installs for a in args if not a.startswith("-")] == [f"$HOME/humans1b[{EXTRAS}]"]
    # The head adds its cloud SDK in the same resolve, with the same extras.
    head = [a for cmd in cfg["head_setup_commands"] for args in _pip_installs(cmd) for a in args if "humans1b" in a]
    assert head == [f"$HOME/humans1b[{EXTRAS}]"]


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.parent.name)
def test_launcher_keeps_token_auth_on(path):
    cfg = _launcher(path)
    assert "--env RAY_AUTH_MODE=token" in cfg["docker"]["run_options"]
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    starts = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2
    assert all("RAY_AUTH_MODE=token ray start" in c for c in starts)


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.parent.name)
def test_launcher_starts_the_spot_watcher_on_workers(path):
    cfg = _launcher(path)
    (cmd,) = [c for c in cfg["worker_start_ray_commands"] if "spot_watcher.py" in c]
    tokens = shlex.split(cmd.split(">")[0])
    script = next(t for t in tokens if t.endswith("spot_watcher.py"))
    assert script.startswith("$HOME/humans1b/") and (REPO / script.removeprefix("$HOME/humans1b/")).is_file()
    args = spot_watcher.parse_args(tokens[tokens.index(script) + 1 :])
    assert args.cloud == cfg["provider"]["type"]
    assert not any("spot_watcher" in c for c in cfg["head_start_ray_commands"])  # the head is on-demand


# ---------------------------------------------------------------- KubeRay manifests


def _manifest(path: Path) -> dict:
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    return doc


def _cluster_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


def test_kuberay_schema_is_valid_and_rejects_unknown_keys():
    jsonschema.Draft7Validator.check_schema(KUBERAY_SCHEMA)
    doc = _manifest(INFRA / "kuberay" / "rayjob-pretrain.yaml")
    jsonschema.validate(doc, KUBERAY_SCHEMA)
    for mutate in (
        lambda d: d["spec"].__setitem__("shutdownAfterJobFinish", True),  # misspelt RayJob field
        lambda d: _cluster_spec(d)["workerGroupSpecs"][0]["template"]["spec"].__setitem__("terminationGracePeriod", 9),
        lambda d: _cluster_spec(d)["headGroupSpec"].__setitem__("rayStartParam", {}),
        lambda d: _cluster_spec(d).__setitem__("authOptions", {"mode": "none"}),
    ):
        bad = copy.deepcopy(doc)
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, KUBERAY_SCHEMA)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_kuberay_manifest_validates_against_the_used_crd_fields(path):
    jsonschema.validate(_manifest(path), KUBERAY_SCHEMA)


def test_kuberay_has_a_cluster_and_a_job_per_entrypoint():
    kinds = [(_manifest(p)["kind"], p.stem) for p in MANIFESTS]
    assert ("RayCluster", "raycluster") in kinds
    jobs = {shlex.split(_manifest(p)["spec"]["entrypoint"])[2] for p in MANIFESTS if _manifest(p)["kind"] == "RayJob"}
    assert jobs == {"jobs.curate", "jobs.pretrain", "jobs.finetune"}


def _pods(spec: dict):
    yield "head", spec["headGroupSpec"]
    for group in spec.get("workerGroupSpecs", []):
        yield group["groupName"], group


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_kuberay_cluster_token_auth_version_image_and_capacity(path):
    from ray._private.label_utils import validate_node_label_syntax, validate_node_labels

    spec = _cluster_spec(_manifest(path))
    assert spec["authOptions"]["mode"] == "token"
    assert spec["rayVersion"] == ray.__version__
    assert spec["enableInTreeAutoscaling"] is True
    version = PYPROJECT["project"]["version"]
    for name, group in _pods(spec):
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"].split("@")[0].endswith(f"/humans1b:{version}"), container["image"]
        validate_node_label_syntax(group["labels"])
        validate_node_labels(group["labels"])
        market = pod["nodeSelector"]["eks.amazonaws.com/capacityType"]
        assert (market, group["labels"]["humans1b.io/market"]) == (
            ("ON_DEMAND", "on-demand") if name == "head" else ("SPOT", "spot")
        )
        gpus = int(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        tolerated = {t["key"] for t in pod.get("tolerations", [])}
        if name != "head":
            assert "humans1b.io/spot" in tolerated
            assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert ("nvidia.com/gpu" in tolerated) == (gpus > 0)
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.stem)
def test_kuberay_spot_pods_drain_and_wait_for_the_checkpoint(path):
    spec = _cluster_spec(_manifest(path))
    for name, group in _pods(spec):
        if name == "head":
            continue
        pod = group["template"]["spec"]
        command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "python" and command[1] == f"{APP_DIR}/infra/preemption/drain_node.py"
        assert (REPO / command[1].removeprefix(APP_DIR + "/")).is_file()
        args = drain_node.parse_args(command[2:])
        assert args.hold
        # Kubernetes kills the pod at the end of the grace period, preStop included: the hold must end first.
        assert pod["terminationGracePeriodSeconds"] >= args.deadline_s + 10
        assert pod["terminationGracePeriodSeconds"] <= 120  # AWS reclaims two minutes after the notice


@pytest.mark.parametrize("path", [p for p in MANIFESTS if p.stem.startswith("rayjob")], ids=lambda p: p.stem)
def test_rayjob_shuts_down_retries_and_has_a_valid_runtime_env(path):
    from ray.runtime_env import RuntimeEnv

    spec = _manifest(path)["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["backoffLimit"] >= 1  # a retry resumes: the jobs keep their state in the output / storage
    env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert set(env) <= set(RuntimeEnv.known_fields)
    RuntimeEnv(**env)  # raises on wrong types
    if "jobs.pretrain" in spec["entrypoint"] or "jobs.finetune" in spec["entrypoint"]:
        assert float(env["env_vars"]["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"]) <= 5


# ---------------------------------------------------------------- entrypoints against the jobs' parsers


def _readme_commands() -> list[str]:
    text = (INFRA / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if "python -m jobs." in line:
                commands.append(line[line.index("python -m jobs.") :])
    return commands


ENTRYPOINTS = [(p.stem, _manifest(p)["spec"]["entrypoint"]) for p in MANIFESTS if _manifest(p)["kind"] == "RayJob"]
ENTRYPOINTS += [(f"README:{c.split()[2]}", c) for c in _readme_commands()]


def _config_path(path: str) -> Path:
    return REPO / path.removeprefix(APP_DIR + "/") if path.startswith(APP_DIR + "/") else REPO / path


@pytest.mark.parametrize("source,command", ENTRYPOINTS, ids=[f"{s}-{i}" for i, (s, _) in enumerate(ENTRYPOINTS)])
def test_entrypoint_exists_and_accepts_its_arguments(source, command):
    argv = shlex.split(command, comments=True)
    assert argv[:2] == ["python", "-m"], command
    module_name, job_args = argv[2], argv[3:]
    assert importlib.util.find_spec(module_name) is not None, f"{source} runs {module_name}, which does not exist"
    module = importlib.import_module(module_name)
    try:
        args = module.parse_args(job_args)
    except SystemExit as exc:
        pytest.fail(f"{module_name} rejects the arguments of {source}: {job_args} (exit {exc.code})")
    if getattr(args, "config", None) and module_name in CONFIG_MODELS:
        from common.config import load_config

        config_file = _config_path(args.config)
        assert config_file.is_file(), f"{source}: {args.config} is not in the repository"
        model_module, model_name = CONFIG_MODELS[module_name]
        model = getattr(importlib.import_module(model_module), model_name)
        load_config(model, config_file, args.overrides)  # raises on a misspelt key or a bad value


def _job_config(command: str):
    """(module name, parsed args, loaded config) of an entrypoint whose job has a typed config."""
    from common.config import load_config

    argv = shlex.split(command)
    module_name = argv[2]
    if module_name not in CONFIG_MODELS:
        pytest.skip(f"{module_name}: no typed config to check")
    args = importlib.import_module(module_name).parse_args(argv[3:])
    model_module, model_name = CONFIG_MODELS[module_name]
    model = getattr(importlib.import_module(model_module), model_name)
    return module_name, load_config(model, _config_path(args.config), args.overrides)


@pytest.mark.parametrize("path", [p for p in MANIFESTS if p.stem.startswith("rayjob")], ids=lambda p: p.stem)
def test_rayjob_cluster_can_hold_what_the_job_asks_for(path):
    spec = _manifest(path)["spec"]
    module_name, cfg = _job_config(spec["entrypoint"])
    groups = []  # (cpus, gpus, max pods) per worker group
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        groups.append((float(limits["cpu"]), float(limits.get("nvidia.com/gpu", 0)), group["maxReplicas"]))
    if module_name == "jobs.curate":
        # Every stage's task or actor fits on some worker pod (the head takes no tasks).
        for name in cfg.enabled_stages:
            stage = cfg.stages[name]
            assert any(cpu >= stage.num_cpus and gpu >= stage.num_gpus for cpu, gpu, _ in groups), name
    elif module_name == "jobs.pretrain":
        ray_cfg = cfg.ray
        assert ray_cfg.use_gpu
        gpu_groups = [(cpu, gpu, n) for cpu, gpu, n in groups if gpu > 0]
        assert sum(gpu * n for _, gpu, n in gpu_groups) >= ray_cfg.workers  # one worker per GPU
        assert all(ray_cfg.cpus_per_worker * gpu <= cpu for cpu, gpu, _ in gpu_groups)


def test_runbook_submits_every_job():
    modules = {shlex.split(c)[2] for c in _readme_commands()}
    assert {"jobs.curate", "jobs.pretrain", "jobs.finetune", "jobs.audit"} <= modules


# ---------------------------------------------------------------- runtime env for `ray job submit --working-dir`


def test_runtime_env_ships_code_and_configs_but_not_data(tmp_path):
    from ray._private.runtime_env.packaging import create_package
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load((INFRA / "runtime_env.yaml").read_text())
    assert set(env) <= set(RuntimeEnv.known_fields) and "working_dir" not in env  # given by --working-dir
    RuntimeEnv(**env)
    tree = tmp_path / "checkout"
    files = {
        "jobs/curate.py": "",
        "configs/curate/lite.yaml": "",
        "curation/score/stage.py": "",
        "pyproject.toml": "",
        "sample_pool/files/a.jpg": "x",
        "out/curated/shards/part-00000.parquet": "x",
        ".git/HEAD": "x",
        "curation/__pycache__/stage.cpython-311.pyc": "x",
        "humans1b.egg-info/PKG-INFO": "x",
        "curation/out_of_range.py": "",  # a name that only starts like an excluded folder stays
    }
    for rel, content in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(content)
    package = tmp_path / "pkg.zip"
    # The packaging code `ray job submit --working-dir` uses, with .gitignore off: the excludes alone must do it.
    create_package(str(tree), package, include_gitignore=False, excludes=env["excludes"])
    shipped = {n for n in zipfile.ZipFile(package).namelist() if not n.endswith("/")}
    assert shipped == {
        "jobs/curate.py",
        "configs/curate/lite.yaml",
        "curation/score/stage.py",
        "pyproject.toml",
        "curation/out_of_range.py",
    }


def test_runtime_env_upload_of_this_checkout_is_small(tmp_path):
    from ray._private.runtime_env.packaging import create_package

    env = yaml.safe_load((INFRA / "runtime_env.yaml").read_text())
    package = tmp_path / "repo.zip"
    create_package(str(REPO), package, include_gitignore=False, excludes=env["excludes"])
    names = zipfile.ZipFile(package).namelist()
    assert (
        "jobs/curate.py" in names and "configs/curate/lite.yaml" in names and "infra/preemption/drain_node.py" in names
    )
    assert not [n for n in names if n.split("/")[0] in {"sample_pool", "out", ".git"}]
    assert package.stat().st_size < 50 * 2**20  # far below Ray's 500 MiB working_dir limit


# ---------------------------------------------------------------- token authentication


def test_token_auth_is_not_disabled_anywhere():
    disabling = re.compile(r"RAY_AUTH_MODE\W{0,4}disabled", re.I)
    skip_dirs = {".git", "out", "sample_pool", "__pycache__", ".pytest_cache", "humans1b.egg-info"}
    offenders = []
    for path in REPO.rglob("*"):
        if path == Path(__file__).resolve() or not path.is_file() or skip_dirs & set(path.relative_to(REPO).parts):
            continue
        if (
            path.suffix not in {".py", ".yaml", ".yml", ".json", ".md", ".sh", ".toml", ".cfg", ".ini", ""}
            and path.name != "Dockerfile"
        ):
            continue
        text = path.read_text(errors="ignore")
        if disabling.search(text):
            offenders.append(str(path.relative_to(REPO)))
    for manifest in MANIFESTS:
        if _cluster_spec(_manifest(manifest)).get("authOptions", {}).get("mode") != "token":
            offenders.append(str(manifest.relative_to(REPO)))
    assert not offenders


# ---------------------------------------------------------------- preemption scripts


def test_drain_command_is_accepted_by_rays_drain_node_cli():
    from ray.scripts.scripts import drain_node as ray_drain_node

    cmd = drain_node.drain_command("ab" * 28, 90, "spot interruption notice", "auto")
    assert cmd[:4] == [sys.executable, "-m", "ray.scripts.scripts", "drain-node"]
    # Parse with Ray's own click command (options, the reason's allowed values), without running it.
    ctx = ray_drain_node.make_context("drain-node", cmd[4:])
    assert ctx.params["reason"] == "DRAIN_NODE_REASON_PREEMPTION"
    assert ctx.params["deadline_remaining_seconds"] == 90
    assert ctx.params["node_id"] == "ab" * 28
    with pytest.raises(SystemExit):
        drain_node.parse_args(["--deadline-s", "-1"])


def test_aws_instance_action_parsing():
    now = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
    assert spot_watcher.aws_seconds_left(404, "", now) is None
    at = (now + timedelta(seconds=118)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert spot_watcher.aws_seconds_left(200, json.dumps({"action": "terminate", "time": at}), now) == 118
    assert spot_watcher.aws_seconds_left(200, json.dumps({"action": "stop", "time": at}), now) == 118
    assert spot_watcher.aws_seconds_left(200, json.dumps({"action": "none", "time": at}), now) is None
    assert spot_watcher.drain_deadline(118, 15) == 103
    assert spot_watcher.drain_deadline(8, 15) == spot_watcher.MIN_DEADLINE_S  # late notice: drain anyway


def test_aws_source_uses_imdsv2_tokens():
    calls = []
    at = "2026-11-29T12:02:00Z"

    def fetch(method, url, headers, timeout_s):
        calls.append((method, url, dict(headers)))
        if url.endswith("/latest/api/token"):
            return 200, "tok-1"
        gets = sum(c[0] == "GET" for c in calls)
        return (404, "") if gets == 1 else (200, json.dumps({"action": "terminate", "time": at}))

    source = spot_watcher.AwsSource(fetch, now=lambda: datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC))
    assert source.seconds_left() is None
    assert source.seconds_left() == 120
    assert [c[0] for c in calls] == ["PUT", "GET", "GET"]  # one token, reused
    assert calls[0][2]["X-aws-ec2-metadata-token-ttl-seconds"]
    assert all(c[2]["X-aws-ec2-metadata-token"] == "tok-1" for c in calls[1:])
    assert all(c[1].startswith("http://169.254.169.254/") for c in calls)


def test_gcp_source_reads_then_long_polls():
    answers = iter([(200, "FALSE"), (200, "TRUE")])
    urls = []

    def fetch(method, url, headers, timeout_s):
        assert headers == {"Metadata-Flavor": "Google"}
        urls.append(url)
        return next(answers)

    assert spot_watcher.GcpSource(fetch).seconds_left() == spot_watcher.GCP_NOTICE_S
    assert "wait_for_change" not in urls[0] and "wait_for_change=true" in urls[1]
    assert spot_watcher.GcpSource(lambda *a: (200, "TRUE")).seconds_left() == spot_watcher.GCP_NOTICE_S
    assert spot_watcher.gcp_preempted(503, "TRUE") is False


def test_watch_drains_once_with_the_time_left_minus_the_margin():
    class Source:
        answers = [None, RuntimeError("metadata hiccup"), None, 100.0]

        def seconds_left(self):
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    drained = []
    code = spot_watcher.watch(Source(), poll_s=0, margin_s=15, drain_fn=lambda d: drained.append(d) or 0)
    assert (code, drained) == (0, [85])
