"""A Hugging Face Hub model's serving files at one commit, in the standard Hugging Face cache.

`fetch("BAAI/bge-m3", "main")` resolves the revision to a commit and returns that commit's snapshot
directory in the cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else ~/.cache/huggingface/hub: the layout
huggingface_hub writes, `models--ORG--NAME/{blobs,snapshots/COMMIT,refs/REVISION}`), downloading what is
missing. Everything goes through huggingface_hub (`HfApi.resolve_revision`, `snapshot_download`), so its
settings hold: `HF_TOKEN` (or the token `hf auth login` saved) for gated and private models, `HF_ENDPOINT`
(a mirror), `HF_HUB_OFFLINE=1` (no network: the cache only; a branch name is read from `refs/`).

Only what serving reads is fetched (`serving_files`): config.json, the safetensors weights (not
`pytorch_model.bin`, ONNX, OpenVINO, TF or Flax copies), the tokenizer's files, an image tower's processor
config, the sentence-transformers pipeline (modules.json and its module directories, a module's
`pytorch_model.bin` only where it has no safetensors), BGE-M3's sparse / ColBERT heads; `weights=False` (Ivy:
the tokenizer and configs) leaves the model's weights out. Where the transformers checkpoint is not at the top
but in the first module's folder (sentence-transformers' older CLIP layout, `0_CLIPModel/`:
`trellis.modeldir.transformer_subdir`, the rule a directory is read by, applied to the listing and modules.json)
that folder is read as the top is. A revision that is a commit already in the cache makes no network call at all: what a
launcher hands its children (`trellis.modelref.pin`), so the Tulips of one host never download in parallel;
processes that resolve on their own (containers sharing a cache volume) take a lock per repository, so one
downloads while the others wait and then find the files.

Every failure is a `ModelRefError` (a ValueError) whose message is one line naming the model and what to do:
huggingface_hub's errors (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError,
RevisionResolutionError, LocalEntryNotFoundError, HfHubHTTPError) are mapped here, and nothing else is.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
from pathlib import Path

from trellis.modeldir import transformer_dir, transformer_subdir

log = logging.getLogger("trellis.hub")


class ModelRefError(ValueError):
    """A model reference that cannot be served: the message is one line naming it and what to do."""


# Files at a repository's top level that serving reads (the engine, Ivy's tokenizer, modeldir's pipeline,
# benchmarks.tokenize's SentencePiece model), whatever the weights.
TOP_FILES = frozenset((
    "config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "sentencepiece.bpe.model", "spiece.model", "tokenizer.model",
    "chat_template.jinja", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
    "preprocessor_config.json", "processor_config.json",
))
HEADS = ("sparse_linear.pt", "colbert_linear.pt")  # BGE-M3's extra heads (rose.layers.heads), weights
# sentence-transformers saves module i of class C under "{i}_{C}/" (1_Pooling, 2_Dense, 1_SpladePooling, ...)
_MODULE_DIR = re.compile(r"\d+_[A-Za-z]\w*")


def serving_files(files, weights: bool = True, root: str = "") -> list[str]:
    """The repository paths among `files` that serving reads (see the module docstring), sorted. `root`: the
    folder holding the transformers checkpoint where it is not the top (`checkpoint_folder`)."""
    names = set(files)
    out = []
    for f in sorted(names):
        top, sep, rest = f.partition("/")
        if not sep or root and top == root and "/" not in rest:  # the checkpoint's own files
            name = rest if sep else f
            if name in TOP_FILES or weights and (name.endswith(".safetensors")
                                                 or name.endswith(".safetensors.index.json") or name in HEADS):
                out.append(f)
        elif _MODULE_DIR.fullmatch(top) and "/" not in rest:  # a module's own files (Dense weights are small)
            if rest.endswith(".json") or rest == "model.safetensors" or (
                    rest == "pytorch_model.bin" and f"{top}/model.safetensors" not in names):
                out.append(f)
    return out


def _weights_check(model: str, at: str, files: list[str], listed, root: str = "") -> None:
    """Serving needs config.json and (for the engine) safetensors beside it (at the top, or in `root`): say so
    before downloading."""
    prefix = f"{root}/" if root else ""

    def beside(f: str) -> bool:
        return f.startswith(prefix) and "/" not in f[len(prefix):]

    if f"{prefix}config.json" not in files:
        raise ModelRefError(f"model {model!r} has no config.json at {at}: not a transformers model repository")
    if not any(beside(f) and f.endswith(".safetensors") for f in files):
        other = sorted(f for f in listed if beside(f) and f.endswith((".bin", ".pt", ".h5", ".msgpack", ".onnx")))
        raise ModelRefError(f"model {model!r} publishes no *.safetensors weights at {at} (found: "
                            f"{', '.join(other) or 'none'}); Trellis loads safetensors only: choose a revision that "
                            "has them (ORG/NAME@REVISION), or convert it and serve the directory")


@contextlib.contextmanager
def _lock(cache: str, folder: str):
    """One resolver per repository at a time across processes sharing the cache (huggingface_hub locks each
    file; this makes a second Tulip wait for the first's whole download instead of racing it file by file)."""
    from filelock import FileLock, Timeout

    path = os.path.join(cache, ".locks", folder, "trellis-resolve.lock")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = FileLock(path)
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is fetching %s; waiting for it", folder)
        lock.acquire()
    except OSError:  # a read-only cache (a mount): nobody downloads into it, nothing to serialise
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _network(e: BaseException) -> bool:
    """A connection or timeout failure rather than an answer from the Hub. huggingface_hub's HTTP client
    (httpx2 today, requests before 1.0) raises its own classes for those, not OSError."""
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    return any(c.__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3", "httpcore")
               for c in type(e).__mro__)


def _hub_error(model: str, e: Exception, endpoint: str, revision: str) -> ModelRefError:
    """huggingface_hub's exception -> the one line a user reads."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo = model.partition("@")[0]
    page = f"{endpoint.rstrip('/')}/{repo}"
    token = ("the token in HF_TOKEN (or `hf auth login`'s) is not of an account that has access: use one that is"
             if _token() else "set HF_TOKEN to a token of an account that has access (or run `hf auth login`)")
    if isinstance(e, GatedRepoError):
        return ModelRefError(f"model {repo!r} is gated: accept its terms at {page}; {token}")
    if isinstance(e, RepositoryNotFoundError):
        return ModelRefError(f"model {repo!r} was not found on the Hugging Face Hub ({endpoint}): check the id "
                             f"(ORG/NAME, as in {page}); if it is private, {token}")
    if isinstance(e, RevisionNotFoundError):
        return ModelRefError(f"model {repo!r} has no revision {revision!r} (a branch, tag or commit) on the Hub: "
                             f"see {page}/commits/main")
    if isinstance(e, LocalEntryNotFoundError):
        return ModelRefError(f"model {model!r}: the cached snapshot is incomplete and the Hub cannot be reached "
                             "(HF_HUB_OFFLINE is set or the network is down): run it once with network access")
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        first = (str(e).strip().splitlines() or [""])[0]
        return ModelRefError(f"model {model!r}: the Hugging Face Hub ({endpoint}) answered HTTP {status} "
                             f"({first}); retry later")
    if _network(e):
        return ModelRefError(f"model {model!r}: the Hugging Face Hub ({endpoint}) cannot be reached "
                             f"({type(e).__name__}) and the cache does not hold it: check the network "
                             "(HTTPS_PROXY), or set HF_HUB_OFFLINE=1 with a cache that holds it")
    if isinstance(e, OSError):
        return ModelRefError(f"model {model!r}: cannot write the Hugging Face cache: {e}")
    first = (str(e).strip().splitlines() or [""])[0]
    return ModelRefError(f"model {model!r}: fetching it from the Hugging Face Hub ({endpoint}) failed: "
                         f"{type(e).__name__}: {first}")


def _token() -> bool:
    from huggingface_hub import get_token

    return bool(get_token())


def fetch(model: str, repo_id: str, revision: str = "", weights: bool = True) -> tuple[Path, str]:
    """`repo_id` at `revision` ("" the default branch; a branch, tag or commit) -> (its snapshot directory in
    the Hugging Face cache, the commit). `model` is the reference as the user wrote it, for messages."""
    from huggingface_hub import HfApi, constants, get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import (CachedRepoTreeNotFoundError, HFValidationError, LocalEntryNotFoundError,
                                        RevisionResolutionError)
    from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name
    from huggingface_hub.hf_api import RepoFile

    cache, endpoint = constants.HF_HUB_CACHE, constants.ENDPOINT
    offline = constants.HF_HUB_OFFLINE
    folder = repo_folder_name(repo_id=repo_id, repo_type="model")
    api = HfApi()
    lock = contextlib.nullcontext() if offline else _lock(cache, folder)
    with lock:
        try:
            rev = api.resolve_revision(repo_id, revision=revision or None, local_files_only=offline)
        except RevisionResolutionError as e:  # not reachable (or offline), and no refs/ entry for it
            raise _not_cached(model, revision, cache, offline, e.__cause__) from None
        except HFValidationError as e:
            raise ModelRefError(f"model {model!r} is not a valid Hub id ({e})") from None
        except Exception as e:
            raise _hub_error(model, e, endpoint, revision or "main") from None
        commit = rev.resolved
        at = f"revision {revision or 'main'} (commit {commit[:12]})"
        try:
            listed = [f.path for f in get_cached_repo_tree(repo_id, revision=commit)]
        except CachedRepoTreeNotFoundError:
            listed = None
        if listed is None and not offline:
            try:
                listed = [f.path for f in api.list_repo_tree(repo_id, revision=commit, recursive=True)
                          if isinstance(f, RepoFile)]
            except Exception as e:
                if not _network(e):
                    raise _hub_error(model, e, endpoint, revision or "main") from None
        root = ""
        if listed is not None:
            try:
                root = checkpoint_folder(repo_id, commit, listed, offline)
            except ValueError as e:  # modules.json names a module serving does not know
                raise ModelRefError(f"model {model!r} at {at}: {e}") from None
            except Exception as e:
                raise _hub_error(model, e, endpoint, revision or "main") from None
        files = serving_files(listed, weights, root) if listed is not None else None
        if files is not None and weights:
            _weights_check(model, at, files, listed, root)
        patterns = [glob.escape(f) for f in files] if files is not None else None
        try:  # what the cache holds, without a network call
            path = snapshot_download(repo_id, revision=rev, allow_patterns=patterns, local_files_only=True)
        except LocalEntryNotFoundError:
            path = None
        if path is not None and files is not None and not all((Path(path) / f).is_file() for f in files):
            path = None  # a snapshot folder holding part of them (modules.json, fetched first; Ivy's files alone)
        if path is None:
            if offline or listed is None:
                raise _not_cached(model, revision, cache, offline, None, commit)
            try:
                _check_access(repo_id, commit, endpoint, f"{root}/config.json" if root else "config.json")
                log.info("fetching %s at %s from %s into %s (%d files; only what serving reads)", repo_id, at,
                         endpoint, cache, len(files))
                path = snapshot_download(repo_id, revision=rev, allow_patterns=patterns)
            except Exception as e:
                raise _hub_error(model, e, endpoint, revision or "main") from None
    path = Path(path)
    have = [str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()]
    inner = transformer_dir(path)
    root = inner.name if inner is not None else ""
    if weights:  # a hand-made or partial cache without a tree listing: check what serving needs
        _weights_check(model, f"{at} in the cache ({path})", have, have, root)
    elif (f"{root}/config.json" if root else "config.json") not in have:
        raise ModelRefError(f"model {model!r} has no config.json at {at} ({path})")
    if REGEX_COMMIT_HASH.fullmatch(path.name) is None:  # pragma: no cover - huggingface_hub's layout
        raise ModelRefError(f"model {model!r}: unexpected cache folder {path}")
    return path, commit


def _check_access(repo_id: str, commit: str, endpoint: str, config: str) -> None:
    """A HEAD on config.json (its path `config`): a gated or private repository's files answer 401 / 403 here,
    before any progress bar is drawn (its listing may well be public)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    get_hf_file_metadata(hf_hub_url(repo_id, config, revision=commit, endpoint=endpoint))


def checkpoint_folder(repo_id: str, commit: str, listed: list[str], offline: bool) -> str:
    """"" or the folder of a repository's transformers checkpoint where it is not at the top (sentence-
    transformers' older CLIP layout: `trellis.modeldir.transformer_subdir`'s rule over the listing), reading
    modules.json (fetched first where needed: a few hundred bytes) only when the top has no config.json."""
    names = set(listed)
    if "config.json" in names or "modules.json" not in names:
        return ""
    from huggingface_hub import hf_hub_download

    modules = json.loads(Path(hf_hub_download(repo_id, "modules.json", revision=commit,
                                              local_files_only=offline)).read_text())
    return transformer_subdir(modules, names.__contains__)


def _not_cached(model: str, revision: str, cache: str, offline: bool, cause, commit: str = "") -> ModelRefError:
    what = f"commit {commit[:12]}" if commit else f"revision {revision or 'main'}"
    if offline:
        return ModelRefError(f"model {model!r} ({what}) is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE "
                             "is set: run it once with network access, or point HF_HOME / HF_HUB_CACHE at a cache "
                             "that holds it")
    reason = f" ({type(cause).__name__})" if cause is not None else ""
    return ModelRefError(f"model {model!r} ({what}) is not in the Hugging Face cache ({cache}) and the Hub cannot be "
                         f"reached{reason}: check the network (HTTPS_PROXY), or set HF_HUB_OFFLINE=1 with a cache that "
                         "holds it")
