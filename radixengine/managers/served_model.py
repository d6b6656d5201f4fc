"""What the server serves, as the front end names it: the model's paths (as given, as located,
its HF folder), its served name, the sampling defaults of its generation_config.json, and its
tokenizer with the server's chat template."""

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
