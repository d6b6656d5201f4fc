"""What the server serves, as the front end names it: the model's paths (as given, as located,
its HF folder), its served name, the sampling defaults of its generation_config.json, and its
tokenizer with the server's chat template (and how many characters one of its tokens can cover)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


@dataclass
class ServedModel:
    model_path: str | None  # as given (the bundled model's when none)
    resolved_model_path: str | None  # its folder or .gguf file
    hf_dir: str | None  # config.json's folder (a GGUF's converted cache)
    tokenizer_path: str | None
    served_model_name: str
    default_sampling_params: dict = field(default_factory=dict)

    @classmethod
    def from_server_args(cls, server_args) -> ServedModel:
        model_path = server_args.model_path or _default_model_path()
        resolved = _located(model_path, server_args.revision)
        hf_dir = _hf_dir(resolved)
        use_defaults = server_args.sampling_defaults == "model"
        return cls(
            model_path=model_path,
            resolved_model_path=resolved,
            hf_dir=hf_dir,
            tokenizer_path=server_args.tokenizer_path or hf_dir,
            served_model_name=server_args.served_model_name or _model_name(server_args.model_path),
            default_sampling_params=model_sampling_defaults(hf_dir) if use_defaults else {},
        )


def load_tokenizer(server_args):
    from radixengine.model_loader import get_tokenizer

    return get_tokenizer(server_args.model_path, server_args.revision, server_args.tokenizer_path)


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja template, or the template itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


# Normalizers that never shrink a text, and those that fold at most 4 characters into one
# (canonical composition: no character decomposes into more than 4).
_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_MAX_COMPOSED = 4
# Pre-tokenizers that split a text without dropping any of it (Split too, unless it removes the
# matches; no pre-tokenizer whose behavior is "Removed").
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of a text one token can stand for: the longest token string of the
    vocabulary (a byte-level token's string has a character per byte, so at least as many as the
    characters it covers), times what the normalizer can fold into one character. None where a
    token may cover any number of characters: a tokenizer that fuses unknown characters into one
    token (BPE's fuse_unk without byte fallback, Unigram, WordPiece), drops text (a whitespace pre-tokenizer, a
    stripping added token) or is not a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    if backend.model.fuse_unk and not backend.model.byte_fallback:
        return None
    if any(t.lstrip or t.rstrip for t in tokenizer.added_tokens_decoder.values()):
        return None
    fold = _normalizer_fold(_state(backend.normalizer))
    if fold is None or not _keeps_text(_state(backend.pre_tokenizer)):
        return None
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(len(t or "") for t in tokens) * fold


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_fold(state: dict | None) -> int | None:
    """How many characters the normalizer may turn into one (None: any number)."""
    kind = None if state is None else state.get("type")
    if kind is None or kind in _KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _MAX_COMPOSED
    if kind == "Replace":
        pattern = state.get("pattern", {}).get("String")
        return 1 if pattern is not None and len(state.get("content", "")) >= len(pattern) else None
    if kind == "Sequence":
        fold = 1
        for part in state.get("normalizers", []):
            part_fold = _normalizer_fold(part)
            if part_fold is None:
                return None
            fold *= part_fold
        return fold
    return None


def _keeps_text(state: dict | None) -> bool:
    kind = None if state is None else state.get("type")
    if kind is None:
        return True
    if state.get("behavior") == "Removed":
        return False
    if kind in _KEEPING_PRE_TOKENIZERS or kind == "Split":
        return True
    if kind == "Sequence":
        return all(_keeps_text(part) for part in state.get("pretokenizers", []))
    return False


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(hf_dir: str | None) -> dict:
    """The sampling fields the model's generation_config.json sets (SGLang's
    `--sampling-defaults model`); {} when it has none."""
    path = os.path.join(hf_dir, "generation_config.json") if hf_dir else None
    if path is None or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    defaults = {k: config[k] for k in SAMPLING_DEFAULT_FIELDS if config.get(k) is not None}
    if defaults.get("top_k") == 0:  # transformers' "no top-k"
        defaults["top_k"] = -1
    return defaults


def _default_model_path() -> str | None:
    from radixengine.model_loader import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        return None


def _located(model_path: str | None, revision: str | None) -> str | None:
    """The folder or .gguf file the model is read from (a repo id's cached snapshot), None if
    there is none."""
    from radixengine.model_loader import locate_model

    try:
        return locate_model(model_path, revision) if model_path else None
    except (FileNotFoundError, ValueError, OSError):
        return None


def _hf_dir(model_path: str | None) -> str | None:
    """The HF folder of the model (a GGUF's converted cache), None if there is none."""
    from radixengine.model_loader import resolve_model_path

    try:
        return resolve_model_path(model_path) if model_path else None
    except (FileNotFoundError, ValueError, OSError):
        return None


def _model_name(model_path: str | None) -> str:
    if not model_path:
        return "SmolLM2-135M-Instruct"
    return model_path.rstrip("/")


def tokenizer_eos_ids(tokenizer: object | None) -> frozenset[int]:
    """The tokenizer's own EOS id (SGLang adds it to the model's EOS set)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset({eos})
