"""The container deployment: docker-compose.yml, Prometheus and Grafana files (the Dockerfile:
test_dockerfile.py).

No Docker is needed: the files are parsed and checked against each other and against the
metrics a live server's ``/metrics`` really exports.
"""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import yaml

from engine_testing import one_thread  # noqa: F401  (autouse fixture)
from metrics_testing import families
from server_testing import BLOCK, MAX_MODEL_LEN, run

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SERVICES = ("tiered-kv", "valkey", "prometheus", "grafana")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def server_port(compose: dict) -> int:
    return int(flag(compose["services"]["tiered-kv"]["command"], "--port"))


def test_services_images_and_build(compose: dict):
    services = compose["services"]
    assert set(SERVICES) <= set(services)
    assert services["tiered-kv"]["build"]["dockerfile"] == "Dockerfile"
    assert (ROOT / services["tiered-kv"]["build"].get("context", ".") / "Dockerfile").is_file()
    assert services["valkey"]["image"].startswith("valkey/valkey:")
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/grafana:")


def test_server_command(compose: dict):
    command = compose["services"]["tiered-kv"]["command"]
    assert flag(command, "--host") == "0.0.0.0"
    assert flag(command, "--model") == "${MODEL:-tiny}"
    assert flag(command, "--kv-cache-dir") == "/var/lib/tiered-kv/kv_cache"


def test_serve_accepts_every_flag_of_the_command(compose: dict):
    from tiered_kv.cli import serve

    accepted = {"--" + name.replace("_", "-") for name in inspect.signature(serve).parameters}
    used = {arg for arg in compose["services"]["tiered-kv"]["command"] if arg.startswith("--")}
    assert used <= accepted


def test_ports(compose: dict):
    services = compose["services"]
    expected = {"tiered-kv": server_port(compose), "valkey": 6379, "prometheus": 9090, "grafana": 3000}
    for name, port in expected.items():
        container_ports = {int(str(p).split(":")[-1]) for p in services[name]["ports"]}
        assert port in container_ports, name


def test_the_server_is_published_on_loopback_only(compose: dict):
    """Without a key in the stack's environment, the API must not face the network."""
    for mapping in compose["services"]["tiered-kv"]["ports"]:
        assert str(mapping).startswith("127.0.0.1:"), mapping


def unset(volume: str) -> str:
    """A volume mapping as compose reads it with no variable set: ``${VAR:-default}``
    becomes ``default``."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", volume)


def test_named_volumes_are_declared_and_used(compose: dict):
    declared = set(compose["volumes"])
    used = set()
    for service in compose["services"].values():
        for volume in map(unset, service.get("volumes", [])):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                used.add(source)
    assert used == declared
    cache_mounts = [v for v in compose["services"]["tiered-kv"]["volumes"]
                    if v.split(":")[1] == "/var/lib/tiered-kv/kv_cache"]
    assert len(cache_mounts) == 1 and cache_mounts[0].split(":")[0] in declared
    for service in ("valkey", "prometheus", "grafana"):
        assert any(not v.startswith(".") for v in compose["services"][service]["volumes"]), service


def test_models_are_a_named_volume_or_the_host_folder_models_dir(compose: dict):
    (mount,) = [v for v in compose["services"]["tiered-kv"]["volumes"] if ":/models" in v]
    assert mount == "${MODELS_DIR:-models}:/models:ro"
    assert unset(mount).split(":")[0] in compose["volumes"]
    assert "MODELS_DIR=" in (ROOT / "docs" / "deployment.md").read_text()


def test_bind_mounted_files_exist(compose: dict):
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            if volume.startswith("./"):
                assert (ROOT / volume.split(":")[0]).exists(), volume


def test_the_server_reads_the_deployment_secret_from_a_secret_file(compose: dict):
    """A remote URL needs the shared secret that seals records, or serve exits at start."""
    from tiered_kv.serve_config import ServeConfig

    server = compose["services"]["tiered-kv"]
    assert "--kv-remote-url" in server["command"]
    environment = server["environment"]
    assert not any("SECRET" in name and not name.endswith("_FILE") for name in environment)
    (name,) = server["secrets"]
    assert environment["TIERED_KV_KV_SECRET_FILE"] == f"/run/secrets/{name}"
    assert unset(compose["secrets"][name]["file"]) == "./kv_secret.key"
    settings = ServeConfig.load(
        {"kv_remote_url": flag(server["command"], "--kv-remote-url")}, environ=environment
    )
    assert settings.tier_config().remote_secret_file == f"/run/secrets/{name}"
    assert "kv_secret.key" in (ROOT / "docs" / "deployment.md").read_text()


def test_every_service_has_a_healthcheck(compose: dict):
    for name, service in compose["services"].items():
        test = service.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), name
    server = " ".join(compose["services"]["tiered-kv"]["healthcheck"]["test"])
    assert f":{server_port(compose)}/health" in server
    assert compose["services"]["valkey"]["healthcheck"]["test"][1:] == ["valkey-cli", "ping"]


def test_dependencies_wait_for_health(compose: dict):
    services = compose["services"]
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency]
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_gpu_reservation(compose: dict):
    devices = compose["services"]["tiered-kv"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)


def test_prometheus_scrapes_the_server(compose: dict):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [
        target
        for job in config["scrape_configs"]
        if job.get("metrics_path", "/metrics") == "/metrics"
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    assert f"tiered-kv:{server_port(compose)}" in targets
    mount = "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    assert mount in compose["services"]["prometheus"]["volumes"]


def test_grafana_provisioning(compose: dict):
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((provisioning / "dashboards" / "tiered-kv.yml").read_text())
    (provider,) = providers["providers"]
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tiered-kv.json").read_text())
    for panel in dashboard["panels"]:
        for target in [panel, *panel["targets"]]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]


@pytest.fixture(scope="module")
def exported_names(tmp_path_factory) -> set[str]:
    """Every sample name a live ``/metrics`` can show (its families after a request): server,
    engine and tier metrics."""
    from engine import AsyncLLM
    from tiered_kv import TierConfig, TierManager

    manager = TierManager(TierConfig(kv_cache_dir=tmp_path_factory.mktemp("kv") / "kv",
                                     cpu_bytes=1 << 20, disk_bytes=16 << 20))
    llm = AsyncLLM("tiny", kv_connector=manager, max_model_len=MAX_MODEL_LEN,
                   num_gpu_blocks_override=32, block_size=BLOCK, device="cpu")

    async def scrape(c):
        await c.post("/v1/completions", json={"prompt": "Dashboards.", "max_tokens": 2})
        return (await c.get("/metrics")).text

    try:
        text = run(llm, scrape)
    finally:
        llm.shutdown()
    suffixes = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    # a histogram's samples appear with its first observation; its # TYPE line is always there
    return {name + suffix for name, kind in families(text).items() for suffix in suffixes[kind]}


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tiered-kv.json").read_text())
    return [(panel["title"], t["expr"]) for panel in dashboard["panels"] for t in panel["targets"]]


def rule_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    return [(rule["alert"], rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> list[str]:
    return re.findall(r"\b(?:vllm:[a-z0-9_:]+|tiered_kv_[a-z0-9_]+)", expr)


def test_dashboard_and_rules_use_only_exported_metrics(exported_names: set[str]):
    assert "vllm:time_to_first_token_seconds_bucket" in exported_names
    assert "tiered_kv_hit_blocks_total" in exported_names
    for title, expr in dashboard_exprs() + rule_exprs():
        assert metric_names(expr), f"{title!r} names no metric"
        for name in metric_names(expr):
            assert name in exported_names, f"{title!r} uses {name}, which is not exported"


def test_dashboard_filters_by_the_model_name_label():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tiered-kv.json").read_text())
    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "model_name"
    for title, expr in dashboard_exprs():
        selectors = re.findall(r"(?:vllm:[a-z0-9_:]+|tiered_kv_[a-z0-9_]+)(\{[^}]*\})?", expr)
        assert all('model_name=~"$model_name"' in s for s in selectors), (title, expr)


def test_dashboard_has_the_promised_panels():
    exprs = " ".join(expr for _, expr in dashboard_exprs())
    titles = " ".join(title for title, _ in dashboard_exprs()).lower()
    assert "histogram_quantile" in exprs and "vllm:time_to_first_token_seconds_bucket" in exprs
    for words in ("time to first token", "inter-token latency", "running and waiting",
                  "hit rate", "occupancy", "bytes moved", "dropped", "preemptions"):
        assert words in titles


def test_prometheus_loads_the_rules(compose: dict):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules.yml"]
    mount = "./deploy/prometheus/rules.yml:/etc/prometheus/rules.yml:ro"
    assert mount in compose["services"]["prometheus"]["volumes"]
