"""The model card (README.md) of a merged folder: where the weights came from and how they were proven.

It is written into the folder before the manifest, so it is hashed like every other file and a Hub push
publishes exactly what was verified.
"""

from __future__ import annotations

from pathlib import Path

CARD_FILE = "README.md"


def model_card(manifest: dict, config: dict, checks: list[dict]) -> str:
    """README.md for the Hub: YAML metadata, where the weights came from and how they were proven."""
    source = manifest["source"]
    base_model = config.get("_name_or_path") or ""
    tags = ["ckptflow", source["format"], source.get("role") or "actor"]
    lines = ["---", "library_name: transformers", "tags:"] + [f"- {t}" for t in tags]
    if base_model and "/" in base_model and not base_model.startswith(("/", ".")):
        lines.append(f"base_model: {base_model}")
    lines += ["---", "", f"# {Path(source['location']).name} at step {source.get('step')}", "",
              "Merged from a distributed training checkpoint and verified by "
              f"[ckptflow](https://pypi.org/project/ckptflow/) {manifest['ckptflow_version']}.", "",
              "| | |", "|---|---|",
              f"| source checkpoint | `{source['location']}` |",
              f"| step | {source.get('step')} |",
              f"| format | {source['format']} |",
              f"| world size | {source.get('world_size')} |",
              f"| mesh | {source.get('mesh_shape')} |",
              f"| dtype | {manifest['dtype']} |", *_lora_rows(source.get("lora")),
              *_quantization_rows(manifest.get("quantization")), "",
              "## Equivalence checks", "", "| check | result | details |", "|---|---|---|"]
    for check in checks:
        if check["check"].startswith("manifest"):  # re-checking local files proves nothing new about the model
            continue
        details = ", ".join(f"{k}={v}" for k, v in check.items() if k not in ("check", "ok", "rows"))
        lines.append(f"| {check['check']} | {'passed' if check['ok'] else 'FAILED'} | {details} |")
    return "\n".join(lines) + "\n"


def _quantization_rows(quantization: dict | None) -> list[str]:
    """The scheme, how many weights it quantized and what it left in the merge dtype (the measured errors are in
    the round-trip row below)."""
    if not quantization:
        return []
    kept = quantization.get("unquantized_modules", [])
    shown = ", ".join(f"`{m}`" for m in kept[:8]) + (f" and {len(kept) - 8} more" if len(kept) > 8 else "")
    rows = [f"| quantization | {quantization['scheme']}: {quantization.get('quantized')} decoder Linear weights |",
            f"| left unquantized | {shown or 'none'} (plus embeddings, norms and biases) |"]
    if quantization.get("user_ignore"):
        rows.append(f"| --quantize-ignore | {', '.join(f'`{p}`' for p in quantization['user_ignore'])} |")
    return rows


def _lora_rows(lora: dict | None) -> list[str]:
    """What a LoRA merge fused, and with which scale: an adapter with the wrong alpha is another model."""
    if not lora:
        return []
    where = ", ".join(f"{k} from {v}" for k, v in lora.get("source", {}).items())
    rows = [f"| LoRA fused | W + (alpha/r)·B·A with r={lora['r']}, alpha={lora['alpha']}"
            f"{' (rsLoRA: alpha/sqrt(r))' if lora.get('use_rslora') else ''} into {', '.join(lora['target_modules'])} "
            f"(adapter {', '.join(lora['adapters'])}; {where}) |"]
    if lora.get("base_model"):
        rows.append(f"| LoRA base model | {lora['base_model']} (`--base-model`: the adapter came from a save_lora_only checkpoint) |")
    if lora.get("output") == "both":
        rows.append("| LoRA adapter | `lora_adapter/` (PEFT: adapter_config.json + adapter_model.safetensors) |")
    return rows
