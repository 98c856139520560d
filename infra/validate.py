"""Check infra/ before applying it, without a cluster.

* Schemas: every Kubernetes, KubeRay, kustomize and Compose document against the JSON Schemas
  kept in infra/schemas/; infra/cluster.yaml against Ray's own cluster-launcher schema; the
  RayService's Serve config against Ray Serve's config schema.
* The project: the RayJob's entrypoint script, preset and overrides load as a qrag config; the
  resources it asks of Ray fit the worker groups (the job's own preflight functions decide);
  the RayService runs serve/config.yaml's application with valid args, a checkpoint where the
  RayJob writes it and GPU fractions that spread shards one per GPU; images, Ray versions, node
  types, paths, volumes, secrets and services agree across files; the Dockerfiles copy what
  exists and pin their bases; the runtime_env mirrors pyproject.toml.

    python infra/validate.py          # one line per problem, exit code 1 if there is any

tests/test_infra_manifests.py runs the same checks in CI.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import yaml

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
SCHEMAS = INFRA / "schemas"
IMAGE_ROOT = PurePosixPath("/opt/qrag")  # the repository root inside the qrag image (Dockerfile WORKDIR)
IMAGE_NAME = "qrag"  # the image's name in manifests; kustomizations map it to a registry
sys.path.insert(0, str(ROOT / "platform"))

SCHEMA_IDS = {
    ("v1", "Namespace"): "urn:qrag:schemas:v1/Namespace",
    ("v1", "PersistentVolumeClaim"): "urn:qrag:schemas:v1/PersistentVolumeClaim",
    ("v1", "Secret"): "urn:qrag:schemas:v1/Secret",
    ("v1", "Service"): "urn:qrag:schemas:v1/Service",
    ("apps/v1", "Deployment"): "urn:qrag:schemas:apps/v1/Deployment",
    ("ray.io/v1", "RayCluster"): "urn:qrag:schemas:ray.io/v1/RayCluster",
    ("ray.io/v1", "RayJob"): "urn:qrag:schemas:ray.io/v1/RayJob",
    ("ray.io/v1", "RayService"): "urn:qrag:schemas:ray.io/v1/RayService",
    (
        "kustomize.config.k8s.io/v1beta1",
        "Kustomization",
    ): "urn:qrag:schemas:kustomize.config.k8s.io/v1beta1/Kustomization",
}
COMPOSE_SCHEMA = "urn:qrag:schemas:compose"
K8S_DIRS = ("kuberay", "mlflow/k8s")


# -- loading ------------------------------------------------------------------------------------


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@dataclass
class Doc:
    """One YAML document of a manifest file."""

    path: Path
    index: int
    body: dict[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return self.body.get("apiVersion", ""), self.body.get("kind", "")

    @property
    def name(self) -> str:
        return (self.body.get("metadata") or {}).get("name", "")

    @property
    def where(self) -> str:
        return f"{rel(self.path)}#{self.index} {self.key[1]}/{self.name}"


def read_docs(path: Path) -> list[Doc]:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    for i, d in enumerate(docs):
        if not isinstance(d, dict):
            raise ValueError(f"{rel(path)}#{i}: a manifest must be a mapping")
    return [Doc(path, i, d) for i, d in enumerate(docs)]


def k8s_files() -> list[Path]:
    return sorted(p for d in K8S_DIRS for p in (INFRA / d).rglob("*.yaml"))


@cache
def k8s_docs() -> tuple[Doc, ...]:
    return tuple(d for p in k8s_files() for d in read_docs(p))


def docs_of(kind: str) -> list[Doc]:
    return [d for d in k8s_docs() if d.key[1] == kind]


def one(kind: str) -> Doc:
    found = docs_of(kind)
    if len(found) != 1:
        raise LookupError(f"expected one {kind} under infra/, found {len(found)}")
    return found[0]


# -- schemas ------------------------------------------------------------------------------------


@cache
def registry():
    from referencing import Registry, Resource

    resources = []
    for path in sorted(SCHEMAS.glob("*.schema.json")):
        schema = json.loads(path.read_text(encoding="utf-8"))
        resources.append((schema["$id"], Resource.from_contents(schema)))
    return Registry().with_resources(resources)


def schema_errors(body: Any, schema_id: str, where: str) -> list[str]:
    from jsonschema import Draft202012Validator

    schema = registry().contents(schema_id)
    validator = Draft202012Validator(schema, registry=registry())
    out = []
    for err in sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path)):
        at = "/".join(str(p) for p in err.absolute_path) or "(top)"
        out.append(f"{where}: {at}: {err.message}")
    return out


def check_schemas() -> list[str]:
    problems = []
    for doc in k8s_docs():
        schema_id = SCHEMA_IDS.get(doc.key)
        if schema_id is None:
            problems.append(
                f"{doc.where}: no schema for apiVersion {doc.key[0]!r} kind {doc.key[1]!r} in infra/schemas/"
            )
        else:
            problems += schema_errors(doc.body, schema_id, doc.where)
    compose = INFRA / "mlflow" / "docker-compose.yaml"
    problems += schema_errors(yaml.safe_load(compose.read_text()), COMPOSE_SCHEMA, rel(compose))
    problems += cluster_launcher_schema_errors()
    for where, config in serve_configs():
        problems += serve_config_errors(config, where)
    return problems


def cluster_launcher_schema_errors() -> list[str]:
    """Ray's own schema for `ray up` files (shipped inside the ray package)."""
    import jsonschema
    import ray

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load((INFRA / "cluster.yaml").read_text())
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"infra/cluster.yaml: {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in validator.iter_errors(config)
    ]


def serve_configs() -> list[tuple[str, dict]]:
    """(where, Serve config) of serve/config.yaml and of every RayService."""
    out = [("serve/config.yaml", yaml.safe_load((ROOT / "serve" / "config.yaml").read_text()))]
    for doc in docs_of("RayService"):
        out.append((f"{doc.where} serveConfigV2", yaml.safe_load(doc.body["spec"]["serveConfigV2"])))
    return out


def serve_config_errors(config: Any, where: str) -> list[str]:
    """Ray Serve's ServeDeploySchema, plus unknown keys (the schema itself ignores them)."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(config)
    except ValidationError as exc:
        return [f"{where}: {e['loc']}: {e['msg']}" for e in exc.errors()]
    problems = [f"{where}: unknown key {k!r}" for k in sorted(set(config) - set(ServeDeploySchema.model_fields))]
    for i, app in enumerate(config.get("applications") or []):
        problems += [
            f"{where}: applications[{i}]: unknown key {k!r}"
            for k in sorted(set(app) - set(ServeApplicationSchema.model_fields))
        ]
        problems += deployment_options(app, f"{where}: applications[{i}]")[1]
    return problems


# -- kustomize, references between manifests ------------------------------------------------------


def kustomizations() -> list[Doc]:
    return docs_of("Kustomization")


def env_file_keys(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value
    return out


def generated_secrets() -> dict[str, set[str]]:
    """Secret name -> keys, from every secretGenerator (keys read from the committed .example)."""
    out: dict[str, set[str]] = {}
    for k in kustomizations():
        for gen in k.body.get("secretGenerator") or []:
            keys = set()
            for env in gen.get("envs") or []:
                example = k.path.parent / f"{env}.example"
                if example.is_file():
                    keys |= set(env_file_keys(example))
            keys |= {lit.split("=", 1)[0] for lit in gen.get("literals") or []}
            out[gen["name"]] = keys
    return out


def check_kustomizations() -> list[str]:
    problems = []
    listed: set[Path] = set()
    namespaces = set()
    for k in kustomizations():
        base = k.path.parent
        namespaces.add(k.body.get("namespace"))
        for res in k.body.get("resources") or []:
            target = (base / res).resolve()
            if not target.is_file():
                problems.append(f"{k.where}: resource {res} does not exist")
            listed.add(target)
        used = {
            c.get("image", "").split(":")[0]
            for r in k.body.get("resources") or []
            if (base / r).is_file()
            for d in read_docs(base / r)
            for c in containers(d.body)
        }
        for image in k.body.get("images") or []:
            if image["name"] not in used:
                problems.append(
                    f"{k.where}: images entry {image['name']!r} matches no container image of its resources"
                )
        for gen in k.body.get("secretGenerator") or []:
            for env in gen.get("envs") or []:
                if not (base / f"{env}.example").is_file():
                    problems.append(
                        f"{k.where}: secretGenerator {gen['name']} reads {env}: commit {env}.example beside it"
                    )
            # The Secret kustomize will generate, from the committed example's keys.
            secret = {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": gen["name"]},
                "type": gen.get("type", "Opaque"),
                "stringData": {key: "" for key in generated_secrets().get(gen["name"], set())},
            }
            problems += schema_errors(secret, SCHEMA_IDS[("v1", "Secret")], f"{k.where} secretGenerator {gen['name']}")
    for path in k8s_files():
        if path.name != "kustomization.yaml" and path.resolve() not in listed:
            problems.append(f"{rel(path)}: not listed in any kustomization.yaml")
    if len(namespaces) != 1:
        problems.append(f"kustomizations disagree on the namespace: {sorted(map(str, namespaces))}")
    return problems


def pod_templates(body: dict) -> Iterator[tuple[str, dict]]:
    """(label, PodTemplateSpec) of a Deployment, RayCluster, RayJob or RayService."""
    spec = body.get("spec") or {}
    if body.get("kind") == "Deployment":
        yield "template", spec.get("template") or {}
    cluster = (
        spec.get("rayClusterConfig")
        or spec.get("rayClusterSpec")
        or (spec if body.get("kind") == "RayCluster" else None)
    )
    if cluster:
        yield "head", (cluster.get("headGroupSpec") or {}).get("template") or {}
        for g in cluster.get("workerGroupSpecs") or []:
            yield g.get("groupName", "?"), g.get("template") or {}


def containers(body: dict) -> Iterator[dict]:
    for _, template in pod_templates(body):
        yield from (template.get("spec") or {}).get("containers") or []


def check_references() -> list[str]:
    """Volumes, claims, secrets, env references, Service selectors and ports."""
    problems = []
    claims = {d.name for d in docs_of("PersistentVolumeClaim")}
    secrets = generated_secrets() | {
        d.name: set((d.body.get("stringData") or {}) | (d.body.get("data") or {})) for d in docs_of("Secret")
    }
    pods: list[tuple[Doc, dict]] = []
    for doc in k8s_docs():
        for label, template in pod_templates(doc.body):
            where = f"{doc.where} ({label})"
            spec = template.get("spec") or {}
            pods.append((doc, template))
            volumes = {v["name"]: v for v in spec.get("volumes") or []}
            for v in volumes.values():
                claim = (v.get("persistentVolumeClaim") or {}).get("claimName")
                if claim and claim not in claims:
                    problems.append(
                        f"{where}: volume {v['name']} claims {claim!r}, which no manifest under infra/ defines"
                    )
            for c in spec.get("containers") or []:
                for m in c.get("volumeMounts") or []:
                    if m["name"] not in volumes:
                        problems.append(
                            f"{where}: container {c['name']} mounts volume {m['name']!r}, which the pod does not define"
                        )
                defined: set[str] = set()
                for e in c.get("env") or []:
                    ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                    if ref and not ref.get("optional"):
                        if ref["name"] not in secrets:
                            problems.append(
                                f"{where}: env {e['name']} reads secret {ref['name']!r}, which nothing defines"
                            )
                        elif ref["key"] not in secrets[ref["name"]]:
                            problems.append(
                                f"{where}: env {e['name']} reads key {ref['key']!r} that secret {ref['name']} lacks"
                            )
                    for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value") or ""):
                        if var not in defined:
                            problems.append(f"{where}: env {e['name']} uses $({var}) before it is defined")
                    defined.add(e["name"])
    for doc in docs_of("Deployment"):
        selector = doc.body["spec"]["selector"].get("matchLabels") or {}
        labels = (doc.body["spec"]["template"].get("metadata") or {}).get("labels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            problems.append(f"{doc.where}: selector {selector} does not match the pod labels {labels}")
    for svc in docs_of("Service"):
        selector = svc.body["spec"].get("selector") or {}
        matched = [
            t
            for _, t in pods
            if selector
            and all(((t.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items())
        ]
        if not matched:
            problems.append(f"{svc.where}: selector {selector} matches no pod template under infra/")
            continue
        names = {p.get("name") for t in matched for c in t["spec"]["containers"] for p in c.get("ports") or []}
        numbers = {p["containerPort"] for t in matched for c in t["spec"]["containers"] for p in c.get("ports") or []}
        for port in svc.body["spec"].get("ports") or []:
            target = port.get("targetPort", port["port"])
            if target not in (names if isinstance(target, str) else numbers):
                problems.append(f"{svc.where}: targetPort {target!r} is not a container port of the pods it selects")
    return problems


# -- Ray clusters ---------------------------------------------------------------------------------


def start_param_resources(params: dict[str, str]) -> dict[str, float]:
    """The custom resources in rayStartParams (KubeRay's quoted-JSON form)."""
    raw = params.get("resources")
    if raw is None:
        return {}
    text = raw.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1].replace('\\"', '"')
    return {k: float(v) for k, v in json.loads(text).items()}


@dataclass
class Group:
    """A Ray node type as Ray sees it: logical resources and autoscaling bounds."""

    name: str
    cpus: float
    gpus: float
    custom: dict[str, float]
    min: int
    max: int

    def resources(self) -> dict[str, float]:
        out = {"CPU": self.cpus, **self.custom}
        if self.gpus:
            out["GPU"] = self.gpus
        return out


def ray_groups(cluster: dict) -> tuple[Group, list[Group]]:
    """(head, workers) of a RayClusterSpec."""

    def group(name: str, params: dict, lo: int, hi: int) -> Group:
        return Group(
            name,
            float(params.get("num-cpus", "nan")),
            float(params.get("num-gpus", 0)),
            start_param_resources(params),
            lo,
            hi,
        )

    head = group("head", cluster["headGroupSpec"].get("rayStartParams") or {}, 1, 1)
    workers = [
        group(g["groupName"], g.get("rayStartParams") or {}, g["minReplicas"], g["maxReplicas"])
        for g in cluster.get("workerGroupSpecs") or []
    ]
    return head, workers


def resources_at_min(cluster: dict) -> dict[str, float]:
    """What ray.cluster_resources() shows once the minimum replicas are up."""
    head, workers = ray_groups(cluster)
    total: dict[str, float] = {}
    for g, count in [(head, 1)] + [(w, w.min) for w in workers]:
        for k, v in g.resources().items():
            total[k] = total.get(k, 0.0) + v * count
    return total


def resources_at_max(cluster: dict) -> dict[str, float]:
    """What an autoscaling cluster can grow to: the head and every worker group at maxReplicas."""
    head, workers = ray_groups(cluster)
    total: dict[str, float] = {}
    for g, count in [(head, 1)] + [(w, w.max) for w in workers]:
        for k, v in g.resources().items():
            total[k] = total.get(k, 0.0) + v * count
    return total


def check_autoscale_limits() -> list[str]:
    """An autoscaling RayCluster tells job drivers its maximum (QRAG_AUTOSCALE_TO on the head,
    read by qrag.distributed.placement.cluster_capacity); the cluster launcher says the same."""
    problems = []
    for doc in docs_of("RayCluster"):
        spec = doc.body["spec"]
        if not spec.get("enableInTreeAutoscaling"):
            continue
        want = resources_at_max(spec)
        head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in head.get("env") or []}
        try:
            have = {k: float(v) for k, v in json.loads(env.get("QRAG_AUTOSCALE_TO") or "null").items()}
        except (ValueError, AttributeError):
            have = None
        if have != want:
            problems.append(
                f"{doc.where}: the head's QRAG_AUTOSCALE_TO {env.get('QRAG_AUTOSCALE_TO')} "
                f"!= the groups at maxReplicas {want}"
            )
        options = " ".join(yaml.safe_load((INFRA / "cluster.yaml").read_text())["docker"].get("run_options") or [])
        found = re.search(r"QRAG_AUTOSCALE_TO='([^']*)'", options)
        if not found or {k: float(v) for k, v in json.loads(found.group(1)).items()} != want:
            problems.append(
                f"infra/cluster.yaml: docker.run_options QRAG_AUTOSCALE_TO != the RayCluster's maximum {want}"
            )
    return problems


def ray_cluster_specs() -> list[tuple[str, dict]]:
    out = [(d.where, d.body["spec"]) for d in docs_of("RayCluster")]
    out += [(d.where, d.body["spec"]["rayClusterConfig"]) for d in docs_of("RayService")]
    out += [
        (d.where, d.body["spec"]["rayClusterSpec"]) for d in docs_of("RayJob") if "rayClusterSpec" in d.body["spec"]
    ]
    return out


def _quantity(value: Any) -> float:
    text = str(value)
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(text)


def check_ray_groups() -> list[str]:
    """Pods ask Kubernetes for what their Ray node declares; the head runs no tasks."""
    problems = []
    for where, cluster in ray_cluster_specs():
        head, workers = ray_groups(cluster)
        if head.cpus != 0:
            problems.append(
                f'{where}: the head should declare num-cpus "0" (no tasks or actors beside GCS and drivers)'
            )
        groups = [(cluster["headGroupSpec"], head)] + list(zip(cluster.get("workerGroupSpecs") or [], workers))
        for spec, g in groups:
            if g.cpus != g.cpus:  # NaN: not declared
                problems.append(f"{where} ({g.name}): declare num-cpus in rayStartParams (Ray would take the node's)")
                continue
            if not g.min <= spec.get("replicas", g.min) <= g.max:
                problems.append(f"{where} ({g.name}): replicas {spec.get('replicas')} outside [{g.min}, {g.max}]")
            pod = spec["template"]["spec"]
            ray_container = pod["containers"][0]
            limits = (ray_container.get("resources") or {}).get("limits") or {}
            if g.cpus and _quantity(limits.get("cpu", 0)) != g.cpus:
                problems.append(f"{where} ({g.name}): cpu limit {limits.get('cpu')} != num-cpus {g.cpus:g}")
            if _quantity(limits.get("nvidia.com/gpu", 0)) != g.gpus:
                problems.append(
                    f"{where} ({g.name}): nvidia.com/gpu limit {limits.get('nvidia.com/gpu', 0)} != num-gpus {g.gpus:g}"
                )
            if not any(
                v.get("emptyDir", {}).get("medium") == "Memory"
                and any(
                    m["mountPath"] == "/dev/shm" and m["name"] == v["name"]
                    for m in ray_container.get("volumeMounts") or []
                )
                for v in pod.get("volumes") or []
            ):
                problems.append(f"{where} ({g.name}): mount a memory emptyDir at /dev/shm (Ray's object store)")
    return problems


def shared_mounts(template: dict) -> set[str]:
    return {m["mountPath"] for c in template["spec"]["containers"] for m in c.get("volumeMounts") or []}


def under(path: str, mounts: set[str]) -> bool:
    return any(PurePosixPath(path).is_relative_to(m) for m in mounts if m != "/dev/shm")


def image_path(path: str) -> Path | None:
    """A path inside the qrag image -> the repository file it comes from."""
    p = PurePosixPath(path)
    return ROOT / p.relative_to(IMAGE_ROOT) if p.is_relative_to(IMAGE_ROOT) else None


@dataclass
class JobPlan:
    cfg: Any
    base_dir: str
    run_dir: str
    config_file: Path


def rayjob_plan(doc: Doc) -> JobPlan:
    """The RayJob's entrypoint parsed with the job's own parser and loaded as a qrag config."""
    from qrag.config import load_config
    from qrag.distributed.job import build_parser

    argv = shlex.split(doc.body["spec"]["entrypoint"])
    if len(argv) < 2 or argv[0] not in ("python", "python3"):
        raise ValueError(f"{doc.where}: the entrypoint should be `python <script> ...`, got {argv[:2]}")
    script = image_path(argv[1])
    if script is None or not script.is_file():
        raise ValueError(f"{doc.where}: entrypoint script {argv[1]} is not a file of the project (under {IMAGE_ROOT})")
    args = build_parser(str(script), script.name).parse_args(argv[2:])
    config_file = image_path(args.config)
    if config_file is None or not config_file.is_file():
        raise ValueError(f"{doc.where}: --config {args.config} is not a file of the project (under {IMAGE_ROOT})")
    cfg = load_config(config_file, args.overrides)
    base = args.base_dir or "/"
    out_dir = (
        cfg.out_dir if cfg.out_dir.startswith("/") or "://" in cfg.out_dir else str(PurePosixPath(base) / cfg.out_dir)
    )
    return JobPlan(cfg, base, f"{out_dir.rstrip('/')}/{cfg.name}", config_file)


def check_rayjob() -> list[str]:
    from qrag.config import ConfigError
    from qrag.distributed.train import learner_resources

    problems = []
    clusters = {d.name: d for d in docs_of("RayCluster")}
    for doc in docs_of("RayJob"):
        try:
            plan = rayjob_plan(doc)
        except (ValueError, ConfigError, SystemExit) as exc:
            problems.append(f"{doc.where}: {exc}")
            continue
        spec = doc.body["spec"]
        target = (spec.get("clusterSelector") or {}).get("ray.io/cluster")
        if target is not None and target not in clusters:
            problems.append(f"{doc.where}: clusterSelector names RayCluster {target!r}, which infra/ does not define")
            continue
        cluster = clusters[target].body["spec"] if target else spec["rayClusterSpec"]
        head_template = cluster["headGroupSpec"]["template"]
        if not under(plan.base_dir, shared_mounts(head_template)):
            problems.append(
                f"{doc.where}: --base-dir {plan.base_dir} is not on a volume of the head pod (the driver runs there)"
            )
        problems += [f"{doc.where}: {p}" for p in placement_problems(plan.cfg, cluster)]
        try:  # what the job itself checks before any actor starts, against the minimum cluster
            learner_resources(plan.cfg, resources_at_min(cluster))
        except ConfigError as exc:
            problems.append(f"{doc.where}: at minReplicas the job would stop: {exc}")
    return problems


def placement_problems(cfg: Any, cluster: dict) -> list[str]:
    """Runners on CPU groups only, the learner on a group that holds it."""
    from qrag.config import ConfigError
    from qrag.distributed.placement import learner_worker_resources, runner_resources

    d = cfg.distributed
    _, workers = ray_groups(cluster)
    try:
        wanted = runner_resources(cfg)
        learner = learner_worker_resources(cfg, use_gpu=d.learner_gpu is not False and any(w.gpus for w in workers))
    except ConfigError as exc:
        return [str(exc)]
    problems = []
    if d.runners:
        hosts = [w for w in workers if all(w.custom.get(k, 0) >= v for k, v in wanted.items())]
        if not wanted:
            problems.append(
                "distributed.runner_resources is empty: EpisodeFeeders may land on GPU nodes; "
                "pin them to the CPU group's marker"
            )
        if any(w.gpus for w in hosts):
            problems.append(
                f"EpisodeFeeders may be placed on GPU groups {[w.name for w in hosts if w.gpus]}: "
                "give the CPU group a marker resource only it declares"
            )
        capacity = sum(w.cpus * w.min for w in hosts if not w.gpus)
        if d.runners * d.runner_cpus > capacity:
            problems.append(
                f"{d.runners} runners x {d.runner_cpus:g} CPUs > {capacity:g} CPUs of the runner groups at minReplicas"
            )
    fits = [w for w in workers if all(w.resources().get(k, 0) >= v for k, v in learner.items())]
    if not fits:
        problems.append(f"no worker group can hold the learner {learner}")
    return problems


def serve_access_problems(body: dict, c: Any, where: str) -> list[str]:
    """A RayService listens on 0.0.0.0: the app refuses to start there without API keys, which
    come from a Secret as $QRAG_API_KEYS on every pod (never written into the manifest)."""
    if c.api_keys:
        return [
            f"{where}: args.api_keys writes keys into the manifest; give the pods QRAG_API_KEYS from a Secret instead"
        ]
    if c.allow_unauthenticated:
        return []
    lacking = [
        label
        for label, template in pod_templates(body)
        if not any(
            e.get("name") == "QRAG_API_KEYS" and (e.get("valueFrom") or {}).get("secretKeyRef")
            for ct in (template.get("spec") or {}).get("containers") or []
            for e in ct.get("env") or []
        )
    ]
    return (
        [
            f"{where}: pods {', '.join(lacking)} have no QRAG_API_KEYS from a Secret: "
            "the app would refuse to start on 0.0.0.0 "
            f"without API keys"
        ]
        if lacking
        else []
    )


def deployment_options(app: dict, where: str) -> tuple[dict[str, dict], list[str]]:
    """An application's ``deployments:`` as {name: options}, and its problems: a name the app
    does not have (with the shard deployments of its args), keys or values Serve's schemas refuse
    (qrag.distributed.serving.deployment_overrides, what `qrag serve --config` checks too)."""
    from qrag.config import ConfigError
    from qrag.distributed.serving import deployment_overrides
    from qrag.serving.service_config import ServeConfig

    d = (app.get("args") or {}).get("shard_deployments", ServeConfig.shard_deployments)
    try:
        return deployment_overrides(
            app.get("deployments"), d if isinstance(d, int) else ServeConfig.shard_deployments
        ), []
    except ConfigError as exc:
        return {}, [f"{where}: {p}" for p in str(exc).split("; ")]


def deployment_problems(app: dict, c: Any, gpus: int, gpus_max: int, where: str) -> list[str]:
    """GPUs (deployments: ray_actor_options) for the roles that run on CUDA: the Ingress holds the
    encoder (and, with shard_deployments 0, every shard); Shard deployments spread one per GPU in
    every start order, with the Ingress at its autoscaling minimum and maximum."""
    from qrag.distributed.placement import gpu_plan_problems
    from qrag.distributed.serving import INGRESS, shard_name

    options, invalid = deployment_options(app, where)
    if invalid:
        return []  # check_schemas reports them
    problems: list[str] = []

    def gpus_of(name: str) -> float | None:
        actor = options.get(name, {}).get("ray_actor_options")
        return None if actor is None else float(actor.get("num_gpus", 0) or 0)

    def replicas(name: str, at: str) -> int:
        opts = options.get(name, {})
        auto = opts.get("autoscaling_config")
        if auto:
            return int(auto.get(f"{at}_replicas", 1))
        return int(opts.get("num_replicas") or 1)

    shards = [shard_name(i) for i in range(c.shard_deployments)]
    ingress_cuda = c.encoder_device.startswith("cuda") or (not shards and c.shard_device.startswith("cuda"))
    needs = ([INGRESS] if ingress_cuda else []) + (shards if c.shard_device.startswith("cuda") else [])
    no_gpu = [n for n in needs if gpus_of(n) == 0]
    if no_gpu:
        problems.append(
            f"{where}: {', '.join(no_gpu)} run on CUDA "
            f"(encoder_device {c.encoder_device}, shard_device {c.shard_device}) "
            "but ask Ray for no GPU (deployments: ray_actor_options.num_gpus)"
        )
    if not gpus:
        return problems
    if not shards:  # the Ingress replicas share the GPUs, replicas_per_gpu to one unless told otherwise
        share = gpus_of(INGRESS) if gpus_of(INGRESS) is not None else 1.0 / max(1, c.replicas_per_gpu)
        at_min, at_max = share * replicas(INGRESS, "min"), share * replicas(INGRESS, "max")
        if at_min > gpus + 1e-9:
            problems.append(f"{where}: deployments ask for more GPUs than the {gpus} of the GPU workers at minReplicas")
        if at_max > gpus_max + 1e-9:
            problems.append(
                f"{where}: at {INGRESS} max_replicas the deployments ask for {at_max:g} GPUs, more than the {gpus_max} "
                "of the GPU workers at maxReplicas"
            )
        return problems
    unset = [n for n in [INGRESS, *shards] if gpus_of(n) is None]
    if unset:
        return problems + [
            f"{where}: set ray_actor_options.num_gpus of {', '.join(unset)} under deployments: "
            "(the defaults pack every shard on one GPU)"
        ]
    shard_gpus = {gpus_of(n) for n in shards}
    if len(shard_gpus) > 1:
        return problems + [f"{where}: give every shard deployment the same num_gpus (got {sorted(shard_gpus)})"]
    per_shard = shard_gpus.pop()
    shard_replicas = sum(replicas(n, "min") for n in shards)
    # Every start order at the minimum (shards and the Ingress's min_replicas on the GPU workers'
    # minReplicas); scaled up, the Ingress's extra replicas take the GPU the shards leave, and the
    # autoscaler adds GPU workers up to maxReplicas for anything left pending.
    others = {"ingress": gpus_of(INGRESS) * replicas(INGRESS, "min")}
    problems += [f"{where}: {p}" for p in gpu_plan_problems(shard_replicas, per_shard, gpus, others)]
    if shard_replicas * per_shard + others["ingress"] > gpus + 1e-9:
        problems.append(f"{where}: deployments ask for more GPUs than the {gpus} of the GPU workers at minReplicas")
    at_max = shard_replicas * per_shard + gpus_of(INGRESS) * replicas(INGRESS, "max")
    if at_max > gpus_max + 1e-9:
        problems.append(
            f"{where}: at {INGRESS} max_replicas the deployments ask for {at_max:g} GPUs, more than the {gpus_max} "
            "of the GPU workers at maxReplicas"
        )
    return problems


def check_rayservice() -> list[str]:
    from qrag.config import ConfigError, from_dict
    from qrag.serving.service_config import ServeConfig

    problems = []
    reference = yaml.safe_load((ROOT / "serve" / "config.yaml").read_text())["applications"][0]
    jobs = [rayjob_plan(d) for d in docs_of("RayJob")]
    for doc in docs_of("RayService"):
        serve_cfg = yaml.safe_load(doc.body["spec"]["serveConfigV2"])
        cluster = doc.body["spec"]["rayClusterConfig"]
        mounts = set.intersection(*(shared_mounts(t) for _, t in pod_templates(doc.body)))
        _, workers = ray_groups(cluster)
        gpus = int(sum(w.gpus * w.min for w in workers))
        gpus_max = int(sum(w.gpus * w.max for w in workers))
        serve_ports = {
            p["containerPort"] for c in containers(doc.body) for p in c.get("ports") or [] if p.get("name") == "serve"
        }
        for c in containers(doc.body):
            env = {e.get("name"): e.get("value") for e in c.get("env") or []}
            if env.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
                problems.append(
                    f"{doc.where}: container {c.get('name')} lacks RAY_SERVE_ENABLE_HA_PROXY=1 "
                    "(Serve's HAProxy ingress, qrag serve's default: every node starts in the same mode)"
                )
        http = serve_cfg.get("http_options") or {}
        if http.get("host") != "0.0.0.0":
            problems.append(
                f"{doc.where}: http_options.host must be 0.0.0.0 in a pod "
                "(the Service reaches the proxy from outside it)"
            )
        if serve_ports != {http.get("port", 8000)}:
            problems.append(
                f"{doc.where}: the serve container ports {sorted(serve_ports)} "
                f"differ from http_options.port {http.get('port', 8000)}"
            )
        for app in serve_cfg.get("applications") or []:
            where = f"{doc.where} application {app.get('name')}"
            if app.get("import_path") != reference["import_path"]:
                problems.append(
                    f"{where}: import_path {app.get('import_path')} "
                    f"is not serve/config.yaml's {reference['import_path']}"
                )
            module, _, attr = app.get("import_path", "").partition(":")
            # A module of the checkout (serve.app) or of the installed package (qrag.distributed.serve_app).
            source = next(
                (p for base in (ROOT, ROOT / "platform") if (p := base / (module.replace(".", "/") + ".py")).is_file()),
                ROOT / (module.replace(".", "/") + ".py"),
            )
            if not source.is_file() or attr not in {
                n.name for n in ast.parse(source.read_text()).body if isinstance(n, ast.FunctionDef)
            }:
                problems.append(f"{where}: {app.get('import_path')} does not resolve to a function in the project")
            try:
                c = from_dict(ServeConfig, dict(app.get("args") or {}))
            except ConfigError as exc:
                problems.append(f"{where}: args: {exc}")
                continue
            problems += serve_access_problems(doc.body, c, where)
            for key in ("storage", "model_cache") + (
                ("checkpoint",) if c.checkpoint and "://" not in c.checkpoint and ":/" not in c.checkpoint else ()
            ):
                value = getattr(c, key)
                if not value.startswith("/") or not under(value, mounts):
                    problems.append(f"{where}: args.{key} {value} is not on the shared volume of every pod")
            trained = {f"{j.run_dir}/{'best' if j.cfg.keep_best else 'final'}" for j in jobs}
            if c.checkpoint and c.checkpoint.startswith("/") and c.checkpoint not in trained:
                problems.append(
                    f"{where}: checkpoint {c.checkpoint} is not where a RayJob writes one ({sorted(trained)})"
                )
            if c.checkpoint and c.checkpoint.startswith("models:/") and "@" in c.checkpoint:
                # models:/<name>@<alias>: some RayJob must register that name and point that alias at it.
                registered = {
                    f"models:/{j.cfg.distributed.mlflow_registered_model}@{j.cfg.distributed.mlflow_model_alias}"
                    for j in jobs
                    if j.cfg.distributed.mlflow_model and j.cfg.distributed.mlflow_registered_model
                }
                if c.checkpoint not in registered:
                    problems.append(
                        f"{where}: checkpoint {c.checkpoint} is not a model a RayJob registers ({sorted(registered)})"
                    )
            problems += deployment_problems(app, c, gpus, gpus_max, where)
    return problems


# -- images and versions --------------------------------------------------------------------------


@dataclass
class Instruction:
    line: int
    op: str
    args: str


def dockerfile_instructions(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    pending, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        op, _, args = text.partition(" ")
        out.append(Instruction(start, op.upper(), args.strip()))
    return out


def copy_sources(ins: Instruction) -> list[str]:
    words = [w for w in shlex.split(ins.args) if not w.startswith("--")]
    if ins.args.lstrip().startswith("["):
        words = json.loads(ins.args[ins.args.index("[") :])
    return words[:-1]


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""

    def rx(pattern: str) -> re.Pattern:
        out = ""
        for part in re.split(r"(\*\*|\*|\?)", pattern.strip("/")):
            out += {"**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part))
        return re.compile(f"^{out}$")

    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        if any(rx(pattern.lstrip("!")).match(p) for p in prefixes):
            excluded = not negate
    return excluded


def image_ref(ref: str) -> tuple[str, str]:
    name, _, tag = ref.rpartition(":") if ":" in ref.split("/")[-1] else (ref, "", "")
    return name, tag


def check_dockerfiles() -> list[str]:
    import ray

    problems = []
    for path, context, ignore in [
        (INFRA / "docker" / "Dockerfile", ROOT, INFRA / "docker" / "Dockerfile.dockerignore"),
        (INFRA / "mlflow" / "Dockerfile", INFRA / "mlflow", None),
    ]:
        where = rel(path)
        ins = dockerfile_instructions(path)
        patterns = (
            [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]
            if ignore
            else []
        )
        froms = [i for i in ins if i.op == "FROM"]
        for f in froms:
            ref = f.args.split()[0]
            name, tag = image_ref(ref)
            if "@sha256:" not in ref and (not tag or tag == "latest" or not re.search(r"\d", tag)):
                problems.append(f"{where}:{f.line}: base image {ref} is not pinned to a version")
        for i in ins:
            if i.op in ("COPY", "ADD") and "--from" not in i.args:
                for src in copy_sources(i):
                    if not (context / src).exists():
                        problems.append(
                            f"{where}:{i.line}: {i.op} source {src} does not exist in the build context {rel(context)}"
                        )
                    elif patterns and dockerignore_excludes(patterns, src.rstrip("/")):
                        problems.append(f"{where}:{i.line}: {i.op} source {src} is excluded by {rel(ignore)}")
            if i.op == "RUN":
                for script in re.findall(r"bash (\S+\.sh)", i.args):
                    if not (context / script).is_file() and not (context / script.removeprefix("/opt/qrag/")).is_file():
                        problems.append(f"{where}:{i.line}: RUN uses {script}, which is not in the build context")
        users = [i.args.split(":")[0] for i in ins if i.op == "USER"]
        if not users or users[-1] in ("root", "0"):
            problems.append(f"{where}: the image should end on a non-root USER")
    qrag_ins = dockerfile_instructions(INFRA / "docker" / "Dockerfile")
    env = " ".join(i.args for i in qrag_ins if i.op == "ENV")
    for var in OFFLINE_VARS:
        if f"{var}=" in env:
            problems.append(
                f"infra/docker/Dockerfile: ENV {var} switches the hub off for every user of the image "
                "(data.hub needs it)"
            )
    base = next(i.args.split()[0] for i in qrag_ins if i.op == "FROM")
    version = ray_image_version(base)
    if version != ray.__version__:
        problems.append(
            f"infra/docker/Dockerfile: base {base} has Ray {version}, the project runs Ray {ray.__version__}"
        )
    problems += check_pins(base)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    py = re.search(r"-py3(\d+)", base)
    if not py or int(py.group(1)) < int(re.search(r"3\.(\d+)", requires).group(1)):
        problems.append(f"infra/docker/Dockerfile: base {base} does not meet requires-python {requires}")
    return problems


TORCH_SPECS = {  # where a torch version is chosen, and how to read it there
    "Makefile": r"^TORCH_SPEC \?= (torch\S*)",
    "infra/docker/Dockerfile": r"^ARG TORCH_SPEC=(torch\S*)",
    "infra/docker/install.sh": r'TORCH_SPEC:-(torch[^}"]*)',
}
FAISS_PACKAGES = ("faiss-cpu", "faiss-gpu")  # one `faiss` module: never two of them in one extra
# Set only on machines we make offline (CI, bench scripts), never for every user of a manifest.
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def check_pins(image: str) -> list[str]:
    """One torch story (the Makefile, the image and install.sh pin the same version, inside
    pyproject.toml's range), Ray pinned to the image's minor, FAISS extras that cannot clobber."""
    from packaging.requirements import Requirement

    problems = []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = {requirement_name(r): Requirement(r) for r in project["dependencies"]}
    pins = {}
    for file, pattern in TORCH_SPECS.items():
        found = re.search(pattern, (ROOT / file).read_text(), re.M)
        spec = Requirement(found.group(1)) if found else None
        pin = next((s.version for s in spec.specifier if s.operator == "=="), None) if spec else None
        if pin is None:
            problems.append(f"{file}: no pinned torch==X.Y.Z default (pattern {pattern})")
            continue
        pins[file] = pin
        if pin not in reqs["torch"].specifier:
            problems.append(f"{file}: torch {pin} is outside pyproject.toml's {reqs['torch']}")
    if len(set(pins.values())) > 1:
        problems.append(f"torch pins disagree: {pins}")
    ray_req = next(Requirement(r) for r in project["optional-dependencies"]["ray"] if requirement_name(r) == "ray")
    version = ray_image_version(image)
    if version and version not in ray_req.specifier:
        problems.append(f"pyproject.toml: {ray_req} does not admit the image's Ray {version}")
    if not any(s.operator in ("<", "~=", "==") for s in ray_req.specifier):
        problems.append(f"pyproject.toml: {ray_req} has no upper bound (pin the tested minor)")
    for extra, items in project["optional-dependencies"].items():
        faiss = [r for r in items if requirement_name(r).startswith(FAISS_PACKAGES)]
        if len(faiss) > 1 or (faiss and extra == "ray"):
            problems.append(
                f"pyproject.toml: extra {extra!r} pulls {faiss}: FAISS wheels overwrite each other; "
                "keep them in extras of their own"
            )
    return problems


CONSTRAINT_FILES = ("constraints/qrag.txt", "constraints/mlflow-server.txt")


def constraint_pins(path: Path) -> dict[str, str]:
    """name -> version of a pip constraints file's `name==version` lines (comments skipped)."""
    pins = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise ValueError(f"{rel(path)}:{n}: {line!r} is not name==version")
        pins[requirement_name(name.strip())] = version.strip()
    return pins


def check_constraints() -> list[str]:
    """The tested versions (constraints/, what `make install` and CI install) agree with each other
    and with what the project declares: torch is left to TORCH_SPEC, the MLflow server runs the
    client's version, the MLflow image (infra/mlflow/Dockerfile) the same, pyproject's ranges admit them."""
    from packaging.requirements import Requirement

    problems = []
    qrag, server = (constraint_pins(ROOT / f) for f in CONSTRAINT_FILES)
    if "torch" in qrag:
        problems.append(f"{CONSTRAINT_FILES[0]}: pins torch {qrag['torch']} (TORCH_SPEC chooses the build)")
    client, served = qrag.get("mlflow-skinny"), server.get("mlflow")
    if client is None or served != client:
        problems.append(
            f"constraints: the MLflow server's mlflow {served} must equal the client's mlflow-skinny {client}"
        )
    args = (i.args.partition("=") for i in dockerfile_instructions(INFRA / "mlflow" / "Dockerfile") if i.op == "ARG")
    image = next((value for name, _, value in args if name == "MLFLOW_VERSION"), None)
    if image != client:
        problems.append(
            f"infra/mlflow/Dockerfile: MLFLOW_VERSION {image} != {CONSTRAINT_FILES[0]}'s mlflow-skinny {client}"
        )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    for text in declared:
        req = Requirement(text)
        name = requirement_name(text)
        if name in qrag and name != "qrag" and not req.specifier.contains(qrag[name], prereleases=True):
            problems.append(f"{CONSTRAINT_FILES[0]}: {name}=={qrag[name]} is outside pyproject.toml's {req}")
    return problems


def ray_image_version(ref: str) -> str | None:
    match = re.match(r"rayproject/ray(?:-ml)?:(\d+\.\d+\.\d+)", ref)
    return match.group(1) if match else None


def kustomize_image(kustomization: Path) -> str:
    body = yaml.safe_load(kustomization.read_text())
    entry = next(i for i in body.get("images") or [] if i["name"] == IMAGE_NAME)
    return f"{entry.get('newName', IMAGE_NAME)}:{entry['newTag']}"


def check_images_and_versions() -> list[str]:
    problems = []
    base = next(i.args.split()[0] for i in dockerfile_instructions(INFRA / "docker" / "Dockerfile") if i.op == "FROM")
    ray_version = ray_image_version(base)
    images = {
        rel(k.path): kustomize_image(k.path)
        for k in kustomizations()
        if any(i["name"] == IMAGE_NAME for i in k.body.get("images") or [])
    }
    if len(set(images.values())) > 1:
        problems.append(f"kustomizations map {IMAGE_NAME} to different images: {images}")
    tags = {img.rsplit(":", 1)[1] for img in images.values()}
    for where, cluster in ray_cluster_specs():
        if cluster.get("rayVersion") != ray_version:
            problems.append(
                f"{where}: rayVersion {cluster.get('rayVersion')} != the image's Ray {ray_version} ({base})"
            )
    for doc in k8s_docs():
        if doc.key[0] != "ray.io/v1":
            continue
        for c in containers(doc.body):
            name, tag = image_ref(c.get("image", ""))
            if name != IMAGE_NAME or tag not in tags:
                problems.append(
                    f"{doc.where}: container {c['name']} runs {c.get('image')}, "
                    f"not the qrag image ({IMAGE_NAME}:{'|'.join(sorted(tags))})"
                )
    launcher = yaml.safe_load((INFRA / "cluster.yaml").read_text())
    if launcher["docker"]["image"] != base:
        problems.append(
            f"infra/cluster.yaml: docker.image {launcher['docker']['image']} != the Dockerfile's base {base}"
        )
    options = " ".join(launcher["docker"].get("run_options") or [])
    problems += [
        f"infra/cluster.yaml: docker.run_options set {k}, which switches the hub off on every node (data.hub needs it)"
        for k in OFFLINE_VARS
        if f"{k}=" in options
    ]
    return problems


def check_cluster_launcher() -> list[str]:
    """infra/cluster.yaml has the RayCluster's node types (Ray resources and bounds)."""
    problems = []
    launcher = yaml.safe_load((INFRA / "cluster.yaml").read_text())
    types = launcher["available_node_types"]
    head_type = types[launcher["head_node_type"]]
    rc = one("RayCluster").body["spec"]
    head, workers = ray_groups(rc)
    if {k: float(v) for k, v in head_type["resources"].items()} != head.resources():
        problems.append(
            f"infra/cluster.yaml: head resources {head_type['resources']} != the RayCluster head's {head.resources()}"
        )
    launched = {name: t for name, t in types.items() if name != launcher["head_node_type"]}
    for w in workers:
        same = [n for n, t in launched.items() if {k: float(v) for k, v in t["resources"].items()} == w.resources()]
        if not same:
            problems.append(
                f"infra/cluster.yaml: no node type with the resources of worker group {w.name} {w.resources()}"
            )
            continue
        t = launched.pop(same[0])
        if (t.get("min_workers", 0), t.get("max_workers")) != (w.min, w.max):
            problems.append(
                f"infra/cluster.yaml: {same[0]} workers [{t.get('min_workers', 0)}, {t.get('max_workers')}] "
                f"!= group {w.name} [{w.min}, {w.max}]"
            )
    for name in launched:
        problems.append(f"infra/cluster.yaml: node type {name} has no worker group in the RayCluster")
    for src in (launcher.get("file_mounts") or {}).values():
        if not (ROOT / src).exists():
            problems.append(f"infra/cluster.yaml: file_mounts source {src} does not exist")
    for cmd in launcher.get("setup_commands") or []:
        for script in re.findall(r"(/opt/qrag/\S+\.sh)", cmd):
            if not image_path(script).is_file():
                problems.append(f"infra/cluster.yaml: setup command runs {script}, which is not in the project")
    return problems


# -- runtime_env, Compose, scripts ---------------------------------------------------------------


def requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def check_runtime_env() -> list[str]:
    from ray.runtime_env import RuntimeEnv

    path = INFRA / "runtime_env.yaml"
    data = yaml.safe_load(path.read_text())
    problems = []
    known = {"working_dir", "excludes", "pip", "env_vars", "py_modules", "config"}
    problems += [f"infra/runtime_env.yaml: unknown key {k!r}" for k in sorted(set(data) - known)]
    try:
        RuntimeEnv(**data)
    except (TypeError, ValueError) as exc:
        problems.append(f"infra/runtime_env.yaml: Ray rejects it: {exc}")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [r for r in project["dependencies"] + extras["ray"] + extras["faiss"] if requirement_name(r) != "ray"]
    packages = (data.get("pip") or {}).get("packages") or []
    if sorted(map(str.lower, packages)) != sorted(map(str.lower, wanted)):
        missing = sorted(set(wanted) - set(packages))
        extra = sorted(set(packages) - set(wanted))
        problems.append(
            f"infra/runtime_env.yaml: pip packages differ from pyproject.toml (missing {missing}, extra {extra})"
        )
    rayignore = [
        line.strip()
        for line in (ROOT / ".rayignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    missing = [p for p in rayignore if p not in data.get("excludes", [])]
    if missing:
        problems.append(f"infra/runtime_env.yaml: excludes lack .rayignore entries {missing}")
    problems += [
        f"infra/runtime_env.yaml: env_vars.{k} switches the hub off for every job (data.hub needs it)"
        for k in OFFLINE_VARS
        if k in (data.get("env_vars") or {})
    ]
    image_env = dict(
        kv.split("=", 1)
        for i in dockerfile_instructions(INFRA / "docker" / "Dockerfile")
        if i.op == "ENV"
        for kv in i.args.split()
    )
    for key, value in (data.get("env_vars") or {}).items():
        if key in image_env and image_env[key] != value:
            problems.append(f"infra/runtime_env.yaml: env_vars.{key}={value} but the image sets {image_env[key]}")
    return problems


def check_compose() -> list[str]:
    path = INFRA / "mlflow" / "docker-compose.yaml"
    compose = yaml.safe_load(path.read_text())
    problems = []
    mlflow = compose["services"].get("mlflow") or {}
    backend = str((mlflow.get("environment") or {}).get("MLFLOW_BACKEND_STORE_URI", ""))
    if not backend.startswith("postgresql://") or "@postgres:" not in backend:
        problems.append(
            f"{rel(path)}: mlflow's MLFLOW_BACKEND_STORE_URI should be the postgres service, got {backend!r}"
        )
    if not (
        path.parent
        / mlflow.get("build", {}).get("context", ".")
        / mlflow.get("build", {}).get("dockerfile", "Dockerfile")
    ).is_file():
        problems.append(f"{rel(path)}: mlflow's build context has no Dockerfile")
    for port in mlflow.get("ports") or []:
        host = str(port).rsplit(":", 2)[0] if str(port).count(":") >= 2 else ""
        if "127.0.0.1" not in host:
            problems.append(f"{rel(path)}: publish {port} on 127.0.0.1 by default (the server has no auth)")
    pg = compose["services"].get("postgres") or {}
    if ":?" not in str((pg.get("environment") or {}).get("POSTGRES_PASSWORD", "")):
        problems.append(
            f"{rel(path)}: POSTGRES_PASSWORD must be required (${{POSTGRES_PASSWORD:?...}}), never defaulted"
        )
    if not (path.parent / ".env.example").is_file():
        problems.append(f"{rel(path)}: commit infra/mlflow/.env.example beside it")
    return problems


def check_mlflow_wiring() -> list[str]:
    """Ray pods' MLFLOW_TRACKING_URI reaches the MLflow Service of infra/mlflow/k8s."""
    problems = []
    services = {d.name: d for d in docs_of("Service")}
    namespace = {k.body.get("namespace") for k in kustomizations()}.pop()
    for doc in k8s_docs():
        if doc.key[0] != "ray.io/v1":
            continue
        for c in containers(doc.body):
            env = {e["name"]: e.get("value") for e in c.get("env") or []}
            uri = env.get("MLFLOW_TRACKING_URI")
            if not uri:
                problems.append(f"{doc.where}: container {c['name']} has no MLFLOW_TRACKING_URI")
                continue
            url = urlparse(uri)
            host = (url.hostname or "").split(".")
            svc = services.get(host[0])
            if url.scheme != "http" or svc is None or (len(host) > 1 and host[1] != namespace):
                problems.append(
                    f"{doc.where}: MLFLOW_TRACKING_URI {uri} "
                    f"is not a Service of infra/mlflow/k8s in namespace {namespace}"
                )
            elif url.port not in {p["port"] for p in svc.body["spec"]["ports"]}:
                problems.append(f"{doc.where}: MLFLOW_TRACKING_URI port {url.port} is not a port of Service {svc.name}")
    return problems


def check_scripts() -> list[str]:
    problems = []
    for script in sorted(INFRA.rglob("*.sh")):
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        if res.returncode:
            problems.append(f"{rel(script)}: {res.stderr.strip()}")
        if not script.stat().st_mode & 0o111:
            problems.append(f"{rel(script)}: not executable")
    return problems


CHECKS = (
    check_schemas,
    check_kustomizations,
    check_references,
    check_ray_groups,
    check_rayjob,
    check_rayservice,
    check_dockerfiles,
    check_images_and_versions,
    check_constraints,
    check_cluster_launcher,
    check_autoscale_limits,
    check_runtime_env,
    check_compose,
    check_mlflow_wiring,
    check_scripts,
)


def all_problems() -> list[str]:
    problems = []
    for check in CHECKS:
        try:
            problems += check()
        except Exception as exc:  # noqa: BLE001 - a broken manifest must be reported, not crash the others
            problems.append(f"{check.__name__}: {type(exc).__name__}: {exc}")
    return problems


def main() -> int:
    problems = all_problems()
    for p in problems:
        print(p)
    files = len(k8s_files()) + 2  # + compose, cluster.yaml
    print(f"infra/validate.py: {files} manifest files, {len(CHECKS)} checks, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
