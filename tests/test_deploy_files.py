"""The deploy files (deploy/Dockerfile.*, compose.yaml, k8s/) linted, validated against their
schemas, and checked against the code they start.

No container runtime or cluster runs here (no Docker daemon, and no registry can be reached to pull
a base image), so no image is built: hadolint lints the Dockerfiles, the compose file is validated
against the Compose Specification's schema (vendored: tests/schemas/README.md), every Kubernetes
manifest against the API schemas `kubernetes-validate` ships (strict: unknown fields fail), and every
command, flag, environment variable, port, probe and path is read out of the files and checked with
the real configs (`TulipConfig` / `IvyConfig` parse each command with the environment the file gives
it, as the service would), the Dockerfiles' COPY lines and the repository.
"""

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deployfiles import (DEPLOY, DOCKERFILES, ROOT, args, copies, dotenv, env, exec_form, instructions,
                               interpolate, parse_command, pending_ivy_fields, source_of, values, variables)

K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yaml"
UID = "10001"


def tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert path, f"{name} is not installed (the test extra of pyproject.toml installs it)"
    return path


# --- Dockerfiles ---------------------------------------------------------------------------------

@pytest.mark.parametrize("role", sorted(DOCKERFILES))
def test_dockerfile_passes_hadolint(role):
    r = subprocess.run([tool("hadolint"), "--no-color", str(DOCKERFILES[role])], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    """The lint bites: an unpinned base image and root at the end fail it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\nCMD [\"python\"]\n")
    r = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3007" in r.stdout, r.stdout


@pytest.mark.parametrize("role", sorted(DOCKERFILES))
def test_dockerfile_copies_what_exists_and_installs_pinned(role):
    path = DOCKERFILES[role]
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for src, _ in copies(path):
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert src.split("/")[0] not in ignored, f"COPY {src}: left out of the build context by .dockerignore"
    base = args(path).get("BASE") or values(path, "FROM")[0]
    for image in {base, *(a for a in (args(path).get("BASE"),) if a)}:
        assert re.search(r":\d+\.\d+\.\d+", image), f"{image}: not pinned to a release"
    # every pip install takes its versions from the committed constraints
    for rest in values(path, "RUN"):
        for cmd in re.split(r"&&|;", rest):
            if re.search(r"\bpip install\b", cmd):
                assert "-c deploy/constraints.txt" in cmd, f"unconstrained: {cmd.strip()}"
    assert values(path, "USER")[-1] == f"{UID}:{UID}"  # not root, numeric (runAsNonRoot can check it)
    (health,) = values(path, "HEALTHCHECK")
    assert "--start-period" in health


def test_the_images_hold_their_packages_and_no_more():
    copied = {role: {src for src, _ in copies(p) if (ROOT / src / "__init__.py").is_file()}
              for role, p in DOCKERFILES.items()}  # whole packages (deploy/ and benchmarks/ lend single files)
    assert copied["tulip"] == {"trellis", "presets", "rose", "tulip"}  # presets: --model preset:NAME
    assert copied["gateway"] == {"trellis", "ivy"}  # Ivy stands on the contracts alone (Tulip's client: trellis.client)
    installs = [c for rest in values(DOCKERFILES["gateway"], "RUN") for c in re.split(r"&&|;", rest) if "pip install" in c]
    assert any('".[${EXTRAS}]"' in c for c in installs) and not any("torch" in c for c in installs)
    assert args(DOCKERFILES["gateway"])["EXTRAS"] == "gateway"  # (a build arg: gateway,tracing adds traces)


def test_image_commands_and_health_checks_match():
    tulip = DOCKERFILES["tulip"]
    _, tcfg = parse_command(exec_form(values(tulip, "CMD")[0]))
    probe = exec_form(values(tulip, "HEALTHCHECK")[0])
    assert probe[:3] == ["python", "-m", "tulip.probe"] and probe[3] == f"127.0.0.1:{tcfg.port}"
    assert {str(tcfg.port), str(tcfg.metrics_port)} <= set(" ".join(values(tulip, "EXPOSE")).split())
    gateway = DOCKERFILES["gateway"]
    _, icfg = parse_command(exec_form(values(gateway, "CMD")[0]) + ["--tulip", "tulip:50051"])
    check = exec_form(values(gateway, "HEALTHCHECK")[0])
    assert f"http://127.0.0.1:{icfg.port}/health" in check[-1]
    assert str(icfg.port) in values(gateway, "EXPOSE")
    assert (ROOT / "deploy" / "prebuild.sh").stat().st_mode & 0o111  # the compose prebuild runs it


def test_kernel_caches_and_presets_live_on_the_cache_volume(monkeypatch):
    e = env(DOCKERFILES["tulip"])
    (volume,) = [json.loads(v)[0] for v in values(DOCKERFILES["tulip"], "VOLUME")]
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "TRELLIS_CACHE"):
        assert e[var].startswith(volume), (var, e[var])
    import presets

    monkeypatch.setenv("TRELLIS_CACHE", e["TRELLIS_CACHE"])  # the variable the presets' cache is read from
    assert str(presets.cache_dir()).startswith(volume)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    return dict(line.split("==") for line in path.read_text().splitlines() if line and not line.startswith("#"))


def test_constraints_are_what_the_tests_run():
    """deploy/constraints.txt (the images' versions) holds what this environment runs (make test installs
    with it), and pins every dependency pyproject.toml names. After an upgrade: python -m deploy.lock."""
    pinned = {canonical(n): v for n, v in pins(DEPLOY / "constraints.txt").items()}
    differ = {}
    for name, version in pinned.items():
        try:
            have = importlib.metadata.version(name).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != version:
            differ[name] = (version, have)
    assert not differ, f"constraints.txt (pinned, installed) differ: {differ}; regenerate: python -m deploy.lock"
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for req in project["dependencies"] + extras["gateway"] + extras["tulip"] + extras["test"]:
        name = canonical(re.match(r"[A-Za-z0-9_.-]+", req).group())
        assert name in pinned or name in ("trellis", "triton"), f"{req}: not pinned in deploy/constraints.txt"
    torch_cpu = re.search(r"torch==([\d.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert pinned["torch"] == torch_cpu  # the Makefile's CPU pin and the images' torch agree
    assert "-c deploy/constraints.txt" in (ROOT / "Makefile").read_text()


# --- compose -------------------------------------------------------------------------------------

def compose(env_file: bool) -> dict:
    doc = yaml.safe_load(COMPOSE.read_text())  # YAML merge keys (<<: *tulip) resolved here
    return interpolate(doc, dotenv(DEPLOY / ".env.example") if env_file else {})


@pytest.mark.parametrize("env_file", [False, True], ids=["defaults", "env-example"])
def test_compose_validates_against_the_compose_spec(env_file):
    import jsonschema

    schema = json.loads((ROOT / "tests" / "schemas" / "compose-spec.json").read_text())
    jsonschema.validate(compose(env_file), schema, cls=jsonschema.Draft7Validator)
    bad = compose(env_file)
    bad["services"]["ivy"]["depends_on"]["tulip-0"]["condition"] = "healthy"  # not a condition compose knows
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema, cls=jsonschema.Draft7Validator)


def test_env_example_names_every_variable():
    secrets = {s["environment"] for s in yaml.safe_load(COMPOSE.read_text())["secrets"].values() if "environment" in s}
    used, example = variables(COMPOSE.read_text()) | secrets, dotenv(DEPLOY / ".env.example")
    assert used <= set(example) | {"TULIP_IMAGE", "GATEWAY_IMAGE", "TULIP_CPU_IMAGE", "GATEWAY_CPU_IMAGE"}
    assert set(example) - {"COMPOSE_PROFILES"} <= used  # nothing in the example is dead
    assert set(example["COMPOSE_PROFILES"].split(",")) <= {"gpu", "cpu"}
    # the filled-in copy (API keys) stays out of git and out of the images' build context
    assert "/deploy/.env" in (ROOT / ".gitignore").read_text().split()
    assert "deploy/.env" in (ROOT / ".dockerignore").read_text().split()


def service_config(svc: dict):
    return parse_command(svc["command"], svc.get("environment"))


def in_profile(services: dict, profile: str) -> dict:
    return {n: s for n, s in services.items() if profile in s.get("profiles", [])}


def test_compose_gpu_node_eight_tulips_behind_one_ivy():
    services = in_profile(compose(env_file=True)["services"], "gpu")
    tulips = {n: s for n, s in services.items() if s["command"][2] == "tulip"}
    assert len(tulips) == 8
    devices = []
    for name, svc in tulips.items():
        _, cfg = service_config(svc)
        assert cfg.host == "0.0.0.0" and cfg.compile and cfg.warmup
        hf_cache(svc, cfg)
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "tulip.probe", f"127.0.0.1:{cfg.port}"]
        (gpu,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert gpu["capabilities"] == ["gpu"] and gpu["driver"] == "nvidia"
        devices += gpu["device_ids"]
        # the attention tables are where the flag points, in the image the service runs
        table = source_of(DOCKERFILES["tulip"], f"{cfg.attention_table}/attention_table_16x16x64.json")
        assert table is not None and table.is_file()
        assert float(svc["stop_grace_period"].rstrip("s")) > 2 * cfg.drain_seconds
        assert svc["restart"] == "unless-stopped" and svc["logging"]["options"]["max-size"]
        assert "kernel-cache:/cache" in svc["volumes"]
    assert sorted(devices) == [str(i) for i in range(8)]  # one GPU each
    (ivy,) = [s for s in services.values() if s["command"][2] == "ivy"]
    _, icfg = service_config(ivy)
    assert sorted(icfg.tulip) == sorted(f"{n}:{service_config(s)[1].port}" for n, s in tulips.items())
    assert icfg.workers == int(dotenv(DEPLOY / ".env.example")["IVY_WORKERS"])  # from the variable
    assert ivy["depends_on"] == {n: {"condition": "service_healthy"} for n in tulips}
    assert ivy["ports"] == [f"{dotenv(DEPLOY / '.env.example')['IVY_PORT']}:{icfg.port}"]
    assert ivy["restart"] == "unless-stopped" and ivy["logging"]["options"]["max-file"]
    assert not icfg.api_keys  # the example leaves them empty; the variable reaches Ivy
    assert ivy["environment"]["IVY_API_KEYS"] == ""
    hf_cache(ivy, icfg)
    assert (icfg.model, icfg.revision) == (cfg.model, cfg.revision)  # the Tulips' files, the same revision


def hf_cache(svc: dict, cfg) -> None:
    """A compose service of a Hub model: the example's Hub id, the Hugging Face cache on the shared hf-cache
    volume (HF_HOME), the token as the secret hf_token (a file: HF_TOKEN_PATH), not as a variable."""
    from trellis.modelref import parse_hub_id

    example = dotenv(DEPLOY / ".env.example")
    assert cfg.model == example["MODEL"] and parse_hub_id(cfg.model) == (example["MODEL"], "")
    home = svc["environment"]["HF_HOME"]
    assert f"hf-cache:{home}" in svc["volumes"] and "hf-cache" in compose(env_file=True)["volumes"]
    assert svc["secrets"] == ["hf_token"] and svc["environment"]["HF_TOKEN_PATH"] == "/run/secrets/hf_token"
    assert compose(env_file=True)["secrets"]["hf_token"] == {"environment": "HF_TOKEN"}
    assert "HF_TOKEN" not in svc["environment"]


def k8s_hf_cache(doc: dict, c: dict, cfg) -> None:
    """A Kubernetes pod of a Hub model: HF_HOME on the shared ReadWriteMany claim, HF_TOKEN from the
    optional Secret (public models need none)."""
    from trellis.modelref import parse_hub_id

    env = {e["name"]: e for e in c["env"]}
    assert parse_hub_id(cfg.model) is not None
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
    assert mounts["hf-cache"] == env["HF_HOME"]["value"]
    assert vols["hf-cache"]["persistentVolumeClaim"] == {"claimName": "trellis-hf-cache"}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "trellis-hf-token", "key": "token",
                                                            "optional": True}


def test_compose_cpu_profile_serves_the_default_model():
    services = in_profile(compose(env_file=False)["services"], "cpu")
    (tulip,) = [s for s in services.values() if s["command"][2] == "tulip"]
    (ivy_name, ivy), = [(n, s) for n, s in services.items() if s["command"][2] == "ivy"]
    _, tcfg = service_config(tulip)
    _, icfg = service_config(ivy)
    assert tcfg.model == icfg.model == "default" and tcfg.device == "cpu"
    assert "deploy" not in tulip  # no GPU reservation
    (tname,) = [n for n, s in services.items() if s is tulip]
    assert icfg.tulip == (f"{tname}:{tcfg.port}",) and ivy["depends_on"] == {tname: {"condition": "service_healthy"}}
    for svc in (tulip, ivy):  # build args the Dockerfiles declare
        dockerfile = ROOT / svc["build"]["dockerfile"]
        assert set(svc["build"].get("args", {})) <= set(args(dockerfile))
    assert ivy["build"]["args"]["WITH_DEFAULT_MODEL"] == "1"  # the gateway image then has the default model


def test_compose_prebuild_runs_the_gpu_tulips_configuration():
    services = compose(env_file=True)["services"]
    pre = services["prebuild"]
    assert pre["profiles"] == ["prebuild"] and pre["restart"] == "no"
    script = source_of(DOCKERFILES["tulip"], pre["command"][0])
    assert script == ROOT / "deploy" / "prebuild.sh"
    assert pre["environment"] == services["tulip-0"]["environment"]  # the same model, flags and warm-up
    assert "kernel-cache:/cache" in pre["volumes"]


# --- Kubernetes ----------------------------------------------------------------------------------

def manifests() -> dict[tuple[str, str], dict]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = {}
    for f in kust["resources"]:
        for d in yaml.safe_load_all((K8S / f).read_text()):
            docs[(d["kind"], d["metadata"]["name"])] = d
    return docs


def test_kustomization_lists_every_manifest():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files
    images = {c["image"] for d in manifests().values() if d["kind"] in ("Deployment", "StatefulSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {i["name"] for i in kust["images"]}


def test_every_manifest_validates_against_the_kubernetes_schemas():
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    docs = manifests()
    assert len(docs) >= 9
    for (kind, name), doc in docs.items():
        kubernetes_validate.validate(doc, version, strict=True)
    bad = json.loads(json.dumps(docs[("StatefulSet", "tulip")]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5  # a typo: strict fails
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


def container(doc: dict) -> dict:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


def k8s_config(c: dict):
    return parse_command(c["command"] + c.get("args", []), {e["name"]: e.get("value", "") for e in c.get("env", [])})


def test_tulip_statefulset_headless_service_probes_and_drain():
    docs = manifests()
    sts = docs[("StatefulSet", "tulip")]
    svc = docs[("Service", sts["spec"]["serviceName"])]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == labels
    assert sts["spec"]["selector"]["matchLabels"] == labels
    assert not svc["spec"].get("publishNotReadyAddresses")  # only ready (SERVING) Tulips are resolved
    c = container(sts)
    _, cfg = k8s_config(c)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": cfg.port, "metrics": cfg.metrics_port}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(ports)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["cpu"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": cfg.port}  # the standard health service, which Tulip serves
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + 2 * cfg.drain_seconds  # gRPC's grace, then the steps still on the GPU
    note = sts["spec"]["template"]["metadata"]["annotations"]
    assert note["prometheus.io/scrape"] == "true" and note["prometheus.io/port"] == str(cfg.metrics_port)
    table = source_of(DOCKERFILES["tulip"], f"{cfg.attention_table}/attention_table_16x16x64.json")
    assert table is not None and table.is_file()
    pod = sts["spec"]["template"]["spec"]
    assert str(pod["securityContext"]["runAsUser"]) == UID and pod["securityContext"]["runAsNonRoot"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["kernel-cache"] == json.loads(values(DOCKERFILES["tulip"], "VOLUME")[0])[0]
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["kernel-cache"]
    k8s_hf_cache(sts, c, cfg)
    assert docs[("PodDisruptionBudget", "tulip")]["spec"]["selector"]["matchLabels"] == labels


def test_ivy_deployment_resolves_the_tulips_by_name():
    docs = manifests()
    dep, sts = docs[("Deployment", "ivy")], docs[("StatefulSet", "tulip")]
    ns = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    c = container(dep)
    _, cfg = k8s_config(c)
    _, tcfg = k8s_config(container(sts))
    assert cfg.tulip == (f"{sts['spec']['serviceName']}.{ns}.svc.cluster.local:{tcfg.port}",)
    k8s_hf_cache(dep, c, cfg)
    assert (cfg.model, cfg.revision) == (tcfg.model, tcfg.revision)  # the Tulips' files, the same revision
    if "resolve_interval" in pending_ivy_fields():
        pytest.skip("IvyConfig has no resolve_interval yet (DNS discovery, branch m-disc): the rest is checked")
    assert cfg.resolve_interval > 0


def test_ivy_deployment_probes_service_hpa_pdb_secret_prompts():
    docs = manifests()
    dep = docs[("Deployment", "ivy")]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    c = container(dep)
    _, cfg = k8s_config(c)
    from ivy.app import create_app
    from ivy.config import IvyConfig

    routes = create_app(IvyConfig(tulip=("127.0.0.1:1",))).state.route_paths

    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": cfg.port}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": cfg.port}
    assert {"/ready", "/health", "/metrics"} <= set(routes)
    (http,) = c["ports"]
    assert http["containerPort"] == cfg.port
    svc = docs[("Service", "ivy")]
    assert svc["spec"]["selector"] == labels and svc["spec"]["ports"][0]["targetPort"] == http["name"]
    hpa = docs[("HorizontalPodAutoscaler", "ivy")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "ivy"}
    assert hpa["spec"]["minReplicas"] == dep["spec"]["replicas"] >= 2 and c["resources"]["requests"]["cpu"]
    # two Ivy workers per Tulip at the HPA's floor (docs/deploy.md's capacity planning)
    assert hpa["spec"]["minReplicas"] * cfg.workers == 2 * docs[("StatefulSet", "tulip")]["spec"]["replicas"]
    pdb = docs[("PodDisruptionBudget", "ivy")]
    assert pdb["spec"]["selector"]["matchLabels"] == labels
    assert pdb["spec"]["maxUnavailable"] == 1  # a node drain can proceed, one pod at a time
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > c["lifecycle"]["preStop"]["sleep"]["seconds"] + 10  # + uvicorn's graceful shutdown
    # API keys from a Secret, required (a missing Secret stops the pod rather than serving without keys)
    (keys,) = [e for e in c["env"] if e["name"] == "IVY_API_KEYS"]
    assert "secretKeyRef" in keys["valueFrom"] and not keys["valueFrom"]["secretKeyRef"].get("optional")
    # the prompts file is in the ConfigMap's volume, mounted without subPath (so the kubelet updates it)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    (name,) = [n for n, v in vols.items() if "configMap" in v]
    assert "subPath" not in mounts[name]
    path = Path(cfg.prompts_file)
    assert str(path.parent) == mounts[name]["mountPath"]
    prompts = json.loads(docs[("ConfigMap", vols[name]["configMap"]["name"])]["data"][path.name])
    assert isinstance(prompts, dict) and all(isinstance(v, str) for v in prompts.values())
    note = dep["spec"]["template"]["metadata"]["annotations"]
    assert note["prometheus.io/port"] == str(cfg.port) and note["prometheus.io/path"] == "/metrics"
    assert str(dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"]) == UID


def test_the_prompts_file_is_reread_on_change(tmp_path):
    """What the ConfigMap relies on: Ivy's templates pick up a changed prompts file without a restart,
    including when the file is swapped as the kubelet does (a symlink to a new directory)."""
    from ivy.templates import Templates

    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "prompts.json").write_text(json.dumps({"query": "q1: "}))
    (tmp_path / "..data").symlink_to("v1")
    (tmp_path / "prompts.json").symlink_to("..data/prompts.json")
    t = Templates({"query": "model: "}, tmp_path / "prompts.json")
    assert t.apply(["x"], "query", None) == ["q1: x"]
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "prompts.json").write_text(json.dumps({"query": "q2: "}))
    old = (tmp_path / "v1" / "prompts.json").stat().st_mtime
    os.utime(tmp_path / "v2" / "prompts.json", (old + 1, old + 1))  # written later, as the kubelet does
    (tmp_path / "..tmp").symlink_to("v2")
    (tmp_path / "..tmp").rename(tmp_path / "..data")  # the atomic swap
    assert t.apply(["x"], "query", None) == ["q2: x"]


def test_instructions_reader_sees_every_line():
    """The Dockerfile reader misses nothing: every instruction keyword it returns is a real one."""
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "USER", "VOLUME", "EXPOSE", "HEALTHCHECK", "CMD", "SHELL"}
    for path in DOCKERFILES.values():
        assert {k for k, _ in instructions(path)} <= known
