"""Input templating: per-model prompts for queries and documents, and instructions.

Prompts come from the model directory's config_sentence_transformers.json (`prompts`, e.g.
{"query": "Instruct: ...\\nQuery:", "document": ""}); an Ivy prompts file (JSON of the same
shape, `--prompts-file`) overrides them and is re-read whenever it changes, so templates can
change without restarting any Tulip (or Ivy). A `default_prompt_name` (config_sentence_transformers.json)
names the prompt an input gets when the request picks none, as sentence-transformers applies it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ivy.errors import APIError

# e5-mistral-7b-instruct names its query prompt after the task (web_search_query, sts_query, ...).
ALIASES = {"document": ("document", "passage", "doc"), "query": ("query", "web_search_query")}


class Templates:
    def __init__(self, model_prompts: dict[str, str], override: Path | None, default_prompt_name: str = ""):
        self.model_prompts = dict(model_prompts)
        self.default_prompt_name = default_prompt_name
        self.override = Path(override) if override else None
        self._mtime = None
        self._override_prompts: dict[str, str] = {}

    def prompts(self) -> dict[str, str]:
        if self.override is not None:
            try:
                m = os.stat(self.override).st_mtime_ns
            except FileNotFoundError:
                m = None
            if m != self._mtime:
                self._override_prompts = json.loads(self.override.read_text()) if m is not None else {}
                if not isinstance(self._override_prompts, dict):
                    raise APIError(503, f"prompts file {self.override} must hold a JSON object")
                self._mtime = m
        return {**self.model_prompts, **self._override_prompts}

    def default_prompt(self) -> str:
        """The prompt `default_prompt_name` names ("" none, or where a prompts file dropped it)."""
        return self.prompts().get(self.default_prompt_name, "") if self.default_prompt_name else ""

    def query_prompt(self) -> str:
        prompts = self.prompts()
        return next((prompts[k] for k in ALIASES["query"] if k in prompts), "")

    def instruction_tuned(self) -> bool:
        return self.query_prompt().startswith("Instruct:")

    def apply(self, texts: list[str], input_type: str | None, instruction: str | None,
              prompt_name: str | None = None) -> list[str]:
        """Prefix `texts` with the prompt for `input_type` or named `prompt_name`, or with `instruction`
        (queries only)."""
        prefix = self.prefix(input_type, instruction, prompt_name)
        return [prefix + t for t in texts] if prefix else texts

    def prefix(self, input_type: str | None, instruction: str | None, prompt_name: str | None = None) -> str:
        """The text put before each input: the prompt for `input_type`, the prompt named `prompt_name`
        (a key of the prompts, as sentence-transformers' `encode(prompt_name=...)` and TEI take it), or
        the instruction's. At most one of the three; none: the default prompt, if the model names one."""
        if prompt_name is not None:
            if input_type is not None or instruction is not None:
                raise APIError(400, "send one of 'prompt_name', 'input_type' and 'instruction'", "prompt_name")
            prompts = self.prompts()
            if prompt_name not in prompts:
                have = ", ".join(f"'{k}'" for k in prompts) or "none"
                raise APIError(400, f"prompt_name '{prompt_name}' is not one of this model's prompts ({have})",
                               "prompt_name")
            return prompts[prompt_name]
        if instruction is not None:
            if not self.instruction_tuned():
                raise APIError(400, "'instruction' is only accepted by instruction-tuned models", "instruction")
            if input_type == "document":
                raise APIError(400, "'instruction' applies to queries; documents take none", "instruction")
            # As the model's own query prompt ends: "Query:" (Qwen3-Embedding) or "Query: " (e5, gte-Qwen2).
            return f"Instruct: {instruction}\nQuery:" + (" " if self.query_prompt().endswith(" ") else "")
        if input_type is None:
            return self.default_prompt()
        prompts = self.prompts()
        return next((prompts[k] for k in ALIASES[input_type] if k in prompts), "")
