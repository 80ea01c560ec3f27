"""A LoRA checkpoint's adapter as a PEFT folder: `adapter_config.json` + `adapter_model.safetensors` under PEFT's
saved names, every saved piece found again bit for bit in the written file. Written alone (`--lora adapter`) or
beside a fused model in its `lora_adapter/` folder (`--lora both`).

It takes plain values (the checkpoint holding the adapter, its hyperparameters) and never the fused view itself:
which merge writes an adapter is the view's and the engine's to say (`views/lora.py`, `engine/merge.py`).

>>> peft_saved_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", "default")
'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, VerificationError
from ..formats.base import CheckpointSource
from ..formats.lora import ADAPTER_CONFIG, LoraHyperparameters, adapter_pairs

ADAPTER_FOLDER = "lora_adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_saved_name(name: str, adapter: str) -> str:
    """PEFT's on-disk name: the in-memory one without the adapter name (`lora_A.default.weight` -> `lora_A.weight`)."""
    return name.replace(f".{adapter}.weight", ".weight").replace(f".{adapter}", "")


def adapter_config(hyper: LoraHyperparameters, base_model: str | None) -> dict:
    """peft's adapter_config.json for these hyperparameters (fields peft leaves at defaults are omitted)."""
    return {"peft_type": "LORA", "task_type": hyper.task_type or "CAUSAL_LM", "r": hyper.r,
            "lora_alpha": hyper.alpha, "target_modules": list(hyper.target_modules), "use_rslora": hyper.use_rslora,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "base_model_name_or_path": base_model}


def write_adapter_files(inner: CheckpointSource, hyper: LoraHyperparameters, folder, base_model: str | None = None) -> dict:
    """adapter_config.json + adapter_model.safetensors (PEFT's saved names) in `folder`, every saved piece then
    found bit for bit in the written file. Returns {"tensors": n, "pieces": m}.

    Not synced here: `folder` is a target's staging folder or lies in one, and the target makes it durable as it
    publishes (a local target fsyncs every file below its staging folder, `lora_adapter/` too, before the rename;
    object storage uploads it)."""
    from safetensors.numpy import save_file

    from ..numbers.arrays import bitwise_equal, cast, dtype_of
    from ..storage.tensorio import SafetensorsFile

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pairs = adapter_pairs(inner.tensors())
    if len(hyper.adapters) != 1:
        raise CheckpointError(f"{inner.location}: adapters {list(hyper.adapters)}; writing more than one adapter is not supported")
    saved = {peft_saved_name(n, p.adapter): n for p in pairs.values() for n in (p.a, p.b)}
    save_file({out: _savable(np.ascontiguousarray(inner.read(n))) for out, n in saved.items()},
              str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(hyper, base_model), indent=2) + "\n")
    pieces = 0
    written = SafetensorsFile(folder / ADAPTER_WEIGHTS)
    for out, n in saved.items():
        value = written.get_tensor(out)
        for piece in inner.pieces(n):
            if not bitwise_equal(value[piece.index], cast(piece.tensor, dtype_of(value))):
                raise VerificationError(f"{piece.source}: adapter tensor {n} differs from {out} as written; "
                                        "do not use it (please report this)")
            pieces += 1
    return {"tensors": len(saved), "pieces": pieces}


def write_adapter_beside(folder, inner: CheckpointSource, hyper: LoraHyperparameters, base_model: str | None) -> list[str]:
    """The PEFT adapter of a fused LoRA merge (output `both`) in `folder/lora_adapter/`; returns the files written,
    relative to `folder`."""
    write_adapter_files(inner, hyper, Path(folder) / ADAPTER_FOLDER, base_model)
    return [f"{ADAPTER_FOLDER}/{ADAPTER_CONFIG}", f"{ADAPTER_FOLDER}/{ADAPTER_WEIGHTS}"]


def _savable(array: np.ndarray) -> np.ndarray:
    """`array` as safetensors.numpy names it: our bfloat16 arrays are uint16 bits, which it would
    save as U16, so they become ml_dtypes' bfloat16 (imported only here, off the merge path)."""
    from ..numbers.arrays import dtype_of

    if dtype_of(array) != "bfloat16":
        return array
    import ml_dtypes

    return array.view(ml_dtypes.bfloat16)
