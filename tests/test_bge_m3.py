"""BGE-M3's three outputs in one call (dense + sparse lexical weights + ColBERT vectors) through
the whole stack, against an independent reference written here from the formulas, on a small
random XLM-RoBERTa saved by transformers with random sparse/colbert heads."""

import base64

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trellis.presets import _stand_in_tokenizer
from tests.checkpoints import save_checkpoint
from tests.conftest import local_stack

SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-bge-m3")
    _, hf = save_checkpoint("xlm-roberta", d)
    _stand_in_tokenizer(SPECIALS, ("<s>", "</s>"), d / "tokenizer.json")
    g = torch.Generator().manual_seed(1)
    sparse = {"weight": torch.randn(1, 64, generator=g) * 0.3, "bias": torch.tensor([0.05])}
    colbert = {"weight": torch.randn(48, 64, generator=g) * 0.2, "bias": torch.randn(48, generator=g) * 0.1}
    torch.save(sparse, d / "sparse_linear.pt")
    torch.save(colbert, d / "colbert_linear.pt")
    with local_stack(d, tmp_path_factory.mktemp("m3-stack")) as (url, _):
        yield url, d.name, hf, sparse, colbert


def reference(hf, sparse, colbert, seq):
    """Dense CLS, lexical weights and ColBERT vectors of one sequence, from the formulas."""
    with torch.no_grad():
        h = hf(input_ids=torch.tensor([seq])).last_hidden_state[0]
    w = torch.relu(h @ sparse["weight"].T + sparse["bias"]).squeeze(-1)
    lex = {}
    for tok, weight in zip(seq, w.tolist()):
        if tok in SPECIALS.values():
            continue
        if weight > lex.get(tok, 0):
            lex[tok] = weight
    col = F.normalize(h[1:] @ colbert["weight"].T + colbert["bias"], dim=-1)
    return h[0], lex, col


def lexical_match(a: dict, b: dict) -> float:
    return sum(w * b[t] for t, w in a.items() if t in b)


def maxsim(q: torch.Tensor, d: torch.Tensor) -> float:
    return (q @ d.T).max(dim=1).values.mean().item()


SEQS = [[0, 10, 11, 10, 12, 2], [0, 12, 13, 14, 12, 15, 16, 2], [0, 2], [0, 20] + list(range(30, 90)) + [2]]


def test_dense_sparse_colbert_in_one_call(m3):
    url, name, hf, sparse, colbert = m3
    r = httpx.post(url + "/v1/embeddings", timeout=60, json={
        "model": name, "input": SEQS, "return_sparse": True, "return_colbert": True})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    refs = [reference(hf, sparse, colbert, s) for s in SEQS]
    ours_lex, ours_col = [], []
    for item, seq, (dense, lex, col) in zip(data, SEQS, refs):
        assert np.abs(np.array(item["embedding"]) - dense.numpy()).max() < 1e-4
        got = {int(k): v for k, v in item["sparse_embedding"].items()}
        assert list(got) == list(lex)  # same ids, first-occurrence order
        assert max((abs(got[t] - lex[t]) for t in lex), default=0) < 1e-4
        c = torch.tensor(item["colbert_embedding"])
        assert c.shape == (len(seq) - 1, 48) and (c - col).abs().max().item() < 1e-4
        ours_lex.append(got)
        ours_col.append(c)
    for i in range(len(SEQS)):
        for j in range(len(SEQS)):
            assert lexical_match(ours_lex[i], ours_lex[j]) == pytest.approx(lexical_match(refs[i][1], refs[j][1]), abs=1e-4)
            assert maxsim(ours_col[i], ours_col[j]) == pytest.approx(maxsim(refs[i][2], refs[j][2]), abs=1e-4)


def test_text_input_sparse_tokens_and_base64_colbert(m3):
    url, name, *_ = m3
    r = httpx.post(url + "/v1/embeddings", timeout=60, json={
        "model": name, "input": ["abca"], "return_sparse": True, "return_colbert": True, "encoding_format": "base64"})
    item = r.json()["data"][0]
    assert sorted(item["sparse_tokens"].values()) == sorted(set(item["sparse_tokens"].values()))
    assert set(item["sparse_tokens"].values()) <= {"a", "b", "c"}
    vecs = np.frombuffer(base64.b64decode(item["colbert_embedding"]), dtype="<f4").reshape(-1, 48)
    assert vecs.shape == (5, 48)  # <s> a b c a </s>: every token after the first
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)


def test_models_without_heads_refuse_extras(stack_default):
    r = httpx.post(stack_default + "/v1/embeddings", json={"input": "hi", "return_colbert": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_colbert"
