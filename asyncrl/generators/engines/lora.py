"""Adapter-only weight updates on the generator: what the learner sends, and how an engine serves it.

With ``model.lora`` the learner publishes only the LoRA tensors of each version, named as peft's
``get_peft_model_state_dict`` names them (``base_model.model.model.layers.0.self_attn.q_proj.
lora_A.weight``), in the model's dtype, and says what they are in the publication's meta:
``"adapter": {"r", "lora_alpha", "target_modules", "base_version"}`` (``AdapterSpec``). The base
weights never travel again: the generator's engine keeps the ones it started from.

Two ways to serve a version (``engine.lora_serving``), both measured on this 2-core CPU host
(``bench/lora_sync.py``, ``docs/reference/weights.md``):

- **adapter**: hot-loaded as a vLLM LoRA adapter. Loading takes ~0.08 s where a merged reload
  rewrites (and, on the CPU backend, re-packs) every targeted matrix (0.6 s for SmolLM2-135M,
  3.8 s for the 0.5 B shape), and a request keeps the adapter it started with, so a version is
  atomic per request without pausing the engine. But every step then runs the LoRA kernels:
  vLLM's CPU build sampled SmolLM2-135M at 45 tokens/s with the adapter against 103 merged, and
  scored the probe 2-2.6 times slower.
- **merge**: base + B·A·alpha/r (``merge_adapter``, the base read from the model folder) reloaded
  into the targeted matrices through the full-weights path: the sampling rate of the plain model.

``auto`` (the default) merges on vLLM's CPU backend, where the sampling rate decides, and serves
adapters elsewhere (vLLM's GPU LoRA kernels; not measured here). Both move only the adapter's
bytes (3.6 % of SmolLM2-135M's, 1.8 % of the 0.5 B shape's at rank 16 on every linear layer).

How versions are kept apart (``AdapterSlots``):

- each version is written once, as a peft folder (``adapter_model.safetensors`` and
  ``adapter_config.json``: the form vLLM 0.32 loads adapters from; its ``LoRARequest`` takes a
  path, not tensors), and loaded under a name and an integer id never used before by this engine
  (``asyncrl-v{version}-{id}``): vLLM caches adapters by id, so a reused id would serve the old
  tensors;
- new requests take the newest adapter; a request holds its adapter (``acquire``/``release``)
  until it ends, and an older adapter is retired (removed from vLLM, its folder deleted) only
  when no request holds it.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.weights.update import WeightSyncError

PEFT_PREFIX = "base_model.model."
"""peft's prefix on every adapter tensor name (``PeftModel`` -> ``LoraModel`` -> the HF model)."""
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM 0.32 accepts as ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)."""
LIVE_ADAPTERS = 4
"""Adapters an engine holds at once (vLLM's ``max_loras``): the newest and the older ones that
requests still run on. A fifth waits in vLLM's queue until one is retired."""


def merges_adapters(serving: str) -> bool:
    """Whether an engine with ``engine.lora_serving`` ``serving`` merges adapters into its weights
    (``auto``: on vLLM's CPU backend, where LoRA kernels halve the sampling rate; see the module
    docstring) instead of serving them as vLLM LoRA adapters."""
    if serving != "auto":
        return serving == "merge"
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``.

    >>> engine_lora_rank(4), engine_lora_rank(16), engine_lora_rank(17)
    (8, 16, 32)
    """
    for allowed in MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"model.lora.rank ({rank}) must be at most {MAX_LORA_RANKS[-1]}: vLLM serves no larger adapter")


@dataclass(frozen=True)
class AdapterSpec:
    """What the learner says about the adapter tensors of a version (``meta["adapter"]``)."""

    r: int
    """The adapter's rank: lora_A is (r, in), lora_B is (out, r)."""
    lora_alpha: float
    """Scale numerator: the update is B·A·lora_alpha/r (lora_alpha/√r with ``use_rslora``)."""
    target_modules: tuple[str, ...]
    """Module names the adapter wraps (``q_proj``, ``down_proj``, ...)."""
    base_version: int = 0
    """The version of the base weights the adapter applies to (0: the initial model)."""
    use_rslora: bool = False
    """Rank-stabilised scale (peft's ``use_rslora``)."""

    @classmethod
    def from_meta(cls, body: dict) -> AdapterSpec:
        """The spec as received; a malformed one is a ``WeightSyncError`` naming the field."""
        if not isinstance(body, dict):
            raise WeightSyncError(f"meta adapter ({body!r:.80}) must be a map")
        missing = {"r", "lora_alpha", "target_modules"} - set(body)
        if missing:
            raise WeightSyncError(f"meta adapter ({sorted(body)}) lacks {sorted(missing)}")
        r, alpha, targets = body["r"], body["lora_alpha"], body["target_modules"]
        if not isinstance(r, int) or r < 1:
            raise WeightSyncError(f"meta adapter r ({r!r}) must be an int >= 1")
        if not isinstance(alpha, (int, float)) or not alpha > 0:
            raise WeightSyncError(f"meta adapter lora_alpha ({alpha!r}) must be > 0")
        if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t for t in targets):
            raise WeightSyncError(f"meta adapter target_modules ({targets!r}) must be a non-empty list of names")
        return cls(
            r=r,
            lora_alpha=float(alpha),
            target_modules=tuple(targets),
            base_version=int(body.get("base_version", 0)),
            use_rslora=bool(body.get("use_rslora", False)),
        )

    @property
    def scaling(self) -> float:
        """The factor on B·A: lora_alpha / r (lora_alpha / √r with ``use_rslora``)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def peft_config(self) -> dict:
        """``adapter_config.json`` as peft writes it (the fields vLLM's ``PEFTHelper`` reads)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": list(self.target_modules),
            "bias": "none",
            "use_rslora": self.use_rslora,
            "use_dora": False,
            "lora_dropout": 0.0,
        }


def split_name(name: str) -> tuple[str, str]:
    """A peft adapter tensor name -> (the HF name of the weight it updates, ``"A"`` or ``"B"``).

    >>> split_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    ('model.layers.0.self_attn.q_proj.weight', 'A')
    """
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if name.startswith(PEFT_PREFIX) and name.endswith(suffix):
            return name[len(PEFT_PREFIX) : -len(suffix)] + ".weight", part
    raise WeightSyncError(
        f"adapter tensor {name!r} must be named as peft names it ({PEFT_PREFIX}<module>.lora_A.weight or .lora_B.weight)"
    )


def check_adapter(named: list, spec: AdapterSpec) -> dict[str, dict]:
    """The adapter's tensors by the weight they update (``{hf_name: {"A": a, "B": b}}``), checked:
    every module wrapped is a target, has both factors, and both have the rank of ``spec``."""
    pairs: dict[str, dict] = {}
    for name, tensor in named:
        weight, part = split_name(name)
        module = weight.rsplit(".", 2)[-2]
        if module not in spec.target_modules:
            raise WeightSyncError(
                f"adapter tensor {name!r}: module {module!r} is not in target_modules {spec.target_modules}"
            )
        pairs.setdefault(weight, {})[part] = tensor
    if not pairs:
        raise WeightSyncError("an adapter update must carry at least one lora_A/lora_B pair")
    for weight, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise WeightSyncError(f"adapter for {weight!r} has lora_{''.join(pair)} only: both factors must come")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != spec.r or b.shape[1] != spec.r:
            raise WeightSyncError(
                f"adapter for {weight!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} must be (r, in) and (out, r), r = {spec.r}"
            )
    return pairs


def write_adapter(named: list, spec: AdapterSpec, folder: Path) -> Path:
    """Write ``named`` (checked by ``check_adapter``) and ``spec`` as a peft adapter folder; the
    tensors are copied, so the caller's buffers may go once this returns."""
    from safetensors.torch import save_file

    check_adapter(named, spec)
    folder.mkdir(parents=True)
    save_file({name: t.detach().contiguous() for name, t in named}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(spec.peft_config()))
    return folder


def read_adapter(folder: str | Path) -> list:
    """``(name, tensor)`` pairs of every ``*.safetensors`` in ``folder`` (the file transport's version)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: has no *.safetensors file")
    return [item for path in files for item in load_file(str(path)).items()]


def adapter_update(engine, weights, version: int, spec: AdapterSpec) -> list:
    """The ``(peft name, tensor)`` pairs of ``version``'s adapter, once both vLLM engines' checks
    pass: the engine can serve adapters (started with a LoRA rank) or merge them, the adapter was
    trained on the base it serves, and, when merging, the base is still the model folder's.
    ``weights``: the pairs, or a directory of safetensors holding them (the file transport)."""
    if engine.adapters is None and not engine.merging:
        raise ValueError(
            f"version {version} is a LoRA adapter (meta adapter) but the engine was started without "
            "lora_rank: set model.lora on the generators' side too"
        )
    if spec.base_version != engine.base_version:
        raise ValueError(
            f"version {version}: adapter of base version {spec.base_version}, the engine serves base version {engine.base_version}"
        )
    if engine.merging and engine._base is None:
        raise ValueError(f"version {version}: the base weights were replaced by a full version: nothing to merge into")
    return read_adapter(weights) if isinstance(weights, (str, Path)) else list(weights)


def merge_adapter(base: dict, named: list, spec: AdapterSpec) -> list:
    """``(HF name, W + scaling·B·A)`` for each weight the adapter updates, in the base's dtype
    (computed in float32): what a generator without LoRA support would load in place of the
    adapter. ``base``: HF name -> the base weight (out, in)."""
    merged = []
    for weight, pair in check_adapter(named, spec).items():
        if weight not in base:
            raise WeightSyncError(f"adapter for {weight!r}: the base model has no such weight")
        w = base[weight]
        delta = pair["B"].float() @ pair["A"].float()  # (out, r) @ (r, in) -> (out, in)
        if delta.shape != w.shape:
            raise WeightSyncError(f"adapter for {weight!r}: B·A is {tuple(delta.shape)}, the weight {tuple(w.shape)}")
        merged.append((weight, (w.float() + spec.scaling * delta).to(w.dtype)))
    return merged


class FolderWeights:
    """The base weights of a model folder by HF name, read on demand from its safetensors
    (memory-mapped: a merge reads the targeted matrices, no resident copy of the model is kept)."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self._files = {}  # name -> the open file that holds it (headers read once)
        for path in sorted(Path(folder).glob("*.safetensors")):
            handle = safe_open(str(path), framework="pt")
            self._files.update(dict.fromkeys(handle.keys(), handle))
        if not self._files:
            raise FileNotFoundError(f"{folder}: has no *.safetensors file")

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def __getitem__(self, name: str):
        return self._files[name].get_tensor(name)


@dataclass
class ServedAdapter:
    """One version's adapter as an engine serves it."""

    version: int
    lora_id: int
    """vLLM's ``lora_int_id``: never reused by the engine."""
    name: str
    """vLLM's ``lora_name``: never reused by the engine."""
    folder: Path
    users: int = 0
    """Requests running on it now."""
    request: object = field(default=None, repr=False)
    """The ``vllm.lora.request.LoRARequest`` (None where no vLLM runs: the simulated engine)."""


class AdapterSlots:
    """The adapters an engine has loaded: fresh names and ids per version, the newest for new
    requests, the older ones retired when no request holds them. Thread-safe."""

    def __init__(self, root: str | Path | None = None, make_request=None):
        base = Path("/dev/shm") if root is None and Path("/dev/shm").is_dir() else root
        self.root = Path(tempfile.mkdtemp(prefix="asyncrl-lora-", dir=base))
        """Where each version's folder is written (memory-backed where /dev/shm exists)."""
        self._make_request = make_request
        self._lock = threading.Lock()
        self._next_id = 1  # vLLM ids start at 1
        self._live: list[ServedAdapter] = []  # oldest first; the last is the newest
        self.used_names: list[str] = []
        """Every name this engine has given an adapter, in order (never reused)."""

    @property
    def newest(self) -> ServedAdapter | None:
        with self._lock:
            return self._live[-1] if self._live else None

    @property
    def live(self) -> list[ServedAdapter]:
        """Adapters still loaded, oldest first."""
        with self._lock:
            return list(self._live)

    def add(self, named: list, spec: AdapterSpec, version: int) -> ServedAdapter:
        """Write ``version``'s adapter under a new name and id; it is the newest once ``commit``ted."""
        with self._lock:
            lora_id, self._next_id = self._next_id, self._next_id + 1
        name = f"asyncrl-v{version}-{lora_id}"
        folder = write_adapter(named, spec, self.root / name)
        request = None if self._make_request is None else self._make_request(name, lora_id, str(folder))
        return ServedAdapter(version, lora_id, name, folder, request=request)

    def commit(self, adapter: ServedAdapter) -> None:
        """Serve ``adapter`` to new requests from now on (the engine has loaded it)."""
        with self._lock:
            self._live.append(adapter)
            self.used_names.append(adapter.name)

    def discard(self, adapter: ServedAdapter) -> None:
        """Drop an adapter the engine failed to load (its folder goes; its id is never reused)."""
        shutil.rmtree(adapter.folder, ignore_errors=True)

    def acquire(self) -> ServedAdapter | None:
        """The newest adapter, held for a request until ``release``; None: none loaded yet."""
        with self._lock:
            if not self._live:
                return None
            adapter = self._live[-1]
            adapter.users += 1
            return adapter

    def release(self, adapter: ServedAdapter | None) -> None:
        if adapter is None:
            return
        with self._lock:
            if adapter.users < 1:
                raise RuntimeError(f"adapter {adapter.name} released more often than acquired")
            adapter.users -= 1

    def retire(self) -> list[ServedAdapter]:
        """Remove from the live set every adapter but the newest that no request holds, delete
        their folders, and return them (the engine then unloads them from vLLM)."""
        with self._lock:
            if not self._live:
                return []
            gone = [a for a in self._live[:-1] if a.users == 0]
            self._live = [a for a in self._live if a not in gone]
        for adapter in gone:
            shutil.rmtree(adapter.folder, ignore_errors=True)
        return gone

    def clear(self) -> list[ServedAdapter]:
        """Forget every adapter (the base weights changed under them); returns them for unloading."""
        with self._lock:
            gone, self._live = self._live, []
        for adapter in gone:
            shutil.rmtree(adapter.folder, ignore_errors=True)
        return gone

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
