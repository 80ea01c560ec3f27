"""The model card (README.md) of a merged folder: where the weights came from and how they were proven.

It is written into the folder before the manifest, so it is hashed like every other file and a Hub push
publishes exactly what was verified.
"""

from __future__ import annotations

import re
from pathlib import Path

CARD_FILE = "README.md"
# The punctuation that can start emphasis, code, a link or image, HTML or an entity, strikethrough, or end a table
# cell, anywhere in a line (backslash escapes make each literal); `#`, `-`, `+` act only at a line's start, which
# a value never is here (line breaks are folded).
# An underscore inside a word (`q_proj`, `global_step_1`) never starts emphasis: only one at a word's edge is escaped.
_MARKUP = re.compile(r"([\\`*\[\]<>!|&~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")


def markdown_text(value) -> str:
    r"""`value` as literal text anywhere in markdown (a table cell, a heading, a description): every string we did
    not write — a path, an object key, a tensor name, a config value — goes through here, in the model card and
    in Prefect's artifacts. Line breaks become spaces (one would end the table row or start a block).

    >>> print(markdown_text("run<b>x</b>\n![m](http://e/x.png) | cell"))
    run\<b\>x\</b\> \!\[m\](http://e/x.png) \| cell
    """
    return _MARKUP.sub(r"\\\1", " ".join(str(value).split()))


def markdown_cell_code(value) -> str:
    r"""`value` as inline code in a table cell (a path, a module name): shown literally, markup and HTML included;
    the fence outgrows any backticks inside, and `|` is escaped as GFM tables ask even inside code.

    >>> print(markdown_cell_code("model.layers.0.mlp.gate"), markdown_cell_code("a`b|c"))
    `model.layers.0.mlp.gate` `` a`b\|c ``
    """
    text = " ".join(str(value).split()).replace("|", "\\|")
    fence = "`" * (max(map(len, re.findall(r"`+", text)), default=0) + 1)
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def model_card(manifest: dict, config: dict, checks: list[dict]) -> str:
    """README.md for the Hub: YAML metadata, where the weights came from and how they were proven. Every value
    the checkpoint or the user chose is shown through `markdown_text`, and enters the YAML only in a form YAML
    cannot misread (a tag of plain characters, a valid Hub repo id)."""
    m = markdown_text
    source = manifest["source"]
    tags = [t for t in ("ckptflow", source["format"], source.get("role") or "actor") if _PLAIN.fullmatch(str(t))]
    lines = ["---", "library_name: transformers", "tags:"] + [f"- {t}" for t in tags]
    if _hub_repo_id(config.get("_name_or_path")):
        lines.append(f"base_model: {config['_name_or_path']}")
    lines += ["---", "", f"# {m(Path(source['location']).name)} at step {m(source.get('step'))}", "",
              "Merged from a distributed training checkpoint and verified by "
              f"[ckptflow](https://pypi.org/project/ckptflow/) {m(manifest['ckptflow_version'])}.", "",
              "| | |", "|---|---|",
              f"| source checkpoint | {markdown_cell_code(source['location'])} |",
              f"| step | {m(source.get('step'))} |",
              f"| format | {m(source['format'])} |",
              f"| world size | {m(source.get('world_size'))} |",
              f"| mesh | {m(source.get('mesh_shape'))} |",
              f"| dtype | {m(manifest['dtype'])} |", *_lora_rows(source.get("lora")),
              *_quantization_rows(manifest.get("quantization")), "",
              "## Equivalence checks", "", "| check | result | details |", "|---|---|---|"]
    for check in checks:
        if check["check"].startswith("manifest"):  # re-checking local files proves nothing new about the model
            continue
        details = ", ".join(f"{k}={v}" for k, v in check.items() if k not in ("check", "ok", "rows"))
        lines.append(f"| {m(check['check'])} | {'passed' if check['ok'] else 'FAILED'} | {m(details)} |")
    return "\n".join(lines) + "\n"


_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _hub_repo_id(name) -> bool:
    """Whether config.json's `_name_or_path` names a Hub model (`org/name`), not a local folder or anything else."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(name, str) or name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _quantization_rows(quantization: dict | None) -> list[str]:
    """The scheme, how many weights it quantized and what it left in the merge dtype (the measured errors are in
    the round-trip row below)."""
    if not quantization:
        return []
    kept = quantization.get("unquantized_modules", [])
    m = markdown_text
    shown = ", ".join(map(markdown_cell_code, kept[:8])) + (f" and {len(kept) - 8} more" if len(kept) > 8 else "")
    rows = [f"| quantization | {m(quantization['scheme'])}: {m(quantization.get('quantized'))} decoder Linear weights |",
            f"| left unquantized | {shown or 'none'} (plus embeddings, norms and biases) |"]
    if quantization.get("user_ignore"):
        rows.append(f"| --quantize-ignore | {', '.join(map(markdown_cell_code, quantization['user_ignore']))} |")
    return rows


def _lora_rows(lora: dict | None) -> list[str]:
    """What a LoRA merge fused, and with which scale: an adapter with the wrong alpha is another model."""
    if not lora:
        return []
    m = markdown_text
    where = ", ".join(f"{k} from {v}" for k, v in lora.get("source", {}).items())
    rows = [f"| LoRA fused | W + (alpha/r)·B·A with r={m(lora['r'])}, alpha={m(lora['alpha'])}"
            f"{' (rsLoRA: alpha/sqrt(r))' if lora.get('use_rslora') else ''} into {m(', '.join(lora['target_modules']))} "
            f"(adapter {m(', '.join(lora['adapters']))}; {m(where)}) |"]
    if lora.get("base_model"):
        rows.append(f"| LoRA base model | {m(lora['base_model'])} (`--base-model`: the adapter came from a save_lora_only checkpoint) |")
    if lora.get("output") == "both":
        rows.append("| LoRA adapter | `lora_adapter/` (PEFT: adapter_config.json + adapter_model.safetensors) |")
    return rows
