"""Megatron-core parameter names -> Hugging Face names, per architecture, as plain data.

Each table row reads `megatron pattern: (hf pattern or tuple of hf patterns, transform kind)`;
`{}` is a number (the layer, then the expert) and appears in the same order on both sides.
A tuple of Hugging Face patterns means the Megatron tensor fuses several HF tensors, in the order
of the transform's parts (`qkv`: q, k, v; `gated`: gate, up). Kinds are in `mergecore.families.transforms`.

Row order matters only when two Megatron names give the same HF name (fused or separate layer
norms, say): the first row is the canonical one (what the test fixtures write); the others are
alternatives read as well. Layer indices in a Megatron file are local to its pipeline chunk; the
reader shifts them to global ones.

The families that use these rows, and so the table of each `model_type`, are registered in
`mergecore.families.registry` (`register_family` adds one without a change here; see docs/adding-a-family.md);
add a one-off parameter with `--custom-mapping FILE`:

    {"decoder.layers.{}.mlp.my_bias": ["model.layers.{}.mlp.my_bias", "replicated"]}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

from ..errors import CheckpointError
from .transforms import KINDS

Row = tuple[str | tuple[str, ...], str]
Table = dict[str, Row]

L = "decoder.layers.{}."
H = "model.layers.{}."


def _qkv(suffix: str) -> tuple[str, str, str]:
    return tuple(f"{H}self_attn.{p}_proj.{suffix}" for p in "qkv")


EMBEDDING_ROWS: Table = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", "vocab"),
}

ATTENTION_ROWS: Table = {
    L + "self_attention.linear_qkv.layer_norm_weight": (H + "input_layernorm.weight", "replicated"),
    L + "input_layernorm.weight": (H + "input_layernorm.weight", "replicated"),  # unfused (local spec)
    L + "self_attention.linear_qkv.weight": (_qkv("weight"), "qkv"),
    L + "self_attention.linear_proj.weight": (H + "self_attn.o_proj.weight", "row"),
}

QKV_BIAS_ROWS: Table = {
    L + "self_attention.linear_qkv.bias": (_qkv("bias"), "qkv"),
}

QK_NORM_ROWS: Table = {
    L + "self_attention.q_layernorm.weight": (H + "self_attn.q_norm.weight", "replicated"),
    L + "self_attention.k_layernorm.weight": (H + "self_attn.k_norm.weight", "replicated"),
}

DENSE_MLP_ROWS: Table = {
    L + "mlp.linear_fc1.layer_norm_weight": (H + "post_attention_layernorm.weight", "replicated"),
    L + "pre_mlp_layernorm.weight": (H + "post_attention_layernorm.weight", "replicated"),  # unfused
    L + "mlp.linear_fc1.weight": ((H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), "gated"),
    L + "mlp.linear_fc2.weight": (H + "mlp.down_proj.weight", "row"),
}

_EXPERT = H + "mlp.experts.{}."
MOE_ROWS: Table = {
    L + "pre_mlp_layernorm.weight": (H + "post_attention_layernorm.weight", "replicated"),
    # megatron-core's local spec keeps the fused name even in MoE layers
    L + "mlp.linear_fc1.layer_norm_weight": (H + "post_attention_layernorm.weight", "replicated"),
    L + "mlp.router.weight": (H + "mlp.gate.weight", "replicated"),
    # SequentialMLP: one module per local expert
    L + "mlp.experts.local_experts.{}.linear_fc1.weight": ((_EXPERT + "gate_proj.weight", _EXPERT + "up_proj.weight"), "gated"),
    L + "mlp.experts.local_experts.{}.linear_fc2.weight": (_EXPERT + "down_proj.weight", "row"),
    # TEGroupedMLP: one weight per local expert, numbered after the name
    L + "mlp.experts.linear_fc1.weight{}": ((_EXPERT + "gate_proj.weight", _EXPERT + "up_proj.weight"), "gated"),
    L + "mlp.experts.linear_fc2.weight{}": (_EXPERT + "down_proj.weight", "row"),
}

SHARED_EXPERT_ROWS: Table = {
    L + "mlp.shared_experts.linear_fc1.weight": (
        (H + "mlp.shared_expert.gate_proj.weight", H + "mlp.shared_expert.up_proj.weight"), "gated"),
    L + "mlp.shared_experts.linear_fc2.weight": (H + "mlp.shared_expert.down_proj.weight", "row"),
    L + "mlp.shared_experts.gate_weight": (H + "mlp.shared_expert_gate.weight", "replicated"),
}

HEAD_ROWS: Table = {
    "decoder.final_layernorm.weight": ("model.norm.weight", "replicated"),
    "output_layer.weight": ("lm_head.weight", "vocab"),
}

# A value model (verl critic): the output layer has one row per label, replicated over TP ranks.
VALUE_HEAD_ROWS: Table = {
    "output_layer.weight": ("score.weight", "replicated"),
    "output_layer.bias": ("score.bias", "replicated"),
}

# Parameters that are not weights: never mapped, never merged.
SKIPPED = re.compile(r"(?:^|\.)_extra_state$|(?:^|\.)rotary_pos_emb\.inv_freq$")


@dataclass(frozen=True)
class Mapped:
    """One Megatron key resolved: the row it matched and the numbers in it."""

    pattern: str
    hf_patterns: tuple[str, ...]
    kind: str
    indices: tuple[int, ...]

    @property
    def is_layer(self) -> bool:
        return self.pattern.startswith(L)

    def hf_names(self, indices: tuple[int, ...] | None = None) -> tuple[str, ...]:
        """The HF names, with `indices` (default: the Megatron ones) filled in."""
        values = self.indices if indices is None else indices
        return tuple(p.format(*values) for p in self.hf_patterns)


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")


@lru_cache(maxsize=64)
def _compiled(items: tuple) -> list[tuple[re.Pattern, str, tuple[str, ...], str]]:
    return [(_compile(p), p, hf, kind) for p, hf, kind in items]


def freeze(table: Table) -> tuple:
    """A table as a hashable tuple of (pattern, hf patterns, kind)."""
    return tuple((p, (hf,) if isinstance(hf, str) else tuple(hf), kind) for p, (hf, kind) in table.items())


def find(key: str, table: Table) -> Mapped | None:
    """The row `key` matches (first match wins), or None.

    >>> find("decoder.layers.3.self_attention.linear_proj.weight", ATTENTION_ROWS).hf_names()
    ('model.layers.3.self_attn.o_proj.weight',)
    """
    for regex, pattern, hf, kind in _compiled(freeze(table)):
        match = regex.match(key)
        if match:
            return Mapped(pattern, hf, kind, tuple(int(g) for g in match.groups()))
    return None


def resolve(key: str, table: Table, where: str = "") -> Mapped:
    """The row `key` matches (first match wins), or a one-line CheckpointError naming the key."""
    mapped = find(key, table)
    if mapped is not None:
        return mapped
    raise CheckpointError(
        f"{where + ': ' if where else ''}parameter {key} has no Hugging Face name in the mapping table; "
        f"map it with --custom-mapping FILE (JSON or YAML: {{\"<megatron pattern with {{}}>\": "
        f"[\"<hf pattern>\", \"{'|'.join(KINDS)}\"]}})"
    )


def load_custom_mapping(path: str) -> Table:
    """Extra rows from a JSON or YAML file: `{megatron pattern: [hf pattern(s), kind]}`
    (or `{megatron pattern: {"hf": ..., "kind": ...}}`)."""
    from ..storage import Location

    location = Location.of(path)
    if not location.exists():
        raise CheckpointError(f"--custom-mapping {path}: does not exist")
    text = location.read_text()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as err:  # noqa: BLE001 - any parse error is the user's file
        raise CheckpointError(f"--custom-mapping {path}: cannot be parsed ({str(err).splitlines()[0]})") from None
    return parse_rows(data, f"--custom-mapping {path}")


def parse_rows(data, where: str) -> Table:
    """Table rows given as data (a custom-mapping file's, or a family's registered with
    `mergecore.families.registry.register_family`), checked: `{megatron pattern: [hf pattern(s), kind]}` or
    `{megatron pattern: {"hf": ..., "kind": ...}}`; `where` leads each one-line error.

    >>> parse_rows({"decoder.layers.{}.mlp.my_bias": ["model.layers.{}.mlp.my_bias", "replicated"]}, "mapping")
    {'decoder.layers.{}.mlp.my_bias': ('model.layers.{}.mlp.my_bias', 'replicated')}
    """
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: must map Megatron patterns to [hf pattern, kind]")
    table: Table = {}
    for pattern, row in data.items():
        if not isinstance(pattern, str):  # YAML keys may be numbers, lists...
            raise CheckpointError(f"{where}: key {pattern!r} is not a Megatron name pattern (text)")
        if isinstance(row, dict):
            row = [row.get("hf"), row.get("kind")]
        if not (isinstance(row, (list, tuple)) and len(row) == 2 and isinstance(row[1], str) and row[1] in KINDS
                and (isinstance(row[0], str) or (isinstance(row[0], (list, tuple))
                                                 and all(isinstance(h, str) for h in row[0])))):
            raise CheckpointError(
                f"{where}: entry {pattern!r} must be [hf pattern (or list), kind] with kind one of {', '.join(KINDS)}"
            )
        hf = row[0] if isinstance(row[0], str) else tuple(row[0])
        for name in (hf,) if isinstance(hf, str) else hf:
            if name.count("{}") != pattern.count("{}"):
                raise CheckpointError(
                    f"{where}: entry {pattern!r} -> {name!r} has a different number of {{}} placeholders"
                )
        table[str(pattern)] = (hf, row[1])
    return table
