"""The GPT sizes the LiveR paper evaluates, as model descriptions the planners accept.

The paper names its models by size only (GPT-14B on the 32-GPU testbed, GPT-20B in table 1, a 70B model
at 1,024 GPUs). The 14B and 20B shapes below are GPT-3-style choices of ours (hidden size a multiple of
128, ``ffn = 4 h``, 128-dimensional heads, 44 layers so that PP 2, 4 and 11 divide evenly) that land on
the named parameter counts; the 70B model is Llama-2-70B, the preset the rest of the project uses.
"""

from __future__ import annotations

from liver.shared.model import PRESETS, ModelError, ModelSpec, load_model

GPT_14B = ModelSpec(
    name="gpt-14b",
    num_layers=44,
    hidden_size=5120,
    ffn_hidden_size=4 * 5120,
    num_attention_heads=40,
    vocab_size=51200,
    max_sequence_length=2048,
)
"""14.1 B parameters."""

GPT_20B = ModelSpec(
    name="gpt-20b",
    num_layers=44,
    hidden_size=6144,
    ffn_hidden_size=4 * 6144,
    num_attention_heads=48,
    vocab_size=51200,
    max_sequence_length=2048,
)
"""20.3 B parameters."""

SIM_MODELS: dict[str, ModelSpec] = {m.name: m for m in (GPT_14B, GPT_20B)}


def sim_model(name_or_path: str) -> ModelSpec:
    """A model by name (the paper's sizes above, or a project preset) or a ``.json`` model file."""
    if name_or_path in SIM_MODELS:
        return SIM_MODELS[name_or_path]
    try:
        return load_model(name_or_path)
    except ModelError as exc:
        if name_or_path.endswith(".json"):
            raise
        names = ", ".join(sorted({*SIM_MODELS, *PRESETS}))
        raise ModelError(f"unknown model {name_or_path!r}; known: {names}, or a .json model file") from exc
