"""docker-compose.yml and the Dockerfile: the file is valid (``docker-compose config``, which
parses it without an engine), and the commands it runs work, run here as processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis as redis_client

from splitbus.model_files.fetch import DEFAULT, SOURCES, fetched_path
from splitbus.redis_server import SPLITBUS_COMMANDS, EmbeddedRedis, free_port
from splitbus.worker.engines.sim import sim_text
from tests.deploy.compose import ROOT, SECRETS, compose, compose_config, host_ip, parse_command

PARTS = ("api", "scheduler", "prefill", "decode")


def test_the_compose_file_is_valid_and_complete() -> None:
    config = compose_config()
    services = config["services"]
    assert set(PARTS) | {"redis"} <= set(services)
    redis = services["redis"]
    assert redis["image"].startswith("redis:") and redis["entrypoint"] == ["sh", "/splitbus/redis-entrypoint.sh"]
    assert "appendonly yes" in ENTRYPOINT.read_text()
    for name in PARTS:
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    assert redis["healthcheck"]["test"][0] == "CMD-SHELL" and "grep -qx PONG" in redis["healthcheck"]["test"][1]
    url = f"redis://splitbus:{SECRETS['SPLITBUS_REDIS_PASSWORD']}@redis:6379/0"
    for name in PARTS:
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert services[name]["environment"]["SPLITBUS_REDIS_URL"] == url
    assert services["prefill"]["command"][services["prefill"]["command"].index("--engine") + 1] == "paddle"


ENTRYPOINT = ROOT / "deploy" / "redis-entrypoint.sh"


def test_nothing_is_published_beyond_this_host_by_default() -> None:
    services = compose_config()["services"]
    published = [(name, port) for name, s in services.items() for port in s.get("ports", [])]
    assert {name for name, _ in published} == {"api", "prometheus", "grafana"}  # Redis, workers, metrics: not at all
    for name, port in published:
        assert host_ip(port) == "127.0.0.1", (name, port)
    opened = compose_config(SPLITBUS_API_BIND="0.0.0.0")["services"]["api"]["ports"][0]
    assert host_ip(opened) == "0.0.0.0"  # only when asked for


@pytest.mark.parametrize(
    ("service", "variable"), [("prometheus", "SPLITBUS_PROMETHEUS_BIND"), ("grafana", "SPLITBUS_GRAFANA_BIND")]
)
def test_the_monitoring_services_publish_on_this_host_unless_asked(service: str, variable: str) -> None:
    """Published only with the monitoring profile, on loopback; another address only when given,
    and no secret of their own is needed (compose interpolates every profile's variables)."""
    services = compose_config("monitoring")["services"]
    assert services[service]["profiles"] == ["monitoring"]
    assert [host_ip(port) for port in services[service]["ports"]] == ["127.0.0.1"]
    opened = compose_config("monitoring", **{variable: "0.0.0.0"})["services"][service]["ports"]
    assert [host_ip(port) for port in opened] == ["0.0.0.0"]


def test_grafana_shows_to_anonymous_viewers_only() -> None:
    grafana = compose_config("monitoring")["services"]["grafana"]
    assert ":" in grafana["image"] and not grafana["image"].endswith(":latest")  # pinned
    env = grafana["environment"]
    assert (env["GF_AUTH_ANONYMOUS_ENABLED"], env["GF_AUTH_ANONYMOUS_ORG_ROLE"]) == ("true", "Viewer")
    assert (env["GF_AUTH_DISABLE_LOGIN_FORM"], env["GF_AUTH_BASIC_ENABLED"], env["GF_USERS_ALLOW_SIGN_UP"]) == (
        "true",
        "false",
        "false",
    )


def test_the_planner_advises_with_metrics_on_the_parts_port() -> None:
    planner = compose_config("monitoring")["services"]["planner"]
    assert planner["profiles"] == ["monitoring"] and "ports" not in planner
    assert planner["environment"]["SPLITBUS_REDIS_URL"].startswith("redis://splitbus:")
    args = parse_command(planner["command"])
    assert args.command == "planner" and (args.metrics_port, args.metrics_host) == (9100, "0.0.0.0")
    assert (args.ttft_slo_ms, args.itl_slo_ms) == (2000, 100)
    assert planner["healthcheck"]["test"][-1].endswith("urlopen('http://127.0.0.1:9100/metrics', timeout=3)")


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_the_secrets_are_required(missing: str) -> None:
    out = compose(**{k: v for k, v in SECRETS.items() if k != missing})
    assert out.returncode != 0 and f"set {missing}" in out.stderr


def test_secrets_reach_the_parts_by_environment_only() -> None:
    services = compose_config()["services"]
    assert services["api"]["environment"]["SPLITBUS_API_KEYS"] == SECRETS["SPLITBUS_API_KEYS"]
    for name in ("scheduler", "prefill", "decode", "planner"):
        assert "SPLITBUS_API_KEYS" not in services[name]["environment"], name  # only the API needs them
    for name, service in services.items():
        words = " ".join(map(str, [*service.get("command", []), *service.get("entrypoint", [])]))
        for secret in SECRETS.values():
            assert secret not in words, name


def test_the_compose_redis_acl_is_the_embedded_one() -> None:
    script = ENTRYPOINT.read_text()
    listed = re.search(r'COMMANDS="([^"]*)"', script)
    assert listed is not None
    assert listed.group(1).replace("\\\n", " ").split() == [f"+{c}" for c in SPLITBUS_COMMANDS]
    assert "-@all $COMMANDS" in script and "user default reset off" in script
    assert "requirepass" not in script and 'redis-server "$conf"' in script  # no password on argv


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils")
def test_the_compose_redis_starts_locked_down(tmp_path: Path) -> None:
    """The entrypoint script run here, with redis-server and docker-entrypoint.sh stubbed by the
    embedded binary: the splitbus user works, CONFIG is refused, no password is on argv."""
    from splitbus.redis_server import find_redis_server

    port = free_port()
    (tmp_path / "docker-entrypoint.sh").write_text(
        f'#!/bin/sh\nshift\nsed -i "s#^appendonly yes#appendonly no#" "$1"\necho "port {port}" >> "$1"\n'
        f'exec {find_redis_server()} "$1"\n'
    )
    os.chmod(tmp_path / "docker-entrypoint.sh", 0o755)
    script = ENTRYPOINT.read_text().replace("conf=/tmp/redis.conf", f"conf={tmp_path}/redis.conf")
    (tmp_path / "entry.sh").write_text(script)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "SPLITBUS_REDIS_PASSWORD": SECRETS["SPLITBUS_REDIS_PASSWORD"]}
    proc = subprocess.Popen(["sh", str(tmp_path / "entry.sh")], env=env, cwd=tmp_path)
    try:
        client = redis_client.Redis(port=port, username="splitbus", password=SECRETS["SPLITBUS_REDIS_PASSWORD"])
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis_client.ConnectionError:
                assert time.monotonic() < deadline and proc.poll() is None, "the compose Redis did not start"
                time.sleep(0.05)
        with pytest.raises(redis_client.exceptions.NoPermissionError):
            client.config_set("dir", "/tmp")
        with pytest.raises(redis_client.exceptions.AuthenticationError):
            redis_client.Redis(port=port).ping()  # the default user is off
        assert SECRETS["SPLITBUS_REDIS_PASSWORD"] not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        assert stat.S_IMODE((tmp_path / "redis.conf").stat().st_mode) == 0o600
        assert SECRETS["SPLITBUS_REDIS_PASSWORD"] not in (tmp_path / "redis.conf").read_text()
    finally:
        proc.terminate()
        proc.wait(10)


def test_environment_switches_engine_and_model() -> None:
    services = compose_config(SPLITBUS_ENGINE="sim", SPLITBUS_MODEL="/models/qwen", SPLITBUS_MODELS_DIR="/srv/hf")[
        "services"
    ]
    for name in ("prefill", "decode"):
        command = services[name]["command"]
        assert command[command.index("--engine") + 1] == "sim"
        assert command[command.index("--model") + 1] == "/models/qwen"
        assert any(str(v).startswith("/srv/hf:/models") for v in services[name]["volumes"])
    assert services["api"]["command"][services["api"]["command"].index("--model") + 1] == "/models/qwen"


def test_the_api_runs_a_pinned_number_of_processes() -> None:
    """Not the API's default (one per core it may use): every part shares the compose host's cores."""
    for env, workers in (({}, "2"), ({"SPLITBUS_API_WORKERS": "4"}, "4")):
        command = compose_config(**env)["services"]["api"]["command"]
        assert command[command.index("--workers") + 1] == workers


CLUSTER_NODES = [f"redis-node-{i}" for i in range(6)]
CLUSTER_ADDRESS = ",".join(f"{node}:6379" for node in CLUSTER_NODES)


def test_the_cluster_profile_forms_six_nodes_and_points_the_parts_at_them() -> None:
    from splitbus.cli.embedded import parse_cluster_url

    pointed = {"SPLITBUS_REDIS_SCHEME": "redis+cluster", "SPLITBUS_REDIS_ADDRESS": CLUSTER_ADDRESS}
    services = compose_config("cluster", SPLITBUS_REDIS_ADMIN_PASSWORD="compose-admin-pw-0123456789", **pointed)[
        "services"
    ]
    for node in CLUSTER_NODES:
        service = services[node]
        assert service["profiles"] == ["cluster"] and service["entrypoint"] == ["sh", "/splitbus/redis-entrypoint.sh"]
        assert service["environment"]["SPLITBUS_REDIS_CLUSTER"] == "yes", node
        assert any(str(v).startswith(f"{node}-data:") or f"{node}-data" in str(v) for v in service["volumes"]), node
        assert "ports" not in service, node
    init = services["redis-cluster-init"]
    assert init["profiles"] == ["cluster"] and init["restart"] == "no"
    assert {node: dep["condition"] for node, dep in init["depends_on"].items()} == dict.fromkeys(
        CLUSTER_NODES, "service_healthy"
    )
    assert init["environment"]["SPLITBUS_REDIS_NODES"].split() == CLUSTER_ADDRESS.split(",")
    for name in PARTS:
        url = parse_cluster_url(services[name]["environment"]["SPLITBUS_REDIS_URL"])
        assert url.nodes == tuple((node, 6379) for node in CLUSTER_NODES), name
        assert (url.username, url.password) == ("splitbus", SECRETS["SPLITBUS_REDIS_PASSWORD"])


def _compose_node(tmp_path: Path, name: str, port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The compose entrypoint run here in ``tmp_path/name`` (its config and nodes.conf there),
    with docker-entrypoint.sh stubbed by the embedded binary on ``port``."""
    from splitbus.redis_server import find_redis_server

    folder = tmp_path / name
    folder.mkdir()
    (folder / "docker-entrypoint.sh").write_text(
        f'#!/bin/sh\nshift\nsed -i "s#^appendonly yes#appendonly no#" "$1"\necho "port {port}" >> "$1"\n'
        f'exec {find_redis_server()} "$1"\n'
    )
    os.chmod(folder / "docker-entrypoint.sh", 0o755)
    script = ENTRYPOINT.read_text().replace("conf=/tmp/redis.conf", f"conf={folder}/redis.conf")
    (folder / "entry.sh").write_text(script)
    environment = {"PATH": f"{folder}:{os.environ['PATH']}", **env}
    return subprocess.Popen(["sh", str(folder / "entry.sh")], env=environment, cwd=folder)


@pytest.mark.timeout(90)
@pytest.mark.skipif(shutil.which("sha256sum") is None or shutil.which("getent") is None, reason="needs coreutils")
def test_the_compose_cluster_forms_here(tmp_path: Path) -> None:
    """Six nodes from the compose entrypoint in cluster mode, formed by the init script (with
    the redis-cli beside the embedded server): every primary gets a replica that syncs as the
    replicator user, and the splitbus user reads and writes through a cluster client."""
    from splitbus.cli.embedded import cluster_url, sync_client
    from splitbus.cli.redis_cli_cmd import find_cli
    from splitbus.redis_cluster import free_cluster_port, parse_nodes

    admin = "compose-admin-pw-0123456789"
    env = {**SECRETS, "SPLITBUS_REDIS_CLUSTER": "yes", "SPLITBUS_REDIS_ADMIN_PASSWORD": admin}
    taken: set[int] = set()
    ports = []
    for _ in range(6):
        ports.append(free_cluster_port("127.0.0.1", taken))
        taken |= {ports[-1], ports[-1] + 10000}
    nodes = [_compose_node(tmp_path, f"node-{i}", port, env) for i, port in enumerate(ports)]
    try:
        clients = [redis_client.Redis(port=port, password=admin) for port in ports]
        for client in clients:
            _wait_for_ping(client)
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "redis-cli").symlink_to(find_cli())
        (bin_dir / "getent").write_text('#!/bin/sh\necho "127.0.0.1 $2"\n')  # the nodes' names resolve here
        os.chmod(bin_dir / "getent", 0o755)
        init_env = {
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "REDISCLI_AUTH": admin,
            "SPLITBUS_REDIS_NODES": " ".join(f"localhost:{port}" for port in ports),
        }
        init = ROOT / "deploy" / "redis-cluster-init.sh"
        done = subprocess.run(["sh", str(init)], env=init_env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "the cluster is healthy" in done.stdout, done.stdout + done.stderr
        _wait_for_replicas(clients)
        rows = parse_nodes(clients[0].execute_command("CLUSTER", "NODES").decode())
        assert sum(row.primary for row in rows) == 3 and len(rows) == 6
        again = subprocess.run(["sh", str(init)], env=init_env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "formed already" in again.stdout, again.stdout + again.stderr
        url = cluster_url("splitbus", SECRETS["SPLITBUS_REDIS_PASSWORD"], [("127.0.0.1", port) for port in ports])
        cluster = sync_client(url, decode_responses=True)
        try:
            for i in range(30):
                cluster.set(f"compose-cluster:{i}", i)
            assert cluster.get("compose-cluster:7") == "7"
        finally:
            cluster.close()
        for folder in tmp_path.glob("node-*"):
            text = (folder / "redis.conf").read_text()
            assert admin not in text and SECRETS["SPLITBUS_REDIS_PASSWORD"] not in text
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            node.wait(10)


def _wait_for_ping(client: redis_client.Redis, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            assert client.ping()
            return
        except redis_client.ConnectionError:
            assert time.monotonic() < deadline, "a compose Redis node did not start"
            time.sleep(0.05)


def _wait_for_replicas(clients: list[redis_client.Redis], timeout_s: float = 30) -> None:
    """Until every replica's link to its primary is up (it logged in as the replicator)."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [client.info("replication") for client in clients]
        replicas = [info for info in infos if info["role"] == "slave"]
        if len(replicas) == 3 and all(info["master_link_status"] == "up" for info in replicas):
            return
        assert time.monotonic() < deadline, f"replicas not in sync: {infos}"
        time.sleep(0.1)


def test_the_parts_serve_the_model_the_image_bakes_in() -> None:
    """The default --model is where `splitbus fetch-model` puts SmolLM2 in the image's data folder,
    and the Dockerfile fetches and converts it there at build time."""
    baked = fetched_path(SOURCES[DEFAULT], Path("/opt/splitbus/models"))
    services = compose_config()["services"]
    for name in ("api", "prefill", "decode"):
        command = services[name]["command"]
        assert command[command.index("--model") + 1] == str(baked), name
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ENV SPLITBUS_DATA_DIR=/opt/splitbus" in dockerfile
    assert f"splitbus fetch-model {DEFAULT} --convert" in dockerfile


def test_the_dockerfile_is_slim_and_runs_as_a_user() -> None:
    lines = [
        line.split() for line in (ROOT / "Dockerfile").read_text().splitlines() if line and not line.startswith("#")
    ]
    assert lines[0][0] == "FROM" and lines[0][1].endswith("-slim")
    user = [words[1] for words in lines if words[0] == "USER"]
    assert user and user[-1] != "root"
    assert ["ENTRYPOINT", '["splitbus"]'] in lines
    assert "tests" in (ROOT / ".dockerignore").read_text().split()


class Deployment:
    """The compose services' commands as local processes: service host names become loopback
    and every port a free one."""

    def __init__(self, services: dict, redis_url: str, prefix: str) -> None:
        self.ports = {
            name: {"8000": str(free_port()), "9100": str(free_port()), "7000": str(free_port())} for name in PARTS
        }
        self.env = {
            **os.environ,
            **services["api"]["environment"],
            "SPLITBUS_REDIS_URL": redis_url,
            "SPLITBUS_PREFIX": prefix,
        }
        self.api_key = services["api"]["environment"]["SPLITBUS_API_KEYS"]
        self.procs = {
            name: self._start(name, services[name]["command"]) for name in ("scheduler", "prefill", "decode", "api")
        }
        self.services = services

    def local(self, name: str, words: list[str]) -> list[str]:
        mapping = {"0.0.0.0": "127.0.0.1", "prefill": "127.0.0.1", "decode": "127.0.0.1", **self.ports[name]}
        return [self._rewrite(w, mapping) for w in words]

    @staticmethod
    def _rewrite(word: str, mapping: dict[str, str]) -> str:
        if word in mapping and word not in ("prefill", "decode"):
            return mapping[word]
        for port in ("8000", "9100"):
            word = word.replace(f"127.0.0.1:{port}", f"127.0.0.1:{mapping.get(port, port)}")
        return word

    def _start(self, name: str, command: list[str]) -> subprocess.Popen[str]:
        args = self.local(name, command)
        if "--transfer-advertise-host" in args:
            args[args.index("--transfer-advertise-host") + 1] = "127.0.0.1"
        return subprocess.Popen(
            [sys.executable, "-m", "splitbus.cli.main", *args],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def healthy(self, name: str) -> bool:
        test = self.local(name, self.services[name]["healthcheck"]["test"][1:])
        assert test[0] == "python"
        return subprocess.run([sys.executable, *test[1:]], capture_output=True, timeout=10, check=False).returncode == 0

    def stop(self) -> dict[str, int | None]:
        for proc in self.procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = None
        return codes


@pytest.fixture
def deployment(redis_server: EmbeddedRedis, tiny_model: Path) -> Iterator[Deployment]:
    services = compose_config(SPLITBUS_ENGINE="sim", SPLITBUS_MODEL=str(tiny_model))["services"]
    running = Deployment(services, redis_server.url, f"d{uuid.uuid4().hex[:8]}")
    yield running
    # The API runs --workers 2: its parent stops both processes on SIGTERM and exits 0 (a single
    # process, --workers 1, would end by the signal uvicorn re-raises: exit status 143).
    assert running.stop() == {"scheduler": 0, "prefill": 0, "decode": 0, "api": 0}


def test_the_compose_commands_serve_a_request(deployment: Deployment) -> None:
    api = f"http://127.0.0.1:{deployment.ports['api']['8000']}"
    deadline = time.monotonic() + 90
    while not _ok(f"{api}/ready"):
        assert time.monotonic() < deadline, "the API did not become ready"
        assert all(p.poll() is None for p in deployment.procs.values()), "a part exited"
        time.sleep(0.2)
    for name in PARTS:
        assert deployment.healthy(name), f"{name}'s health check failed"
    wrong = openai.OpenAI(base_url=f"{api}/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="compose", max_tokens=6)
    client = openai.OpenAI(base_url=f"{api}/v1", api_key=deployment.api_key, max_retries=0, timeout=60)
    reply = client.completions.create(model="tiny", prompt="compose", max_tokens=6, seed=3)
    assert reply.choices[0].text == sim_text(3, 6)
    scheduler_metrics = (
        urllib.request.urlopen(f"http://127.0.0.1:{deployment.ports['scheduler']['9100']}/metrics", timeout=5)
        .read()
        .decode()
    )
    assert 'splitbus_scheduler_dispatches_total{outcome="dispatched"} 1.0' in scheduler_metrics


def _ok(url: str) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=2).status == 200
    except OSError:
        return False
