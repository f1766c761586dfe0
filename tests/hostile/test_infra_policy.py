"""Hostile changes to infra/: a cloud identity that can do more than the jobs need (or nothing: workers that cannot
read s3://), an image reference that can float, a pod that can gain privileges, an unbounded /dev/shm, token auth
turned off, a placeholder nobody is told to fill in.

Each rule is a function that lists what breaks it. The repository's files must give no findings, and a copy broken
in each of the ways listed in MUTATIONS must give at least one, so that no rule passes vacuously.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml
from ray._private.ray_constants import DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES, DEFAULT_OBJECT_STORE_MEMORY_PROPORTION
from ray.autoscaler._private.aws.config import DEFAULT_RAY_INSTANCE_PROFILE
from ray.autoscaler.tags import TAG_RAY_CLUSTER_NAME

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"

# Ray's GCP bootstrap account (ray.autoscaler._private.gcp.config, which needs the Google SDK to import).
RAY_DEFAULT_GCP_ACCOUNT = "ray-autoscaler-sa-v1"
# Policies on the worker role (infra/README.md, "IAM"); the head role has these and the autoscaler's.
WORKER_POLICIES = {"data-policy.json"}
# What the user fills in; infra/README.md says how for each.
PLACEHOLDERS = {
    "<ACCOUNT_ID>",
    "<POOL_BUCKET>",
    "<OUTPUT_BUCKET>",
    "<PROJECT_ID>",
    "<RAY_IMAGE_DIGEST>",
    "<HUMANS1B_IMAGE_DIGEST>",
}
PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*>")
# name:tag@sha256:<64 hex>, or a placeholder for the digest (not a valid digest: pulls fail until it is filled in).
PINNED = re.compile(r"^[^\s@]+:\w[\w.-]{0,127}@sha256:(?:[0-9a-f]{64}|<[A-Z][A-Z0-9_]*>)$")
# The only actions allowed on Resource "*": EC2's Describe calls, which have no resource-level permissions.
UNSCOPED_OK = re.compile(r"^ec2:Describe\w+$")
# EC2 calls that change an existing instance: allowed on this cluster's instances only (Ray's cluster-name tag).
INSTANCE_CHANGES = {
    "ec2:TerminateInstances",
    "ec2:StopInstances",
    "ec2:StartInstances",
    "ec2:RebootInstances",
    "ec2:CreateTags",
    "ec2:DeleteTags",
    "ec2:ModifyInstanceAttribute",
}
PROFILE_ARN = re.compile(r"^arn:aws:iam::(?:\d{12}|<ACCOUNT_ID>):instance-profile/([\w+=,.@-]+)$")
SHM = "/dev/shm"


def _load() -> dict:
    """Everything the rules read, parsed from the working tree."""
    paths = [
        INFRA / "Dockerfile",
        *sorted(INFRA.glob("*/cluster.yaml")),
        *sorted((INFRA / "aws" / "iam").glob("*.json")),
        INFRA / "gcp" / "autoscaler-role.yaml",
        *sorted((INFRA / "kuberay").glob("*.yaml")),
    ]
    texts = {str(p.relative_to(REPO)): p.read_text() for p in paths}
    return {
        "aws": yaml.safe_load(texts["infra/aws/cluster.yaml"]),
        "gcp": yaml.safe_load(texts["infra/gcp/cluster.yaml"]),
        "policies": {Path(k).name: json.loads(v) for k, v in texts.items() if k.startswith("infra/aws/iam/")},
        "gcp_role": yaml.safe_load(texts["infra/gcp/autoscaler-role.yaml"]),
        "dockerfile": texts["infra/Dockerfile"],
        "manifests": {Path(k).stem: yaml.safe_load(v) for k, v in texts.items() if k.startswith("infra/kuberay/")},
        "readme": (INFRA / "README.md").read_text(),
        "texts": texts,
    }


SNAPSHOT = _load()


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


# ---------------------------------------------------------------- AWS: instance profiles and IAM policies


def _profiles(cfg: dict) -> dict[str, str | None]:
    """Instance-profile name per node type (None: no profile, or an ARN that is not an instance profile's)."""
    names = {}
    for name, node_type in cfg["available_node_types"].items():
        profile = node_type["node_config"].get("IamInstanceProfile") or {}
        match = PROFILE_ARN.match(profile.get("Arn", ""))
        names[name] = match.group(1) if match else profile.get("Name")
    return names


def aws_profile_problems(s: dict) -> list[str]:
    cfg = s["aws"]
    profiles = _profiles(cfg)
    head = profiles[cfg["head_node_type"]]
    problems = []
    for name, profile in profiles.items():
        if profile is None:
            problems.append(f"{name}: no instance profile (an IamInstanceProfile with an instance-profile ARN)")
        elif profile == DEFAULT_RAY_INSTANCE_PROFILE:
            problems.append(f"{name}: Ray's default profile {profile} (EC2 and S3 full access)")
        elif name != cfg["head_node_type"] and profile == head:
            problems.append(f"{name}: a worker with the head's profile (it could launch instances)")
    return problems


def _condition_values(statement: dict, key: str) -> list:
    conditions = statement.get("Condition", {}).values()
    return [v for op in conditions for k, values in op.items() if k == key for v in _listed(values)]


def _arn_region(arn: str) -> str | None:
    parts = arn.split(":")
    return parts[3] if len(parts) > 5 and parts[2] in {"ec2", "ssm"} else None


def _statement_problems(where: str, st: dict, cfg: dict, worker_policy: bool) -> list[str]:
    if "NotAction" in st or "NotResource" in st:
        return [f"{where}: NotAction / NotResource grants everything not listed"]
    cluster, region = cfg["cluster_name"], cfg["provider"]["region"]
    actions, resources = _listed(st["Action"]), _listed(st["Resource"])
    problems = [f"{where}: wildcard action {a}" for a in actions if "*" in a]
    if "*" in resources:
        problems += [f"{where}: {a} on Resource *" for a in actions if not UNSCOPED_OK.match(a)]
    if worker_policy:
        problems += [f"{where}: {a} in a worker policy (S3 only)" for a in actions if not a.startswith("s3:")]
    problems += [f"{where}: {r} is not in {region}" for r in resources if _arn_region(r) not in {None, region}]
    if "iam:PassRole" in actions:
        profiles = _profiles(cfg)
        workers = {p for n, p in profiles.items() if n != cfg["head_node_type"]}
        roles = {r.rsplit(":role/", 1)[-1] for r in resources}
        if not roles <= workers or profiles[cfg["head_node_type"]] in roles:
            problems.append(f"{where}: passes {sorted(roles)}, not only the worker role {sorted(workers)}")
        if _condition_values(st, "iam:PassedToService") != ["ec2.amazonaws.com"]:
            problems.append(f"{where}: PassRole not limited to EC2 (iam:PassedToService)")
    launches = "ec2:RunInstances" in actions and any(":instance/" in r for r in resources)
    if launches or INSTANCE_CHANGES & set(actions):
        tag = [f"aws:{kind}Tag/{TAG_RAY_CLUSTER_NAME}" for kind in ("Request", "Resource")]
        tagged = cluster in _condition_values(st, tag[0]) + _condition_values(st, tag[1])
        at_launch = actions == ["ec2:CreateTags"] and _condition_values(st, "ec2:CreateAction") == ["RunInstances"]
        if not (tagged or at_launch):
            problems.append(f"{where}: {actions} on instances not tagged {TAG_RAY_CLUSTER_NAME}={cluster}")
    writes = [a for a in actions if a.startswith("s3:") and not a.startswith(("s3:Get", "s3:List"))]
    if writes and any("<POOL_BUCKET>" in r for r in resources):
        problems.append(f"{where}: {writes} on the pool bucket (read-only)")
    return problems


def iam_policy_problems(s: dict) -> list[str]:
    problems = []
    for name, policy in s["policies"].items():
        for st in _listed(policy["Statement"]):
            where = f"{name}:{st.get('Sid', '?')}"
            if "Principal" in st:  # a trust policy: who may assume the role
                if st["Principal"] != {"Service": "ec2.amazonaws.com"} or st["Action"] != "sts:AssumeRole":
                    problems.append(f"{where}: the role may be assumed by {st['Principal']}, not only by EC2")
            elif st["Effect"] == "Allow":
                problems += _statement_problems(where, st, s["aws"], name in WORKER_POLICIES)
    return problems


def test_ray_keeps_the_configured_head_profile(monkeypatch):
    # `ray up` gives the head Ray's default profile (created with EC2 and S3 full access) unless the head's node
    # type names one: with ours it must not even look the default up.
    from ray.autoscaler._private.aws import config as aws_config

    class LooksUpDefault(Exception):
        pass

    def lookup(name, config):
        raise LooksUpDefault(name)

    monkeypatch.setattr(aws_config, "_get_instance_profile", lookup)
    cfg = copy.deepcopy(SNAPSHOT["aws"])
    head = cfg["available_node_types"][cfg["head_node_type"]]["node_config"]
    assert "IamInstanceProfile" in head
    assert aws_config._configure_iam_role(copy.deepcopy(cfg)) == cfg
    del head["IamInstanceProfile"]
    with pytest.raises(LooksUpDefault, match=DEFAULT_RAY_INSTANCE_PROFILE):
        aws_config._configure_iam_role(cfg)


# ---------------------------------------------------------------- GCP: service accounts and the autoscaler role


def gcp_account_problems(s: dict) -> list[str]:
    cfg = s["gcp"]
    domain = f"@{cfg['provider']['project_id']}.iam.gserviceaccount.com"
    emails = {}
    problems = []
    for name, node_type in cfg["available_node_types"].items():
        accounts = node_type["node_config"].get("serviceAccounts") or [{}]
        email = emails[name] = accounts[0].get("email", "")
        if email.startswith(f"{RAY_DEFAULT_GCP_ACCOUNT}@"):
            problems.append(f"{name}: Ray's default account (project-wide compute.admin, storage.objectAdmin)")
        elif not email.endswith(domain):
            problems.append(f"{name}: runs as {email or 'no account'}, not an account of its own ({domain})")
    head = emails[cfg["head_node_type"]]
    workers = {n: e for n, e in emails.items() if n != cfg["head_node_type"]}
    return problems + [f"{n}: a worker with the head's account" for n, e in workers.items() if e == head]


def gcp_role_problems(s: dict) -> list[str]:
    return [
        f"autoscaler role: {p} (only named compute permissions, no IAM changes)"
        for p in s["gcp_role"]["includedPermissions"]
        if "*" in p or not p.startswith("compute.") or "IamPolicy" in p
    ]


# ---------------------------------------------------------------- images pinned by digest


def _froms(dockerfile: str) -> list[tuple[str, str]]:
    """(reference as written, as resolved with the ARG defaults) of every FROM not built on an earlier stage."""
    args: dict[str, str] = {}
    stages = {"scratch"}
    froms = []
    for line in dockerfile.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word.upper() == "ARG":
            key, _, value = rest.strip().partition("=")
            args[key] = value
        elif word.upper() == "FROM":
            ref, *alias = rest.split()
            if ref.lower() not in stages:
                resolved = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), ref)
                froms.append((ref, resolved))
            stages |= {alias[-1].lower()} if alias else set()
    return froms


def dockerfile_problems(s: dict) -> list[str]:
    froms = _froms(s["dockerfile"])
    # The @ must be in the FROM itself: a whole reference in an ARG can be overridden with a bare tag.
    return [
        f"FROM {ref} ({resolved}) is not pinned by digest"
        for ref, resolved in froms
        if "@" not in ref or not PINNED.match(resolved)
    ] + ([] if froms else ["no FROM"])


def _images(node) -> list[str]:
    if isinstance(node, dict):
        own = [v for k, v in node.items() if k in {"image", "head_image", "worker_image"} and isinstance(v, str)]
        return own + [i for v in node.values() for i in _images(v)]
    if isinstance(node, list):
        return [i for v in node for i in _images(v)]
    return []


def image_problems(s: dict) -> list[str]:
    docs = {"aws": s["aws"], "gcp": s["gcp"], **s["manifests"]}
    problems = [
        f"{where}: {image} is not pinned by digest"
        for where, doc in docs.items()
        for image in _images(doc)
        if not PINNED.match(image)
    ]
    problems += [f"{where}: no image" for where, doc in docs.items() if not _images(doc)]
    base = _froms(s["dockerfile"])[0][1]  # the VM clusters run the image's base, the project pip-installed on top
    return problems + [
        f"{c}: runs {s[c]['docker']['image']}, not the Dockerfile's base {base}"
        for c in ("aws", "gcp")
        if s[c]["docker"]["image"] != base
    ]


# ---------------------------------------------------------------- KubeRay pods: securityContext, /dev/shm, token


def _cluster_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


def _ray_pods(doc: dict) -> list[tuple[str, dict]]:
    spec = _cluster_spec(doc)
    groups = [(g["groupName"], g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]
    return [("head", spec["headGroupSpec"]["template"]["spec"]), *groups]


def _all_pods(doc: dict) -> list[tuple[str, dict]]:
    pods = _ray_pods(doc)
    if doc["kind"] == "RayJob":  # without a template KubeRay's submitter pod has no securityContext
        template = doc["spec"].get("submitterPodTemplate") or {}
        pods.append(("submitter", template.get("spec") or {"containers": []}))
    return pods


def _container_problems(where: str, sc: dict | None) -> list[str]:
    sc = sc or {}
    problems = []
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: allowPrivilegeEscalation is not false")
    caps = sc.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []) or caps.get("add"):
        problems.append(f"{where}: capabilities not dropped (drop: [ALL], nothing added)")
    if sc.get("privileged") or sc.get("runAsUser") == 0 or sc.get("runAsNonRoot") is False:
        problems.append(f"{where}: the container overrides the pod's non-root user")
    return problems


def pod_security_problems(s: dict) -> list[str]:
    problems = []
    for stem, doc in s["manifests"].items():
        for name, pod in _all_pods(doc):
            where = f"{stem}/{name}"
            sc = pod.get("securityContext") or {}
            if sc.get("runAsNonRoot") is not True or sc.get("runAsUser") != 1000:
                problems.append(f"{where}: pod not runAsNonRoot as the image's user 1000")
            if (sc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
                problems.append(f"{where}: pod without the RuntimeDefault seccomp profile")
            if not pod["containers"]:
                problems.append(f"{where}: no pod template")
            for container in pod["containers"] + pod.get("initContainers", []):
                problems += _container_problems(f"{where}/{container['name']}", container.get("securityContext"))
        spec = _cluster_spec(doc)
        if spec.get("enableInTreeAutoscaling"):  # the head's autoscaler sidecar has a securityContext of its own
            sidecar = (spec.get("autoscalerOptions") or {}).get("securityContext")
            problems += _container_problems(f"{stem}/autoscaler", sidecar)
    return problems


_UNITS = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _bytes(quantity) -> float:
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(quantity)).groups()
    return float(number) * _UNITS[unit]


def shm_problems(s: dict) -> list[str]:
    problems = []
    for stem, doc in s["manifests"].items():
        for name, pod in _ray_pods(doc):
            where = f"{stem}/{name}"
            ray = pod["containers"][0]
            mounts = [m["name"] for m in ray.get("volumeMounts", []) if m["mountPath"] == SHM]
            volume = next((v for v in pod.get("volumes", []) if mounts and v["name"] == mounts[0]), {})
            empty_dir = volume.get("emptyDir") or {}
            if empty_dir.get("medium") != "Memory" or "sizeLimit" not in empty_dir:
                problems.append(f"{where}: {SHM} is not a memory-backed emptyDir with a sizeLimit")
                continue
            limit, memory = empty_dir["sizeLimit"], ray["resources"]["limits"]["memory"]
            # Ray's default object store, which it keeps within 95% of the free /dev/shm (ray._private.utils).
            store = min(DEFAULT_OBJECT_STORE_MEMORY_PROPORTION * _bytes(memory), DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES)
            if 0.95 * _bytes(limit) < store:
                problems.append(f"{where}: {SHM} of {limit} is too small for the object store ({store / 2**30:.1f}Gi)")
            if _bytes(limit) > _bytes(memory) / 2:
                problems.append(f"{where}: {SHM} of {limit} may take over half of the pod's {memory}")
    return problems


def kuberay_token_problems(s: dict) -> list[str]:
    problems = []
    for stem, doc in s["manifests"].items():
        if (_cluster_spec(doc).get("authOptions") or {}).get("mode") != "token":
            problems.append(f"{stem}: authOptions.mode is not token")
        for name, pod in _all_pods(doc):
            env = [e for c in pod["containers"] for e in c.get("env", []) if e["name"] == "RAY_AUTH_MODE"]
            problems += [f"{stem}/{name}: RAY_AUTH_MODE={e.get('value')}" for e in env if e.get("value") != "token"]
    return problems


def launcher_token_problems(s: dict) -> list[str]:
    problems = []
    for cloud in ("aws", "gcp"):
        cfg = s[cloud]
        if "--env RAY_AUTH_MODE=token" not in cfg["docker"]["run_options"]:
            problems.append(f"{cloud}: the container does not set RAY_AUTH_MODE=token")
        starts = [c for c in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"] if "ray start" in c]
        problems += [
            f"{cloud}: {c!r} without RAY_AUTH_MODE=token" for c in starts if "RAY_AUTH_MODE=token ray start" not in c
        ]
        problems += [] if starts else [f"{cloud}: no ray start"]
    return problems


# ---------------------------------------------------------------- placeholders


def placeholder_problems(s: dict) -> list[str]:
    used = {p: path for path, text in s["texts"].items() for p in PLACEHOLDER.findall(text)}
    unknown = [f"{path}: {p} is not one of {sorted(PLACEHOLDERS)}" for p, path in used.items() if p not in PLACEHOLDERS]
    return unknown + [
        f"{path}: infra/README.md does not say how to fill in {p}" for p, path in used.items() if p not in s["readme"]
    ]


RULES = {
    f.__name__: f
    for f in (
        aws_profile_problems,
        iam_policy_problems,
        gcp_account_problems,
        gcp_role_problems,
        dockerfile_problems,
        image_problems,
        pod_security_problems,
        shm_problems,
        kuberay_token_problems,
        launcher_token_problems,
        placeholder_problems,
    )
}


@pytest.mark.parametrize("rule", RULES)
def test_repository_follows_the_rule(rule):
    assert RULES[rule](SNAPSHOT) == []


# ---------------------------------------------------------------- each rule catches a broken copy
# Getters into a snapshot, and mutations built on them.


def node(cloud: str, node_type: str):
    return lambda s: s[cloud]["available_node_types"][node_type]["node_config"]


def statements(policy: str):
    return lambda s: s["policies"][policy]["Statement"]


def statement(policy: str, sid: str):
    return lambda s: next(st for st in s["policies"][policy]["Statement"] if st.get("Sid") == sid)


def cluster(stem: str):
    return lambda s: _cluster_spec(s["manifests"][stem])


def pod(stem: str, name: str):
    return lambda s: dict(_all_pods(s["manifests"][stem]))[name]


def container(stem: str, name: str):
    return lambda s: pod(stem, name)(s)["containers"][0]


def setting(getter, key, value):
    return lambda s: getter(s).__setitem__(key, value)


def deleting(getter, key):
    return lambda s: getter(s).__delitem__(key)


def appending(getter, item):
    return lambda s: getter(s).append(item)


def own_security(getter, key, value):
    """Changes the securityContext of one pod or container only (the manifests share one through a YAML anchor)."""
    return lambda s: getter(s).__setitem__("securityContext", {**getter(s)["securityContext"], key: value})


def replacing(key: str, old: str, new: str):
    def mutate(s):
        assert old in s[key]
        s[key] = s[key].replace(old, new)

    return mutate


def allow(action, resource, **extra):
    return {"Sid": "Added", "Effect": "Allow", "Action": action, "Resource": resource, **extra}


ACCOUNT = "arn:aws:iam::<ACCOUNT_ID>"
PASS_ROLE = statement("autoscaler-policy.json", "PassOnlyTheWorkerRoleToEc2")


def gcp_permissions(s):
    return s["gcp_role"]["includedPermissions"]


def gcp_cpu_account(s):
    return node("gcp", "cpu_spot")(s)["serviceAccounts"][0]


def cpu_shm(s):
    return pod("raycluster", "cpu-spot")(s)["volumes"][0]["emptyDir"]


DIGEST_ARG = "ARG RAY_IMAGE_DIGEST=sha256:<RAY_IMAGE_DIGEST>"
FROM = "FROM rayproject/ray:${RAY_VERSION}-py311-gpu@${RAY_IMAGE_DIGEST}"
TAG_ONLY = "registry.example.com/humans1b:0.1.0"

MUTATIONS = [
    ("aws_profile_problems", "head-without-profile", deleting(node("aws", "head"), "IamInstanceProfile")),
    ("aws_profile_problems", "worker-without-profile", deleting(node("aws", "cpu_spot"), "IamInstanceProfile")),
    (
        "aws_profile_problems",
        "rays-default-profile",
        setting(
            node("aws", "head"),
            "IamInstanceProfile",
            {"Arn": f"{ACCOUNT}:instance-profile/{DEFAULT_RAY_INSTANCE_PROFILE}"},
        ),
    ),
    (
        "aws_profile_problems",
        "worker-with-head-profile",
        lambda s: node("aws", "cpu_spot")(s).update(IamInstanceProfile=node("aws", "head")(s)["IamInstanceProfile"]),
    ),
    (
        "aws_profile_problems",
        "role-arn-not-profile",
        setting(node("aws", "cpu_spot"), "IamInstanceProfile", {"Arn": f"{ACCOUNT}:role/humans1b-ray-worker"}),
    ),
    ("iam_policy_problems", "action-star", appending(statements("autoscaler-policy.json"), allow("*", "*"))),
    ("iam_policy_problems", "s3-star-on-star", appending(statements("data-policy.json"), allow("s3:*", "*"))),
    (
        "iam_policy_problems",
        "get-object-anywhere",
        setting(statement("data-policy.json", "ReadThePool"), "Resource", "*"),
    ),
    (
        "iam_policy_problems",
        "action-prefix-wildcard",
        setting(statement("data-policy.json", "ReadAndWriteOutputs"), "Action", ["s3:Put*"]),
    ),
    (
        "iam_policy_problems",
        "not-action",
        appending(statements("autoscaler-policy.json"), {"Effect": "Allow", "NotAction": "iam:*", "Resource": "*"}),
    ),
    (
        "iam_policy_problems",
        "worker-may-launch",
        appending(statements("data-policy.json"), allow("ec2:RunInstances", "arn:aws:ec2:us-west-2::image/*")),
    ),
    (
        "iam_policy_problems",
        "worker-may-pass-roles",
        appending(statements("data-policy.json"), allow("iam:PassRole", f"{ACCOUNT}:role/humans1b-ray-worker")),
    ),
    ("iam_policy_problems", "pass-any-role", setting(PASS_ROLE, "Resource", f"{ACCOUNT}:role/humans1b-*")),
    ("iam_policy_problems", "pass-head-role", setting(PASS_ROLE, "Resource", f"{ACCOUNT}:role/humans1b-ray-head")),
    ("iam_policy_problems", "pass-role-to-any-service", deleting(PASS_ROLE, "Condition")),
    (
        "iam_policy_problems",
        "terminate-any-instance",
        deleting(statement("autoscaler-policy.json", "RetagAndTerminateOnlyThisCluster"), "Condition"),
    ),
    (
        "iam_policy_problems",
        "launch-untagged",
        deleting(statement("autoscaler-policy.json", "LaunchOnlyInstancesTaggedForThisCluster"), "Condition"),
    ),
    (
        "iam_policy_problems",
        "pool-writable",
        appending(statements("data-policy.json"), allow("s3:PutObject", "arn:aws:s3:::<POOL_BUCKET>/*")),
    ),
    (
        "iam_policy_problems",
        "other-region",
        setting(
            statement("autoscaler-policy.json", "ResolveTheAmiParameterAtLaunch"),
            "Resource",
            "arn:aws:ssm:us-east-1::parameter/aws/service/x",
        ),
    ),
    (
        "iam_policy_problems",
        "anyone-may-assume",
        setting(statement("trust-ec2.json", "Ec2InstancesOnly"), "Principal", {"AWS": "*"}),
    ),
    ("gcp_account_problems", "head-without-account", deleting(node("gcp", "head"), "serviceAccounts")),
    ("gcp_account_problems", "compute-default-account", setting(gcp_cpu_account, "email", "default")),
    (
        "gcp_account_problems",
        "rays-default-account",
        setting(gcp_cpu_account, "email", f"{RAY_DEFAULT_GCP_ACCOUNT}@<PROJECT_ID>.iam.gserviceaccount.com"),
    ),
    (
        "gcp_account_problems",
        "worker-with-head-account",
        lambda s: gcp_cpu_account(s).update(email=node("gcp", "head")(s)["serviceAccounts"][0]["email"]),
    ),
    (
        "gcp_account_problems",
        "other-project",
        setting(gcp_cpu_account, "email", "humans1b-ray-worker@other.iam.gserviceaccount.com"),
    ),
    ("gcp_role_problems", "compute-wildcard", appending(gcp_permissions, "compute.instances.*")),
    ("gcp_role_problems", "act-as-anyone", appending(gcp_permissions, "iam.serviceAccounts.actAs")),
    ("gcp_role_problems", "storage", appending(gcp_permissions, "storage.objects.create")),
    ("gcp_role_problems", "set-iam-policy", appending(gcp_permissions, "compute.instances.setIamPolicy")),
    ("dockerfile_problems", "tag-only", replacing("dockerfile", FROM, FROM.split("@")[0])),
    ("dockerfile_problems", "digest-arg-empty", replacing("dockerfile", DIGEST_ARG, "ARG RAY_IMAGE_DIGEST=")),
    ("dockerfile_problems", "digest-arg-a-tag", replacing("dockerfile", DIGEST_ARG, "ARG RAY_IMAGE_DIGEST=latest")),
    (
        "dockerfile_problems",
        "whole-reference-in-an-arg",
        replacing(
            "dockerfile", FROM, "ARG BASE=rayproject/ray:2.60.0-py311-gpu@sha256:<RAY_IMAGE_DIGEST>\nFROM ${BASE}"
        ),
    ),
    (
        "dockerfile_problems",
        "unpinned-second-stage",
        lambda s: s.update(dockerfile=s["dockerfile"] + "FROM python:3.11-slim AS tools\n"),
    ),
    ("dockerfile_problems", "no-from", lambda s: s.update(dockerfile="RUN true\n")),
    (
        "image_problems",
        "launcher-tag-only",
        setting(lambda s: s["aws"]["docker"], "image", "rayproject/ray:2.60.0-py311-gpu"),
    ),
    (
        "image_problems",
        "launcher-other-base",
        setting(lambda s: s["gcp"]["docker"], "image", "rayproject/ray:2.60.0-py311-gpu@sha256:" + "0" * 64),
    ),
    ("image_problems", "worker-tag-only", setting(container("raycluster", "cpu-spot"), "image", TAG_ONLY)),
    (
        "image_problems",
        "digest-without-tag",
        setting(container("raycluster", "head"), "image", "registry.example.com/humans1b@sha256:" + "0" * 64),
    ),
    (
        "image_problems",
        "submitter-latest",
        setting(container("rayjob-curate", "submitter"), "image", "registry.example.com/humans1b:latest"),
    ),
    (
        "image_problems",
        "autoscaler-image-unpinned",
        setting(lambda s: cluster("rayjob-pretrain")(s)["autoscalerOptions"], "image", "rayproject/ray:2.60.0"),
    ),
    ("pod_security_problems", "worker-pod-without-context", deleting(pod("raycluster", "cpu-spot"), "securityContext")),
    ("pod_security_problems", "root-allowed", own_security(pod("raycluster", "head"), "runAsNonRoot", False)),
    ("pod_security_problems", "root-user", own_security(pod("raycluster", "head"), "runAsUser", 0)),
    (
        "pod_security_problems",
        "seccomp-unconfined",
        own_security(pod("raycluster", "cpu-spot"), "seccompProfile", {"type": "Unconfined"}),
    ),
    (
        "pod_security_problems",
        "escalation",
        own_security(container("raycluster", "cpu-spot"), "allowPrivilegeEscalation", True),
    ),
    (
        "pod_security_problems",
        "capabilities-kept",
        own_security(container("raycluster", "cpu-spot"), "capabilities", {"drop": []}),
    ),
    (
        "pod_security_problems",
        "capability-added",
        own_security(container("raycluster", "cpu-spot"), "capabilities", {"drop": ["ALL"], "add": ["SYS_ADMIN"]}),
    ),
    ("pod_security_problems", "privileged", own_security(container("raycluster", "cpu-spot"), "privileged", True)),
    ("pod_security_problems", "container-as-root", own_security(container("raycluster", "cpu-spot"), "runAsUser", 0)),
    (
        "pod_security_problems",
        "container-without-context",
        deleting(container("raycluster", "cpu-spot"), "securityContext"),
    ),
    (
        "pod_security_problems",
        "default-submitter",
        deleting(lambda s: s["manifests"]["rayjob-curate"]["spec"], "submitterPodTemplate"),
    ),
    (
        "pod_security_problems",
        "submitter-pod-without-context",
        deleting(pod("rayjob-curate", "submitter"), "securityContext"),
    ),
    (
        "pod_security_problems",
        "autoscaler-without-context",
        deleting(lambda s: cluster("raycluster")(s)["autoscalerOptions"], "securityContext"),
    ),
    ("shm_problems", "disk-backed", setting(cpu_shm, "medium", "")),
    ("shm_problems", "no-size-limit", deleting(cpu_shm, "sizeLimit")),
    ("shm_problems", "too-small-for-the-object-store", setting(cpu_shm, "sizeLimit", "12Gi")),
    ("shm_problems", "whole-pod-memory", setting(cpu_shm, "sizeLimit", "56Gi")),
    ("shm_problems", "not-mounted", setting(container("raycluster", "cpu-spot"), "volumeMounts", [])),
    (
        "kuberay_token_problems",
        "auth-disabled",
        setting(lambda s: cluster("rayjob-finetune")(s)["authOptions"], "mode", "disabled"),
    ),
    ("kuberay_token_problems", "auth-removed", deleting(cluster("raycluster"), "authOptions")),
    (
        "kuberay_token_problems",
        "submitter-env-disabled",
        setting(container("rayjob-pretrain", "submitter"), "env", [{"name": "RAY_AUTH_MODE", "value": "disabled"}]),
    ),
    (
        "launcher_token_problems",
        "container-env-removed",
        lambda s: s["aws"]["docker"]["run_options"].remove("--env RAY_AUTH_MODE=token"),
    ),
    (
        "launcher_token_problems",
        "worker-start-without-token",
        lambda s: s["gcp"].update(
            worker_start_ray_commands=[
                c.replace("RAY_AUTH_MODE=token ray start", "ray start") for c in s["gcp"]["worker_start_ray_commands"]
            ]
        ),
    ),
    (
        "placeholder_problems",
        "unknown-placeholder",
        lambda s: s["texts"].update({"infra/aws/cluster.yaml": "bucket: <BUCKET>"}),
    ),
    ("placeholder_problems", "undocumented-placeholder", replacing("readme", "<OUTPUT_BUCKET>", "the output bucket")),
]


@pytest.mark.parametrize(
    "rule,mutate",
    [(r, m) for r, _, m in MUTATIONS],
    ids=[f"{r.removesuffix('_problems')}-{i}" for r, i, _ in MUTATIONS],
)
def test_rule_catches_a_broken_copy(rule, mutate):
    broken = copy.deepcopy(SNAPSHOT)
    mutate(broken)
    assert RULES[rule](broken), "the rule misses this break"


def test_every_rule_is_broken_at_least_once():
    assert {r for r, _, _ in MUTATIONS} == set(RULES)
