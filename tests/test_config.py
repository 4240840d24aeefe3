"""Flags and environment variables map onto the frozen configs in one place, with clear errors."""

import dataclasses

import pytest

from ivy.config import IvyConfig
from tulip.config import TulipConfig


def test_flags_env_and_defaults(monkeypatch):
    monkeypatch.setenv("TULIP_MAX_BATCH_TOKENS", "4096")
    monkeypatch.setenv("TULIP_PORT", "6000")
    cfg = TulipConfig.from_args(["--model", "/m", "--port", "7000", "--dtype", "bfloat16"])
    assert (cfg.model, cfg.port, cfg.dtype, cfg.max_batch_tokens, cfg.host) == ("/m", 7000, "bfloat16", 4096, "127.0.0.1")
    assert TulipConfig.from_args(["--compile"]).compile is True
    assert TulipConfig.from_args(["--compile", "false"]).compile is False
    assert TulipConfig.from_args(["--kernel-tokens", "0"]).kernel_tokens == 0
    with pytest.raises(ValueError, match="kernel_tokens -1 must be >= 0"):
        TulipConfig(kernel_tokens=-1)
    assert TulipConfig.from_args(["--warmup", "1x128", "--warmup", "4x512"]).warmup == ("1x128", "4x512")
    assert TulipConfig.from_args(["--warmup", "1x128+sparse+colbert"]).warmup == ("1x128+sparse+colbert",)
    from tulip.config import warmup_shapes

    assert warmup_shapes(("1-3x512", "2x64+sparse")) == [(1, 512, frozenset()), (2, 512, frozenset()),
                                                         (3, 512, frozenset()), (2, 64, frozenset({"sparse"}))]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1


def test_every_field_is_documented():
    for cls in (TulipConfig, IvyConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


def test_repeated_and_env_list(monkeypatch):
    cfg = IvyConfig.from_args(["--tulip", "a:1", "--tulip", "b:2"])
    assert cfg.tulip == ("a:1", "b:2")
    monkeypatch.setenv("IVY_TULIP", "c:3,d:4")
    assert IvyConfig.from_args([]).tulip == ("c:3", "d:4")
    assert IvyConfig.from_json(cfg.to_json()) == cfg
    assert IvyConfig.from_args(["--tulip", "unix:/run/tulip.sock"]).tulip == ("unix:/run/tulip.sock",)


@pytest.mark.parametrize("cls, argv, fragment", [
    (TulipConfig, ["--port", "70000"], "port 70000"),
    (TulipConfig, ["--max-batch-tokens", "-1"], "max_batch_tokens -1"),
    (TulipConfig, ["--dtype", "fp8"], "invalid choice: 'fp8'"),
    (TulipConfig, ["--port", "abc"], "invalid int value: 'abc'"),
    (TulipConfig, ["--warmup", "128"], "warmup shape '128' is not NxL"),
    (TulipConfig, ["--warmup", "4-2x128"], "warmup shape '4-2x128' is not NxL or A-BxL"),
    (TulipConfig, ["--warmup", "0x128"], "is not NxL"),
    (TulipConfig, ["--warmup", "1x128+dense"], "outputs after '+' are sparse and/or colbert"),
    (IvyConfig, [], "at least one --tulip"),
    (IvyConfig, ["--tulip", "nohostport"], "'nohostport' is not HOST:PORT or unix:PATH"),
])
def test_bad_values_quote_the_value(cls, argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        cls.from_args(argv)
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def test_bad_env_value(monkeypatch, capsys):
    monkeypatch.setenv("TULIP_DRAIN_SECONDS", "soon")
    with pytest.raises(SystemExit):
        TulipConfig.from_args([])
    assert "TULIP_DRAIN_SECONDS='soon'" in capsys.readouterr().err


def test_api_doc_lists_every_metric():
    import types
    from pathlib import Path

    from ivy.app import Metrics
    from rose.graphs import GraphStats
    from tulip.metrics import GraphCollector, TulipMetrics

    doc = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    engine = types.SimpleNamespace(runner=types.SimpleNamespace(stats=GraphStats()))
    names = [m.name for reg in (TulipMetrics().registry, Metrics().registry) for m in reg.collect()]
    names += [m.name for m in GraphCollector(engine).collect()]
    missing = [n for n in names if f"`{n}" not in doc]
    assert len(names) > 10 and not missing, f"docs/api.md's metrics table lacks {missing}"


def _doc_default(value) -> str:
    """A config default as docs/configuration.md's tables write it."""
    if value == ():
        return "none"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def test_configuration_doc_lists_every_flag_with_its_env_and_default():
    """docs/configuration.md has one row per config field: Tulip's and Ivy's flag, environment variable
    and default as the dataclasses declare them, and each --model-config entry field."""
    from pathlib import Path

    from ivy.config import ModelConfig

    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text().splitlines()
            if line.startswith("| `")]
    wrong = []
    for cls, prefix in ((TulipConfig, "TULIP"), (IvyConfig, "IVY")):
        for f in dataclasses.fields(cls):
            want = [f"`--{f.name.replace('_', '-')}`", f"`{prefix}_{f.name.upper()}`", _doc_default(f.default)]
            if not any(r[:3] == want for r in rows):
                wrong.append(" | ".join(want))
    for f in dataclasses.fields(ModelConfig):
        if not any(r[:2] == [f"`{f.name}`", _doc_default(f.default)] for r in rows):
            wrong.append(f"ModelConfig.{f.name}")
    assert not wrong, f"docs/configuration.md lacks (or has another default for) {wrong}"


def _markdown_links(text: str):
    """(line number, target) of each [text](target) outside fenced code, and the page's heading anchors
    as GitHub makes them (lower case, punctuation dropped, spaces as dashes, -1 for a repeat)."""
    import re

    links, anchors, fenced = [], set(), False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            k, a = 0, slug
            while a in anchors:
                k += 1
                a = f"{slug}-{k}"
            anchors.add(a)
        links += [(n, t) for t in re.findall(r"\]\(([^)\s]+)\)", line)]
    return links, anchors


def test_readme_is_short_and_every_doc_link_resolves():
    """README.md is a newcomer's path (<= 200 lines, no link out of the repository); every relative
    link in it and in docs/*.md names a file of the repository, and an #anchor a heading there."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, f"README.md has {len(readme.splitlines())} lines"
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    parsed = {p.resolve(): _markdown_links(p.read_text()) for p in pages}
    bad = []
    for page in pages:
        for n, target in parsed[page.resolve()][0]:
            where = f"{page.relative_to(root)}:{n}: {target}"
            if target.startswith(("http://", "https://", "mailto:")):
                if page.name == "README.md":
                    bad.append(where + " (outside the repository)")
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page.resolve()
            if not dest.is_relative_to(root) or not dest.exists():
                bad.append(where + " (no such file in the repository)")
            elif anchor and dest.suffix == ".md":
                anchors = (parsed.get(dest) or _markdown_links(dest.read_text()))[1]
                if anchor not in anchors:
                    bad.append(where + " (no such heading)")
    assert not bad, "\n".join(bad)


def test_structure_doc_names_every_module():
    """docs/structure.md is the module map: every source, script and test file is in it."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "structure.md").read_text()
    files = subprocess.run(["git", "ls-files", "rose", "ivy", "tulip", "deploy", "benchmarks/*.py", "benchmarks/*.sh",
                            "trellis", "tests"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    files = [f for f in files if (f.endswith((".py", ".sh", ".yaml")) or "Dockerfile" in Path(f).name)
             and not f.endswith("__init__.py") and not f.startswith("trellis/tulip/v1/")]
    assert files
    missing = [f for f in files if f"`{f}`" not in doc]
    assert not missing, f"docs/structure.md does not mention {missing}"


def test_model_config_file(tmp_path, monkeypatch):
    """--model-config lists more models, each with its own Tulips; --model with --tulip comes first
    (the default); the file alone serves its own list; the config travels to workers as JSON."""
    import json

    from ivy.config import ModelConfig

    f = tmp_path / "models.json"
    f.write_text(json.dumps([{"name": "rr", "model": "/m/rr", "tulip": ["a:1", "b:2"]},
                             {"model": "/m/docs", "tulip": "unix:/run/t.sock", "prompts_file": "/p.json"}]))
    cfg = IvyConfig.from_args(["--tulip", "t:1", "--model-config", str(f)])
    assert cfg.models == (ModelConfig("default", ("t:1",)), ModelConfig("/m/rr", ("a:1", "b:2"), "rr"),
                          ModelConfig("/m/docs", ("unix:/run/t.sock",), "", "/p.json"))
    assert IvyConfig.from_json(cfg.to_json()).models == cfg.models
    monkeypatch.setenv("IVY_MODEL_CONFIG", str(f))
    assert [m.model for m in IvyConfig.from_args([]).models] == ["/m/rr", "/m/docs"]
    f.write_text(json.dumps({"models": [{"model": "/m/x", "tulip": ["x:9"]}]}))
    assert IvyConfig.from_args([]).models == (ModelConfig("/m/x", ("x:9",)),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.models[0].name = "x"


@pytest.mark.parametrize("content, fragment", [
    ("{", "Expecting property name"),
    ("[]", "must hold a non-empty JSON list"),
    ('{"model": "/m"}', "must hold a non-empty JSON list"),
    ('["/m"]', "entry 0 is not an object"),
    ('[{"model": "/m", "tulip": ["a:1"], "replicas": 2}]', "unknown field(s) ['replicas']"),
    ('[{"model": "/m"}]', "model '/m': 'tulip' must list at least one"),
    ('[{"name": "rr", "model": "/m", "tulip": []}]', "model 'rr': 'tulip' must list"),
    ('[{"model": "/m", "tulip": ["nohost"]}]', "model '/m': --tulip 'nohost' is not HOST:PORT"),
    ('[{"model": "/m", "tulip": [1]}]', "'tulip' must list"),
    ('[{"model": 7, "tulip": ["a:1"]}]', "'model' must be a Hub id, a model directory"),
])
def test_bad_model_config_quotes_the_value(tmp_path, capsys, content, fragment):
    f = tmp_path / "models.json"
    f.write_text(content)
    with pytest.raises(SystemExit) as e:
        IvyConfig.from_args(["--model-config", str(f)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err, err


def test_missing_model_config_and_duplicate_names(tmp_path, model_path):
    import json

    with pytest.raises(ValueError, match="--model-config '/nonexistent.json'.*No such file"):
        IvyConfig(model_config="/nonexistent.json")
    from ivy.app import create_app

    f = tmp_path / "models.json"
    f.write_text(json.dumps([{"model": str(model_path), "name": "all-MiniLM-L6-v2", "tulip": ["a:1"]}]))
    with pytest.raises(ValueError, match="two models are served as 'all-MiniLM-L6-v2'"):
        create_app(IvyConfig(tulip=("b:2",), model_config=str(f)))
