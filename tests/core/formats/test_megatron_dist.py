"""Megatron dist_ckpt (torch_dist) checkpoints: discovery, reading, verification and bad inputs.

Layout evidence (every claimed layout merged to the model's own parameters and logits) comes from real
megatron-core saves in test_megatron_core_real.py. The synthetic checkpoints here (our transforms run
backwards, saved with plain torch DCP) supply what a real save cannot: optimizer bytes in the same file,
odd files, damaged metadata.
"""

from __future__ import annotations

from helpers import REPO
import json
import os
import pickle
from pathlib import Path

import pytest
from conftest import copy_run
import torch

from mergecore import CheckpointError, VerificationError, compare_with_reference, merge_checkpoint
from mergecore import open_checkpoint, prepare, verify_round_trip
from mergecore.formats.megatron.dist import MegatronDistCheckpoint
from ckptflow.testing.megatron_dist_fixtures import OPTIMIZER_KEY, write_dist_checkpoint
from ckptflow.testing.megatron_fixtures import MegatronFixture
from weights import load_folder

# name -> (arch, layout, stacked layer axis): synthetic inputs for the reading, fault and bad-input tests below
CASES = {
    "llama": ("llama", "verl091", True),
    "qwen2": ("qwen2", "verl091", True),
    "qwen3-per-layer-old": ("qwen3", "old", False),
    "qwen2_moe": ("qwen2_moe", "verl091", True),
    "llama-tied-old": ("llama-tied", "old", True),
    "critic": ("critic", "verl091", True),
}


@pytest.fixture(scope="session")
def dist(tmp_path_factory):
    made: dict = {}

    def get(case: str) -> MegatronFixture:
        if case not in made:
            arch, layout, stacked = CASES[case]
            made[case] = write_dist_checkpoint(tmp_path_factory.mktemp(case), arch, layout=layout, stacked=stacked)
        return made[case]

    return get


@pytest.fixture
def dist_copy(dist, tmp_path):
    def copy(case: str) -> MegatronFixture:
        return copy_run(dist(case), tmp_path / "copy")

    return copy


def dist_dir(ckpt: MegatronFixture) -> Path:
    nested = ckpt.role_dir / "model" / "dist_ckpt"
    return nested if nested.exists() else ckpt.role_dir / "dist_ckpt"


def hf_config_file(ckpt: MegatronFixture) -> Path:
    return dist_dir(ckpt).parent / "huggingface" / "config.json"


def edit_config(ckpt: MegatronFixture, **changes) -> None:
    path = hf_config_file(ckpt)
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def one_line_error(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def mapped_bytes(folder: Path) -> int:
    """Resident bytes of this process's mappings of `folder`'s .distcp files: the pages a read touched."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5].startswith(str(folder)) and fields[5].endswith(".distcp")
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


# ---- merging ---------------------------------------------------------------------------------

def test_value_head_is_the_output_layer(dist, tmp_path):
    """A critic's `output_layer.weight` [1, hidden] becomes `score.weight`, read here with torch's own DCP loader."""
    import torch.distributed.checkpoint as dcp

    ckpt = dist("critic")
    raw = {"output_layer.weight": torch.empty(1, 64)}
    dcp.load(raw, checkpoint_id=str(dist_dir(ckpt)), no_dist=True)
    manifest = merge_checkpoint(str(ckpt.role_dir), tmp_path / "out", dtype="keep")
    merged = load_folder(tmp_path / "out")
    assert "lm_head.weight" not in merged and torch.equal(merged["score.weight"], raw["output_layer.weight"])
    assert manifest["verification"][0]["ok"]


def test_tied_embeddings_have_no_output_layer(dist):
    source = open_checkpoint(str(dist("llama-tied-old").run_root))
    assert "lm_head.weight" not in source.tensors()
    assert "output_layer.weight" not in source.metadata.state_dict_metadata


def test_both_layouts_are_found(dist):
    new, old = dist("qwen2"), dist("qwen3-per-layer-old")
    for ckpt, nested in ((new, True), (old, False)):
        for path in (ckpt.run_root, ckpt.role_dir, ckpt.role_dir.parent):
            source = open_checkpoint(str(path))
            assert isinstance(source, MegatronDistCheckpoint)
            assert source.dist_dir.url.endswith("actor/model/dist_ckpt" if nested else "actor/dist_ckpt")
            assert source.hf_dir.url.endswith("actor/model/huggingface" if nested else "actor/huggingface")
        assert isinstance(open_checkpoint(str(ckpt.role_dir), backend="megatron_dist"), MegatronDistCheckpoint)
        # verl's --backend megatron covers its dist_ckpt layout (its default) as well as mp_rank folders
        assert isinstance(open_checkpoint(str(ckpt.role_dir), backend="megatron"), MegatronDistCheckpoint)
    with pytest.raises(CheckpointError, match="is not a megatron_legacy checkpoint"):
        open_checkpoint(str(new.role_dir), backend="megatron_legacy")  # the legacy reader does not claim it


def test_metadata_is_read_without_torch(dist):
    """`.metadata` goes through the record allow-list: a process that cannot import torch reads it, and
    finds what torch's own reader finds."""
    import subprocess
    import sys

    from torch.distributed.checkpoint import FileSystemReader

    folder = dist_dir(dist("qwen2"))
    code = ("import sys; sys.modules['torch'] = None\n"
            "import io, json\n"
            "from mergecore.formats.untrusted import AllowListUnpickler, DCP_METADATA\n"
            f"data = open({str(folder / '.metadata')!r}, 'rb').read()\n"
            "md = AllowListUnpickler(io.BytesIO(data), DCP_METADATA, file_bytes=len(data)).load()\n"
            "print(json.dumps({k: [list(v.size), v.properties.dtype, [[list(c.offsets), list(c.sizes)] for c in v.chunks]]\n"
            "                  for k, v in md.state_dict_metadata.items() if hasattr(v, 'chunks')}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout
    expected = FileSystemReader(str(folder)).read_metadata()  # plain pickle: fine for our own fixture
    assert json.loads(out) == {
        key: [list(md.size), str(md.properties.dtype).removeprefix("torch."),
              [[list(c.offsets), list(c.sizes)] for c in md.chunks]]
        for key, md in expected.state_dict_metadata.items() if hasattr(md, "chunks")}


def test_names_shapes_order_and_describe(dist):
    source = open_checkpoint(str(dist("qwen3-per-layer-old").role_dir))
    infos = source.tensors()
    names = list(infos)
    assert names[0] == "model.embed_tokens.weight" and names[-2:] == ["model.norm.weight", "lm_head.weight"]
    assert infos["model.embed_tokens.weight"].shape == (300, 64)  # 384 padded rows in the file, trimmed
    assert source.metadata.state_dict_metadata["embedding.word_embeddings.weight"].size == torch.Size([384, 64])
    assert infos["model.layers.3.self_attn.q_proj.weight"].shape == (128, 64)  # head_dim 32
    assert infos["model.layers.3.self_attn.k_proj.weight"].shape == (64, 64)
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers) and set(layers) == {0, 1, 2, 3}
    facts = source.describe()
    assert facts["format"] == "verl-megatron-dist" and facts["layers"] == 4 and facts["iteration"] == 10
    assert facts["files"] == ["dist_ckpt/__0_0.distcp"]
    moe = open_checkpoint(str(dist("qwen2_moe").role_dir)).tensors()
    assert moe["model.layers.2.mlp.experts.3.gate_proj.weight"].layout.endswith(
        "decoder.layers.mlp.experts.experts.linear_fc1.weight[2, 3]")


def test_reads_only_the_requested_layer(tmp_path):
    """A layer of a stacked `[L, ...]` key touches that layer's bytes, not the whole stack (torch's own DCP
    reader loads whole chunks): the chunk is mapped, and only the pages copied out become resident."""
    import numpy as np
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from mergecore.formats import torchfile

    stacked = torch.randn(8, 512, 1024)  # 2 MiB per layer, 16 MiB in all
    dcp.save({"decoder.layers.self_attention.linear_qkv.weight": stacked}, checkpoint_id=str(tmp_path), no_dist=True)
    (info,) = FileSystemReader(str(tmp_path)).read_metadata().storage_data.values()
    path = str(tmp_path / info.relative_path)
    resident_before = mapped_bytes(tmp_path)
    chunk = torchfile.load(path, "item", info.offset, info.length)
    layer = np.array(chunk[2])
    touched = mapped_bytes(tmp_path) - resident_before
    assert np.array_equal(layer, stacked[2].numpy())
    # the kernel maps some pages around each fault (read-around), so allow slack, far below the whole stack
    assert stacked[2].nbytes <= touched < stacked.nbytes / 2, touched
    assert np.array_equal(chunk, stacked.numpy())  # the item read whole equals what was saved


def test_damaged_optimizer_bytes_do_not_matter(dist_copy, tmp_path):
    """Optimizer state sharing the .distcp file is never parsed: zero its byte range, the merge is still exact."""
    ckpt = dist_copy("llama")
    source = open_checkpoint(str(ckpt.role_dir))
    (info,) = [v for k, v in source.metadata.storage_data.items() if k.fqn == OPTIMIZER_KEY]
    path = dist_dir(ckpt) / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset: info.offset + info.length] = bytes(info.length)
    path.write_bytes(bytes(data))
    merge_checkpoint(str(ckpt.role_dir), tmp_path / "out", dtype="keep")
    assert compare_with_reference(tmp_path / "out", ckpt.reference_dir)["max_abs_diff"] == 0.0


def test_input_files_come_from_the_storage_index(dist):
    ckpt = dist("qwen2")
    source = open_checkpoint(str(ckpt.role_dir))
    files = source.input_files(["model.layers.1.mlp.up_proj.weight"])
    assert [Path(str(f)) for f in files] == [dist_dir(ckpt) / "__0_0.distcp"]
    assert source.input_files() == files


# ---- verification ----------------------------------------------------------------------------

def test_check_round_trip_catches_a_tampered_output(dist, tmp_path):
    ckpt = dist("qwen2")
    merge_checkpoint(str(ckpt.role_dir), tmp_path / "out", dtype="keep")
    source = open_checkpoint(str(ckpt.role_dir))
    weights = load_folder(tmp_path / "out")
    for name in ("model.layers.3.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight", "lm_head.weight"):
        tensor = weights[name]
        assert source.check_round_trip(name, tensor) == 1
        bad = tensor.clone()
        bad[-1, -1] += 1
        with pytest.raises(VerificationError, match=r"__0_0.distcp: .* differs from the merged") as excinfo:
            source.check_round_trip(name, bad)
        one_line_error(excinfo)
    # the whole output tampered on disk: verify_round_trip refuses it
    from safetensors.torch import load_file, save_file

    (file,) = sorted((tmp_path / "out").glob("*.safetensors"))
    state = load_file(file)
    state["model.layers.1.self_attn.q_proj.bias"][0] += 1
    save_file(state, file, metadata={"format": "pt"})
    with pytest.raises(VerificationError, match=r"decoder.layers.self_attention.linear_qkv.bias\[1\] \(q part\)"):
        verify_round_trip(open_checkpoint(str(ckpt.role_dir)), tmp_path / "out", {})


# ---- untrusted pickles -----------------------------------------------------------------------

class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_metadata_is_refused_without_running(dist_copy, tmp_path):
    ckpt = dist_copy("llama")
    marker = tmp_path / "pwned"
    (dist_dir(ckpt) / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: refused to unpickle \(global (posix|os)\.system") as excinfo:
        merge_checkpoint(str(ckpt.role_dir), tmp_path / "out")
    one_line_error(excinfo)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_malicious_common_pt_is_refused(dist_copy, tmp_path):
    ckpt = dist_copy("llama")
    marker = tmp_path / "pwned"
    torch.save({"iteration": 1, "evil": _Evil(marker)}, dist_dir(ckpt) / "common.pt")
    with pytest.raises(CheckpointError, match=r"common.pt: refused to unpickle") as excinfo:
        merge_checkpoint(str(ckpt.role_dir), tmp_path / "out")
    one_line_error(excinfo)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_truncated_metadata(dist_copy):
    ckpt = dist_copy("llama")
    path = dist_dir(ckpt) / ".metadata"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"\.metadata: cannot be read") as excinfo:
        open_checkpoint(str(ckpt.role_dir))
    one_line_error(excinfo)


# ---- bad inputs: one line each, nothing written -----------------------------------------------

@pytest.mark.parametrize("changes, message", [
    ({"num_hidden_layers": 5}, r"\.metadata: decoder.layers.* stacks 4 decoder layers but num_hidden_layers=5"),
    ({"num_key_value_heads": 4}, r"\.metadata: decoder.layers.self_attention.linear_qkv.(weight|bias) has 128 rows per layer "
                                 r"but .*config.json implies 192"),
    ({"hidden_size": 96, "head_dim": 16}, r"has 64 columns but hidden_size=96"),
    ({"vocab_size": 500}, r"embedding.word_embeddings.weight has 384 rows, fewer than vocab_size=500"),
])
def test_metadata_must_match_the_config(changes, message, dist_copy, tmp_path):
    ckpt = dist_copy("qwen2")
    edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match=message) as excinfo:
        merge_checkpoint(str(ckpt.role_dir), tmp_path / "out")
    one_line_error(excinfo)
    assert not (tmp_path / "out").exists()


def test_per_layer_keys_must_cover_the_config_layers(dist_copy, tmp_path):
    ckpt = dist_copy("qwen3-per-layer-old")
    edit_config(ckpt, num_hidden_layers=5)
    with pytest.raises(CheckpointError, match=r"holds 4 decoder layers but num_hidden_layers=5 .*layer 4 missing") as excinfo:
        merge_checkpoint(str(ckpt.role_dir), tmp_path / "out")
    one_line_error(excinfo)
    assert not (tmp_path / "out").exists()


def test_other_backends_and_missing_files(dist_copy, tmp_path):
    ckpt = dist_copy("llama")
    (dist_dir(ckpt) / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: missing .*copy the whole checkpoint folder") as excinfo:
        prepare(str(ckpt.role_dir))
    one_line_error(excinfo)
    (dist_dir(ckpt) / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CheckpointError, match=r"metadata.json: sharded_backend is 'zarr'; only the torch_dist"):
        open_checkpoint(str(ckpt.role_dir))


# ---- start-up and streaming ------------------------------------------------------------------

def merge_in_a_fresh_process(role_dir: Path, out: Path, chunk_bytes: str) -> list[str]:
    """Merge `role_dir` in a new Python process with the chunk budget `chunk_bytes`; the heavy modules it imported."""
    import os
    import subprocess
    import sys

    code = ("import json, sys\n"
            "from mergecore import merge_checkpoint\n"
            f"merge_checkpoint({str(role_dir)!r}, {str(out)!r}, dtype='keep')\n"
            "print(json.dumps(sorted(m for m in ('torch', 'ml_dtypes', 'transformers') if m in sys.modules)))\n")
    root = REPO
    env = {**os.environ, "CKPTFLOW_CHUNK_BYTES": chunk_bytes, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["qwen2", "qwen2_moe"])
def test_merge_imports_no_torch_and_streams_within_a_tiny_budget(dist, case, tmp_path):
    """A dist_ckpt merge never imports torch once the config check's answer for its config.json is cached (a first
    merge, here `prepare` in this process, asks transformers), and with a 4 KB chunk budget (every tensor in many row
    blocks, fused QKV and [gate; up] parts and the padded vocabulary included) the output equals save_pretrained's."""
    ckpt = dist(case)
    prepare(str(ckpt.role_dir))  # the session's CKPTFLOW_CONFIG_CACHE, which the fresh process inherits
    assert merge_in_a_fresh_process(ckpt.role_dir, tmp_path / "out", "4KB") == []
    assert compare_with_reference(tmp_path / "out", ckpt.reference_dir)["max_abs_diff"] == 0.0
    verify_round_trip(open_checkpoint(str(ckpt.role_dir)), tmp_path / "out", {})


def test_read_rows_come_from_views_of_the_mapped_chunks(dist):
    """Rows of the (padded, vocab-trimmed) embedding and of a fused QKV part come straight from views of the
    mapped chunks, and equal the saved model's rows."""
    ckpt = dist("qwen2")
    source = open_checkpoint(str(ckpt.role_dir))
    reference = load_folder(ckpt.reference_dir)
    rows = source.read_rows("model.embed_tokens.weight", 290, 300)
    assert rows.tobytes() == reference["model.embed_tokens.weight"][290:300].numpy().tobytes()
    k = source.read_rows("model.layers.1.self_attn.k_proj.weight", 3, 21)
    assert k.tobytes() == reference["model.layers.1.self_attn.k_proj.weight"][3:21].numpy().tobytes()
    pieces = list(source.pieces("model.layers.1.self_attn.k_proj.weight"))
    assert all(not p.tensor.flags.owndata for p in pieces)  # views of the mapped file, never copies
