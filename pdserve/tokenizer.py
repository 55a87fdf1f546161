"""Text <-> token ids for one model: a thin wrapper over the Hugging Face `tokenizers` library.

Owns reading (and writing) a model directory's tokenizer files (tokenizer.json,
tokenizer_config.json, the chat template, EOS ids from generation_config.json / config.json), the
rule for adding BOS/EOS, and rendering chat templates in a sandboxed jinja2 environment. It never
imports `transformers`.

BOS/EOS rule (what transformers' fast tokenizers do, plus the Llama default):
- tokenizer_config.json sets add_bos_token / add_eos_token: the post-processor is replaced by a
  template that adds exactly those tokens;
- neither is set and tokenizer.json has a post-processor: it is used as is (Llama 3, Qwen2);
- neither is set and there is no post-processor: BOS is added when a bos_token exists (Llama).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import processors


class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model. Immutable after construction.

    Takes ownership of `backend`: it sets the backend's post-processor (BOS/EOS rule) and turns
    off truncation and padding.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        # A server must never truncate or pad silently; length limits are the router's job.
        backend.no_truncation()
        backend.no_padding()
        self._special = {"bos_token": bos_token, "eos_token": eos_token,
                         "pad_token": pad_token, "unk_token": unk_token}
        for name, token in self._special.items():
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"{name} {token!r} is not in the tokenizer vocabulary")
        self.bos_token_id = self.token_to_id(bos_token) if bos_token else None
        eos_ids = {int(i) for i in extra_eos_token_ids}
        if eos_token:
            eos_ids.add(backend.token_to_id(eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self._chat_template = chat_template
        self._add_flags = {"add_bos_token": add_bos_token, "add_eos_token": add_eos_token}
        self._set_post_processor(add_bos_token, add_eos_token)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, chat_template: str | None = None
                        ) -> Tokenizer:
        """Load from a HF model directory (tokenizer.json is required); `chat_template`
        replaces the model's own (vLLM's --chat-template)."""
        root = Path(model_dir)
        if not (root / "tokenizer.json").is_file():
            raise FileNotFoundError(f"model_dir {root}: no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            unk_token=_token_content(config.get("unk_token")),
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=config.get("add_eos_token"),
            chat_template=chat_template or _find_chat_template(root, config),
            extra_eos_token_ids=_config_eos_ids(root),
        )

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write tokenizer.json, tokenizer_config.json and generation_config.json (the EOS ids)
        so that `from_pretrained(out_dir)` builds a tokenizer that encodes and decodes the same."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(out / "tokenizer.json"), pretty=False)
        config = {**self._special, **self._add_flags, "chat_template": self._chat_template}
        _write_json(out / "tokenizer_config.json",
                    {k: v for k, v in config.items() if v is not None})
        _write_json(out / "generation_config.json", {"eos_token_id": sorted(self.eos_token_ids)})
        return out

    def with_chat_template(self, chat_template: str) -> Tokenizer:
        """This tokenizer with another chat template (vLLM's --chat-template); the backend is
        shared (its BOS/EOS post-processor is already set, so it is left as it is)."""
        return Tokenizer(self._backend, **self._special, chat_template=chat_template,
                         extra_eos_token_ids=sorted(self.eos_token_ids))

    # -- vocabulary ------------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (do not reconfigure it)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._special["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self._special["eos_token"]

    @property
    def pad_token_id(self) -> int | None:
        pad = self._special["pad_token"]
        return self.token_to_id(pad) if pad else None

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self._backend.id_to_token(int(i)) for i in ids]

    # -- encode / decode -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens adds BOS/EOS per the rule in the module doc."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        # encode_batch, not encode: the same ids, but it releases the GIL while it works, so
        # a long text tokenised on a worker thread does not stall the caller's event loop.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text (added and special tokens included): a
        text of B bytes has at least B / max_token_bytes tokens, for a tokenizer whose decoded
        tokens spell the text back (every byte-level BPE and SentencePiece model)."""
        ids = [[i] for i in range(self.vocab_size)]
        texts = self._backend.decode_batch(ids, skip_special_tokens=False)
        return max((len(t.encode("utf-8")) for t in texts), default=1) or 1

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ids; invalid UTF-8 byte sequences decode to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _set_post_processor(self, add_bos: bool | None, add_eos: bool | None) -> None:
        if add_bos is None and add_eos is None:
            if self._backend.post_processor is not None:
                return
            add_bos = self.bos_token is not None
        bos = self.bos_token if add_bos else None
        eos = self.eos_token if add_eos else None
        single = " ".join(filter(None, (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0")))
        pair = " ".join(filter(None, (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1")))
        specials = [(t, self._backend.token_to_id(t)) for t in (bos, eos) if t]
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=specials)

    # -- chat ------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True,
        continue_final_message: bool = False, tools: list[dict] | None = None, **kwargs: Any
    ) -> str:
        """Render messages with the model's chat template (sandboxed jinja2, like transformers).

        `tools` (OpenAI function definitions) reach the template as `tools`;
        `continue_final_message` cuts the text right after the last message's content, so
        the model continues that message (transformers' rule). The result already holds any
        BOS the template writes: encode it with add_special_tokens=False (see `encode_chat`).
        Raises ValueError for a model without a template, for malformed messages and for
        errors the template raises.
        """
        _check_messages(messages)
        context = {**self._special, "tools": tools, "documents": None, **kwargs,
                   "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            text = self._compiled_template.render(**context)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
        return _continue_final(text, messages) if continue_final_message else text

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True,
        continue_final_message: bool = False, tools: list[dict] | None = None,
        add_special_tokens: bool = False, **kwargs: Any
    ) -> list[int]:
        """Token ids of a chat prompt: the rendered template; special tokens are not added
        again unless asked (vLLM's add_special_tokens)."""
        text = self.apply_chat_template(messages, add_generation_prompt,
                                        continue_final_message, tools, **kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self._chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json has no "
                             "chat_template and there is no chat_template.jinja); use a plain "
                             "completion prompt instead")
        try:
            return _chat_environment().from_string(self._chat_template)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Chat-template environment


class _GenerationTag(Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` blocks and renders the body.

    transformers uses the tag to find assistant tokens for training masks; serving only needs the
    template to compile and render the same text.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    # Templates come with downloaded models: untrusted code, hence the immutable sandbox.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _continue_final(text: str, messages: list[dict]) -> str:
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text content")
    at = text.rfind(final.strip())
    if at < 0:
        raise ValueError("continue_final_message is set but the final message does not "
                         "appear in the rendered chat template")
    keep = len(final.lstrip()) if text[at:at + len(final.lstrip())] == final.lstrip() \
        else len(final.strip())
    return text[:at + keep]


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}].role must be a str")


# ---------------------------------------------------------------------------------------------
# Reading model files


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unsupported special token entry in tokenizer_config.json: {value!r}")


def _find_chat_template(root: Path, config: dict) -> str | None:
    # Newer transformers save the template beside the config; those files take precedence.
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(root / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{root}: chat_template must be a string")
    return template


def _config_eos_ids(root: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        value = _read_json(root / name).get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        for v in values:
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{root / name}: eos_token_id must be a non-negative int or a "
                                 f"list of them, got {value!r}")
            ids.append(v)
    return ids
