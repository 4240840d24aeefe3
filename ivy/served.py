"""The models one Ivy serves: per model its directory (tokenizer, prompts, maximum length), its own
Tulip replicas (one Balancer each) and the turning of a request's inputs into token sequences;
`Models`, routing a request's `model` field to one of them (absent: the default, the first).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import numpy as np

from ivy.balancer import Balancer
from ivy.config import IvyConfig, ModelConfig
from ivy.errors import APIError, input_kind_error
from ivy.front import CALL, Stamp, _no_stamp
from ivy.schemas import EmbeddingRequest
from ivy.templates import Templates
from ivy.tokenizer import TextTokenizer
from trellis.modeldir import ModelSpec
from trellis.modelref import resolve
from trellis.tulip.v1 import tulip_pb2

log = logging.getLogger("ivy")

INFO_WAIT_S = 5.0  # a request reaching a worker that has not heard from a replica yet waits this long, then 503


class ServedModel:
    """One model: its name, directory, tokenizer and templates, and (once `start`ed on the serving
    event loop) the balancer over its Tulips."""

    def __init__(self, mc: ModelConfig, cfg: IvyConfig, created: int):
        self.config, self.cfg, self.created = mc, cfg, created
        # its tokenizer and configs (a Hub id: the weights left out; the parent process fetched them once and
        # pinned the commit, ivy.__main__); the same files its Tulips serve
        self.ref = resolve(mc.model, mc.revision, weights=False)
        self.spec = ModelSpec.read(self.ref.path)
        # the transformers checkpoint's folder (its tokenizer, config.json, image processor): the reference's own
        # directory, or where sentence-transformers' older CLIP layout keeps it (0_CLIPModel/; ModelSpec.read)
        self.path = self.spec.path
        self.name = mc.name or self.ref.name
        self.tokenizer = TextTokenizer.for_model(self.spec, cfg.tokenize_offload_chars,
                                                 max_request_tokens=cfg.max_request_tokens)
        self.templates = Templates(self.spec.prompts, Path(mc.prompts_file) if mc.prompts_file else None,
                                   self.spec.default_prompt_name)
        # sentence-transformers' include_prompt: false (last-token pooling is not affected by it)
        self.pool_without_prompt = self.spec.pooling != "last" and not self.spec.include_prompt
        self.balancer: Balancer | None = None  # gRPC channels must be made on the server's event loop
        self._mismatch: str | None = None  # checked once, on the first Info

    def start(self) -> None:
        cfg = self.cfg
        self.balancer = Balancer(self.config.tulip, cfg.max_chunk_tokens, cfg.transport, cfg.tulip_spin_ms,
                                cfg.resolve_interval)
        self.balancer.start()

    async def close(self) -> None:
        if self.balancer is not None:
            await self.balancer.close()

    def check_room(self) -> None:
        """A 429 at once, before any tokenizing, while every replica's queue is known to be full."""
        if self.balancer.full():
            raise APIError(429, "every inference server's queue is full; retry shortly", None, "overloaded")

    def card(self) -> dict:
        """OpenAI's model object, with which files are served: a Hub id's commit (`revision`, else null) and
        whether the weights are a preset's random ones (`random_weights`: its outputs mean nothing)."""
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "trellis",
                "revision": self.ref.revision or None, "random_weights": self.ref.random_weights}

    async def info(self) -> tulip_pb2.InfoReply:
        """The model's Info from its Tulips, or a 503 when none has answered yet."""
        info = await self.balancer.info(wait=INFO_WAIT_S)
        if info is None:
            raise APIError(503, f"no inference server for '{self.name}' is reachable yet; retry shortly", None,
                           "replica_unavailable")
        if self._mismatch is None:
            self._mismatch = ""
            if info.vocab_size != self.spec.vocab_size:  # token ids from this tokenizer would mean other tokens
                self._mismatch = (f"model '{self.name}' is misconfigured: its Tulips serve a model with a vocabulary "
                                  f"of {info.vocab_size} (Info: '{info.model}'), its directory {self.path} has "
                                  f"{self.spec.vocab_size}")
                log.error("%s; its requests are refused", self._mismatch)
            elif info.revision and self.ref.revision and info.revision != self.ref.revision:
                log.warning("model '%s': this gateway reads revision %s's tokenizer and configs, its Tulips serve "
                            "revision %s (Info); pin one revision (ORG/NAME@REVISION) for both", self.name,
                            self.ref.revision, info.revision)
        if self._mismatch:
            raise APIError(503, self._mismatch, "model", "model_mismatch")
        return info

    async def offload(self, chars: int, fn, *args):
        return fn(*args) if chars <= self.cfg.tokenize_offload_chars else await asyncio.to_thread(fn, *args)

    async def text_sequences(self, texts: list[str], prefix: str, truncate: bool, param: str = "input",
                             item: str | None = "input", stamp: Stamp = _no_stamp
                             ) -> tuple[list[np.ndarray], list[int]]:
        """Token ids of texts with `prefix` (a prompt, `templates.prefix`) before each, and per text the
        leading prompt tokens pooling leaves out (empty unless the model's pooling has include_prompt: false)."""
        seqs = await self.tokenizer.encode([prefix + t for t in texts] if prefix else texts, truncate, param=param,
                                           item=item)
        stamp("tokenize")
        if prefix and self.pool_without_prompt:
            n = self.tokenizer.prompt_length(prefix)
            return seqs, [min(n, len(s) - 1) for s in seqs]
        return seqs, []

    async def pair_sequences(self, queries: str | list[str], documents: list[str], truncate: bool, param: str,
                             item: str, instruction: str | None = None) -> tuple[list[np.ndarray], list[int]]:
        """A cross-encoder's pairs (`TextTokenizer.encode_pairs`), with the prompt CrossEncoder.predict
        applies where the request sends none: the model's default prompt (`default_prompt_name`), as a
        chat template's system message, or before each query."""
        default = self.templates.default_prompt()
        if instruction is None and default:
            if self.tokenizer.chat is not None:
                instruction = default
            else:  # sentence-transformers puts a prompt before a pair's first text
                queries = default + queries if isinstance(queries, str) else [default + q for q in queries]
        return await self.tokenizer.encode_pairs(queries, documents, truncate, param, item, instruction)

    async def long_text_sequences(self, texts: list[str], mode: str, prefix: str, stamp: Stamp
                                  ) -> tuple[list[np.ndarray], list[int], list[int]]:
        """truncate "start" / "chunk": each text encoded whole with its prompt `prefix`, and one over the
        maximum cut to its last tokens (the prompt kept) or split into windows (the prompt in the
        first). Returns the sequences, their pool_from (as `text_sequences`), windows per text."""
        tokenizer = self.tokenizer
        whole = await tokenizer.encode([prefix + t for t in texts] if prefix else texts, False, check_length=False)
        n_prompt = tokenizer.prompt_length(prefix) if prefix else 0
        keep = max(n_prompt - len(tokenizer.wrap[0]), 0) if prefix and tokenizer.wrap else 0
        seqs, pool_from, windows = [], [], []
        for s in whole:
            parts = [s] if len(s) <= tokenizer.max_len else tokenizer.windows(s, mode, keep)
            seqs += parts
            windows.append(len(parts))
            pool_from += [min(n_prompt, len(parts[0]) - 1)] + [0] * (len(parts) - 1)
        stamp("tokenize")
        return seqs, pool_from if prefix and self.pool_without_prompt else [], windows

    async def sequences(self, req: EmbeddingRequest, inp: list, info: tulip_pb2.InfoReply,
                        stamp: Stamp) -> tuple[list[np.ndarray], list[int], list[int]]:
        """Token-id arrays for an embeddings request's inputs `inp`, per sequence the leading prompt
        tokens mean pooling leaves out (empty unless the model's pooling has include_prompt: false),
        and per input how many sequences (windows) it became (all 1 unless truncate is "chunk")."""
        kinds = set(map(type, inp))  # one kind per array (the decoder takes str, int or int arrays per item)
        if len(kinds) != 1:
            raise input_kind_error()
        mode = req.mode
        if str in kinds:
            for i, s in enumerate(inp):
                if not s:
                    raise APIError(400, f"input {i} is an empty string", "input")
            prefix = self.templates.prefix(req.input_type, req.instruction, req.prompt_name)
            stamp("template")
            if mode in ("start", "chunk"):
                return await self.long_text_sequences(inp, mode, prefix, stamp)
            seqs, pool_from = await self.text_sequences(inp, prefix, mode == "end", stamp=stamp)
            return seqs, pool_from, [1] * len(seqs)
        if req.input_type is not None or req.instruction is not None or req.prompt_name is not None:
            raise APIError(400, "'input_type', 'instruction' and 'prompt_name' apply to text inputs, not token ids",
                           "input_type" if req.prompt_name is None else "prompt_name")
        if int in kinds:
            inp = [inp]
        seqs, windows, cap = [], [], info.max_seq_len
        for i, ids in enumerate(inp):
            if not ids:
                raise APIError(400, f"input {i} is an empty token array", "input")
            try:
                a = np.array(ids, dtype=np.int64)
                lo, hi = int(a.min()), int(a.max())
            except OverflowError:  # beyond int64: certainly outside any vocabulary
                lo = hi = max(ids, key=abs)
            if lo < 0 or hi >= info.vocab_size:
                raise APIError(400, f"input {i} has token id {lo if lo < 0 else hi}, outside the vocabulary "
                               f"[0, {info.vocab_size})", "input")
            a = a.astype(np.int32)
            if len(a) > cap:  # token ids are the caller's: cut as they are, no special tokens added
                if mode is None:
                    raise APIError(
                        400, f"input {i} has {len(a)} tokens, more than this model's maximum of {cap}; "
                        "shorten it or send \"truncate\": true", "input", "context_length_exceeded")
                parts = ([a[:cap]] if mode == "end" else [a[len(a) - cap:]] if mode == "start"
                         else [a[k: k + cap] for k in range(0, len(a), cap)])
            else:
                parts = [a]
            seqs += parts
            windows.append(len(parts))
        stamp("tokenize")
        return seqs, [], windows


class Models:
    """The served models by name, in configuration order; the first is the default."""

    def __init__(self, cfg: IvyConfig):
        created = int(time.time())
        self.all = [ServedModel(mc, cfg, created) for mc in cfg.models]
        self.by_name: dict[str, ServedModel] = {}
        for m in self.all:
            if m.name in self.by_name:
                raise ValueError(f"two models are served as {m.name!r} ({self.by_name[m.name].config.model!r} and "
                                 f"{m.config.model!r}): give each a distinct name")
            self.by_name[m.name] = m
        self.default = self.all[0]

    def get(self, name: str | None) -> ServedModel:
        """The model a request names (None: the default), its name kept for the request's metrics;
        an unknown name is OpenAI's 404 model_not_found."""
        m = self.default if name is None else self.by_name.get(name)
        if m is None:
            served = ", ".join(f"'{n}'" for n in self.by_name)
            raise APIError(404, f"The model '{name}' does not exist; this server serves {served}", "model",
                           "model_not_found")
        call = CALL.get()
        if call is not None:
            call.model = m.name
        return m

    def start(self) -> None:
        for m in self.all:
            m.start()

    async def close(self) -> None:
        await asyncio.gather(*(m.close() for m in self.all), return_exceptions=True)
