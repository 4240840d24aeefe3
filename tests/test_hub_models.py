"""Models by their Hugging Face Hub id (issue 48), through the `trellis` console command, real processes.

- A Hugging Face cache in a temporary HF_HOME, in the layout huggingface_hub writes
  (models--ORG--NAME/{blobs/OID, snapshots/COMMIT/... -> ../../blobs/OID, refs/main}), holding the shipped
  all-MiniLM-L6-v2 under its Hub id at two commits (the second without its Normalize module) and a tiny
  cross-encoder; HF_HUB_OFFLINE=1. One `trellis serve` serves both MiniLM commits, the cross-encoder and a
  preset by their references: vectors and scores against sentence-transformers on the same files, each
  model's revision (and the preset's random weights) in /v1/models, Tulip's Info, /ready and the banner.
- A bare preset name, an unknown id, an id offline and not cached, a gated id without a token, an unknown
  revision: `trellis serve` exits 2 with one line naming the model and what to do. The Hub's answers come
  from tests/fakehub.py (HF_ENDPOINT), as huggingface_hub reads them.
- A download from that stand-in Hub fetches only what serving reads, once, while two processes resolve
  the same model at the same time, and then resolves offline from the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from tests.conftest import ROOT, Child, free_port, http_status
from tests.fakehub import FakeHub, Repo, git_oid

TRELLIS = Path(sys.executable).parent / "trellis"  # the console script pip installs ([project.scripts])
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
CE = "trellis-test/tiny-cross-encoder"
REV1, REV2, REV_CE = (hashlib.sha1(s).hexdigest() for s in (b"minilm-1", b"minilm-2", b"ce-1"))
TEXTS = ["The cat sat on the mat.", "Hugging Face Hub ids name models.", "Où est la gare ?", "x" * 300]
QUERY, DOCS = "where do cats sleep", ["cats sleep on mats", "the stock market fell", "a cat naps in the sun"]


def write_snapshot(cache: Path, repo: str, commit: str, files: dict[str, Path], ref: str = "") -> Path:
    """`files` (repository path -> file) as commit `commit` of `repo` in the Hugging Face cache `cache`, as
    huggingface_hub writes a download: each content once under blobs/ (named by its git blob id, the ETag
    the Hub gives a non-LFS file), the snapshot's paths relative symlinks to them, refs/REF -> commit."""
    top = cache / ("models--" + repo.replace("/", "--"))
    for rel, src in files.items():
        data = src.read_bytes()
        blob = top / "blobs" / git_oid(data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = top / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (top / "refs").mkdir(exist_ok=True)
        (top / "refs" / ref).write_text(commit)
    return top / "snapshots" / commit


def tree(d: Path) -> dict[str, Path]:
    return {str(p.relative_to(d)): p for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def hub_stack(tmp_path_factory):
    """`trellis serve` over a populated offline cache: (Ivy URL, banner lines, {name: snapshot dir})."""
    from tests.checkpoints import save_cross_encoder
    from trellis.modelref import resolve_model_path

    tmp = tmp_path_factory.mktemp("hub")
    cache = tmp / "hf" / "hub"
    minilm = tree(resolve_model_path("default"))
    v2 = tmp / "minilm-v2-modules.json"  # the second commit: the pipeline without its Normalize module
    v2.write_text(json.dumps([m for m in json.loads(minilm["modules.json"].read_text())
                              if not m["type"].endswith("Normalize")]))
    ce_path, _ = save_cross_encoder("bert", tmp / "ce", max_length=64)
    snaps = {MINILM: write_snapshot(cache, MINILM, REV1, minilm, "main"),
             "v2": write_snapshot(cache, MINILM, REV2, {**minilm, "modules.json": v2}),
             "rr": write_snapshot(cache, CE, REV_CE, tree(ce_path), "main")}
    port = free_port()
    env = {"HF_HOME": str(tmp / "hf"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_TOKEN": ""}
    proc = Child([str(TRELLIS), "serve", "--model", MINILM, "--add-model", f"v2={MINILM}@{REV2}",
                  "--add-model", f"rr={CE}", "--add-model", "p=preset:msmarco-distilbert", "--port", str(port),
                  "--device", "cpu"], tmp / "serve.log", env)
    try:
        proc.wait_for(lambda: "Trellis is ready" in proc.output(), timeout=180)
        out = proc.output()
        banner = [line for line in out[out.index("Trellis is ready"):].splitlines()
                  if re.match(r"  (WARNING: )?model '", line)]
        yield f"http://127.0.0.1:{port}", banner, snaps
    finally:
        assert proc.stop(timeout=60) == 0
    out = proc.output()  # offline: nothing downloaded, and no complaint that the Hub is out of reach
    assert "Traceback" not in out and "fetching" not in out and "Could not reach" not in out


def test_hub_ids_served_from_the_cache_equal_sentence_transformers(hub_stack):
    from sentence_transformers import CrossEncoder, SentenceTransformer

    url, _, snaps = hub_stack
    got = {}
    for name in (MINILM, "v2"):
        r = httpx.post(url + "/v1/embeddings", json={"model": name, "input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        got[name] = np.array([d["embedding"] for d in r.json()["data"]])
        want = SentenceTransformer(str(snaps[name]), device="cpu").encode(TEXTS)
        np.testing.assert_allclose(got[name], want, atol=2e-5)
    # the pinned second commit is what served "v2": its vectors are not normalised, the first commit's are
    np.testing.assert_allclose(np.linalg.norm(got[MINILM], axis=1), 1.0, atol=1e-5)
    assert np.linalg.norm(got["v2"], axis=1).min() > 1.5
    r = httpx.post(url + "/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    scores = [x["relevance_score"] for x in sorted(r.json()["results"], key=lambda x: x["index"])]
    want = CrossEncoder(str(snaps["rr"]), device="cpu").predict([(QUERY, d) for d in DOCS])
    np.testing.assert_allclose(scores, want, atol=1e-5)


def test_revision_and_random_weights_wherever_the_model_is_named(hub_stack):
    from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc

    url, banner, _ = hub_stack
    models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert {m["id"]: (m["revision"], m["random_weights"]) for m in models} == {
        MINILM: (REV1, False), "v2": (REV2, False), "rr": (REV_CE, False), "p": (None, True)}
    assert httpx.get(url + "/info", timeout=10).json()["model_sha"] == REV1  # TEI's route, the default model
    ready = httpx.get(url + "/ready", timeout=10)
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "random_weights": ["p"]}
    # the banner: one line per model, its revision or the preset's warning, its Tulips; their Info agrees
    want = {MINILM: (REV1, False), "v2": (REV2, False), "rr": (REV_CE, False), "p": ("", True)}
    assert len(banner) == 4
    for line in banner:
        m = re.fullmatch(r"  (WARNING: )?model '([^']+)': (.*); Tulips (\S+)", line)
        assert m, line
        warned, name, what, target = m.groups()
        revision, random = want[name]
        assert (revision in what if revision else "RANDOM WEIGHTS" in what) and bool(warned) == random, line
        with grpc.insecure_channel(target) as ch:
            info = tulip_pb2_grpc.TulipStub(ch).Info(tulip_pb2.InfoRequest(), timeout=10)
        assert (info.model, info.revision, info.random_weights) == (name, revision, random)


def hub_env(**kw: str) -> dict:
    """This environment for a child, without a token or a cache path of the caller's, with `kw`."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HF_HUB_CACHE", "HF_ENDPOINT")}
    return {**env, "PYTHONPATH": str(ROOT), **kw}


def serve_error(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(TRELLIS), "serve", "--device", "cpu", *args], env=hub_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def small_repo() -> dict[str, bytes]:
    """A repository as the Hub holds one: the serving files beside what serving never reads (ONNX and
    OpenVINO exports, PyTorch pickles next to safetensors, TF / Flax weights, a README)."""
    paths = ["config.json", "model.safetensors", "pytorch_model.bin", "tf_model.h5", "flax_model.msgpack",
             "onnx/model.onnx", "onnx/model_qint8.onnx", "openvino/openvino_model.xml", "README.md", ".gitattributes",
             "tokenizer.json", "tokenizer_config.json", "vocab.txt", "modules.json", "sentence_bert_config.json",
             "1_Pooling/config.json", "2_Dense/config.json", "2_Dense/model.safetensors", "2_Dense/pytorch_model.bin"]
    # distinct contents: the cache keeps one blob per content, so equal files would be fetched once
    return {p: f"{p}: content\n".encode() * (512 if p.endswith((".safetensors", ".bin")) else 1) for p in paths}


SERVED = sorted({"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                 "modules.json", "sentence_bert_config.json", "1_Pooling/config.json", "2_Dense/config.json",
                 "2_Dense/model.safetensors"})


def test_bad_references_exit_2_with_one_line(tmp_path):
    c = hashlib.sha1(b"gated").hexdigest()
    hub = {"trellis-test/gated": Repo({c: small_repo()}, {"main": c}, gated=True),
           "trellis-test/model": Repo({c: small_repo()}, {"main": c})}
    with FakeHub(hub) as h:
        online = {"HF_ENDPOINT": h.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
                  "TRANSFORMERS_OFFLINE": "0"}
        offline = {**online, "HF_HUB_OFFLINE": "1"}
        cases = {  # what the line must name: the reference, and what to do
            "bare preset": (serve_error({}, "--model", "bge-m3"), ("'bge-m3'", "preset:bge-m3", "BAAI/bge-m3")),
            "unknown id": (serve_error(online, "--model", "trellis-test/no-such-model"),
                           ("'trellis-test/no-such-model'", "not found", "check the id")),
            "offline": (serve_error(offline, "--model", "trellis-test/model"),
                        ("'trellis-test/model'", "not in the Hugging Face cache", "HF_HUB_OFFLINE")),
            "gated": (serve_error(online, "--model", "trellis-test/gated"),
                      ("'trellis-test/gated'", "is gated", f"{h.url}/trellis-test/gated", "HF_TOKEN")),
            "revision": (serve_error(online, "--model", "trellis-test/model@v9"), ("no revision 'v9'",)),
            "revision twice": (serve_error(online, "--model", "trellis-test/model@main", "--revision", "v2"),
                               ("--revision", "'v2'")),
        }
        for what, (p, needles) in cases.items():
            out, err = p.communicate(timeout=120)
            lines = err.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("trellis serve: error: "), (what, err)
            assert all(n in lines[0] for n in needles), (what, lines[0])
            assert "Traceback" not in out + err and "Trellis is ready" not in out
        assert not any(kind == "resolve" and method == "GET" for method, kind, _, _ in h.requests)  # nothing fetched


def test_the_trellis_command_lists_its_subcommands():
    r = subprocess.run([str(TRELLIS), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and all(f"\n  {c} " in r.stdout for c in ("serve", "ivy", "tulip", "bench")), r.stdout
    r = subprocess.run([str(TRELLIS), "serv"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown command 'serv' (did you mean 'serve'?)" in r.stderr, r.stderr
    r = subprocess.run([str(TRELLIS), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: trellis serve ") and "--revision" in r.stdout


RESOLVE = ("import json, sys; from trellis.modelref import resolve; r = resolve(sys.argv[1], weights=sys.argv[2] == '1');"
           " print(json.dumps([str(r.path), r.revision, r.name]))")


def resolver(env: dict, model: str, weights: bool = True) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RESOLVE, model, "1" if weights else "0"], env=hub_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_download_fetches_the_serving_files_once_then_works_offline(tmp_path):
    c = hashlib.sha1(b"download").hexdigest()
    # the weights take a second to come: the two processes of one cache surely overlap
    with FakeHub({"trellis-test/model": Repo({c: small_repo()}, {"main": c})}, {"model.safetensors": 1.0}) as h:
        env = {"HF_ENDPOINT": h.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
               "TRANSFORMERS_OFFLINE": "0"}
        both = [resolver({**env, "HF_HUB_USER_AGENT_ORIGIN": f"tulip-{i}"}, "trellis-test/model")
                for i in range(2)]  # two Tulips of one host at once
        ivy = resolver({**env, "HF_HOME": str(tmp_path / "ivy")}, "trellis-test/model", weights=False)
        results = [p.communicate(timeout=120) for p in (*both, ivy)]
        for p, (out, err) in zip((*both, ivy), results):
            assert p.returncode == 0, err
        (path, revision, name), again = (json.loads(out) for out, _ in results[:2])
        assert again == [path, revision, name] and (revision, name) == (c, "trellis-test/model")
        snapshot = Path(path)
        assert snapshot == tmp_path / "hf" / "hub" / "models--trellis-test--model" / "snapshots" / c
        assert sorted(tree(snapshot)) == SERVED  # no ONNX, OpenVINO, TF, Flax, pickles beside safetensors, README
        assert (snapshot.parent.parent / "refs" / "main").read_text() == c
        # each file fetched once per cache (the gateway's cache: no model weights); of the two processes on one
        # cache, one fetched while the other waited on trellis.hub's lock, then found the files: it asked the
        # Hub for the commit and nothing else
        ivy_files = [f for f in SERVED if f != "model.safetensors"]
        fetched = {f: h.requests[("GET", "resolve", "trellis-test/model", f)] for f in SERVED}
        assert fetched == {f: 1 + (f in ivy_files) for f in SERVED}, fetched
        asked = [sorted((m, k, f) for (o, m, k, f), n in h.by_origin.items() if o == f"tulip-{i}") for i in range(2)]
        assert sorted(asked, key=len)[0] == [("GET", "revision", "")], asked
        assert sorted(tree(Path(json.loads(results[2][0])[0]))) == ivy_files  # the gateway: no weights
        before = sum(h.requests.values())
        out, err = resolver({**env, "HF_HUB_OFFLINE": "1"}, "trellis-test/model").communicate(timeout=120)
        assert json.loads(out) == [path, revision, name], err
        assert sum(h.requests.values()) == before  # offline: the cache alone


def test_the_older_clip_layout_resolves_by_hub_id(tmp_path):
    """sentence-transformers' older CLIP layout (sentence-transformers/clip-ViT-B-32's: no config.json at the top,
    the checkpoint, tokenizer and processor config in 0_CLIPModel/, modules.json naming it) resolves by Hub id:
    a Tulip's fetch takes that folder's serving files (its safetensors, not the pickle beside them), Ivy's
    (weights=False) the same without the weights; a revision that publishes only the pickle is refused before
    anything is downloaded."""
    c1, c2 = (hashlib.sha1(s).hexdigest() for s in (b"clip-0", b"clip-0-pickle"))
    modules = [{"idx": 0, "name": "0", "path": "0_CLIPModel", "type": "sentence_transformers.models.CLIPModel"}]
    files = {"modules.json": json.dumps(modules).encode(), "config_sentence_transformers.json": b"{}\n",
             "README.md": b"# clip\n", ".gitattributes": b"*.bin filter=lfs\n"}
    for f in ("config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json",
              "vocab.json", "merges.txt", "special_tokens_map.json", "preprocessor_config.json"):
        files[f"0_CLIPModel/{f}"] = f"{f}: content\n".encode() * (512 if f.endswith((".safetensors", ".bin")) else 1)
    pickle_only = {k: v for k, v in files.items() if k != "0_CLIPModel/model.safetensors"}
    repo = "trellis-test/clip-0"
    with FakeHub({repo: Repo({c1: files, c2: pickle_only}, {"main": c1, "pickle": c2})}) as h:
        env = {"HF_ENDPOINT": h.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0",
               "TRANSFORMERS_OFFLINE": "0"}
        procs = [resolver(env, repo), resolver({**env, "HF_HOME": str(tmp_path / "ivy")}, repo, weights=False),
                 resolver({**env, "HF_HOME": str(tmp_path / "old")}, repo + "@pickle")]
        (tulip, _), (ivy, _), (_, err) = (p.communicate(timeout=120) for p in procs)
        assert [p.returncode for p in procs] == [0, 0, 1], err
        folder = ("config.json", "merges.txt", "model.safetensors", "preprocessor_config.json",
                  "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.json")
        want = ["0_CLIPModel/" + f for f in folder] + ["config_sentence_transformers.json", "modules.json"]
        assert sorted(tree(Path(json.loads(tulip)[0]))) == want
        assert sorted(tree(Path(json.loads(ivy)[0]))) == [f for f in want if not f.endswith(".safetensors")]
        assert "publishes no *.safetensors weights" in err and "0_CLIPModel/pytorch_model.bin" in err, err
        assert not any(m == "GET" and k == "resolve" and f.endswith(".bin") for m, k, _, f in h.requests)
