"""config.json against the weights a merge writes, asked of transformers itself.

The model class config.json names is built on the meta device (`mergecore.families.meta_model`, the same model
the Hub-layout view asks), and what its `save_pretrained` would write is computed with transformers' own save
steps on meta tensors: the state dict (persistent buffers in, non-persistent ones out), less
`_keys_to_ignore_on_save` and the tied weights it drops, in the Hub's layout (`revert_weight_conversion`). The
merge must write exactly those names and shapes. Only where transformers has no class for the config (custom code,
an unknown model_type) does the hand-written shape table of `mergecore.families.layout` judge instead; the returned record
says which (it is kept in the manifest).

Building the meta model costs seconds of imports (torch, transformers), so its answer is kept on disk per
config.json content and transformers install (`CKPTFLOW_CONFIG_CACHE`, default `saved-tensors/` under `CKPTFLOW_CACHE`): the next
checkpoint of the same training run is checked without importing either. Without a kept answer it is asked in a
short-lived child process (`python -m` this module), unless this process imported both already: the imports'
~240 MiB would otherwise stay in the merging process for its whole life, above the memory budget's rows.

>>> check_config(source, config, plan)  # doctest: +SKIP
{'by': 'transformers', 'model': 'Qwen2ForCausalLM', 'tensors': 27}
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from ..errors import CheckpointError
from .layout import EMBEDDING, OUTPUT, check_against_config, layer_index, text_config, tied_embeddings
from .meta_model import meta_model

_CACHE_FORMAT = 2  # bump when what is cached changes meaning (2: "tied")
_FIX = "the checkpoint and config.json are from different models: pass --hf_model_path with the right config"


def check_config(source, config: dict, plan) -> dict:
    """Refuse, in one line, a config.json that does not describe the tensors `plan` writes; returns how it was
    checked: `{"by": "transformers", "model": ...}` or `{"by": "shape table", "why": ...}`."""
    where = str(source.hf_dir.join("config.json"))
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise CheckpointError(f"{where}: has no model_type, so nothing can load the merged model; restore config.json "
                              "from the base model or pass --hf_model_path with its folder")
    written = {t.name: tuple(t.shape) for t in plan.tensors}
    saved = saved_tensors(config)
    if saved["model"] is None:
        check_against_config(written, config, where, allow_unknown=bool(getattr(source, "custom_mapping", None)))
        return {"by": "shape table", "why": saved["why"], "tensors": len(written)}
    expected = {name: tuple(shape) for name, shape in saved["tensors"].items()}
    if written != expected:
        layers = layer_difference(written, expected, config)
        raise CheckpointError(f"{where}: {layers}{describe_difference(written, expected, saved['model'])}; {_FIX}")
    return {"by": "transformers", "model": saved["model"], "tensors": len(written)}


def tied_aliases(config: dict, names) -> dict[str, str]:
    """The tensors of `names` that save_pretrained drops because they are tied, each mapped to the written tensor
    holding its values, under the Hub's names: per transformers' own model where it knows the config (a VLM's
    `language_model.lm_head.weight` -> `language_model.model.embed_tokens.weight`), else `lm_head.weight` ->
    `model.embed_tokens.weight` when config.json ties the embeddings.

    >>> tied_aliases({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
    ...              ["language_model.lm_head.weight", "language_model.model.embed_tokens.weight"])  # doctest: +SKIP
    {'language_model.lm_head.weight': 'language_model.model.embed_tokens.weight'}
    """
    names = set(names)
    saved = _answer_if_typed(config)
    if saved["model"] is not None:
        return {dropped: kept for dropped, kept in saved["tied"].items() if dropped in names and kept in names}
    return {OUTPUT: EMBEDDING} if tied_embeddings(config) and {OUTPUT, EMBEDDING} <= names else {}


def writes_output_head(config: dict) -> bool:
    """Whether save_pretrained writes the head as `lm_head.weight` when untied: per transformers' own model where it
    knows the config (DeepSeek-V4's files call it `head.weight`), else when config.json names a causal LM.

    >>> writes_output_head({"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]})  # doctest: +SKIP
    False
    """
    saved = _answer_if_typed(config)
    if saved["model"] is not None:
        return OUTPUT in saved["tensors"]
    architectures = config.get("architectures")
    named = architectures[0] if isinstance(architectures, list) and architectures else None
    return isinstance(named, str) and named.endswith("CausalLM")


def _answer_if_typed(config: dict) -> dict:
    """`saved_tensors`, or no model when config.json has no model_type (`check_config` refuses it, in its words)."""
    typed = isinstance(config.get("model_type"), str) and config["model_type"]
    return saved_tensors(config) if typed else {"model": None, "why": "config.json has no model_type"}


def describe_difference(written: dict, expected: dict, model: str, few: int = 3) -> str:
    """The first few mis-shaped, missing and unexpected names, on one line.

    >>> describe_difference({"a": (2,), "b": (1,)}, {"a": (3,), "c": (1,)}, "M")
    'the merge would write tensors that M.save_pretrained does not: a has shape (2,) but the config implies (3,); missing c; unexpected b'
    """
    def first(names):
        names = list(names)
        return ", ".join(names[:few]) + (f" and {len(names) - few} more" if len(names) > few else "")

    misshaped = [f"{n} has shape {written[n]} but the config implies {shape}"
                 for n, shape in expected.items() if n in written and written[n] != shape]
    missing = [n for n in expected if n not in written]
    unexpected = [n for n in written if n not in expected]
    parts = ([first(misshaped)] if misshaped else []) + ([f"missing {first(missing)}"] if missing else []) \
        + ([f"unexpected {first(unexpected)}"] if unexpected else [])
    return f"the merge would write tensors that {model}.save_pretrained does not: " + "; ".join(parts)


def layer_difference(written, expected, config: dict) -> str:
    """A lead for the commonest mismatch, as the user would fix it: another decoder layer count; or, when the count
    agrees with config.json, which layers the model has that the checkpoint lacks (or the other way round).

    >>> layer_difference(["model.layers.0.w", "model.layers.1.w"], ["model.layers.0.w"], {"num_hidden_layers": 1})
    'the checkpoint has decoder layers 0..1 (2) but the config says num_hidden_layers=1; '
    >>> layer_difference(["model.layers.0.w", "model.layers.1.w"], ["model.layers.0.w", "model.layers.1.w",
    ...                  "model.layers.2.w"], {"num_hidden_layers": 2})
    "the checkpoint's 2 decoder layers agree with num_hidden_layers=2, but the model transformers builds from the config also has layer 2; "
    """
    def layers(names):
        return {i for n in names if (i := layer_index(n)) is not None and "vision" not in n and "visual" not in n}

    have, want = layers(written), layers(expected)
    if not have or have == want:
        return ""
    count = text_config(config).get("num_hidden_layers")
    if len(have) != count:
        return (f"the checkpoint has decoder layers {min(have)}..{max(have)} ({len(have)}) but the config says "
                f"num_hidden_layers={count}; ")
    extra, lacking = sorted(want - have), sorted(have - want)
    differs = ([f"also has layer{'s' * (len(extra) > 1)} {', '.join(map(str, extra[:3]))}"] if extra else []) + \
              ([f"lacks layer{'s' * (len(lacking) > 1)} {', '.join(map(str, lacking[:3]))}"] if lacking else [])
    return (f"the checkpoint's {len(have)} decoder layers agree with num_hidden_layers={count}, but the model "
            f"transformers builds from the config {' and '.join(differs)}; ")


def saved_tensors(config: dict) -> dict:
    """`{"model": class name, "tensors": {name: shape}, "tied": {dropped name: kept name}}` as that model's
    save_pretrained writes them, or
    `{"model": None, "why": ...}` when transformers has no class for the config; from the disk cache when this
    config was checked before with the same transformers install."""
    cache = _cache_file(config)
    if cache is not None:
        try:
            return json.loads(cache.read_text())["answer"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # absent or unreadable: compute it
    key = json.dumps(config, sort_keys=True)
    if key not in _ANSWERED:  # an unwritable cache must not cost every later call its own child
        _ANSWERED[key] = _ask_transformers(config) if _imports_paid() else _ask_in_child(config)
    if cache is not None:
        _store(cache, {"answer": _ANSWERED[key]})
    return _ANSWERED[key]


_ANSWERED: dict[str, dict] = {}


def _imports_paid() -> bool:
    """Whether this process already holds torch and transformers' model code (a Hub-layout view built the meta
    model, or the caller is a training script): then a child would only pay them twice."""
    return "torch" in sys.modules and "transformers.modeling_utils" in sys.modules


def _ask_in_child(config: dict) -> dict:
    """`_ask_transformers` in a child process, so its imports leave with it. A refusal comes back as the same
    one-line CheckpointError; any other failure of the child is asked again here, to surface as it would have."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    try:
        child = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(config), capture_output=True,
                               text=True, env=env)
        said = json.loads(child.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):  # no interpreter to start, or it died: ask here
        return _ask_transformers(config)
    if "refused" in said:
        raise CheckpointError(said["refused"])
    return said["answer"]


def _ask_transformers(config: dict) -> dict:
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model = meta_model(config)
    if model is None:
        from transformers import CONFIG_MAPPING

        if config["model_type"] not in CONFIG_MAPPING:
            return {"model": None, "why": f"transformers does not know model_type {config['model_type']!r}"}
        return {"model": None, "why": f"transformers has no class {(config.get('architectures') or [None])[0]!r}"}
    state = model.state_dict()  # meta tensors: persistent buffers included, non-persistent ones not
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    # the Hub's name of each in-memory one: the conversion renames (returns the same tensor) all of them at once
    hub_name = {id(t): name for name, t in revert_weight_conversion(model, dict(state)).items()}
    tied = {hub_name[id(state[dropped])]: hub_name[id(state[keeper])] for dropped, keeper in _ties(model, state, kept)
            if id(state[dropped]) in hub_name and id(state[keeper]) in hub_name}
    written = revert_weight_conversion(model, kept)
    return {"model": type(model).__name__, "tensors": {name: list(t.shape) for name, t in written.items()},
            "tied": tied}


def _ties(model, state: dict, kept: dict):
    """(dropped, kept) in-memory names of each tied tensor save_pretrained drops: the same parameter object."""
    same = model.get_parameter_or_buffer
    for dropped in state:
        if dropped not in kept:
            keeper = next((name for name in kept if same(name) is same(dropped)), None)
            if keeper is not None:
                yield dropped, keeper


def _cache_file(config: dict) -> Path | None:
    """Where the answer for this config.json and transformers install is kept (None: transformers missing)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    installed = os.stat(spec.origin)  # an upgrade or reinstall rewrites it: a new key
    key = json.dumps([_CACHE_FORMAT, spec.origin, installed.st_mtime_ns, installed.st_size, config], sort_keys=True)
    from ..storage import default_cache_dir

    root = Path(os.environ.get("CKPTFLOW_CONFIG_CACHE") or default_cache_dir() / "saved-tensors")
    return root / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def _store(cache: Path, data: dict) -> None:
    """Write atomically; a cache that cannot be written only costs the next merge its imports."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f".{cache.name}.{os.getpid()}")
        partial.write_text(json.dumps(data))
        os.replace(partial, cache)
    except OSError:
        pass


if __name__ == "__main__":  # `_ask_in_child`: config.json on stdin, one JSON line on stdout
    try:
        _said = {"answer": _ask_transformers(json.load(sys.stdin))}
    except CheckpointError as refused:
        _said = {"refused": str(refused)}
    print(json.dumps(_said))
