"""The family registry is the one place a family is described: registering one (as docs/adding-a-family.md shows,
its snippet run as written) makes a Megatron merge read it, a quantized export keep its own modules unquantized and
the config check judge its names; an unknown family stops in one line naming both fixes. Expected values: the
fixtures' `save_pretrained` reference folders."""

from __future__ import annotations

from helpers import REPO
import ast
import json
import re
from pathlib import Path

import pytest
from conftest import copy_run
from safetensors import safe_open

from ckptflow.testing.megatron_fixtures import write_megatron_checkpoint
from mergecore import CheckpointError, compare_with_reference, merge_checkpoint
from mergecore.families.layout import check_against_config
from mergecore.families.registry import family_of, forget_family, register_family

ROOT = REPO
DOC = ROOT / "docs" / "adding-a-family.md"


def doc_snippet() -> str:
    return re.search(r"```python\n(.*?)```", DOC.read_text(), re.S).group(1)


@pytest.fixture(scope="module")
def acme(tmp_path_factory):
    """A TP=2 legacy Megatron checkpoint of a Llama whose config.json names a family nobody ships: acme_llama."""
    ckpt = write_megatron_checkpoint(tmp_path_factory.mktemp("acme"), "llama", tp=2)
    config_file = ckpt.role_dir / "huggingface" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "acme_llama",
                                       "architectures": ["AcmeLlamaForCausalLM"]}))
    return ckpt


def test_an_unknown_family_stops_in_one_line_naming_both_fixes(acme, tmp_path):
    assert family_of({"model_type": "acme_llama"}) is None
    with pytest.raises(CheckpointError) as excinfo:
        merge_checkpoint(str(acme.role_dir), tmp_path / "out")
    text = str(excinfo.value)
    assert "\n" not in text
    assert "config.json: model_type 'acme_llama' has no Megatron mapping table" in text
    assert "register the family" in text and "register_family" in text and "--custom-mapping FILE" in text
    assert not (tmp_path / "out").exists()


def test_registering_the_docs_family_makes_a_megatron_merge_read_it(acme, tmp_path):
    exec(compile(doc_snippet(), str(DOC), "exec"), {})
    try:
        assert family_of({"model_type": "acme_llama"}).hub_layout == "registry"
        merge_checkpoint(str(acme.role_dir), tmp_path / "out", dtype="keep")
        assert compare_with_reference(tmp_path / "out", acme.reference_dir)["max_abs_diff"] == 0.0
    finally:
        forget_family("acme_llama")


def test_the_registry_says_which_names_a_family_has():
    """The config check reads a family's name tables from its entry: registered, an unknown name is refused."""
    shapes = {"model.norm.weight": (8,), "model.layers.0.mlp.my_gate.weight": (8, 8)}
    config = {"model_type": "acme_strict", "hidden_size": 8, "num_hidden_layers": 1}
    check_against_config(shapes, config, "hf/config.json")  # unregistered: names it does not know pass
    register_family("acme_strict", names=("decoder",), hub_layout="registry")
    try:
        with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.my_gate.weight is not a acme_strict parameter"):
            check_against_config(shapes, config, "hf/config.json")
    finally:
        forget_family("acme_strict")


def test_a_wrong_registration_is_one_line_naming_it():
    with pytest.raises(CheckpointError, match=r"register_family\('acme_bad'\): megatron: entry 'output_layer.weight' "
                                              r"must be \[hf pattern \(or list\), kind\] with kind one of column, row"):
        register_family("acme_bad", megatron={"output_layer.weight": ["lm_head.weight", "sideways"]})
    with pytest.raises(CheckpointError, match=r"register_family\('llama'\): already registered; pass replace=True"):
        register_family("llama")
    assert family_of({"model_type": "acme_bad"}) is None


def test_inspect_says_where_a_megatron_layout_comes_from(acme, cli, tmp_path):
    """Unknown family: every saved parameter is unplaced (`layout: none`), nothing raised; with the Llama rows as a
    custom mapping: `custom mapping`, everything placed."""
    import torch

    saved = {key for chunk in torch.load(acme.role_dir / "model" / "mp_rank_00" / "model.pt", weights_only=True)
             for key in chunk if not key.endswith("_extra_state")}
    result = cli("inspect", acme.role_dir, "--json")
    assert result.exit_code == 2 and "cannot place" in result.stderr and "register the family" in result.stderr
    report = json.loads(result.stdout)  # shown, then refused as a merge would be
    assert (report["family"]["layout"], report["groups"]) == ("none", [])
    assert set(report["family"]["unplaced"]) == saved
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps(family_of({"model_type": "llama"}).megatron))
    result = cli("inspect", acme.role_dir, "--custom-mapping", rows)
    assert result.exit_code == 0, result.output
    assert f"layout: custom mapping — {rows}" in result.stdout
    assert "cannot place" not in result.stdout


def safetensors_of(folder) -> dict:
    """Every tensor of a folder, read by safetensors itself."""
    found = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            found.update({name: f.get_tensor(name) for name in f.keys()})
    return found


def test_the_docs_familys_quantize_ignore_keeps_its_modules_unquantized(demo, tmp_path):
    """The snippet's `quantize_ignore` is read by a quantized export: an FSDP checkpoint of acme_llama (the dense
    quantizable fixture under that model_type) merged with --quantize w4a16 keeps every layer's down_proj as
    trained (the reference folder's values, cast to the output dtype) and lists it unquantized; up_proj is packed."""
    pytest.importorskip("compressed_tensors", reason="the quantize extra (compressed-tensors) is not installed")
    ckpt = copy_run(demo("quant-dense-tied"), tmp_path / "acme")
    config_file = ckpt.role_dir / "huggingface" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": "acme_llama",
                                       "architectures": ["AcmeLlamaForCausalLM"]}))
    exec(compile(doc_snippet(), str(DOC), "exec"), {})
    try:
        merge_checkpoint(str(ckpt.run_root), tmp_path / "out", quantize="w4a16")
    finally:
        forget_family("acme_llama")
    reference, merged = safetensors_of(ckpt.reference_dir), safetensors_of(tmp_path / "out")
    down = sorted(name for name in reference if name.endswith(".mlp.down_proj.weight"))
    assert len(down) == json.loads(config_file.read_text())["num_hidden_layers"] > 0
    ignored = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["ignore"]
    for name in down:
        module = name.removesuffix(".weight")
        assert module in ignored and f"{module}.weight_packed" not in merged
        assert merged[name].equal(reference[name].to(merged[name].dtype))
        assert f"{module.replace('down_proj', 'up_proj')}.weight_packed" in merged  # its neighbours are quantized


def test_a_wrong_quantize_ignore_is_one_line_naming_it():
    for bad in ("", 3, None):
        with pytest.raises(CheckpointError) as excinfo:
            register_family("acme_bad", quantize_ignore=("*.mlp.acme_router", bad))
        assert str(excinfo.value) == (f"register_family('acme_bad'): quantize_ignore {bad!r} is no module name "
                                      "pattern: give fnmatch patterns such as '*.mlp.gate'")
    assert family_of({"model_type": "acme_bad"}) is None
    try:  # one pattern given bare is one pattern, not one per character
        assert register_family("acme_one", quantize_ignore="*.mlp.acme_router").quantize_ignore == ("*.mlp.acme_router",)
    finally:
        forget_family("acme_one")


# What the families package may import: what sits below it (numbers, storage, error types) and itself. The
# readers (formats), views, quantize, the engine, proofs, targets and the entry points sit above it.
BELOW_FAMILIES = {"mergecore.errors", "mergecore.numbers", "mergecore.storage", "mergecore.families"}


def test_the_families_package_imports_nothing_above_it():
    """Family knowledge (the meta model the config check asks included) lives in families: no module of it imports
    a higher layer, not even inside a function (the config check used to take views.hub_layout's private meta-model
    builder)."""
    folder = REPO / "mergecore" / "families"
    above = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:  # relative to mergecore.families.<module>
                base = ["mergecore", "families"][: 3 - node.level]
                modules = [".".join(base + ([node.module] if node.module else []))]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            else:
                continue
            for module in modules:
                top = ".".join(module.split(".")[:2])
                if module.startswith("mergecore") and top not in BELOW_FAMILIES:
                    above.setdefault(path.name, []).append(module)
    assert above == {}
