"""DPO's reference log-probabilities: computed once, before training, and cached in the run.

DPO compares the policy with its starting point, pi_ref. Rather than keep a frozen copy of the
model beside the one being trained (twice the weights, a second forward every step), the
reference's ``log pi_ref(y|x)`` of every pair's chosen and rejected response is computed once by
a no-grad pass of the starting model (the engine's own weights before the first update, in the
training precision and layout) and written to ``RUN_DIR/reference_logprobs.json``, keyed by the
pair's uid. A resume reads the file back (it is taken before the checkpoint is loaded, so even
without it the numbers are the starting model's); a file made for other data, another model or
another scale (ipo: the mean over tokens, else the sum) is computed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from asyncrl.learner.offline.data import Example

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference_logprobs.json"


def fingerprint(model_dir: Path, examples: list[Example], length_normalised: bool) -> str:
    """What the cached numbers depend on: the model, the examples' tokens, the scale."""
    digest = hashlib.sha256(f"{Path(model_dir).resolve()}|{length_normalised}".encode())
    for example in examples:
        digest.update(example.uid.encode())
        for seq in example.sequences:
            digest.update(str((seq.ids, seq.mask)).encode())
    return digest.hexdigest()


def cached_reference(
    run_dir: Path,
    key: str,
    compute: Callable[[], dict[str, tuple[float, float]]],
    lead: bool,
    barrier: Callable[[], None],
) -> dict[str, tuple[float, float]]:
    """The reference's (chosen, rejected) log-probabilities by uid: from the run's file when it
    was made for ``key``, else ``compute()`` (collective: every rank calls it), written by the lead."""
    path = Path(run_dir) / REFERENCE_FILE
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("fingerprint") == key:
            log.info("reference log-probabilities from %s (%d pairs)", path, len(saved["logprobs"]))
            return {uid: (float(c), float(r)) for uid, (c, r) in saved["logprobs"].items()}
        log.info("%s was made for other data or another model: computing the reference again", path)
    values = compute()
    if lead:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"fingerprint": key, "logprobs": values}))
        tmp.replace(path)
    barrier()
    return values
