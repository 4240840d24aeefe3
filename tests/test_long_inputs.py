"""Long inputs and request ids through a real Tulip + Ivy (deploy.local, the default MiniLM model,
256 tokens at most): `truncate` "chunk" against its windows embedded one by one, "start" against
the expected token ids, "end" against true, false's 400; `x-request-id` accepted, generated,
replaced and echoed, and carried to Tulip on the stream."""

import asyncio
import json
import re
import signal

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.conftest import Proc, free_port
from tests.sentences import SENTENCES

MAX = 256
PROMPT = "query: "  # MiniLM has no prompts: a prompts file gives it a query prompt


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port, tmp = free_port(), tmp_path_factory.mktemp("long")
    (tmp / "prompts.json").write_text(json.dumps({"query": PROMPT}))
    proc = Proc(["-m", "deploy.local", "--model", "default", "--port", str(port), "--device", "cpu"], tmp,
                env={"IVY_PROMPTS_FILE": str(tmp / "prompts.json")})
    proc.wait_for(lambda: "Trellis is ready" in proc.output(), timeout=180)
    tulip = re.search(r"TULIP_READY (127\.0\.0\.1:\d+)", proc.output()).group(1)
    yield f"http://127.0.0.1:{port}", tulip
    proc.stop(signal.SIGINT)


@pytest.fixture(scope="module")
def doc(model_path):
    """An 8,192-token document (the issue's long input; MiniLM's windows are 256), its whole token ids
    ([CLS] ... [SEP]) and the model's tokenizer."""
    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    text, ids = "", [101, 102]
    for k in range(5000):
        if len(ids) >= 8192:
            break
        text += SENTENCES[k % len(SENTENCES)] + " "
        if k % 16 == 15 or len(ids) > 8000:  # re-encode now and then: the text only grows
            ids = tok.encode(text).ids
    assert 8192 <= len(ids) < 8400 and ids[0] == 101 and ids[-1] == 102
    return text, ids, tok


def embed(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/embeddings", json=body, timeout=60)


def vectors(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float64)


def cos(a, b) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_chunk_is_the_token_weighted_mean_of_its_windows(stack, doc):
    url, _ = stack
    text, ids, _ = doc
    content = ids[1:-1]
    windows = [[101, *content[i: i + MAX - 2], 102] for i in range(0, len(content), MAX - 2)]
    assert len(windows) >= 32 and len(windows[-1]) < MAX and all(len(w) == MAX for w in windows[:-1])
    r = embed(url, input=[SENTENCES[4], text], truncate="chunk")
    got = vectors(r)
    short = embed(url, input=SENTENCES[4]).json()["usage"]["prompt_tokens"]
    assert r.json()["usage"]["prompt_tokens"] == short + sum(map(len, windows))  # every window's tokens
    one_by_one = np.concatenate([vectors(embed(url, input=[w])) for w in windows])
    weights = np.array([len(w) for w in windows], dtype=np.float64)
    want = (one_by_one * weights[:, None]).sum(0) / weights.sum()
    want /= np.linalg.norm(want)  # MiniLM normalises
    assert cos(got[1], want) >= 0.9999
    # the weights matter: the short last window pulls the plain mean away (by little over 33 windows)
    assert 1 - cos(got[1], want) < 0.1 * (1 - cos(got[1], one_by_one.mean(0)))
    assert abs(np.linalg.norm(got[1]) - 1) < 1e-5
    assert cos(got[0], vectors(embed(url, input=SENTENCES[4]))[0]) >= 0.9999  # a short input: one window
    assert cos(got[1], one_by_one[0]) < 0.99  # the mean, not the first window
    # Matryoshka on the pooled vector: its first values, normalised again
    cut = vectors(embed(url, input=text, truncate="chunk", dimensions=64))[0]
    assert cut.shape == (64,) and cos(cut, want[:64]) >= 0.9999 and abs(np.linalg.norm(cut) - 1) < 1e-5
    # token ids are cut as they are: windows of the maximum, no special tokens added
    raw = [ids[i: i + MAX] for i in range(0, len(ids), MAX)]
    r = embed(url, input=[ids], truncate="chunk")
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    parts = vectors(embed(url, input=raw))
    w = np.array([len(p) for p in raw], dtype=np.float64)
    assert cos(vectors(r)[0], (parts * w[:, None]).sum(0)) >= 0.9999


def test_start_end_true_and_false(stack, doc):
    url, _ = stack
    text, ids, _ = doc
    start = embed(url, input=text, truncate="start")
    assert start.json()["usage"]["prompt_tokens"] == MAX
    want = vectors(embed(url, input=[[101, *ids[-(MAX - 1):-1], 102]]))[0]
    assert cos(vectors(start)[0], want) >= 0.9999
    head = vectors(embed(url, input=[ids[: MAX - 1] + [102]]))[0]
    assert cos(vectors(start)[0], head) < 0.99
    end, true = embed(url, input=text, truncate="end"), embed(url, input=text, truncate=True)
    assert cos(vectors(end)[0], vectors(true)[0]) >= 0.99999 and cos(vectors(end)[0], head) >= 0.9999
    assert end.json()["usage"] == true.json()["usage"] == {"prompt_tokens": MAX, "total_tokens": MAX}
    assert cos(vectors(embed(url, input=[ids], truncate="start"))[0],
               vectors(embed(url, input=[ids[-MAX:]]))[0]) >= 0.9999  # token ids: the last MAX as sent
    for r in (embed(url, input=text), embed(url, input=text, truncate=False)):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "input"
        assert f"{len(ids)} tokens, more than this model's maximum of {MAX}" in err["message"]


def test_a_prompt_goes_once_at_the_start(stack, doc):
    """"chunk": the prompt leads the first window only; "start": the prompt is kept, then the last tokens."""
    url, _ = stack
    text, _, tok = doc
    whole = tok.encode(PROMPT + text).ids
    content, keep = whole[1:-1], len(tok.encode(PROMPT).ids) - 2
    assert keep > 0 and whole[1: 1 + keep] == tok.encode(PROMPT).ids[1:-1]
    windows = [[101, *content[i: i + MAX - 2], 102] for i in range(0, len(content), MAX - 2)]
    r = embed(url, input=text, truncate="chunk", input_type="query")
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, windows))
    parts = vectors(embed(url, input=windows))
    w = np.array([len(x) for x in windows], dtype=np.float64)
    assert cos(vectors(r)[0], (parts * w[:, None]).sum(0)) >= 0.9999
    r = embed(url, input=text, truncate="start", input_type="query")
    want = [101, *content[:keep], *content[len(content) - (MAX - 2 - keep):], 102]
    assert len(want) == MAX and cos(vectors(r)[0], vectors(embed(url, input=[want]))[0]) >= 0.9999


@pytest.mark.parametrize("body, param, fragment", [
    ({"truncate": "middle"}, "truncate", 'one of "end", "start", "chunk"'),
    ({"truncate": 2}, "truncate", "valid boolean"),
    ({"truncate": "chunk", "return_sparse": True}, "return_sparse", "not supported"),
])
def test_bad_truncate_is_400_naming_the_field(stack, body, param, fragment):
    r = embed(stack[0], input="hi", **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and fragment in r.json()["error"]["message"]


def test_request_id_is_echoed_generated_or_replaced(stack):
    url, _ = stack
    r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, headers={"x-request-id": "trace-42/a b"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42/a b"
    r = httpx.post(url + "/v1/embeddings", json={"input": "hi"})
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    assert httpx.post(url + "/v1/embeddings", json={"input": "hi"}).headers["x-request-id"] != r.headers["x-request-id"]
    for bad in ("x" * 129, "caf\u00e9", "tab\there"):
        r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, headers={"x-request-id": bad.encode()})
        assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]), bad
    r = httpx.post(url + "/v1/embeddings", json={"input": ""}, headers={"x-request-id": "bad-one"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-one"
    r = httpx.post(url + "/v1/embeddings", content=b"{not json", headers={"x-request-id": "x" * 128})
    assert r.status_code == 400 and r.headers["x-request-id"] == "x" * 128
    for path in ("/health", "/v1/models", "/v1/models/nope"):  # FastAPI's routes, a 404 among them
        r = httpx.get(url + path, headers={"x-request-id": "get-1"})
        assert r.headers["x-request-id"] == "get-1", path
    r = httpx.post(url + "/v1/tokenize", json={"input": "hi"}, headers={"x-request-id": "tok-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "tok-1"


def test_tulip_gets_the_request_id_on_the_stream(stack):
    """TulipStream tags each message with the caller's id plus "#n" (Tulip matches replies and
    cancels by it, so two requests with one caller id stay apart); Tulip's replies carry it back."""
    from trellis.tulip.v1 import tulip_pb2
    from trellis.client import TulipClient, pack

    async def main():
        async with TulipClient(stack[1]) as c:
            ids, lengths = pack([[101, 7592, 102]])
            reqs = [tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths, request_id="same") for _ in range(3)]
            replies = await asyncio.gather(*(c.stream.request(r, 10.0) for r in reqs))
            return [r.request_id for r in reqs], [r.request_id for r in replies]

    sent, got = asyncio.run(main())
    assert sorted(sent) == sorted(got) == ["same#0", "same#1", "same#2"]
