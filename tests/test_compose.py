"""docker-compose.yml, checked statically (no Docker engine runs here): every service's command must
parse with the real CLI, and the nginx config must pass `nginx -t` where nginx is installed."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pagedserve.services.cli import SERVICES, _service_args

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = {"keys", "redis", "kvstore", "worker", "scheduler", "router", "nginx", "prometheus", "grafana"}


def _substitute(value: str) -> str:
    """Compose's ${VAR:-default} with the defaults, as `docker compose config` would."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_present(compose):
    assert EXPECTED <= set(compose["services"])
    assert compose["services"]["router"]["deploy"]["replicas"] == 2
    assert compose["services"]["router"]["healthcheck"]["test"][-1].endswith("/ready")
    assert compose["services"]["worker"]["ipc"] == "host"
    assert "devices" in str(compose["services"]["worker"]["deploy"]["resources"])


def test_kvstore_and_worker_share_one_gpu_and_ipc(compose):
    """The worker maps the kvstore's pool and events through CUDA IPC: same device, shared IPC."""
    kv, worker = compose["services"]["kvstore"], compose["services"]["worker"]
    for svc in (kv, worker):
        assert svc["ipc"] == "host" and svc["pid"] == "host"
    devices = [svc["deploy"]["resources"]["reservations"]["devices"] for svc in (kv, worker)]
    assert devices[0] == devices[1] and "device_ids" in devices[0][0]


def test_the_kvstores_block_bytes_fit_the_workers_dtype(compose, tiny_llama):
    import torch
    from pagedserve.services.worker.model_loader import inspect_model_dir
    kv = [_substitute(str(a)) for a in compose["services"]["kvstore"]["command"]]
    worker = [_substitute(str(a)) for a in compose["services"]["worker"]["command"]]
    _, spec = inspect_model_dir(tiny_llama)   # the image's /models/tiny is built the same way
    dtype = getattr(torch, worker[worker.index("--dtype") + 1])
    block_size = int(worker[worker.index("--block-size") + 1])
    assert int(kv[kv.index("--block-bytes") + 1]) == spec.block_bytes(block_size, dtype)


@pytest.mark.parametrize("name", ["kvstore", "worker", "scheduler", "router"])
def test_command_parses_with_real_cli(compose, name):
    argv = [_substitute(str(a)) for a in compose["services"][name]["command"]]
    assert argv[0] in SERVICES
    args = _service_args(argv)              # argparse exits (SystemExit) on an unknown flag
    assert args.command == name


def test_every_zeromq_process_gets_the_curve_keys_made_first(compose, tmp_path):
    """The engine's sockets listen on the compose network: each process reads the keys volume
    (PAGEDSERVE_CURVE_KEYS) after the one-shot keys service wrote it, and the keys it writes load."""
    from pagedserve.services.cli import build_parser
    from pagedserve.services.curve import CurveKeys, is_local
    services = compose["services"]
    keys = services["keys"]
    args = build_parser().parse_args(keys["command"][:1] + [str(tmp_path / "k")])
    assert args.func(args) == 0 and CurveKeys.load(str(tmp_path / "k")).client_secret is not None
    assert keys["restart"] == "no" and keys["volumes"] == ["curve-keys:/keys"]
    for name in ("kvstore", "worker", "scheduler", "router"):
        svc = services[name]
        folder = svc["environment"]["PAGEDSERVE_CURVE_KEYS"]
        assert f"curve-keys:{folder}:ro" in svc["volumes"] and keys["command"][1] == folder, name
        assert svc["depends_on"]["keys"] == {"condition": "service_completed_successfully"}, name
        argv = [_substitute(str(a)) for a in svc["command"]]
        if "--endpoint" in argv:   # why the keys are needed: a network address
            assert not is_local(argv[argv.index("--endpoint") + 1]), name


def test_nginx_config_is_valid(tmp_path):
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        pytest.skip("nginx is not installed here (.ci/run installs it when it can)")
    # The upstream host only resolves inside compose's network: check the syntax against loopback.
    conf = (ROOT / "deploy" / "nginx.conf").read_text().replace("server router:8000", "server 127.0.0.1:8000")
    (tmp_path / "nginx.conf").write_text(conf)
    (tmp_path / "logs").mkdir()
    res = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"),
                          "-g", f"pid {tmp_path}/nginx.pid; error_log {tmp_path}/logs/error.log;"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_prometheus_and_grafana_are_provisioned_from_deploy(compose):
    """Every file the two services mount exists; Prometheus's config passes promtool where it is
    installed; the dashboard is JSON whose data sources are the provisioned one."""
    import json
    for name in ("prometheus", "grafana"):
        for volume in compose["services"][name]["volumes"]:
            assert (ROOT / volume.split(":")[0]).exists(), (name, volume)
    dash = json.loads((ROOT / "deploy/grafana/dashboards/pagedserve.json").read_text())
    assert dash["uid"] == "pagedserve" and len([p for p in dash["panels"] if p["type"] != "row"]) >= 12
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["uid"] == dash["templating"]["list"][0]["current"]["value"]
    promtool = shutil.which("promtool")
    if promtool:
        r = subprocess.run([promtool, "check", "config", str(ROOT / "deploy/prometheus.yml")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
