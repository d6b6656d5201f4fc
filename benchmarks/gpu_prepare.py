"""What `benchmarks/gpu_check.sh` needs on a GPU machine without network, gathered where PyPI is
reachable: the wheels of every package radixengine and its tests need (the versions installed here,
so the GPU runs what CI runs) for the GPU machine's Python, less torch and its CUDA libraries and
less what that machine already has; with `--model-files`, the default model's config and
tokenizer without its weights (3.5 MB: gpu_check's offline stage then runs on random weights of
its shape), and the shared workloads W1/W2 beside them (`workloads/`).

    python benchmarks/gpu_prepare.py --dest .whl --have their_pip_freeze.txt --model-files .gpu_model
    # there: WHEELS=.whl MODEL_PATH=.gpu_model WORKLOADS_DIR=.gpu_model/workloads bash benchmarks/gpu_check.sh

`--have` is the GPU machine's `pip list --format=freeze` (or one package name a line). Run it in
the environment that has radixengine[test] installed (`make setup`'s .venv).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

# torch brings these itself on a CUDA machine, built for its CUDA
NEVER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|pytorch-triton.*)$")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def needed(root: str, extras: set[str], python_version: str) -> dict[str, str]:
    """name -> installed version for `root`'s requirements (with `extras`) and theirs, as markers
    evaluate on Linux under `python_version`."""
    env = {**default_environment(), "python_version": python_version, "sys_platform": "linux"}
    found: dict[str, str] = {}
    stack = [(root, extras)]
    while stack:
        name, wanted_extras = stack.pop()
        dist = md.distribution(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in wanted_extras | {""}):
                continue
            key = canonical(req.name)
            if key in found or NEVER.match(key):
                continue
            try:
                found[key] = md.version(req.name)
            except md.PackageNotFoundError:
                continue  # an optional dependency not installed here: the tests do not need it
            stack.append((req.name, set(req.extras)))
    return found


def have_names(path: str | None) -> set[str]:
    if not path:
        return set()
    lines = Path(path).read_text().splitlines()
    return {canonical(re.split(r"[=<>@ ]", line.strip())[0]) for line in lines if line.strip()}


WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads"


def copy_model_files(dest: Path) -> None:
    """The default model's config, tokenizer and chat template, no weights."""
    from radixengine.model_loader import resolve_model_path

    source = Path(resolve_model_path(None))
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, dest / name)
    print(f"model files of {source} in {dest}")


def copy_workloads(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("W1.jsonl", "W2.jsonl"):
        shutil.copy(WORKLOADS / name, dest / name)
    print(f"workloads of {WORKLOADS} in {dest}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", default=".whl")
    p.add_argument("--have", default=None, help="the GPU machine's pip freeze: packages to leave out")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    p.add_argument("--extras", default="test")
    p.add_argument("--leave-out", default="ruff", help="comma list: packages the GPU run does not use")
    p.add_argument(
        "--add",
        default="",
        help="comma list of further pins, e.g. flashinfer-python==0.6.1,apache-tvm-ffi==0.1.15.post2",
    )
    p.add_argument(
        "--model-files",
        default=None,
        help="copy the default model's config and tokenizer here, the workloads below it",
    )
    p.add_argument("--dry-run", action="store_true", help="list the wheels, download nothing")
    args = p.parse_args()

    packages = needed("radixengine", set(args.extras.split(",")), args.python_version)
    skip = have_names(args.have) | {canonical(n) for n in args.leave_out.split(",") if n}
    added = {canonical(pin.split("==")[0]): pin for pin in args.add.split(",") if pin}
    pins = sorted(f"{name}=={version}" for name, version in packages.items() if name not in skip | set(added))
    pins += added.values()
    print("\n".join(pins))
    if args.dry_run:
        return
    if args.model_files:
        copy_model_files(Path(args.model_files))
        copy_workloads(Path(args.model_files) / "workloads")
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    cmd += ["--python-version", args.python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + pins, check=True)
    size = sum(f.stat().st_size for f in dest.glob("*.whl"))
    print(f"{len(pins)} packages, {len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {dest}")


if __name__ == "__main__":
    main()
