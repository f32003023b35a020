"""The deployment files say what the code needs: docker compose (CPU and GPU) and the KubeRay manifests.

No Docker daemon or Kubernetes runs here: the files are parsed and the fields that matter are checked; a real compose
(`docker compose config`, or Debian's `docker-compose config`) validates the compose files, and `kubectl kustomize`
renders the KubeRay overlay.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.config.settings import Settings

REPO = Path(__file__).resolve().parents[2]
SHUNTER_COMMANDS = {"api", "dispatcher"}


def _compose(*names: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / names[0]).read_text())


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    return dict(env) if isinstance(env, dict) else dict(item.split("=", 1) for item in env)


def _command(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return cmd.split() if isinstance(cmd, str) else list(cmd)


# ---- docker compose ---------------------------------------------------------------------------------------------
def test_compose_services_share_one_image_built_from_the_dockerfile() -> None:
    services = _compose("docker-compose.yml")["services"]
    assert set(services) == {"postgres", "ray-head", "ray-worker", "api", "dispatcher"}
    assert services["postgres"]["image"].startswith("postgres:")
    images = {name: s["image"] for name, s in services.items() if name != "postgres"}
    assert len(set(images.values())) == 1, images
    for name in images:
        assert services[name]["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}, name
    assert (REPO / "deploy/Dockerfile").is_file() and (REPO / "deploy/Dockerfile.gpu").is_file()


def test_compose_processes_ports_and_healthchecks() -> None:
    services = _compose("docker-compose.yml")["services"]
    assert _command(services["api"])[:2] == ["shunter", "api"]
    assert _command(services["dispatcher"]) == ["shunter", "dispatcher"]
    head_cmd = " ".join(_command(services["ray-head"]))
    assert "ray start --head" in head_cmd and "--port=6379" in head_cmd and "--dashboard-port=8265" in head_cmd
    assert "--block" in head_cmd and "--dashboard-host=0.0.0.0" in head_cmd
    assert _command(services["ray-worker"])[:3] == ["ray", "start", "--address=ray-head:6379"]
    assert "127.0.0.1:8265:8265" in services["ray-head"]["ports"]
    assert "127.0.0.1:8080:8080" in services["api"]["ports"]
    assert "8080" in _command(services["api"])

    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert "/api/version" in " ".join(services["ray-head"]["healthcheck"]["test"])
    assert "127.0.0.1:8080/readyz" in " ".join(services["api"]["healthcheck"]["test"])
    # Start order: Ray workers after a healthy head; the API after PostgreSQL and Ray; dispatchers after the API
    # (which has created the schema by then).
    assert services["ray-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert {k: v["condition"] for k, v in services["api"]["depends_on"].items()} == {
        "postgres": "service_healthy",
        "ray-head": "service_healthy",
    }
    assert services["dispatcher"]["depends_on"]["api"]["condition"] == "service_healthy"
    assert services["ray-worker"]["deploy"]["replicas"] >= 1
    assert services["dispatcher"]["deploy"]["replicas"] >= 1


def test_compose_environment_names_real_settings() -> None:
    services = _compose("docker-compose.yml")["services"]
    known = {f"SHUNTER_{name.upper()}" for name in Settings.model_fields}
    for name in ("api", "dispatcher"):
        env = _env(services[name])
        assert env["SHUNTER_DATABASE_URL"].startswith("postgresql+psycopg://shunter:")
        assert env["SHUNTER_DATABASE_URL"].endswith("@postgres:5432/shunter")
        assert env["SHUNTER_RAY_ADDRESS"] == "ray-head:6379"
        assert env["SHUNTER_RAY_DASHBOARD_URL"] == "http://ray-head:8265"
        assert env["SHUNTER_STORAGE_URI"] == "/shared/checkpoints"
        unknown = {k for k in env if k.startswith("SHUNTER_")} - known
        assert not unknown, f"{name}: settings that service/config/settings.py does not read: {unknown}"
    for name in ("ray-head", "ray-worker"):
        assert _env(services[name])["RAY_JOB_STOP_SIGNAL"] == "SIGINT"


def test_compose_volumes_for_database_and_checkpoints() -> None:
    compose = _compose("docker-compose.yml")
    services = compose["services"]
    assert {"pgdata", "checkpoints"} <= set(compose["volumes"])
    assert "pgdata:/var/lib/postgresql/data" in services["postgres"]["volumes"]
    # Train workers write checkpoints, the next attempt reads them on any node: one shared volume on every Ray node.
    for name in ("ray-head", "ray-worker", "api", "dispatcher"):
        assert "checkpoints:/shared/checkpoints" in services[name]["volumes"], name


def test_compose_gpu_override_reserves_gpus_with_the_cuda_image() -> None:
    base = _compose("docker-compose.yml")["services"]
    gpu = _compose("docker-compose.gpu.yml")["services"]
    assert set(gpu) <= set(base)
    assert gpu["ray-head"]["image"] == gpu["ray-worker"]["image"], "Ray nodes must share Python and Ray versions"
    assert gpu["ray-worker"]["build"]["dockerfile"] == "deploy/Dockerfile.gpu"
    devices = gpu["ray-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    env = _env(gpu["ray-worker"])
    assert {"NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= set(env)
    dockerfile = (REPO / "deploy/Dockerfile.gpu").read_text()
    assert "FROM ${CUDA_IMAGE}" in dockerfile and "nvidia/cuda:" in dockerfile


def test_dockerfiles_install_the_workers_extra_with_the_constraints() -> None:
    for name, index in (("Dockerfile", "whl/cpu"), ("Dockerfile.gpu", "whl/cu")):
        text = (REPO / "deploy" / name).read_text()
        assert "pip install -c constraints.txt" in text and '".[workers]"' in text, name
        assert index in text, name
        assert any(line.startswith("COPY") and "constraints.txt" in line for line in text.splitlines()), name
        # Same Python minor version and Ray version in both images, so CPU and GPU nodes can share a cluster.
        assert "ARG PYTHON_VERSION=3.11" in text and "ARG RAY_VERSION=2.60.0" in text, name


def _compose_command() -> list[str]:
    """What validates a compose file here: Docker's compose plugin where it is installed, else Debian's
    `docker-compose` (1.29, which .ci/run installs). Neither needs a Docker engine for `config`. None: the test fails
    (a skip here once hid that nothing validated the files)."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("no compose to validate the files: install Debian's docker-compose (apt-get install docker-compose)")


def test_compose_gcs_fault_tolerance_override() -> None:
    base = _compose("docker-compose.yml")["services"]
    ft = _compose("docker-compose.gcs-ft.yml")
    services = ft["services"]
    assert set(services) - set(base) == {"redis"} and services["redis"]["image"].startswith("redis:")
    assert "--appendonly" in services["redis"]["command"], "a Redis that keeps nothing loses the cluster with it"
    assert "redis-data" in ft["volumes"]
    head = _env(services["ray-head"])
    assert head["RAY_REDIS_ADDRESS"] == "redis:6379" and head["RAY_external_storage_namespace"]
    assert services["ray-head"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert int(_env(services["ray-worker"])["RAY_gcs_rpc_server_reconnect_timeout_s"]) >= 60
    known = {f"SHUNTER_{name.upper()}" for name in Settings.model_fields}
    for name in ("api", "dispatcher"):
        env = _env(services[name])
        assert env["SHUNTER_RAY_DRIVERS_OFF_HEAD"] == "true", name
        assert set(env) <= known, name


@pytest.mark.parametrize(
    "files",
    [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"],
     ["docker-compose.yml", "docker-compose.gcs-ft.yml"]],
)  # fmt: skip
def test_docker_compose_config_validates(files: list[str]) -> None:
    args = _compose_command() + [arg for f in files for arg in ("-f", f)] + ["config", "--quiet"]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ---- KubeRay ----------------------------------------------------------------------------------------------------
def _kube() -> dict[tuple[str, str], dict[str, Any]]:
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted((REPO / "deploy/kuberay").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and "metadata" in doc:
                docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def test_kuberay_raycluster_head_and_gpu_workers() -> None:
    cluster = _kube()[("RayCluster", "shunter-ray")]
    assert cluster["apiVersion"] == "ray.io/v1"
    assert cluster["spec"]["rayVersion"] == "2.60.0"
    head = cluster["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    (head_container,) = head["template"]["spec"]["containers"]
    ports = {p["containerPort"] for p in head_container["ports"]}
    assert {6379, 8265} <= ports
    assert {"name": "RAY_JOB_STOP_SIGNAL", "value": "SIGINT"} in head_container["env"]

    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"gpu-a100", "cpu"}
    gpu = groups["gpu-a100"]
    (worker,) = gpu["template"]["spec"]["containers"]
    assert worker["image"] == head_container["image"], "Ray nodes must share Python and Ray versions"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e["value"] for e in worker["env"]}
    assert {"NCCL_DEBUG", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"} <= set(env)
    for group in groups.values():
        (container,) = group["template"]["spec"]["containers"]
        assert container["image"] == head_container["image"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/shared/checkpoints" in mounts and "/dev/shm" in mounts
        assert group["minReplicas"] == 0 and group["maxReplicas"] >= 1, "groups start from zero and grow"


def _group_holds(group: dict[str, Any]) -> dict[str, float]:
    """What the autoscaler reads that one pod of a worker group holds: CPUs and GPUs from the container's limits, other
    resources from rayStartParams.resources."""
    import json

    (container,) = group["template"]["spec"]["containers"]
    limits = container["resources"]["limits"]
    holds = {"CPU": float(limits["cpu"])}
    if "nvidia.com/gpu" in limits:
        holds["GPU"] = float(limits["nvidia.com/gpu"])
    custom = group["rayStartParams"].get("resources")
    if custom:
        holds.update(json.loads(json.loads(custom)))  # a JSON object inside a quoted string, as KubeRay passes it
    return holds


def test_kuberay_autoscaler_and_shunters_node_types_agree() -> None:
    """The in-tree autoscaler is on, and SHUNTER_NODE_TYPES names each worker group with what one pod holds and its
    maxReplicas (docs/operations.md: a type out of step refuses its jobs, or keeps them waiting for ever)."""
    import json

    docs = _kube()
    cluster = docs[("RayCluster", "shunter-ray")]["spec"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    config = docs[("ConfigMap", "shunter-config")]["data"]
    assert config["SHUNTER_CLUSTER_MAY_GROW"] == "true"
    declared = json.loads(config["SHUNTER_NODE_TYPES"])
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(declared) == set(groups)
    for name, group in groups.items():
        assert declared[name]["max"] == group["maxReplicas"], name
        assert declared[name]["resources"] == _group_holds(group), name
    Settings(node_types=declared)  # and the service parses them


def test_kuberay_api_and_dispatcher_deployments() -> None:
    docs = _kube()
    config = docs[("ConfigMap", "shunter-config")]["data"]
    # KubeRay names the head Service <cluster>-head-svc.
    assert config["SHUNTER_RAY_ADDRESS"] == "shunter-ray-head-svc:6379"
    assert config["SHUNTER_RAY_DASHBOARD_URL"] == "http://shunter-ray-head-svc:8265"
    known = {f"SHUNTER_{name.upper()}" for name in Settings.model_fields}
    assert set(config) <= known, set(config) - known

    for name, command in (("shunter-api", ["shunter", "api"]), ("shunter-dispatcher", ["shunter", "dispatcher"])):
        container = _container(docs[("Deployment", name)])
        assert container["command"] == command
        assert container["image"].startswith("ghcr.io/") and not container["image"].endswith("-gpu")
        assert {"configMapRef": {"name": "shunter-config"}} in container["envFrom"]
        env = {e["name"]: e for e in container["env"]}
        assert env["SHUNTER_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "shunter-db", "key": "database-url"}
        assert "value" not in env["SHUNTER_DATABASE_URL"], "the database URL (with its password) comes from a Secret"
        assert docs[("Deployment", name)]["spec"]["replicas"] >= 1

    api = _container(docs[("Deployment", "shunter-api")])
    assert api["ports"] == [{"name": "http", "containerPort": 8080}]
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # Bound to 0.0.0.0 in the pod: `shunter api` refuses that without tokens, so tokens come from a Secret.
    assert {e["name"]: e for e in api["env"]}["SHUNTER_API_TOKENS"]["valueFrom"]["secretKeyRef"]["name"]
    assert config["SHUNTER_HOST"] == "0.0.0.0" and config["SHUNTER_PORT"] == "8080"
    service = docs[("Service", "shunter-api")]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    labels = docs[("Deployment", "shunter-api")]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()

    dispatcher = _container(docs[("Deployment", "shunter-dispatcher")])
    owner = {e["name"]: e for e in dispatcher["env"]}["SHUNTER_DISPATCHER_ID"]
    assert owner["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert docs[("PersistentVolumeClaim", "shunter-checkpoints")]["spec"]["accessModes"] == ["ReadWriteMany"]


SERVICE_SECRETS = ("SHUNTER_DATABASE_URL", "SHUNTER_API_TOKENS", "SHUNTER_PROGRESS_SECRET", "POSTGRES_PASSWORD",
                   "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN")  # fmt: skip


def test_ray_nodes_get_no_service_secret() -> None:
    """Jobs run on the Ray nodes: no setting of the service's that opens the database or the API reaches them."""
    compose = _compose("docker-compose.yml")["services"]
    ray_services = [name for name, svc in compose.items() if "ray" in " ".join(_command(svc))]
    assert ray_services, "no Ray service found in docker-compose.yml"
    for name in ray_services:
        text = yaml.safe_dump(compose[name])
        assert not [s for s in SERVICE_SECRETS if s in text], name
    cluster = yaml.safe_dump(_kube()[("RayCluster", "shunter-ray")])
    assert not [s for s in SERVICE_SECRETS if s in cluster]


def _kuberay_gcs_ft_rendered() -> list[dict[str, Any]]:
    """The GCS fault-tolerance overlay as kustomize builds it (`kubectl kustomize`, kubectl's own kustomize)."""
    assert shutil.which("kubectl"), "kubectl renders the overlay (Debian's kubectl package; .ci/run installs it)"
    proc = subprocess.run(["kubectl", "kustomize", str(REPO / "deploy/kuberay-gcs-ft")], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_kuberay_gcs_fault_tolerance_overlay() -> None:
    """Checked on what kustomize renders: a patch that replaced the worker group list (a strategic merge on a custom
    resource does) would leave the GPU workers without image or resources."""
    rendered = {(d["kind"], d["metadata"]["name"]): d for d in _kuberay_gcs_ft_rendered()}
    base = _kube()
    assert set(base) <= set(rendered)
    cluster = rendered[("RayCluster", "shunter-ray")]["spec"]
    assert cluster["gcsFaultToleranceOptions"] == {"redisAddress": "shunter-redis:6379",
                                                    "externalStorageNamespace": "shunter"}  # fmt: skip
    assert ("Service", "shunter-redis") in rendered
    assert rendered[("Service", "shunter-redis")]["spec"]["ports"][0]["port"] == 6379
    # Everything of the base's worker group is still there, plus the reconnect timeout.
    base_groups = base[("RayCluster", "shunter-ray")]["spec"]["workerGroupSpecs"]
    assert len(cluster["workerGroupSpecs"]) == len(base_groups)
    for base_group, group in zip(base_groups, cluster["workerGroupSpecs"], strict=True):
        (base_container,) = base_group["template"]["spec"]["containers"]
        (container,) = group["template"]["spec"]["containers"]
        assert {k: v for k, v in container.items() if k != "env"} == {
            k: v for k, v in base_container.items() if k != "env"
        }
        assert {k: v for k, v in group.items() if k != "template"} == {
            k: v for k, v in base_group.items() if k != "template"
        }
        env = {e["name"]: e["value"] for e in container["env"]}
        assert {e["name"]: e["value"] for e in base_container["env"]}.items() <= env.items()
        assert int(env["RAY_gcs_rpc_server_reconnect_timeout_s"]) >= 60, group["groupName"]
    config = rendered[("ConfigMap", "shunter-config")]["data"]
    assert config["SHUNTER_RAY_DRIVERS_OFF_HEAD"] == "true"
    assert set(config) - {"SHUNTER_RAY_DRIVERS_OFF_HEAD"} == set(base[("ConfigMap", "shunter-config")]["data"])
    assert "ray_drivers_off_head" in Settings.model_fields
    redis = _container(rendered[("Deployment", "shunter-redis")])
    assert "--appendonly" in redis["args"] and redis["volumeMounts"][0]["mountPath"] == "/data"


def test_the_dispatchers_serve_their_metrics_where_they_are_scraped() -> None:
    """Issue 38, item 6: the standalone dispatchers bind their /metrics beyond loopback, on the port the KubeRay pod
    annotations and Service name (the process itself: tests/service/test_dispatcher_metrics.py)."""
    port = Settings().dispatcher_metrics_port
    docs = _kube()
    deployment = docs[("Deployment", "shunter-dispatcher")]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(port)
    container = _container(deployment)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SHUNTER_DISPATCHER_METRICS_HOST"] == "0.0.0.0" and env["SHUNTER_DISPATCHER_METRICS_PORT"] == str(port)
    assert {"name": "metrics", "containerPort": port} in container["ports"]
    assert docs[("Service", "shunter-dispatcher")]["spec"]["ports"][0]["port"] == port
    compose = _compose("docker-compose.yml")["services"]["dispatcher"]
    assert _env(compose)["SHUNTER_DISPATCHER_METRICS_HOST"] == "0.0.0.0" and str(port) in compose["expose"]
