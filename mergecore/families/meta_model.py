"""A family's model as transformers ships it: the class config.json names, built on the meta device (no memory).

Two things ask transformers about a family through this one model: the Hub-layout view
(`mergecore.views.hub_layout`, how `save_pretrained` renames and reshapes the in-memory tensors) and the config
check (`mergecore.families.config_check`, which names and shapes `save_pretrained` writes). It is built once per
process and config and shared, since building it costs the imports of torch and transformers and the model's
construction. Where transformers has no class for the config (custom code: we never load model code) the answer
is None and the names stay as saved.

>>> meta_model({"model_type": "acme_unknown"}) is None  # doctest: +SKIP
True
"""

from __future__ import annotations

import json
import os
import tempfile
from functools import lru_cache

from ..errors import CheckpointError

__all__ = ["meta_model", "model_class_of"]


def meta_model(config: dict):
    """The model class of config.json (`model_class_of`) built on the meta device, or None when transformers has
    no such class. A config transformers refuses is a one-line CheckpointError naming the fix."""
    return _meta_model_of(json.dumps(config, sort_keys=True))


@lru_cache(maxsize=2)  # keyed by the config's text: a dict is not hashable, and equal configs share one model
def _meta_model_of(config_text: str):
    import torch
    from transformers import CONFIG_MAPPING

    config = json.loads(config_text)
    model_class = model_class_of(config)
    if model_class is None:
        return None
    try:
        hf_config = _as_transformers_reads(CONFIG_MAPPING[config["model_type"]], config_text)
        with torch.device("meta"):
            return model_class._from_config(hf_config)
    except Exception as exc:  # transformers' own complaint about the config, on one line
        reason = " ".join(str(exc).split())[:200]
        raise CheckpointError(f"config.json: transformers cannot build {model_class.__name__} from it ({reason}); "
                              "fix it or pass --hf_model_path with the base model's folder") from None


def _as_transformers_reads(config_class, config_text: str):
    """config.json read by transformers' own loader (`from_json_file`), which decodes what its writer encodes: a
    non-finite number is saved as `{"__float__": "Infinity"}` (Mamba hybrids' `time_step_limit`), which a plain
    `json.loads` + `from_dict` hands to the config class as a dict."""
    with tempfile.TemporaryDirectory(prefix="ckptflow-config-") as scratch:
        path = os.path.join(scratch, "config.json")
        with open(path, "w") as f:
            f.write(config_text)
        return config_class.from_json_file(path)


def model_class_of(config: dict):
    """The transformers class config.json names (`architectures[0]`), or, when it names none, the causal LM
    class of its `model_type` (what `AutoModelForCausalLM` loads); None when transformers has neither.

    >>> model_class_of({"model_type": "qwen2"}).__name__  # doctest: +SKIP
    'Qwen2ForCausalLM'
    """
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    architectures = config.get("architectures")
    named = architectures[0] if isinstance(architectures, list) and architectures else None
    name = named if isinstance(named, str) else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    model_class = getattr(transformers, name, None) if name else None  # a name from an untrusted file: check it
    return model_class if isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel) \
        else None
