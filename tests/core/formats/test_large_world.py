"""A W=256 verl FSDP2 checkpoint (fake process group, real DTensor pickles): merged exactly, opened in linear time."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ckptflow.testing.large_world import LargeWorldSpec, write_large_world
from mergecore import merge_checkpoint, open_checkpoint
from mergecore.errors import CheckpointError
from weights import load_folder

WORLD = 256


@pytest.fixture(scope="session")
def world256(tmp_path_factory):
    return write_large_world(tmp_path_factory.mktemp("world256"), LargeWorldSpec(world_size=WORLD))


def test_rank_files_are_real_fsdp2_dtensors(world256):
    """The fixture's files load with torch itself as the DTensors FSDP2 saves: rank r sits at (r,) on a (W,) mesh."""
    import torch.distributed.tensor  # noqa: F401  (registers DTensor for unpickling)

    state = torch.load(world256.role_dir / f"model_world_size_{WORLD}_rank_7.pt", weights_only=True, mmap=True)
    embed, q_proj = state["model.embed_tokens.weight"], state["model.layers.0.self_attn.q_proj.weight"]
    assert embed.device_mesh.shape == (WORLD,) and embed.device_mesh.mesh_dim_names == ("fsdp",)
    assert tuple(embed.device_mesh.get_coordinate()) == (7,)
    # verl's placement function: vocab 16000 does not divide by 256, hidden 256 does
    assert str(embed.placements[0]) == "S(1)" and str(q_proj.placements[0]) == "S(0)"
    assert len(state) == 51


def test_w256_merge_equals_the_saved_model(world256, tmp_path):
    started = time.perf_counter()
    manifest = merge_checkpoint(str(world256.role_dir), tmp_path / "out", dtype="keep")
    seconds = time.perf_counter() - started
    merged, reference = load_folder(tmp_path / "out"), load_folder(world256.reference_dir)
    assert sorted(merged) == sorted(reference) and len(reference) == 51
    for name, tensor in reference.items():
        assert torch.equal(merged[name], tensor), name
    assert [c["check"] for c in manifest["verification"]] == ["round-trip"]
    print(f"W={WORLD} merge: {seconds:.2f} s")  # stays fast: seconds, where pairwise checks took minutes


def test_w256_shards_tile_each_tensor_once(world256):
    """Uneven torch.chunk sizing at W=256: a 128-row bias gives 128 ranks one row and 128 ranks none;
    the embedding, Shard(1), one column per rank."""
    source = open_checkpoint(str(world256.role_dir))
    rows = [p.sizes[0] for p in source.pieces("model.layers.0.self_attn.k_proj.bias")]
    assert rows == [1] * 128 + [0] * 128
    columns = [(p.offsets[1], p.sizes) for p in source.pieces("model.embed_tokens.weight")]
    assert columns == [(rank, (16000, 1)) for rank in range(WORLD)]


def _resave_rank(world, target_dir, rank: int, from_rank: int, mesh_order: list[int]) -> None:
    """Rank `rank`'s file rewritten by real torch as that rank of a fake group, holding `from_rank`'s
    shards on a mesh whose ranks are in `mesh_order`: a file from a save with another rank order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    state = torch.load(world.role_dir / f"model_world_size_{WORLD}_rank_{from_rank}.pt", weights_only=True)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    try:
        mesh = DeviceMesh("cpu", torch.tensor(mesh_order), mesh_dim_names=("fsdp",))
        resaved = {name: DTensor.from_local(value.to_local(), mesh, value.placements, run_check=False,
                                            shape=value.shape, stride=value.stride()) for name, value in state.items()}
        torch.save(resaved, target_dir / f"model_world_size_{WORLD}_rank_{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture
def world_copy(world256, tmp_path):
    import shutil

    copy = tmp_path / "actor"
    shutil.copytree(world256.role_dir, copy)
    return copy


def test_a_shard_saved_twice_is_refused_among_many_ranks(world256, world_copy):
    """Rank 100's file from a save where ranks 99 and 100 swapped places: its shards land on rank 99's
    rows; the sorted sweep finds that one overlap among 256 shards (and the rows left uncovered)."""
    order = list(range(WORLD))
    order[99], order[100] = 100, 99
    _resave_rank(world256, world_copy, rank=100, from_rank=99, mesh_order=order)
    # as many elements as the tensor has: only the overlap test can tell
    with pytest.raises(CheckpointError, match=r"tensor model\.embed_tokens\.weight do not tile .*\(4096000 of 4096000 elements, overlapping\)"):
        open_checkpoint(str(world_copy)).validate()


def test_a_rank_file_copied_under_another_rank_is_refused(world_copy):
    import shutil

    shutil.copyfile(world_copy / f"model_world_size_{WORLD}_rank_99.pt", world_copy / f"model_world_size_{WORLD}_rank_100.pt")
    with pytest.raises(CheckpointError, match="rank_100.pt: was saved by rank 99, not rank 100"):
        open_checkpoint(str(world_copy)).validate()


def test_mesh_grid_is_built_once_per_rank_file(world256):
    from mergecore.formats.fsdp import load_rank_file

    path = world256.role_dir / f"model_world_size_{WORLD}_rank_3.pt"
    state = load_rank_file(str(path), path.name)
    meshes = {id(value.device_mesh) for value in state.values()}
    assert len(meshes) == 1  # every DTensor of the file shares the pickled mesh
    mesh = next(iter(state.values())).device_mesh
    assert mesh.mesh is mesh.mesh and np.array_equal(mesh.mesh, np.arange(WORLD))
    assert not mesh.mesh.flags.writeable


def test_rank_file_records_are_kept_out_of_the_cycle_collectors_scans(world256):
    """Opening W=256 rank files makes ~13k pieces and their summaries, all alive until the merge ends and none in a
    cycle: they are frozen as made, so the cycle collector's runs during the merge do not walk them again."""
    import gc

    before = gc.get_freeze_count()
    source = open_checkpoint(str(world256.role_dir))
    names = list(source.tensors())
    pieces = [piece for name in names for piece in source.pieces(name)]
    assert len(pieces) == WORLD * len(names)
    assert gc.get_freeze_count() - before >= 2 * len(pieces)  # every Piece and its rank's summary entry at least
