"""Deployment files: the Dockerfile, .dockerignore, compose file and Kubernetes manifests.

These are structure checks that run anywhere (no Docker engine, no ``kubectl``);
``deploy/test-docker.sh`` is the end-to-end test on a real engine. Every command line
in the deployment files is parsed by the real ``streampack`` argument parser and every
settings file by the real settings loader, so a renamed flag or setting fails here.
"""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from streampack import settings as sp_settings
from streampack.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CONFIG_MOUNT = "/etc/streampack/streampack.toml"
CORPUS_MOUNT = "/data/corpus"
SERVICE_UID = 10001
ROLE_SETTINGS = {
    "producer": sp_settings.ProducerSettings,
    "worker": sp_settings.WorkerSettings,
    "consumer": sp_settings.ConsumerSettings,
}
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _parse_cli(args: list[str]) -> Any:
    """Parse a container's arguments with the real CLI; a bad flag fails the test."""
    try:
        return build_parser().parse_args(args)
    except SystemExit as exc:  # argparse reports and exits
        pytest.fail(f"streampack rejects {args}: exit {exc.code}")


def _check_settings_text(text: str) -> None:
    """Every role's settings build from this TOML text (unknown keys are errors)."""
    toml = sp_settings.tomllib.loads(text)
    for cls in ROLE_SETTINGS.values():
        sp_settings.build(cls, toml)


# ---------------------------------------------------------------- Dockerfile


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text()
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    out = []
    for entry in logical:
        keyword, _, rest = entry.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return _dockerfile_instructions()


def _stages(instructions: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for keyword, rest in instructions:
        if keyword == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else rest
            current = stages.setdefault(name, [])
        if current is not None:
            current.append((keyword, rest))
    return stages


def test_every_stage_is_built_from_the_base_image_argument(dockerfile):
    first_from = next(i for i, (k, _) in enumerate(dockerfile) if k == "FROM")
    global_args = [rest for keyword, rest in dockerfile[:first_from] if keyword == "ARG"]
    assert "BASE_IMAGE=python:3.12-slim" in global_args
    froms = [rest.split() for keyword, rest in dockerfile if keyword == "FROM"]
    assert len(froms) >= 2, "expected a multi-stage build"
    for parts in froms:
        assert parts[0] == "${BASE_IMAGE}", f"stage {parts} does not start from BASE_IMAGE"


def test_builder_installs_a_wheel_into_a_venv(dockerfile):
    builder = _stages(dockerfile)["builder"]
    runs = " ".join(rest for keyword, rest in builder if keyword == "RUN")
    assert "python3 -m venv /opt/venv" in runs
    assert "pip wheel" in runs and ".whl" in runs
    # The source tree itself never reaches the runtime stage.
    runtime = _stages(dockerfile)["runtime"]
    copies = [rest for keyword, rest in runtime if keyword == "COPY"]
    assert copies == ["--from=builder /opt/venv /opt/venv"]


def test_runtime_is_unprivileged_with_a_warm_numba_cache(dockerfile):
    runtime = _stages(dockerfile)["runtime"]
    keywords = [keyword for keyword, _ in runtime]
    env = " ".join(rest for keyword, rest in runtime if keyword == "ENV")
    assert "NUMBA_CACHE_DIR=/var/cache/streampack/numba" in env
    users = [rest for keyword, rest in runtime if keyword == "USER"]
    assert users == [f"{SERVICE_UID}:{SERVICE_UID}"], "run as the numeric, non-root user"
    # The warm-up runs after the venv is in place, as the runtime user, so the cache
    # it writes is keyed by the very files (and owner) a container uses.
    user_at = keywords.index("USER")
    copy_at = keywords.index("COPY")
    warm = [
        i for i, (keyword, rest) in enumerate(runtime) if keyword == "RUN" and "warmup.py" in rest
    ]
    assert warm and all(i > max(user_at, copy_at) for i in warm)
    setup = " ".join(rest for keyword, rest in runtime if keyword == "RUN")
    assert "chown" in setup and "/var/cache/streampack" in setup


def test_entrypoint_healthcheck_and_labels(dockerfile):
    entrypoints = [rest for keyword, rest in dockerfile if keyword == "ENTRYPOINT"]
    assert [json.loads(rest) for rest in entrypoints] == [["streampack"]], "exec form"
    health = [rest for keyword, rest in dockerfile if keyword == "HEALTHCHECK"]
    assert len(health) == 1
    options, _, command = health[0].partition(" CMD ")
    assert "--interval=" in options and "--start-period=" in options
    argv = json.loads(command)
    assert argv[:2] == ["/bin/sh", "-c"]
    assert "exec streampack health" in argv[2]
    assert '"$STREAMPACK_HEALTH_ENDPOINT"' in argv[2]
    labels = " ".join(rest for keyword, rest in dockerfile if keyword == "LABEL")
    for key in ("title", "description", "licenses", "version", "revision"):
        assert f"org.opencontainers.image.{key}=" in labels


# ---------------------------------------------------------------- .dockerignore


def _dockerignore_excludes(path: str, rules: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule[1:] if negate else rule
        pattern = pattern.rstrip("/")
        globs = {pattern}
        if pattern.startswith("**/"):
            globs.add(pattern[3:])
        if any(fnmatch.fnmatchcase(c, g) for c in candidates for g in globs):
            excluded = not negate
    return excluded


@pytest.mark.parametrize(
    ("path", "excluded"),
    [
        (".git/HEAD", True),
        (".venv/bin/python", True),
        (".numba_cache/x.nbi", True),
        (".pytest_cache/v/cache", True),
        ("tests/project/test_deploy.py", True),
        ("fixtures/corpus/manifest.json", True),
        ("deploy/docker-compose.yml", True),
        ("fixtures/seed/input.json", False),
        ("deploy/warmup.py", False),
        ("streampack/__pycache__/cli.cpython-311.pyc", True),
        ("streampack/kernels/__pycache__/pack_cpu.pack-13.py311.nbi", True),
        ("pyproject.toml", False),
        ("README.md", False),
        ("streampack/cli.py", False),
        ("streampack/kernels/pack_cpu.py", False),
        ("streampack/service/producer.py", False),
        ("workers/worker.py", True),
    ],
)
def test_dockerignore_sends_only_the_packages(path, excluded):
    rules = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert _dockerignore_excludes(path, rules) is excluded


# ---------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_example_settings_file_is_valid():
    _check_settings_text((DEPLOY / "streampack.toml").read_text())


def test_compose_services_share_image_network_config_and_corpus(compose):
    services = compose["services"]
    assert set(services) == {"producer", "worker", "consumer"}
    images = {service["image"] for service in services.values()}
    assert len(images) == 1
    assert set(compose["networks"]) == {"streampack"}
    for name, service in services.items():
        assert service["networks"] == ["streampack"], name
        mounts = {volume.rsplit(":", 2)[1]: volume for volume in service["volumes"]}
        assert mounts[CONFIG_MOUNT] == f"./streampack.toml:{CONFIG_MOUNT}:ro", name
        assert mounts[CORPUS_MOUNT].endswith(f":{CORPUS_MOUNT}:ro"), name
        assert (DEPLOY / "streampack.toml").is_file()


def test_compose_commands_parse_and_wire_up(compose):
    services = compose["services"]
    producer = _parse_cli(services["producer"]["command"])
    assert producer.command == "produce"
    worker = _parse_cli(services["worker"]["command"])
    assert worker.command == "worker" and worker.connect == "tcp://producer:5555"
    consumer = _parse_cli(services["consumer"]["command"])
    assert consumer.command == "consume" and consumer.connect == "tcp://producer:5556"
    # Producer endpoints come from the mounted settings: all interfaces, ports 5555/5556.
    toml = sp_settings.load_toml(DEPLOY / "streampack.toml")
    built = sp_settings.build(sp_settings.ProducerSettings, toml)
    assert built.worker_endpoint == "tcp://0.0.0.0:5555"
    assert built.consumer_endpoint == "tcp://0.0.0.0:5556"
    assert services["producer"]["ports"] == ["5555:5555", "5556:5556", "127.0.0.1:5557:5557"]
    # Producer and workers serve metrics on 5557 inside the network.
    assert (built.metrics_port, built.metrics_address) == (5557, "0.0.0.0")
    worker_settings = sp_settings.build(sp_settings.WorkerSettings, toml)
    assert (worker_settings.metrics_port, worker_settings.metrics_address) == (5557, "0.0.0.0")
    assert services["producer"]["expose"] == ["5557"]
    assert services["worker"]["expose"] == ["5557", "5558"]


def _serve_port(settings: Any) -> str:
    """The port a worker's serve_endpoint binds (every interface, a fixed port)."""
    host, _, port = settings.serve_endpoint.removeprefix("tcp://").rpartition(":")
    assert host == "0.0.0.0" and port.isdigit(), settings.serve_endpoint
    return port


def test_compose_workers_serve_the_consumers_at_their_own_names(compose):
    """The data plane: each worker replica binds serve_endpoint and advertises its
    container's hostname (which the network resolves) at that port; the command the
    shell runs is the worker's command with --serve-advertise added."""
    toml = sp_settings.load_toml(DEPLOY / "streampack.toml")
    assert sp_settings.build(sp_settings.ProducerSettings, toml).data_plane == "workers"
    port = _serve_port(sp_settings.build(sp_settings.WorkerSettings, toml))
    worker = compose["services"]["worker"]
    shell, flag, script, name = worker["entrypoint"]
    assert (shell, flag, name) == ("/bin/sh", "-c", "streampack")
    assert script == f'exec streampack "$$@" --serve-advertise "tcp://$$HOSTNAME:{port}"'
    # What the container runs once compose unescapes $$ and the shell expands it.
    argv = [*worker["command"], "--serve-advertise", f"tcp://0123456789ab:{port}"]
    args = _parse_cli(argv)
    assert args.command == "worker" and args.serve_advertise == f"tcp://0123456789ab:{port}"


def test_compose_workers_scale_and_wait_for_a_healthy_producer(compose):
    services = compose["services"]
    assert services["worker"]["deploy"]["replicas"] >= 2
    assert "container_name" not in services["worker"], "a fixed name prevents --scale"
    for name in ("worker", "consumer"):
        assert services[name]["depends_on"]["producer"]["condition"] == "service_healthy"
    test = services["producer"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    assert _parse_cli(test[2:]).command == "health"


# ---------------------------------------------------------------- Kubernetes


def _k8s_documents() -> list[dict[str, Any]]:
    documents = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                document["__file__"] = path.name
                documents.append(document)
    return documents


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for document in _k8s_documents():
        key = (document["kind"], document["metadata"]["name"])
        assert key not in out, f"duplicate {key}"
        out[key] = document
    return out


API_VERSIONS = {
    "Deployment": "apps/v1",
    "Service": "v1",
    "ConfigMap": "v1",
    "PersistentVolumeClaim": "v1",
}


def test_k8s_documents_have_valid_kinds_and_names(k8s):
    assert {kind for kind, _ in k8s} == set(API_VERSIONS)
    for (kind, name), document in k8s.items():
        assert document["apiVersion"] == API_VERSIONS[kind], (kind, name)
        assert DNS_1123.match(name) and len(name) <= 63, name
        assert set(document) <= {"apiVersion", "kind", "metadata", "spec", "data", "__file__"}


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_configmap_holds_valid_settings(k8s):
    config = k8s[("ConfigMap", "streampack-config")]
    _check_settings_text(config["data"]["streampack.toml"])


def _containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize("name", ["streampack-producer", "streampack-worker"])
def test_deployment_structure(k8s, name):
    deployment = k8s[("Deployment", name)]
    spec = deployment["spec"]
    selector = spec["selector"]["matchLabels"]
    labels = spec["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), "selector must match the pod template"
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == SERVICE_UID
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for container in _containers(deployment):
        assert container["image"].startswith("streampack:")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[0] == "streampack", (probe, command)
            assert _parse_cli(command[1:]).command == "health"
        requests = container["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests)
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
        assert mounts["/etc/streampack"]["readOnly"] is True
        for mount in mounts.values():
            assert mount["name"] in volumes, f"volumeMount {mount['name']} has no volume"
        assert volumes["config"]["configMap"]["name"] in {n for k, n in k8s if k == "ConfigMap"}
        args = _parse_cli(container["args"])
        assert args.config == f"{CONFIG_MOUNT}"


def test_producer_service_and_workers_are_wired(k8s):
    producer = k8s[("Deployment", "streampack-producer")]
    service = k8s[("Service", "streampack-producer")]
    assert producer["spec"]["replicas"] == 1
    assert producer["spec"]["strategy"]["type"] == "Recreate"
    pod_labels = producer["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (container,) = _containers(producer)
    named_ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert named_ports == {"workers": 5555, "consumers": 5556, "metrics": 5557}
    service_ports = {port["name"]: port for port in service["spec"]["ports"]}
    for port_name, number in named_ports.items():
        assert service_ports[port_name]["targetPort"] == port_name
        assert service_ports[port_name]["port"] == number
    assert _parse_cli(container["args"]).command == "produce"
    claim = next(
        v["persistentVolumeClaim"]["claimName"]
        for v in producer["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    )
    assert ("PersistentVolumeClaim", claim) in k8s

    worker = k8s[("Deployment", "streampack-worker")]
    assert worker["spec"]["replicas"] >= 2
    (container,) = _containers(worker)
    args = _parse_cli(container["args"])
    assert args.command == "worker"
    assert args.connect == f"tcp://{service['metadata']['name']}:5555"
    probe = container["livenessProbe"]["exec"]["command"]
    assert f"tcp://{service['metadata']['name']}:5556" in probe


def test_k8s_workers_serve_the_trainers_at_their_pod_ip(k8s):
    """The data plane: each worker pod binds serve_endpoint on its port ``batches``,
    advertises its own pod IP (downward API) there, and the headless worker Service
    names that port for every pod."""
    config = sp_settings.tomllib.loads(
        k8s[("ConfigMap", "streampack-config")]["data"]["streampack.toml"]
    )
    assert sp_settings.build(sp_settings.ProducerSettings, config).data_plane == "workers"
    port = _serve_port(sp_settings.build(sp_settings.WorkerSettings, config))
    (container,) = _containers(k8s[("Deployment", "streampack-worker")])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["batches"] == int(port)
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert _parse_cli(container["args"]).serve_advertise == f"tcp://$(POD_IP):{port}"
    service = k8s[("Service", "streampack-worker")]["spec"]
    assert service["clusterIP"] == "None"
    service_ports = {p["name"]: p for p in service["ports"]}
    assert (service_ports["batches"]["port"], service_ports["batches"]["targetPort"]) == (
        int(port),
        "batches",
    )


# ---------------------------------------------------------------- the docker test script


def test_docker_script_is_valid_bash_and_reports_skips():
    script = DEPLOY / "test-docker.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "DOCKER TESTS SKIPPED: " in text
    assert "trap cleanup EXIT" in text
    for needle in ("--network host", '--build-arg "BASE_IMAGE=', "docker kill"):
        assert needle in text, needle


def test_docker_script_skips_when_no_engine_can_start(tmp_path):
    """No engine answers and dockerd dies at start: a SKIPPED line and exit 0."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text(
        "#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n"
    )
    (fake / "dockerd").write_text(
        "#!/bin/sh\necho 'level=fatal msg=\"no cgroup mount found\"'\nexit 1\n"
    )
    for tool in fake.iterdir():
        tool.chmod(0o755)
    env = {
        "PATH": f"{fake}:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(tmp_path),
        "STREAMPACK_DOCKER_CACHE": str(tmp_path / "cache"),
    }
    result = subprocess.run(
        ["bash", str(DEPLOY / "test-docker.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    (line,) = [out for out in result.stdout.splitlines() if out.startswith("DOCKER TESTS")]
    assert line.startswith("DOCKER TESTS SKIPPED: ")
    assert "FAIL" not in result.stdout


# ---------------------------------------------------------------- metrics scraping


@pytest.mark.parametrize(
    "name, role",
    [
        ("streampack-producer", sp_settings.ProducerSettings),
        ("streampack-worker", sp_settings.WorkerSettings),
    ],
)
def test_pods_announce_the_metrics_port_their_settings_serve(k8s, name, role):
    deployment = k8s[("Deployment", name)]
    template = deployment["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    (container,) = _containers(deployment)
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    config = k8s[("ConfigMap", "streampack-config")]["data"]["streampack.toml"]
    settings = sp_settings.build(role, sp_settings.tomllib.loads(config))
    assert settings.metrics_address == "0.0.0.0"
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"] == settings.metrics_port


def test_the_service_monitor_reaches_producer_and_workers(k8s):
    folder = K8S / "prometheus-operator"
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["..", "servicemonitor.yaml"]
    monitor = yaml.safe_load((folder / "servicemonitor.yaml").read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for name in ("streampack-producer", "streampack-worker"):
        service = k8s[("Service", name)]
        assert selector.items() <= service["metadata"]["labels"].items(), name
        port = {p["name"]: p for p in service["spec"]["ports"]}[endpoint["port"]]
        pods = k8s[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= pods.items(), name
        (container,) = _containers(k8s[("Deployment", name)])
        assert port["targetPort"] in {p["name"] for p in container["ports"]}


# ---------------------------------------------------------------- a corpus built by a Job


def _build_jobs() -> tuple[dict[str, Any], dict[str, Any]]:
    folder = K8S / "build"
    build = yaml.safe_load((folder / "corpus-build.yaml").read_text())
    merge = yaml.safe_load((folder / "corpus-merge.yaml").read_text())
    return build, merge


def test_the_indexed_build_job_gives_each_pod_its_part_and_the_merge_all_of_them():
    """Every pod of the indexed Job runs a real `corpus build --shard I/N` (its args
    parsed by the real CLI for each index Kubernetes gives, 0 .. completions-1), and
    the merge Job merges exactly those N parts of the same --out."""
    from streampack.corpus.parts import Part

    build, merge = _build_jobs()
    for job in (build, merge):
        assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
        assert DNS_1123.match(job["metadata"]["name"])
        pod = job["spec"]["template"]["spec"]
        assert pod["restartPolicy"] in ("Never", "OnFailure")
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == SERVICE_UID
        (container,) = pod["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    spec = build["spec"]
    assert spec["completionMode"] == "Indexed"
    count = spec["completions"]
    assert 1 <= spec["parallelism"] <= count
    (container,) = spec["template"]["spec"]["containers"]
    shards = [a for a in container["args"] if a.startswith("--shard=")]
    assert shards == [f"--shard=$(JOB_COMPLETION_INDEX)/{count}"]
    outs = set()
    for index in range(count):
        args = [a.replace("$(JOB_COMPLETION_INDEX)", str(index)) for a in container["args"]]
        parsed = _parse_cli(args)
        assert (parsed.command, parsed.action) == ("corpus", "build")
        assert Part.parse(parsed.shard) == Part(index, count)
        outs.add(parsed.out)
    (merger,) = merge["spec"]["template"]["spec"]["containers"]
    parsed = _parse_cli(merger["args"])
    assert (parsed.command, parsed.action) == ("corpus", "merge")
    assert parsed.parts == count and outs == {parsed.out}
    assert merger["image"] == container["image"]
    # The build's input and output are URLs of one store, reached with the same Secret.
    assert build_parser().parse_args(container["args"]).source.startswith("s3://")
    assert merger["envFrom"] == container["envFrom"]
