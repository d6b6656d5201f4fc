"""Where a model is on disk: a local folder or .gguf file, or a Hugging Face repo id looked up in
the local Hugging Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`), never downloaded.

Accepted `--model-path` forms besides local paths: `org/name` (a snapshot folder; one with no
config.json but a single .gguf means that file), `org/name/file.gguf` (a file of the repo, as
`hf download org/name file.gguf` stores it) and `org/name:Q4_K_M` (vLLM's form: the repo's one
.gguf whose name ends in that quantization). `--revision` is a branch, tag or commit hash.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from radixengine.model_loader.default_model import default_model_path
from radixengine.model_loader.gguf_loader import convert_gguf, is_gguf

_NAME = r"[\w][\w.-]*"
_REPO = rf"{_NAME}(?:/{_NAME})?"
_HUB_FILE = re.compile(rf"(?P<repo>{_NAME}/{_NAME})/(?P<file>.+\.gguf)")
_HUB_QUANT = re.compile(rf"(?P<repo>{_REPO}):(?P<quant>[\w.-]+)")
_HUB_REPO = re.compile(rf"(?P<repo>{_REPO})")


@dataclass(frozen=True)
class HubRef:
    """A model named by its Hugging Face repo: the repo, and maybe one .gguf of it."""

    repo_id: str
    filename: str | None = None  # a file of the repo
    quant: str | None = None  # the .gguf whose name ends in this quantization type

    @classmethod
    def parse(cls, path: str) -> HubRef | None:
        for pattern in (_HUB_FILE, _HUB_QUANT, _HUB_REPO):
            m = pattern.fullmatch(path)
            if m:
                return cls(m["repo"], *(m.groupdict().get(k) for k in ("file", "quant")))
        return None


def hf_hub_cache() -> Path:
    """huggingface_hub's cache folder, read from the environment now (huggingface_hub reads it
    once, at import)."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    cache = (
        os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    )
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def locate_model(model_path: str | None, revision: str | None = None, flag: str = "--model-path") -> str:
    """The model on disk: a folder or a .gguf file (the bundled default model when None);
    `flag` names the option in errors."""
    model_path = model_path or default_model_path()
    if os.path.exists(model_path):
        return _gguf_of_folder(model_path)
    ref = HubRef.parse(model_path)
    if ref is None or model_path.startswith((".", "~")):
        raise FileNotFoundError(f"{flag} {model_path}: no such file or folder")
    return _locate_in_cache(f"{flag} {model_path}", ref, revision)


def resolve_model_path(model_path: str | None, revision: str | None = None) -> str:
    """The HF folder to load from: the model's folder, or the converted cache of a GGUF file."""
    path = locate_model(model_path, revision)
    if is_gguf(path):
        return str(convert_gguf(path))
    if not Path(path, "config.json").exists():
        ggufs = _gguf_names(path) if os.path.isdir(path) else []
        pick = (
            f" (it holds {ggufs}: name one, as a path, <repo>/<file>.gguf or <repo>:<type>)" if ggufs else ""
        )
        raise FileNotFoundError(f"{path} is neither a GGUF file nor a folder with config.json{pick}")
    return path


def resolve_tokenizer_path(
    model_path: str | None, tokenizer_path: str | None = None, revision: str | None = None
) -> str:
    """What `AutoTokenizer.from_pretrained` reads: `tokenizer_path` (a tokenizer's own folder
    needs no config.json), else the model's folder; a GGUF's converted cache. `revision` names a
    version of the model's repo, so it applies to `tokenizer_path` only when that is the model's."""
    if tokenizer_path is None or tokenizer_path == model_path:
        located = locate_model(model_path, revision)
    else:
        located = locate_model(tokenizer_path, flag="--tokenizer-path")
    return str(convert_gguf(located)) if is_gguf(located) else located


def _gguf_of_folder(path: str) -> str:
    """A folder holding no config.json but a single .gguf (a GGUF repo) means that file."""
    if not os.path.isdir(path) or Path(path, "config.json").exists():
        return path
    ggufs = sorted(Path(path).glob("*.gguf"))
    return str(ggufs[0]) if len(ggufs) == 1 else path


def _locate_in_cache(given: str, ref: HubRef, revision: str | None) -> str:
    snapshot = _snapshot_folder(given, ref.repo_id, revision)
    if ref.filename is not None:
        path = Path(snapshot, ref.filename)
        if not path.is_file():
            raise FileNotFoundError(
                f"{given}: {ref.filename} is not in the cached snapshot {snapshot} "
                f"(its .gguf files: {_gguf_names(snapshot) or 'none'}); download it with "
                f"`hf download {ref.repo_id} {ref.filename}`"
            )
        return str(path)
    if ref.quant is not None:
        return _gguf_by_quant(given, snapshot, ref.quant)
    return _gguf_of_folder(snapshot)


def _snapshot_folder(given: str, repo_id: str, revision: str | None) -> str:
    """The cached snapshot of `repo_id` at `revision` (a branch or tag in refs/, or a commit),
    found offline; a snapshot known to lack some of the repo's files is used as it is (the
    files the engine needs are checked when it reads them)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hf_hub_cache()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError as e:
        if getattr(e, "snapshot_path", None):
            return str(e.snapshot_path)
        raise FileNotFoundError(_not_cached_message(given, repo_id, revision, cache)) from None
    except HFValidationError as e:
        raise FileNotFoundError(f"{given}: no such file or folder ({e})") from None


def _not_cached_message(given: str, repo_id: str, revision: str | None, cache: Path) -> str:
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    rev = revision or "main"
    looked = (
        f"{repo_dir}/refs/{rev}" if not re.fullmatch(r"[0-9a-f]{40}", rev) else f"{repo_dir}/snapshots/{rev}"
    )
    known = ""
    if repo_dir.is_dir():
        refs = sorted(p.name for p in (repo_dir / "refs").glob("*"))
        snaps = sorted(p.name for p in (repo_dir / "snapshots").glob("*"))
        known = f"; the cache holds refs {refs or 'none'} and snapshots {snaps or 'none'}"
    return (
        f"{given}: not a local file or folder, and revision {rev!r} of the Hugging Face "
        f"repo {repo_id} is not in the local cache (looked for {looked}; cache {cache}, set by HF_HUB_CACHE "
        f"or HF_HOME){known}. The engine does not download: run `hf download {repo_id}` first, or pass a "
        "local folder"
    )


def _gguf_by_quant(given: str, snapshot: str, quant: str) -> str:
    names = _gguf_names(snapshot)
    tail = re.compile(rf"(?:^|.*[-._]){re.escape(quant)}\.gguf", re.IGNORECASE)
    found = [n for n in names if tail.fullmatch(n)]
    if len(found) != 1:
        what = "no" if not found else "more than one"
        raise FileNotFoundError(
            f"{given}: {what} .gguf file of {snapshot} ends in {quant} "
            f"(its .gguf files: {names or 'none'}); name the file as <repo>/<file>.gguf"
        )
    return str(Path(snapshot, found[0]))


def _gguf_names(snapshot: str) -> list[str]:
    return sorted(str(p.relative_to(snapshot)) for p in Path(snapshot).rglob("*.gguf"))
