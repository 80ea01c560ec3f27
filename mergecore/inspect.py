"""A plain-data description of a checkpoint, for `ckptflow inspect` and pipeline reports."""

from __future__ import annotations

from .numbers.arrays import element_size
from .formats import open_checkpoint
from .views.hub_layout import hub_view
from .families.layout import group_of
from .views.lora import hf_name, is_lora_checkpoint, is_lora_only, read_hyperparameters


def describe_checkpoint(path: str, role: str = "actor", backend: str = "auto", custom_mapping: str | None = None,
                        lora: dict | None = None) -> dict:
    """Format facts plus tensors, bytes, dtypes and layouts per layer group (metadata only).

    A LoRA checkpoint also gets `lora`: rank, alpha, target modules, adapters, where each came from
    (`lora` overrides as for the merge: r, alpha, target_modules); alpha is None when nothing says it.

    >>> describe_checkpoint("ckpts/run1")["checkpoint"]["world_size"]  # doctest: +SKIP
    4
    """
    return describe_source(shown_view(open_checkpoint(path, role=role, backend=backend, custom_mapping=custom_mapping)),
                           lora)


def shown_view(source):
    """The view `inspect` shows of an opened checkpoint (or of a merge's view of it, `merge_view`): the names a
    merge writes, except that a LoRA save is shown under its saved names, adapters and all.

    >>> shown_view(open_checkpoint("ckpts/run1")).tensors()  # doctest: +SKIP
    """
    while getattr(source, "inner", None) is not None:  # back to the checkpoint as saved (Hub layout, fused LoRA)
        source = source.inner
    if source.format_name == "verl-fsdp" and is_lora_checkpoint(source.tensors()):
        return source
    return hub_view(source)


def describe_source(source, lora: dict | None = None) -> dict:
    """`describe_checkpoint` of a source already opened (and viewed with `shown_view`)."""
    groups: dict[str, dict] = {}
    order: dict[str, tuple] = {}
    for name, info in source.tensors().items():
        key, group = group_of(hf_name(name))  # PEFT names group like the HF names they adapt
        order[group] = key
        entry = groups.setdefault(group, {"group": group, "tensors": 0, "bytes": 0, "dtypes": set(), "layouts": set()})
        entry["tensors"] += 1
        entry["bytes"] += info.numel * element_size(info.dtype)
        entry["dtypes"].add(info.dtype)
        entry["layouts"].add(info.layout)
    rows = [{**g, "dtypes": sorted(g["dtypes"]), "layouts": sorted(g["layouts"])}
            for name, g in sorted(groups.items(), key=lambda item: order[item[0]])]
    facts = source.describe()
    facts["tensors"] = len(source.tensors())
    facts["bytes"] = sum(g["bytes"] for g in rows)
    report = {"checkpoint": facts, "groups": rows}
    names = list(source.tensors())
    if source.format_name == "verl-fsdp" and is_lora_checkpoint(names):
        found = read_hyperparameters(source, names, lora).to_dict()
        report["lora"] = {"save": "lora_only" if is_lora_only(names) else "full", **found}
    return report
