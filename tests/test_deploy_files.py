"""The container files (deploy/Dockerfile, compose.yaml, k8s/trellis.yaml) against the code they start.

No Docker engine or cluster runs here, so the images are not built; what can be checked is that every
command line parses with the real configs, every path they name exists in the image, Ivy points at
the Tulips that exist, and the health checks call what the services serve.
"""

import re
from pathlib import Path

import pytest
import yaml

from ivy.config import IvyConfig
from tulip.config import TulipConfig

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def expand(s: str) -> str:
    """Compose's ${VAR:-default} with every variable unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", s)


def in_image(path: str) -> Path:
    """/app/... in the image is the repository root here (the Dockerfile copies it there)."""
    assert path.startswith("/app/"), path
    return ROOT / path.removeprefix("/app/")


def check_command(cmd: list[str]):
    """Parse a `python -m tulip|ivy ...` command with the real config; return (role, config)."""
    cmd = [expand(str(c)) for c in cmd]
    assert cmd[:2] == ["python", "-m"], cmd
    role, argv = cmd[2], cmd[3:]
    cfg = (TulipConfig if role == "tulip" else IvyConfig).from_args(argv)
    if role == "tulip":
        assert cfg.host == "0.0.0.0" and cfg.port and cfg.metrics_port
        if cfg.attention_table:  # the sweep's directory: bge-m3's table must be in it
            from rose.layers.attention_table import table_file

            table = in_image(cfg.attention_table)
            assert table.is_file() or (table / table_file((16, 16, 64))).is_file()
    return role, cfg


def test_dockerfile_copies_what_exists():
    text = (DEPLOY / "Dockerfile").read_text()
    copies = re.findall(r"^COPY\s+(.+?)\s+\S+$", text, re.M)
    assert copies
    for sources in copies:
        for src in sources.split():
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    # every package of the project is copied (the install is not editable)
    packages = {d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file() and d.name != "tests"}
    assert packages <= {s for c in copies for s in c.split()}
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert not ignored & {s for c in copies for s in c.split()}  # nothing copied is left out of the context


def test_compose_commands_parse_and_ivy_reaches_the_tulips():
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    tulips = {}
    for name, svc in services.items():
        role, cfg = check_command(svc["command"])
        if role == "tulip":
            tulips[name] = cfg
            assert svc["healthcheck"]["test"][1:4] == ["python", "-m", "tulip.probe"]
            assert svc["healthcheck"]["test"][4] == f"127.0.0.1:{cfg.port}"
            (gpu,) = svc["deploy"]["resources"]["reservations"]["devices"]
            assert gpu["capabilities"] == ["gpu"]
    assert len(tulips) == 2
    gpus = [services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n in tulips]
    assert gpus == [["0"], ["1"]]  # one GPU each
    _, ivy = check_command(services["ivy"]["command"])
    assert sorted(ivy.tulip) == sorted(f"{n}:{c.port}" for n, c in tulips.items())
    assert set(services["ivy"]["depends_on"]) == set(tulips)
    assert f"{ivy.port}:{ivy.port}" in services["ivy"]["ports"]
    assert "/ready" in services["ivy"]["healthcheck"]["test"][-1]


def test_kubernetes_manifests_fit_together():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all((DEPLOY / "k8s" / "trellis.yaml").read_text())}
    sts, headless = docs[("StatefulSet", "tulip")], docs[("Service", "tulip")]
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "tulip"
    (tulip,) = sts["spec"]["template"]["spec"]["containers"]
    _, tcfg = check_command(tulip["args"])
    assert tulip["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert tulip[probe]["grpc"]["port"] == tcfg.port
    ivy_dep = docs[("Deployment", "ivy")]
    (ivy,) = ivy_dep["spec"]["template"]["spec"]["containers"]
    _, icfg = check_command(ivy["args"])
    replicas = sts["spec"]["replicas"]
    assert sorted(icfg.tulip) == sorted(f"tulip-{i}.tulip:{tcfg.port}" for i in range(replicas))
    assert ivy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": icfg.port}
    assert ivy["livenessProbe"]["httpGet"] == {"path": "/health", "port": icfg.port}
    assert docs[("Service", "ivy")]["spec"]["ports"][0]["targetPort"] == icfg.port
    for d in (sts, ivy_dep):  # the model volume is the same claim, read-only
        (vol,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
        assert vol["persistentVolumeClaim"] == {"claimName": "trellis-models", "readOnly": True}


@pytest.mark.parametrize("path", ["/ready", "/health"])
def test_probed_routes_exist(path):
    from ivy.app import create_app

    assert path in create_app(IvyConfig(tulip=("127.0.0.1:1",))).state.route_paths
