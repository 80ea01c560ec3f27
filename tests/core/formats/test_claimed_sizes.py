"""Sizes come from the files, not from what a file claims.

A world size (`fsdp_config.json`, rank file names), layer numbers in key names, `num_hidden_layers`, a device
mesh's layout, a DCP `.metadata`'s shapes, chunks and byte ranges are claims; every reader bounds them by what
the folder holds (`mergecore.numbers.claims`) before sizing anything by them.

The readers run as users run them: the real CLI in a process of its own, under a 3 GiB address-space limit, so
a reader that sizes anything by a claim dies there (a MemoryError traceback, exit 1) instead of taking the
machine's memory. Each case is one line naming the file, exit 2, nothing written; `poll` and `ckptflow watch`
keep going and report such a folder as waiting.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import copy_run

from mergecore.formats.completeness import poll

MEMORY_LIMIT = 3 << 30


def limited(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` in a process of its own whose address space is capped at MEMORY_LIMIT."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, preexec_fn=cap,
                          timeout=300, env={**os.environ, **(env or {})})


def ckptflow(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return limited("-m", "ckptflow.flows.cli", *args, env=env)


def refused_in_one_line(result: subprocess.CompletedProcess, target: Path, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr[-2000:]
    assert all(fragment in lines[0] for fragment in fragments), lines[0]
    assert not target.exists()
    assert not list(target.parent.glob(f".{target.name}.ckptflow-*")), "a staging folder was left behind"


# ---- the claims: each edits a real fixture checkpoint and says what the one-line error names ------------------

def claim_world_size(world: int, in_config: bool = True):
    """The one rank file of a world-size-1 save (and its optimizer and extra-state files) renamed for `world`
    ranks; `fsdp_config.json` claims `world` too, or is gone (the file names alone claim it)."""
    def edit(role: Path) -> tuple[str, ...]:
        for kind in ("model", "optim", "extra_state"):
            (role / f"{kind}_world_size_1_rank_0.pt").rename(role / f"{kind}_world_size_{world}_rank_0.pt")
        config = role / "fsdp_config.json"
        if in_config:
            config.write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
        else:
            config.unlink()
        return f"model_world_size_{world}_rank_1.pt: missing", f"({world - 1} of {world} rank files absent)"
    return edit


def claim_mesh_of(ranks: tuple[int, int]):
    """Rank 0's device mesh (torch 2.13 pickles a rank map and a layout of mesh sizes) claims a mesh of
    `ranks` over the rank map of the two ranks really saved."""
    def edit(role: Path) -> tuple[str, ...]:
        import torch
        import torch.distributed.tensor  # noqa: F401 - DTensor's classes, to load the fixture's own file
        from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout

        path = role / "model_world_size_2_rank_0.pt"
        state = torch.load(path, weights_only=False, map_location="cpu")  # our own fixture file: trusted
        for value in state.values():
            value.device_mesh._layout = _MeshLayout(axes=(_FlatLayout(shape=ranks, stride=(ranks[1], 1)),))
        torch.save(state, path)
        return path.name, f"claims {ranks[0] * ranks[1]} ranks but its rank map holds 2"
    return edit


def renumber_last_layer(layer: int):
    """The legacy model.pt's last decoder layer (3 of 0..3) saved under the number `layer`."""
    def edit(role: Path) -> tuple[str, ...]:
        import torch

        path = role / "model" / "mp_rank_00" / "model.pt"
        chunks = torch.load(path, weights_only=False)  # our own fixture file: trusted
        chunks[0] = {key.replace("decoder.layers.3.", f"decoder.layers.{layer}."): value
                     for key, value in chunks[0].items()}
        torch.save(chunks, path)
        return path.name, f"has decoder layers [0, 1, 2, {layer}] but no layer 3"
    return edit


def claim_num_hidden_layers(layers: int):
    def edit(role: Path) -> tuple[str, ...]:
        path = role / "huggingface" / "config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, "num_hidden_layers": layers}))
        return "holds 4 decoder layers", f"num_hidden_layers={layers} in", "config.json (layer 4 missing)"
    return edit


# .metadata edits, with torch's own DCP classes on the fixture's own metadata (trusted)
STACKED_KEY = "decoder.layers.mlp.linear_fc1.layer_norm_weight"  # float32 [4 layers, 64], one chunk
# a stacked key with an expert axis ([layers, experts, ...]): one slice per layer and expert
EXPERT_KEY = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def on_metadata(change):
    def edit(role: Path) -> tuple[str, ...]:
        import torch
        from torch.distributed.checkpoint import FileSystemReader

        folder = role / "model" / "dist_ckpt"
        metadata = FileSystemReader(str(folder)).read_metadata()
        fragment = change(metadata, folder, torch)
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        return ".metadata", fragment
    return edit


OWN = "STACKED_KEY's own storage item"


def as_expert_key(metadata, torch, size, chunks) -> None:
    """STACKED_KEY's entry saved as EXPERT_KEY of `size`, in `chunks`: (offsets, sizes, storage item), the item
    OWN (STACKED_KEY's bytes), another one, or None (no storage item)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md = metadata.state_dict_metadata.pop(STACKED_KEY)
    (index,) = [i for i in metadata.storage_data if i.fqn == STACKED_KEY]
    own = metadata.storage_data.pop(index)
    metadata.state_dict_metadata[EXPERT_KEY] = dataclasses.replace(
        md, size=torch.Size(size), chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(n)) for o, n, _ in chunks])
    for offsets, _, item in chunks:
        if item is not None:
            metadata.storage_data[MetadataIndex(EXPERT_KEY, torch.Size(offsets))] = own if item is OWN else item


def empty_experts(metadata, folder, torch):
    """10**12 experts of nothing in each of the 4 layers: no element to bound by a byte, yet a slice each."""
    as_expert_key(metadata, torch, [4, 10 ** 12, 0], [([0, 0, 0], [4, 10 ** 12, 0], OWN)])
    return f"{EXPERT_KEY}: shape (4, 1000000000000, 0) claims 4000000000000 places"


def chunk_without_storage(metadata, folder, torch):
    """One real expert per layer, and 10**12 - 1 more in a chunk that no storage item holds."""
    as_expert_key(metadata, torch, [4, 10 ** 12, 64], [([0, 0, 0], [4, 1, 64], OWN),
                                                       ([0, 1, 0], [4, 10 ** 12 - 1, 64], None)])
    return f"{EXPERT_KEY}: chunk at (0, 1, 0) has no storage entry"


def items_sharing_bytes(metadata, folder, torch):
    """4 x 1000 chunks, each with a storage item of its own, every item claiming the whole data file (each inside
    it): 4 layers of 1000 x 3696 experts of 64 float32, from one 0.9 MB file."""
    size = (folder / "__0_0.distcp").stat().st_size
    rows = size // (64 * 4)
    whole_file = dataclasses.replace(next(iter(metadata.storage_data.values())), offset=0, length=size)
    as_expert_key(metadata, torch, [4, 1000 * rows, 64],
                  [([layer, i * rows, 0], [1, rows, 64], whole_file) for layer in range(4) for i in range(1000)])
    return "claim the same bytes"


def one_chunk_many_times(metadata, folder, torch):
    """The real chunk listed 1000 times over a tensor of 1000 x 4 layers: the same bytes would count 1000 times."""
    md = metadata.state_dict_metadata[STACKED_KEY]
    metadata.state_dict_metadata[STACKED_KEY] = dataclasses.replace(md, size=torch.Size([4000, 64]),
                                                                     chunks=md.chunks * 1000)
    return f"{STACKED_KEY}: two chunks at (0, 0) claim one storage item"


BOTH = ("inspect", "merge")
CASES = {  # name: (fixture, edit -> fragments of the one-line error, commands)
    "fsdp_config-world_size-10**9": ("fsdp2-w1", claim_world_size(10 ** 9), BOTH),
    "fsdp_config-world_size-10**18": ("fsdp2-w1", claim_world_size(10 ** 18), BOTH),
    "file-names-world_size-10**18": ("fsdp2-w1", claim_world_size(10 ** 18, in_config=False), BOTH),
    "device-mesh-of-10**10": ("fsdp2-w2", claim_mesh_of((10 ** 5, 10 ** 5)), BOTH),
    "legacy-layer-number-10**12": ("legacy", renumber_last_layer(10 ** 12), BOTH),
    "legacy-num_hidden_layers-10**12": ("legacy", claim_num_hidden_layers(10 ** 12), ("merge",)),
    "dist-10**12-empty-experts": ("dist", on_metadata(empty_experts), BOTH),
    "dist-chunk-without-storage": ("dist", on_metadata(chunk_without_storage), BOTH),
    "dist-items-sharing-bytes": ("dist", on_metadata(items_sharing_bytes), BOTH),
    "dist-one-chunk-many-times": ("dist", on_metadata(one_chunk_many_times), BOTH),
}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    from ckptflow.testing.megatron_dist_fixtures import write_dist_checkpoint
    from ckptflow.testing.megatron_fixtures import write_megatron_checkpoint

    return {"legacy": write_megatron_checkpoint(tmp_path_factory.mktemp("claims-legacy"), "llama"),
            "dist": write_dist_checkpoint(tmp_path_factory.mktemp("claims-dist"), "llama", layout="verl091")}


@pytest.mark.parametrize("case, command", [pytest.param(case, command, id=f"{case}:{command}")
                                           for case, (_, _, commands) in CASES.items() for command in commands])
def test_a_claimed_size_is_bounded_by_the_folder(case, command, demo, megatron, tmp_path):
    fixture, edit, _ = CASES[case]
    ckpt = copy_run(megatron[fixture] if fixture in megatron else demo(fixture), tmp_path / "ckpt")
    fragments = edit(ckpt.role_dir)
    target = tmp_path / "out" / "model"
    args = ("merge", "--local_dir", ckpt.role_dir, "--target_dir", target) if command == "merge" else \
        ("inspect", ckpt.role_dir)
    refused_in_one_line(ckptflow(*args), target, *fragments)


# ---- completeness and `ckptflow watch` ----------------------------------------------------------------------

def upload(demo, root: Path, name: str, edit=None) -> Path:
    """A copy of the world-size-1 demo run under `root` (as training uploads it), edited; its role folder."""
    ckpt = copy_run(demo("fsdp2-w1"), root / name)
    shutil.rmtree(ckpt.reference_dir)
    if edit:
        edit(ckpt.role_dir)
    return ckpt.role_dir


POLL_TWICE = ("import json, sys\n"
              "from mergecore.formats.completeness import poll\n"
              "first = poll(sys.argv[1])\n"
              "second = poll(sys.argv[1], first.sizes)\n"
              "print(json.dumps({'complete': second.complete, 'waiting': second.waiting}))\n")


@pytest.mark.parametrize("world", [10 ** 9, 10 ** 18])
def test_poll_reports_a_claimed_world_size_as_waiting(world, demo, tmp_path):
    good, bad = upload(demo, tmp_path, "good"), upload(demo, tmp_path, "bad", claim_world_size(world))
    result = limited("-c", POLL_TWICE, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(result.stdout)
    assert seen["complete"] == [str(good)]
    assert list(seen["waiting"]) == [str(bad)]
    assert f"rank files for world size {world} incomplete (missing ranks [1, 2, 3, 4, 5, 6, 7, 8])" \
        in seen["waiting"][str(bad)]


def test_watch_keeps_running_past_a_claimed_world_size(demo, tmp_path):
    bad = upload(demo, tmp_path / "uploads", "bad", claim_world_size(10 ** 18))
    state = tmp_path / "watch-state.json"
    env = {"PREFECT_API_URL": "http://127.0.0.1:9/api", "PREFECT_HOME": str(tmp_path / "prefect")}  # nothing to post
    for _ in range(2):  # the second poll compares sizes with the first's
        result = ckptflow("watch", tmp_path / "uploads", "--once", "--state", state, env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "announced" not in result.stdout and "Traceback" not in result.stderr
    assert list(json.loads(state.read_text())["sizes"]) == [str(bad)]  # still watched, not announced


DEEP = "[" * 200_000 + "]" * 200_000  # deeper than the JSON parser's stack


def write(relative: str, text: str):
    def edit(role: Path) -> None:
        (role / relative).write_text(text)
    return edit


def dist_upload(megatron, root: Path, edit) -> Path:
    ckpt = copy_run(megatron["dist"], root / "dist")
    edit(ckpt.role_dir)
    return ckpt.role_dir


MARKERS = {  # a marker file poll reads, hostile: (fsdp or dist, edit, fragment of the folder's waiting reason)
    "fsdp_config-world_size-Infinity": ("fsdp", write("fsdp_config.json", '{"world_size": Infinity}'),
                                        "world_size is inf, not a positive integer"),
    "fsdp_config-deeply-nested": ("fsdp", write("fsdp_config.json", DEEP), "nested too deeply"),
    "ckpt_contents-a-list-of-lists": ("dist", write("ckpt_contents.json", '[["model"]]'),
                                      "ckpt_contents.json is not a list of part names"),
    "ckpt_contents-deeply-nested": ("dist", write("ckpt_contents.json", DEEP), "unreadable yet (RecursionError)"),
}


@pytest.mark.parametrize("case", MARKERS)
def test_poll_reports_a_hostile_marker_file_as_waiting(case, demo, megatron, tmp_path):
    kind, edit, fragment = MARKERS[case]
    good = upload(demo, tmp_path, "good")
    bad = upload(demo, tmp_path, "bad", edit) if kind == "fsdp" else dist_upload(megatron, tmp_path, edit)
    first = poll(tmp_path)
    second = poll(tmp_path, first.sizes)
    assert second.complete == [str(good)]
    assert list(second.waiting) == [str(bad)] and fragment in second.waiting[str(bad)], second.waiting
