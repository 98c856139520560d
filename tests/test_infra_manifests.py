"""infra/: every manifest parses, matches its schema (infra/schemas/, Ray's own schemas) and agrees
with the project (infra/validate.py); each check is shown to fail on a broken copy. Also the
placement arithmetic of qrag.distributed.placement. No cluster, no Docker: seconds."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

spec = importlib.util.spec_from_file_location("infra_validate", ROOT / "infra" / "validate.py")
validate = sys.modules["infra_validate"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(validate)


def test_the_shipped_infra_has_no_problems():
    assert validate.all_problems() == []


@pytest.mark.parametrize("path", validate.k8s_files(), ids=lambda p: str(p.relative_to(ROOT / "infra")))
def test_every_kubernetes_document_has_a_schema_and_matches_it(path):
    docs = validate.read_docs(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert doc.key in validate.SCHEMA_IDS, doc.where
        assert validate.schema_errors(doc.body, validate.SCHEMA_IDS[doc.key], doc.where) == []


def test_the_manifests_cover_the_issue():
    kinds = {d.key[1] for d in validate.k8s_docs()}
    assert {
        "RayCluster",
        "RayJob",
        "RayService",
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "Namespace",
        "Kustomization",
    } <= kinds
    job = validate.one("RayJob")
    assert "/opt/qrag/jobs/train_hotpot.py" in job.body["spec"]["entrypoint"]
    groups = {g.name: g for g in validate.ray_groups(validate.one("RayCluster").body["spec"])[1]}
    assert (
        groups["gpu-workers"].gpus == 1
        and groups["cpu-workers"].gpus == 0
        and groups["cpu-workers"].custom == {"qrag_cpu_node": 1000}
    )
    assert all(g.max > g.min for g in groups.values())  # autoscaling bounds


# -- every check fails on a broken copy ------------------------------------------------------------


@pytest.fixture
def infra(tmp_path, monkeypatch):
    """A copy of infra/ that the checks read instead of the real one."""
    copy = tmp_path / "infra"
    shutil.copytree(ROOT / "infra", copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(validate, "INFRA", copy)
    validate.k8s_docs.cache_clear()
    yield copy
    validate.k8s_docs.cache_clear()


def edit(path: Path, change, index: int = 0) -> None:
    """Apply ``change(doc)`` to document ``index`` of a YAML file."""
    docs = list(yaml.safe_load_all(path.read_text()))
    change(docs[index])
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    validate.k8s_docs.cache_clear()


def problems_after(path: Path, change, index: int = 0) -> str:
    edit(path, change, index)
    return "\n".join(validate.all_problems())


def serve_args(change):
    def apply(doc):
        cfg = yaml.safe_load(doc["spec"]["serveConfigV2"])
        change(cfg["applications"][0]["args"], cfg)
        doc["spec"]["serveConfigV2"] = yaml.safe_dump(cfg, sort_keys=False)

    return apply


def serve_deployment(name: str, change):
    """Apply ``change(options)`` to deployment ``name`` of the RayService's application."""

    def apply(a, c):
        entry = next(d for d in c["applications"][0]["deployments"] if d["name"] == name)
        change(entry)

    return serve_args(apply)


def shard_layout(change=None):
    """The RayService's app in the layout for corpora beyond one GPU (two Shard deployments, a GPU
    each, the Ingress with the encoder beside one of them), then ``change(args, config)``."""

    def apply(a, c):
        a.update(shard_deployments=2)
        app = c["applications"][0]
        ingress = next(d for d in app["deployments"] if d["name"] == "Ingress")
        ingress["autoscaling_config"].update(min_replicas=1, max_replicas=2)
        ingress["ray_actor_options"] = {"num_cpus": 0, "num_gpus": 0.4}
        app["deployments"] += [
            {"name": f"Shard{i}", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0, "num_gpus": 0.6}}
            for i in range(2)
        ]
        if change is not None:
            change(a, c)

    return serve_args(apply)


def in_shard_layout(name: str, change):
    """:func:`shard_layout`, then ``change(options)`` of deployment ``name``."""
    return shard_layout(lambda a, c: change(next(d for d in c["applications"][0]["deployments"] if d["name"] == name)))


def entrypoint(old: str, new: str):
    def apply(doc):
        assert old in doc["spec"]["entrypoint"]
        doc["spec"]["entrypoint"] = doc["spec"]["entrypoint"].replace(old, new)

    return apply


RAYCLUSTER = "kuberay/cluster/raycluster.yaml"
RAYJOB = "kuberay/train/rayjob.yaml"
RAYSERVICE = "kuberay/serve/rayservice.yaml"


@pytest.mark.parametrize(
    "file, change, expected",
    [
        # schemas
        (RAYCLUSTER, lambda d: d["spec"]["workerGroupSpecs"][1].update(minReplica=1), "'minReplica' was unexpected"),
        (
            RAYCLUSTER,
            lambda d: d["spec"]["workerGroupSpecs"][0]["rayStartParams"].update({"num-gpus": 1}),
            "1 is not of type 'string'",
        ),
        (RAYCLUSTER, lambda d: d["spec"]["autoscalerOptions"].update(upscalingMode="Fast"), "'Fast' is not one of"),
        (RAYSERVICE, serve_args(lambda a, c: c.update(proxy_locaton="EveryNode")), "unknown key 'proxy_locaton'"),
        # the RayJob against the project
        (RAYJOB, entrypoint("jobs/train_hotpot.py", "jobs/train_hotpotqa.py"), "is not a file of the project"),
        (
            RAYJOB,
            entrypoint("distributed.runners=8", "distributed.runnerz=8"),
            "unknown config key distributed.runnerz",
        ),
        (RAYJOB, entrypoint("distributed.runners=8", "distributed.runners=20"), "20 runners x 1 CPUs > 16 CPUs"),
        (
            RAYJOB,
            entrypoint("'distributed.runner_resources={qrag_cpu_node: 0.001}'", ""),
            "EpisodeFeeders may land on GPU nodes",
        ),
        (RAYJOB, entrypoint("qrag_cpu_node", "qrag_cpu"), "asks for 0.001 of 'qrag_cpu' but the Ray cluster has 0"),
        (
            RAYJOB,
            entrypoint("distributed.learner_cpus=4", "distributed.learner_cpus=12"),
            "no worker group can hold the learner",
        ),
        (RAYJOB, lambda d: d["spec"].update(clusterSelector={"ray.io/cluster": "other"}), "names RayCluster 'other'"),
        # the RayService against the project and the GPUs
        (RAYSERVICE, shard_layout(), ""),  # the other layout of the same app is valid too
        (
            RAYSERVICE,
            shard_layout(
                lambda a, c: [
                    d["ray_actor_options"].update(num_gpus=0.5)
                    for d in c["applications"][0]["deployments"]
                    if d["name"].startswith("Shard")
                ]
            ),
            "lets 2 shards share one GPU",
        ),
        (
            RAYSERVICE,
            serve_args(lambda a, c: a.update(checkpoint="models:/qrag-hotpot@staging")),
            "is not a model a RayJob registers",
        ),
        (RAYCLUSTER, lambda d: d["spec"]["workerGroupSpecs"][1].update(maxReplicas=9), "QRAG_AUTOSCALE_TO"),
        (
            RAYSERVICE,
            in_shard_layout("Ingress", lambda d: d["autoscaling_config"].update(min_replicas=2)),
            "some placement order leaves a shard without a GPU",
        ),
        (
            RAYSERVICE,
            in_shard_layout("Ingress", lambda d: d["autoscaling_config"].update(max_replicas=9)),
            "at Ingress max_replicas the deployments ask for",
        ),
        (
            RAYSERVICE,
            serve_deployment("Ingress", lambda d: d["autoscaling_config"].update(max_replicas=9)),
            "at Ingress max_replicas the deployments ask for",
        ),
        (
            RAYSERVICE,
            serve_deployment("Ingress", lambda d: d["autoscaling_config"].update(min_replicas=5)),
            "more GPUs than the 2 of the GPU workers",
        ),
        (
            RAYSERVICE,
            in_shard_layout("Shard1", lambda d: d.update(name="Shard2")),
            "(Shard2): no deployment 'Shard2' in the app with 2 shard deployment(s)",
        ),
        (
            RAYSERVICE,
            serve_deployment("Ingress", lambda d: d["autoscaling_config"].update(target_ongoing_request=4)),
            "autoscaling_config.target_ongoing_request: unknown key",
        ),
        (
            RAYSERVICE,
            serve_deployment("Ingress", lambda d: d.update(max_ongoing_request=4)),
            "unknown key 'max_ongoing_request'",
        ),
        (RAYSERVICE, serve_args(lambda a, c: a.update(shard_replicas=2)), "unknown config key shard_replicas"),
        (
            RAYSERVICE,
            in_shard_layout("Shard1", lambda d: d.pop("ray_actor_options")),
            "set ray_actor_options.num_gpus of Shard1",
        ),
        (RAYSERVICE, serve_args(lambda a, c: a.update(shardz=2)), "unknown config key shardz"),
        (
            RAYSERVICE,
            serve_deployment("Ingress", lambda d: d["ray_actor_options"].update(num_gpus=0)),
            "Ingress run on CUDA",
        ),
        (
            RAYSERVICE,
            serve_args(lambda a, c: a.update(checkpoint="/mnt/qrag/runs/other/final")),
            "is not where a RayJob writes one",
        ),
        (
            RAYSERVICE,
            serve_args(lambda a, c: a.update(storage="qrag_indexes")),
            "args.storage qrag_indexes is not on the shared volume",
        ),
        (
            RAYSERVICE,
            serve_args(lambda a, c: c["applications"][0].update(import_path="serve.app:make")),
            "does not resolve to a function",
        ),
        (
            RAYSERVICE,
            serve_args(lambda a, c: c["http_options"].update(host="127.0.0.1")),
            "http_options.host must be 0.0.0.0",
        ),
        (
            RAYSERVICE,
            lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update(
                env=[]
            ),
            "pods gpu-workers have no QRAG_API_KEYS from a Secret",
        ),
        (
            RAYSERVICE,
            lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"].pop(),
            "container ray-head lacks RAY_SERVE_ENABLE_HA_PROXY=1",
        ),
        (
            RAYSERVICE,
            serve_args(lambda a, c: a.update(api_keys="k1:write")),
            "args.api_keys writes keys into the manifest",
        ),
        (
            "kuberay/serve/kustomization.yaml",
            lambda d: d["secretGenerator"][0].update(name="qrag-keys"),
            "reads secret 'qrag-serve-keys', which nothing defines",
        ),
        # pods, images, versions, wiring
        (
            RAYCLUSTER,
            lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"][
                "limits"
            ].update({"nvidia.com/gpu": "2"}),
            "nvidia.com/gpu limit 2 != num-gpus 1",
        ),
        (
            RAYCLUSTER,
            lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": "4"}),
            "the head should declare num-cpus",
        ),
        (RAYCLUSTER, lambda d: d["spec"].update(rayVersion="2.59.0"), "rayVersion 2.59.0 != the image's Ray"),
        (
            RAYCLUSTER,
            lambda d: d["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0].update(
                image="rayproject/ray:2.60.0"
            ),
            "not the qrag image",
        ),
        (
            RAYCLUSTER,
            lambda d: d["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0]["env"][0].update(
                value="http://mlflow.qrag.svc.cluster.local:5001"
            ),
            "port 5001 is not a port of Service mlflow",
        ),
        (
            RAYCLUSTER,
            lambda d: d["spec"]["workerGroupSpecs"][1]["template"]["spec"]["volumes"][0][
                "persistentVolumeClaim"
            ].update(claimName="nope"),
            "claims 'nope'",
        ),
        (
            "mlflow/k8s/mlflow.yaml#1",
            lambda d: d["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"].update(
                key="PASSWORD"
            ),
            "reads key 'PASSWORD' that secret mlflow-secrets lacks",
        ),
        (
            "mlflow/k8s/mlflow.yaml#2",
            lambda d: d["spec"]["ports"][0].update(targetPort="web"),
            "targetPort 'web' is not a container port",
        ),
        (
            "mlflow/k8s/kustomization.yaml",
            lambda d: d["resources"].append("redis.yaml"),
            "resource redis.yaml does not exist",
        ),
        (
            "mlflow/k8s/kustomization.yaml",
            lambda d: d["secretGenerator"][0].update(name="MLflow_Secrets"),
            "secretGenerator MLflow_Secrets: metadata/name",
        ),
        (
            "mlflow/docker-compose.yaml",
            lambda d: d["services"]["mlflow"].update(ports=["5000:5000"]),
            "publish 5000:5000 on 127.0.0.1",
        ),
        (
            "cluster.yaml",
            lambda d: d["available_node_types"]["gpu_worker"]["resources"].update(CPU=4),
            "no node type with the resources of worker group gpu-workers",
        ),
        (
            "cluster.yaml",
            lambda d: d["available_node_types"]["cpu_worker"].update(max_worker=3),
            "'max_worker' was unexpected",
        ),
        ("runtime_env.yaml", lambda d: d["pip"]["packages"].remove("faiss-cpu>=1.8"), "missing ['faiss-cpu>=1.8']"),
        (
            "runtime_env.yaml",
            lambda d: d["env_vars"].update(TOKENIZERS_PARALLELISM="true"),
            "env_vars.TOKENIZERS_PARALLELISM=true but the image sets false",
        ),
        (
            "runtime_env.yaml",
            lambda d: d["env_vars"].update(HF_HUB_OFFLINE="1"),
            "env_vars.HF_HUB_OFFLINE switches the hub off for every job",
        ),
        (
            "cluster.yaml",
            lambda d: d["docker"]["run_options"].append("--env HF_HUB_OFFLINE=1"),
            "docker.run_options set HF_HUB_OFFLINE",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and "/" in v else None,
)
def test_a_broken_manifest_is_reported(infra, file, change, expected):
    path, _, index = file.partition("#")  # file#n: the n-th document of the file
    report = problems_after(infra / path, change, int(index or 0))
    assert expected in report, report


def test_dockerfile_checks(infra):
    dockerfile = infra / "docker" / "Dockerfile"
    text = dockerfile.read_text()
    dockerfile.write_text(
        text.replace("rayproject/ray:2.60.0-py311-cu128", "rayproject/ray:latest")
        .replace("COPY --chown=ray:users serve/ serve/", "COPY --chown=ray:users serve/ serve/\nCOPY bench/ bench/")
        .replace("USER ray\nWORKDIR", "WORKDIR")
    )
    report = "\n".join(validate.check_dockerfiles())
    assert "base image rayproject/ray:latest is not pinned" in report
    assert "COPY source bench/ is excluded" in report
    ignore = infra / "docker" / "Dockerfile.dockerignore"
    ignore.write_text(ignore.read_text().replace("!platform/\n", ""))
    dockerfile.write_text(text)
    assert "COPY source platform/ is excluded" in "\n".join(validate.check_dockerfiles())


def test_one_torch_pin_ray_pinned_and_faiss_extras_apart(tmp_path, monkeypatch):
    root = tmp_path / "root"
    for name in ("Makefile", "pyproject.toml", "infra/docker/Dockerfile", "infra/docker/install.sh"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, root / name)
    monkeypatch.setattr(validate, "ROOT", root)
    image = "rayproject/ray:2.60.0-py311-cu128"
    assert validate.check_pins(image) == []
    assert "does not admit the image's Ray 2.61.0" in "\n".join(
        validate.check_pins("rayproject/ray:2.61.0-py311-cu128")
    )
    makefile = root / "Makefile"
    makefile.write_text(makefile.read_text().replace("TORCH_SPEC ?= torch==2.13.0", "TORCH_SPEC ?= torch==2.12.0"))
    assert "torch pins disagree" in "\n".join(validate.check_pins(image))
    pyproject = root / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace('faiss = ["faiss-cpu>=1.8"]', 'faiss = ["faiss-cpu>=1.8", "faiss-gpu-cu12>=1.8"]')
    )
    assert "FAISS wheels overwrite each other" in "\n".join(validate.check_pins(image))


def test_tested_versions_agree_with_the_project_and_the_mlflow_image(tmp_path, monkeypatch):
    root = tmp_path / "root"
    for name in (*validate.CONSTRAINT_FILES, "pyproject.toml", "infra/mlflow/Dockerfile"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, root / name)
    monkeypatch.setattr(validate, "ROOT", root)
    monkeypatch.setattr(validate, "INFRA", root / "infra")
    assert validate.check_constraints() == []
    client = validate.constraint_pins(root / "constraints/qrag.txt")["mlflow-skinny"]
    assert re.search(rf"^ARG MLFLOW_VERSION={re.escape(client)}$", (ROOT / "infra/mlflow/Dockerfile").read_text(), re.M)

    def planted(name: str, old: str, new: str) -> str:
        path = root / name
        text = path.read_text()
        assert old in text, (name, old)
        path.write_text(text.replace(old, new))
        problems = "\n".join(validate.check_constraints())
        path.write_text(text)
        return problems

    server = f"mlflow=={client}\n"
    assert "must equal the client's mlflow-skinny" in planted(
        "constraints/mlflow-server.txt", server, "mlflow==0.0.1\n"
    )
    assert "MLFLOW_VERSION 0.0.1" in planted(
        "infra/mlflow/Dockerfile", f"MLFLOW_VERSION={client}", "MLFLOW_VERSION=0.0.1"
    )
    ray = next(line for line in (root / "constraints/qrag.txt").read_text().splitlines() if line.startswith("ray=="))
    assert "ray==2.61.0 is outside" in planted("constraints/qrag.txt", ray + "\n", "ray==2.61.0\n")
    assert "pins torch" in planted("constraints/qrag.txt", ray + "\n", ray + "\ntorch==2.13.0\n")
    with pytest.raises(ValueError, match=r"qrag.txt:\d+: 'ray>=2' is not name==version"):
        (root / "constraints/qrag.txt").write_text("ray>=2\n")
        validate.check_constraints()


def test_make_installs_the_tested_versions_unless_told_not_to(tmp_path):
    def dry_run(*overrides: str) -> list[str]:
        venv = tmp_path / "venv"  # absent: make plans the whole install
        out = subprocess.run(
            ["make", "-n", f"VENV={venv}", *overrides, "install", "mlflow-server"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [line for line in out.splitlines() if "pip install" in line]

    pinned = dry_run()
    project = next(line for line in pinned if "-e '.[dev]'" in line)
    assert "-c constraints/qrag.txt" in project
    server = [line for line in pinned if "mlflow-server/bin/pip" in line]
    assert len(server) == 2 and all("-c constraints/mlflow-server.txt" in line for line in server)
    assert not any("-c " in line for line in pinned if "torch==" in line)  # TORCH_SPEC picks the build
    assert not any("-c " in line for line in dry_run("CONSTRAINTS=")), "CONSTRAINTS= must install the newest releases"


def test_dockerignore_rules_follow_docker():
    rules = ["**", "!platform/", "**/__pycache__/"]
    assert not validate.dockerignore_excludes(rules, "platform")
    assert not validate.dockerignore_excludes(rules, "platform/qrag/config.py")
    assert validate.dockerignore_excludes(rules, "platform/qrag/__pycache__/x.pyc")
    assert validate.dockerignore_excludes(rules, ".venv/bin/python")


def test_dockerfile_parser_joins_continuations(tmp_path):
    f = tmp_path / "Dockerfile"
    f.write_text('# c\nFROM a:1\nENV A=1 \\\n    # inner comment\n    B=2\nCOPY ["x y", "/z"]\n')
    ins = validate.dockerfile_instructions(f)
    assert [(i.op, i.line) for i in ins] == [("FROM", 2), ("ENV", 3), ("COPY", 6)]
    assert ins[1].args.split() == ["A=1", "B=2"]
    assert validate.copy_sources(ins[2]) == ["x y"]


def test_scripts_are_checked(infra):
    (infra / "mlflow" / "server.sh").write_text("#!/usr/bin/env bash\nif then fi\n")
    assert "server.sh" in "\n".join(validate.check_scripts())


# -- placement arithmetic (qrag.distributed.placement) --------------------------------------------


def test_shard_fractions_spread_one_shard_per_gpu_in_every_order():
    from qrag.distributed.placement import gpu_plan_problems, shard_gpu_fraction

    assert shard_gpu_fraction(2, 2, reserved=0.4) == pytest.approx(0.6)
    assert shard_gpu_fraction(4, 2, reserved=0.2) == pytest.approx(0.4)  # two per GPU, never three
    assert shard_gpu_fraction(3, 0) == 0.0
    with pytest.raises(ValueError, match="reserve at most"):
        shard_gpu_fraction(2, 2, reserved=0.6)
    assert gpu_plan_problems(2, 0.6, 2, {"encoder": 0.2, "learner": 0.2}) == []
    assert "share one GPU" in gpu_plan_problems(2, 0.5, 2, {"encoder": 0.2})[0]
    assert "placement order" in gpu_plan_problems(2, 0.6, 2, {"encoder": 0.4, "learner": 0.2})[0]

    # Every order Ray could place them in, with its best-fit choice of GPU: shards never share.
    import itertools

    def place(order, gpus=2):
        free = [1.0] * gpus
        where = {}
        for name, need in order:
            fits = [i for i in range(gpus) if free[i] + 1e-9 >= need]
            if not fits:
                return None
            i = min(fits, key=lambda j: (free[j], j))
            free[i] -= need
            where[name] = i
        return where

    items = [("shard0", 0.6), ("shard1", 0.6), ("encoder", 0.2), ("learner", 0.2)]
    for order in itertools.permutations(items):
        where = place(order)
        assert where is not None and where["shard0"] != where["shard1"], order


def test_resource_maps_are_checked():
    from qrag.config import ConfigError, load_config
    from qrag.distributed.placement import check_cluster_has, check_resource_map, learner_worker_resources

    assert check_resource_map("k", {"qrag_cpu_node": 0.001}) == {"qrag_cpu_node": 0.001}
    for bad, message in [
        ({"CPU": 1}, "not a custom resource"),
        ({"x": 0}, "positive"),
        ({"x": 1.5}, "only up to 1"),
        ({"": 1}, "non-empty"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_resource_map("k", bad)
    cfg = load_config(
        None,
        [
            "distributed.runner_resources={qrag_cpu_node: 0.001}",
            "distributed.learner_gpus=0.25",
            "distributed.learner_resources={'accelerator_type:A10G': 0.001}",
        ],
    )
    assert learner_worker_resources(cfg, True) == {"CPU": 1.0, "GPU": 0.25, "accelerator_type:A10G": 0.001}
    assert learner_worker_resources(cfg, False) == {"CPU": 1.0, "accelerator_type:A10G": 0.001}
    with pytest.raises(ConfigError, match="'qrag_cpu_node' but the Ray cluster has 0"):
        check_cluster_has(cfg, {"CPU": 8, "accelerator_type:A10G": 1})
    check_cluster_has(cfg, {"CPU": 8, "qrag_cpu_node": 1000, "accelerator_type:A10G": 1})
    with pytest.raises(ConfigError, match="learner_gpus"):
        learner_worker_resources(load_config(None, ["distributed.learner_gpus=1.5"]), True)


def test_the_job_asks_ray_for_what_the_config_says():
    """train.learner_resources (the job's preflight) now carries the placement fields."""
    from qrag.config import ConfigError, load_config
    from qrag.distributed.train import learner_resources

    cfg = load_config(
        None,
        [
            "distributed.learner_gpus=0.2",
            "distributed.runners=2",
            "distributed.runner_resources={qrag_cpu_node: 0.001}",
        ],
    )
    assert learner_resources(cfg, {"CPU": 8, "GPU": 2, "qrag_cpu_node": 1000}) == (True, {"CPU": 1.0, "GPU": 0.2})
    with pytest.raises(ConfigError, match="qrag_cpu_node"):
        learner_resources(cfg, {"CPU": 8, "GPU": 2})
