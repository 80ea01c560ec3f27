"""Checkpoints saved by real megatron-core (tests/mcore_dist_save.py) and what they must merge to.

Shared by the dist_ckpt and legacy tests. Saves run in subprocesses (importing megatron.core widens
torch.load's weights_only allow-list for the whole process, which would hide unpickling bugs in ours)
and are cached for the session. Importing torch and megatron-core (~7 s on two cores) costs more than a
save, so they come in stages, each one process or spawn, each written on first need: every TP=1 save
(`tp1_save`), then every reshard of one world size (`parallel_save`, `ep_saves`: world 2 or 4) at once.

The expected Hugging Face tensors come from the TP=1 model's own `state_dict()` through `hf_tensors`,
a name table written here from the two libraries' module layouts, independent of mergecore's
`megatron_maps`/`transforms`; megatron-core's own forward (logits.pt) checks that table in turn.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_dist_save import KINDS, world_size

SAVER = Path(__file__).with_name("mcore_dist_save.py")
STEP = 7

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                    or importlib.util.find_spec("megatron.core") is None,
                                    reason="megatron-core is not installed (pip install '.[megatron]')")

# layout name -> (tp, pp, vpp)
LAYOUTS = {"tp2": (2, 1, 1), "tp2-pp2": (2, 2, 1), "tp2-pp2-vpp2": (2, 2, 2)}

_made: dict[tuple, Path] = {}  # module-level: one save per session even when two test modules ask


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _megatron(*args) -> None:
    done = subprocess.run([sys.executable, str(SAVER), *map(str, args)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def tp1_save(factory, kind: str) -> Path:
    """The role folder of a TP=1 dist_ckpt save of `kind`, with params.pt and logits.pt (every kind of KINDS
    is written by one process on the first call)."""
    assert kind in KINDS, f"no TP=1 save of {kind!r}: tests/mcore_dist_save.py writes {KINDS}"
    if ("tp1",) not in _made:
        root = factory.mktemp("mcore-tp1")
        _megatron("save_many", root, _free_port(), *KINDS)
        _made[("tp1",)] = root
    return _made[("tp1",)] / kind / f"global_step_{STEP}" / "actor"


def parallel_save(factory, kind: str, layout: str, keys: str = "stacked") -> tuple[Path, Path]:
    """(dist_ckpt role folder, legacy role folder) of the TP=1 `kind` model saved at `layout` by TP*PP ranks.

    Both are written by the same processes; the dist_ckpt one also holds logits.pt when PP == 1.
    """
    return _reshard(factory, *_parallel_entry(kind, layout, keys))


def _parallel_entry(kind: str, layout: str, keys: str) -> tuple[tuple, tuple]:
    """(cache key, (kind, keys, (tp, pp, vpp, ep, etp))) of a reshard at one of LAYOUTS."""
    return ("parallel", kind, layout, keys), (kind, keys, (*LAYOUTS[layout], 1, None))


def _ep_entry(name: str) -> tuple[tuple, tuple]:
    """(cache key, (kind, keys, sizes)) of the MoE model at EP_LAYOUTS[name]."""
    return ("ep", name), ("moe", "stacked", EP_LAYOUTS[name])


def _planned() -> dict[tuple, tuple]:
    """Every reshard the tests use: cache key -> (kind, keys, (tp, pp, vpp, ep, etp))."""
    return dict([*(_parallel_entry(*save) for save in PARALLEL), *map(_ep_entry, EP_LAYOUTS)])


def _reshard(factory, key: tuple, wanted: tuple) -> tuple[Path, Path]:
    """The (dist, legacy) roles of reshard `key`. On first need, one spawn writes it with every planned reshard
    of its world size not yet written, into ROOT/NAME/{dist,legacy}/global_step_7/actor."""
    if key not in _made:
        world = world_size(*wanted[2])
        group = {k: v for k, v in _planned().items() if world_size(*v[2]) == world and k not in _made}
        group[key] = wanted
        root = factory.mktemp(f"mcore-world{world}")
        layouts, roles = [], {}
        for k, (kind, keys, (tp, pp, vpp, ep, etp)) in group.items():
            name = "-".join(k[1:])  # ep: the EP_LAYOUTS name, as ep_saves documents
            roles[k] = tuple(root / name / side / f"global_step_{STEP}" / "actor" for side in ("dist", "legacy"))
            layouts.append(dict(source=str(tp1_save(factory, kind)), kind=kind, keys=keys, tp=tp, pp=pp, vpp=vpp,
                                ep=ep, etp=etp, dist_role=str(roles[k][0]), legacy_role=str(roles[k][1])))
        (root / "layouts.json").write_text(json.dumps(layouts))
        _megatron("reshard", root / "layouts.json", _free_port())
        for k, pair in roles.items():
            for role in pair:
                (role.parent.parent / "latest_checkpointed_iteration.txt").write_text(str(STEP))
            _made[k] = pair
    return _made[key]


def as_verl091(role: Path, into: Path) -> Path:
    """A copy of a dist_ckpt role folder in verl 0.9.1's layout: model/dist_ckpt, model/huggingface."""
    shutil.copytree(role / "dist_ckpt", into / "model" / "dist_ckpt")
    shutil.copytree(role / "huggingface", into / "model" / "huggingface")
    (into / "ckpt_contents.json").write_text(json.dumps(["model", "hf_model"]))
    return into


# ---- the expected Hugging Face tensors -----------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron GPTModel submodule -> Hugging Face module, one line per parameter the tiny models have
_SAME_SHAPE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}


def _layer_tensors(suffix: str, value: torch.Tensor, config: dict) -> dict[str, torch.Tensor]:
    if suffix in _SAME_SHAPE:
        return {_SAME_SHAPE[suffix]: value}
    if suffix.startswith("self_attention.linear_qkv."):
        # Megatron fuses q, k, v per query group: [heads/groups q heads, one k head, one v head] x groups
        heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        per_group = value.reshape(groups, heads // groups + 2, head_dim, *value.shape[1:])
        kind = suffix.rsplit(".", 1)[1]
        return {f"self_attn.q_proj.{kind}": per_group[:, :-2].reshape(heads * head_dim, *value.shape[1:]),
                f"self_attn.k_proj.{kind}": per_group[:, -2].reshape(groups * head_dim, *value.shape[1:]),
                f"self_attn.v_proj.{kind}": per_group[:, -1].reshape(groups * head_dim, *value.shape[1:])}
    fc1 = re.fullmatch(r"mlp\.(?:experts\.local_experts\.(\d+)\.|(shared_experts)\.)?linear_fc1\.weight", suffix)
    if fc1:  # SwiGLU: the first half of the rows is the gate, the second the up projection
        module = f"mlp.experts.{fc1[1]}" if fc1[1] else "mlp.shared_expert" if fc1[2] else "mlp"
        gate, up = value.chunk(2)
        return {f"{module}.gate_proj.weight": gate, f"{module}.up_proj.weight": up}
    fc2 = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.weight", suffix)
    if fc2:
        return {f"mlp.experts.{fc2[1]}.down_proj.weight": value}
    raise KeyError(f"no Hugging Face name for decoder layer tensor {suffix}: extend tests/mcore_real.py")


def hf_tensors(role: Path) -> dict[str, torch.Tensor]:
    """The TP=1 save's own parameters (params.pt) as the Hugging Face model holds them."""
    params = torch.load(role / "params.pt", weights_only=True)
    config = json.loads((role / "huggingface" / "config.json").read_text())
    vocab, expected = config["vocab_size"], {}
    for key, value in params.items():
        layer = _LAYER.match(key)
        if layer:
            for name, tensor in _layer_tensors(layer[2], value, config).items():
                expected[f"model.layers.{layer[1]}.{name}"] = tensor
        elif key == "embedding.word_embeddings.weight":
            expected["model.embed_tokens.weight"] = value[:vocab]  # Megatron pads the vocabulary
        elif key == "decoder.final_layernorm.weight":
            expected["model.norm.weight"] = value
        elif key == "output_layer.weight":
            expected["lm_head.weight"] = value[:vocab]
        else:
            raise KeyError(f"no Hugging Face name for {key}: extend tests/mcore_real.py")
    if config.get("tie_word_embeddings"):
        assert "lm_head.weight" not in expected  # Megatron keeps no separate output weight at TP=1 either
    return expected


def assert_logits_match(merged: Path, logits_file: Path) -> None:
    """The merged folder's transformers forward equals Megatron's own forward of the saved model (fp32)."""
    import transformers

    reference = torch.load(logits_file, weights_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(reference["tokens"]).logits
    assert logits.shape == reference["logits"].shape
    assert torch.allclose(logits, reference["logits"], rtol=0, atol=1e-5), (logits - reference["logits"]).abs().max()


# (kind, layout, dist_ckpt keys): the parallel saves both test modules use, each written once per session
# (tied under TP2xPP2 is also the PP-without-VPP case: one real save less, each costs 20-40 s here)
PARALLEL = [("dense", "tp2", "stacked"), ("dense", "tp2-pp2-vpp2", "stacked"),
            ("tied", "tp2-pp2", "stacked"), ("qwen3", "tp2", "per-layer"), ("moe", "tp2", "stacked")]
PARALLEL_IDS = [f"{kind}-{layout}" + ("-per-layer" if keys == "per-layer" else "") for kind, layout, keys in PARALLEL]


# ---- expert parallelism ----------------------------------------------------------------------------

# name -> (tp, pp, vpp, ep, etp): the MoE model at expert_model_parallel_size 2, both of world size 2, written by
# the world-size-2 spawn. tp2-ep2-etp1: experts whole on each rank (ETP 1), each TP rank its own expert rank, so verl's
# legacy files (data-parallel rank 0 only) hold every expert. ep2: TP 1, data parallel 2 = expert parallel 2,
# so the legacy files hold expert rank 0's experts only (verl #2086).
EP_LAYOUTS = {"tp2-ep2-etp1": (2, 1, 1, 2, 1), "ep2": (1, 1, 1, 2, None)}


def ep_saves(factory) -> Path:
    """The root of the EP saves: NAME/{dist,legacy}/global_step_7/actor for each of EP_LAYOUTS (dist roles also
    hold experts_rank_R.pt, megatron-core's own placement of each rank's experts). Written with every other
    reshard of world size 2."""
    (root,) = {ep_role(factory, name, "dist").parents[3] for name in EP_LAYOUTS}
    return root


def ep_role(factory, name: str, side: str) -> Path:
    dist_role, legacy_role = _reshard(factory, *_ep_entry(name))
    return {"dist": dist_role, "legacy": legacy_role}[side]


def megatron_expert_placement(dist_role: Path, config: dict) -> dict[str, torch.Tensor]:
    """Every rank's own experts (experts_rank_R.pt, keyed by megatron-core's global expert index), as the Hugging
    Face tensors they must become (gate/up rows of fc1 split in half, as `_layer_tensors` does)."""
    found = {}
    for dump in sorted(dist_role.glob("experts_rank_*.pt")):
        for key, value in torch.load(dump, weights_only=True).items():
            layer, expert, which = key.split(".")
            suffix = f"mlp.experts.local_experts.{expert}.linear_{which}.weight"
            for name, tensor in _layer_tensors(suffix, value, config).items():
                found[f"model.layers.{layer}.{name}"] = tensor
    return found
