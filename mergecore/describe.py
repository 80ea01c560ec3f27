"""A plain-data description of a checkpoint, for `ckptflow inspect` and pipeline reports."""

from __future__ import annotations

from .errors import CheckpointError
from .numbers.arrays import element_size
from .formats import open_checkpoint
from .formats.base import read_hf_config
from .views.hub_layout import HubLayoutSource, hub_view
from .families.layout import SHAPE_TABLES, family_tables, group_of, shape_rows
from .families.registry import family_of
from .formats.lora import hf_name, is_lora_checkpoint, is_lora_name, is_lora_only, read_hyperparameters

# How the names a merge writes were found (`family_report`'s "layout"):
LAYOUTS = {
    "transformers": "transformers' conversion",  # the model class's own save layout (its meta model)
    "registry": "registry",  # the family's entry in mergecore.families.registry (Hub name tables, Megatron table)
    "custom mapping": "custom mapping",  # the user's --custom-mapping FILE (over the registry's table, if any)
    "as saved": "as saved",  # nothing knows the family: names kept as the checkpoint holds them (FSDP)
    "none": "none",  # nothing knows the family and its names are not Hugging Face ones (Megatron): cannot merge
}
_FIX = "register the family (mergecore.families.register_family, docs/adding-a-family.md) or pass --custom-mapping FILE"


def describe_checkpoint(path: str, role: str = "actor", backend: str = "auto", custom_mapping: str | None = None,
                        lora: dict | None = None) -> dict:
    """Format facts plus tensors, bytes, dtypes and layouts per layer group (metadata only), and the family
    (`family_report`: which one, how the names a merge writes were derived, what nothing places).

    A LoRA checkpoint also gets `lora`: rank, alpha, target modules, adapters, where each came from
    (`lora` overrides as for the merge: r, alpha, target_modules); alpha is None when nothing says it.

    >>> describe_checkpoint("ckpts/run1")["checkpoint"]["world_size"]  # doctest: +SKIP
    4
    """
    return describe_source(shown_view(open_checkpoint(path, role=role, backend=backend, custom_mapping=custom_mapping)),
                           lora, family=True)


def shown_view(source):
    """The view `inspect` shows of an opened checkpoint (or of a merge's view of it, `merge_view`): the names a
    merge writes, except that a LoRA save is shown under its saved names, adapters and all.

    >>> shown_view(open_checkpoint("ckpts/run1")).tensors()  # doctest: +SKIP
    """
    source = _saved(source)
    if source.format_name == "verl-fsdp" and is_lora_checkpoint(source.tensors()):
        return source
    return hub_view(source)


def describe_source(source, lora: dict | None = None, family: bool = False) -> dict:
    """`describe_checkpoint` of a source already opened (and viewed with `shown_view`); with `family`, also its
    `family_report` (it reads config.json), and a Megatron checkpoint whose parameters the table cannot all place
    is then described by its family alone (its tensors have no Hugging Face names to group by)."""
    if not family:
        return _describe_tensors(source, lora)
    family = family_report(source)
    if family["unplaced"] and not _saved_names_kept(source):
        facts = {"format": source.format_name, "location": str(source.location)}
        return {"checkpoint": facts, "family": family, "groups": []}
    return {**_describe_tensors(source, lora), "family": family}


def refuse_unplaced(report: dict) -> None:
    """After showing a report, the one-line error a merge would stop on when the saved parameters it lists
    have no Hugging Face name (a Megatron checkpoint; an FSDP one writes such names as saved)."""
    family = report.get("family") or {}
    if family.get("unplaced") and not report["groups"]:
        few = ", ".join(family["unplaced"][:3]) + (" ..." if len(family["unplaced"]) > 3 else "")
        raise CheckpointError(f"{report['checkpoint']['location']}: cannot place {len(family['unplaced'])} saved "
                              f"parameters ({few}); {_FIX}")


def _saved_names_kept(source) -> bool:
    """An FSDP checkpoint keeps names nothing places (written as saved); a Megatron one has no name for them."""
    return not hasattr(_saved(source), "unplaced")


def _saved(source):
    while getattr(source, "inner", None) is not None:  # back to the checkpoint as saved (Hub layout, fused LoRA)
        source = source.inner
    return source


def family_report(source) -> dict:
    """Which family a checkpoint is, how the names a merge writes were derived (`LAYOUTS`), and the saved tensors
    nothing places (listed, never a failure: `inspect` is where one looks when a merge refuses).

    >>> family_report(shown_view(open_checkpoint("ckpts/run1")))  # doctest: +SKIP
    {'model_type': 'qwen2', 'registered': True, 'layout': 'registry', 'detail': ..., 'unplaced': []}
    """
    saved = _saved(source)
    config = _config_or_empty(saved)
    model_type = config.get("model_type")
    report = {"model_type": model_type, "registered": family_of(config) is not None}
    if hasattr(saved, "unplaced"):
        return {**report, **_megatron_layout(saved, config)}
    if isinstance(source, HubLayoutSource):
        from .families.meta_model import model_class_of

        model = model_class_of(config)
        return {**report, "layout": LAYOUTS["transformers"], "unplaced": [],
                "detail": f"{model.__name__ if model else model_type} saves these tensors under other names"}
    return {**report, **_fsdp_layout(source, config)}


def _config_or_empty(source) -> dict:
    try:
        return read_hf_config(source)
    except CheckpointError:
        return {}  # no config.json: the family is unknown, which the report says


def _megatron_layout(source, config: dict) -> dict:
    model_type = config.get("model_type")
    try:
        unplaced = source.unplaced()
    except CheckpointError as err:  # the family has no Megatron table and no custom mapping was given
        return {"layout": LAYOUTS["none"], "unplaced": sorted(set(source.saved_parameters().values())),
                "detail": f"model_type {model_type!r} has no Megatron mapping table: {_FIX}" if model_type else str(err)}
    if source.custom_mapping:
        over = " over the registry's table" if family_of(config) and family_of(config).megatron else ""
        return {"layout": LAYOUTS["custom mapping"], "detail": f"{source.custom_mapping}{over}", "unplaced": unplaced}
    fix = f"; map them: {_FIX}" if unplaced else ""
    return {"layout": LAYOUTS["registry"], "detail": f"the Megatron table of {model_type}{fix}", "unplaced": unplaced}


def _fsdp_layout(source, config: dict) -> dict:
    """Names already the Hub's: by the registry's name tables, by transformers' own model, or by nothing (as saved)."""
    model_type = config.get("model_type")
    names = [hf_name(n) for n in source.tensors() if not is_lora_name(n)]
    tables = family_tables(config) if config else ()
    if tables:
        rows = shape_rows(*tables).values()
        outside = [n for n in names if not any(regex.match(n) for regex, _ in rows)]
        if not outside:
            return {"layout": LAYOUTS["registry"], "unplaced": [],
                    "detail": f"the Hub names of the {model_type} entry, which the checkpoint holds already"}
    if model_type and names:
        from .views.hub_layout import hub_slices

        infos = source.tensors()
        shapes = {hf_name(n): info.shape for n, info in infos.items() if not is_lora_name(n)}
        if hub_slices(config, shapes) is not None:  # a LoRA save, shown under its saved names, converts on merge
            return {"layout": LAYOUTS["transformers"], "unplaced": [],
                    "detail": "the merge writes these tensors under the names the model class saves"}
        from .families.config_check import saved_tensors

        saved = saved_tensors(config)
        if saved["model"] is not None:
            unplaced = [n for n in names if n not in saved["tensors"]]
            return {"layout": LAYOUTS["transformers"], "unplaced": unplaced,
                    "detail": f"{saved['model']} saves these names as the checkpoint holds them"}
    rows = shape_rows(*(tables or SHAPE_TABLES.values())).values()
    unplaced = [n for n in names if not any(regex.match(n) for regex, _ in rows)]
    what = f"model_type {model_type!r} is neither registered nor known to transformers" if model_type \
        else "no config.json says which model this is"
    return {"layout": LAYOUTS["as saved"], "unplaced": unplaced,
            "detail": f"{what}: names are kept as saved" + ("; to place the rest, register the family with its Hub "
                                                             "name tables (docs/adding-a-family.md)" if unplaced else "")}


def _describe_tensors(source, lora: dict | None = None) -> dict:
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
