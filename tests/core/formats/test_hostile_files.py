"""Hostile checkpoint files: every reader refuses them through the real CLI, with one line naming the
file, exit code 2, no code run (no marker file), nothing written (no target, no staging folder).

Payloads start from real fixture files (FSDP rank files written by torch.distributed, legacy Megatron
`model.pt`, a dist_ckpt saved by torch DCP): their pickles are read into a tree of globals and calls
(`to_tree`), edited, and written back by hand (`to_pickle`); archives are rewritten with `zipfile`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
from conftest import copy_run
from helpers import damage_tensor_member, damaged_fsdp

from ckptflow.testing.megatron_dist_fixtures import write_dist_checkpoint
from ckptflow.testing.megatron_fixtures import write_megatron_checkpoint

# ---- pickles by hand -------------------------------------------------------------------------


class Global:
    """A pickled global `module.name`; calling it (REDUCE) gives a Call. `stack`: written as STACK_GLOBAL."""

    def __init__(self, module: str, name: str, stack: bool = False):
        self.module, self.name, self.stack = module, name, stack

    def __call__(self, *args):
        return Call(self, *args)


class Call:
    """`func(*args)`, then BUILD `state` and SETITEMS `items`, as a pickle does it."""

    def __init__(self, func, *args, state=None):
        self.func, self.args, self.state, self.items = func, list(args), state, {}

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, key, value):
        self.items[key] = value


class NewObj(Call):
    """`cls.__new__(cls, *args)` (NEWOBJ), how dataclasses and Namespace pickle."""


class Persistent:
    def __init__(self, pid):
        self.pid = list(pid)


class TreeUnpickler(pickle._Unpickler):
    """Reads a pickle into Globals, Calls and Persistents: nothing is imported or called."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module, name):
        return Global(module, name)

    def persistent_load(self, pid):
        return Persistent(pid)

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(NewObj(cls, *args))

    def load_newobj_ex(self):
        self.stack.pop()  # kwargs
        self.load_newobj()

    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex


class HandPickler(pickle._Pickler):
    dispatch = dict(pickle._Pickler.dispatch)

    def save_global_marker(self, obj):
        if obj.stack:
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())

    def save_call(self, obj):
        self.save(obj.func)
        self.save(tuple(obj.args))
        self.write(pickle.NEWOBJ if isinstance(obj, NewObj) else pickle.REDUCE)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)
        if obj.items:
            self.write(pickle.MARK)
            for key, value in obj.items.items():
                self.save(key)
                self.save(value)
            self.write(pickle.SETITEMS)

    dispatch[Global] = save_global_marker
    dispatch[Call] = save_call
    dispatch[NewObj] = save_call

    def persistent_id(self, obj):
        return tuple(obj.pid) if isinstance(obj, Persistent) else None


def to_tree(data: bytes):
    return TreeUnpickler(io.BytesIO(data)).load()


def to_pickle(tree) -> bytes:
    out = io.BytesIO()
    HandPickler(out, protocol=2).dump(tree)
    return out.getvalue()


def walk(obj):
    """Every node of a tree, depth first."""
    seen, todo = set(), [obj]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if isinstance(node, dict):
            todo.extend(reversed([*node.keys(), *node.values()]))
        elif isinstance(node, (list, tuple)):
            todo.extend(reversed(node))
        elif isinstance(node, Call):
            todo.extend(reversed([*node.args, node.state, *node.items.keys(), *node.items.values()]))


def calls(tree, name: str) -> list[Call]:
    return [n for n in walk(tree) if isinstance(n, Call) and getattr(n.func, "name", None) == name]


def with_payload(tree, payload):
    """`payload` unpickled before anything else of the file."""
    return [payload, tree]


# ---- zip archives by hand ------------------------------------------------------------------


def rewrite_archive(data: bytes, pkl: bytes | None = None, replace: dict | None = None, extra=(),
                    compress: dict | None = None) -> bytes:
    """A torch.save archive with data.pkl (and members in `replace`) swapped, `extra` (name, bytes) appended,
    members named in `compress` stored with that zip method (the others keep theirs); members aligned to 64 bytes as torch writes them."""
    source = zipfile.ZipFile(io.BytesIO(data))
    prefix = source.infolist()[0].filename.split("/", 1)[0]
    entries = []
    for info in source.infolist():
        name = info.filename.split("/", 1)[-1]
        content = source.open(info).read()
        entries.append((info.filename, pkl if name == "data.pkl" and pkl is not None else (replace or {}).get(name, content),
                        info.compress_type))
    entries += [(f"{prefix}/{name}", content, zipfile.ZIP_STORED) for name, content in extra]
    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        warnings.simplefilter("ignore", UserWarning)  # "Duplicate name": what a tampered archive holds
        for name, content, method in entries:
            info = zipfile.ZipInfo(name)
            info.compress_type = (compress or {}).get(name.split("/", 1)[-1], method)
            pad = -(out.tell() + 30 + len(name.encode())) % 64
            pad += 64 if 0 < pad < 4 else 0
            info.extra = struct.pack("<HH", 0x4246, pad - 4) + b"Z" * (pad - 4) if pad else b""
            archive.writestr(info, content)
    return out.getvalue()


def archive_pickle(data: bytes) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(data))
    (name,) = [n for n in source.namelist() if n.endswith("/data.pkl")]
    return source.read(name)


def member_size(data: bytes, key: str) -> int:
    source = zipfile.ZipFile(io.BytesIO(data))
    (info,) = [i for i in source.infolist() if i.filename.split("/", 1)[-1] == f"data/{key}"]
    return info.file_size


# ---- payloads on torch.save archives: (archive bytes, marker) -> archive bytes ------------------

def code(module, name, args, stack=False):
    def payload(data: bytes, marker: Path, _target) -> bytes:
        call = Global(module, name, stack)(*args(marker))
        return rewrite_archive(data, to_pickle(with_payload(to_tree(archive_pickle(data)), call)))
    return payload


def on_tensor(edit):
    """Edit the first tensor rebuild of `target` (a key of the state, or None for the whole tree)."""
    def payload(data: bytes, marker: Path, target) -> bytes:
        tree = to_tree(archive_pickle(data))
        where = find_key(tree, target) if target else tree
        rebuild = calls(where, "_rebuild_tensor_v2")[0]
        replace = edit(rebuild, data) or {}
        return rewrite_archive(data, to_pickle(tree), replace=replace)
    return payload


def find_key(tree, key):
    for node in walk(tree):
        mapping = node.items if isinstance(node, Call) else node if isinstance(node, dict) else {}
        if key in mapping:
            return mapping[key]
    raise KeyError(key)


def numel_minus_one(rebuild, data):
    """The reproduced defect: numel=-1 over a 4-byte member read the members after it."""
    storage = rebuild.args[0]
    storage.pid[4] = -1
    return {f"data/{storage.pid[2]}": b"\0" * 4}


def numel_past_member(rebuild, data):
    storage = rebuild.args[0]
    storage.pid[4] = member_size(data, storage.pid[2]) // 4 + 1


def numel_2_40(rebuild, data):
    rebuild.args[0].pid[4] = 2 ** 40


def offset_past_storage(rebuild, data):
    rebuild.args[1] = rebuild.args[0].pid[4]


def stride_past_storage(rebuild, data):
    rebuild.args[3] = (rebuild.args[0].pid[4],) + tuple(rebuild.args[3][1:])


def negative_stride(rebuild, data):
    """A reversed view over exactly its storage: inside it, but torch never saves one."""
    numel = rebuild.args[0].pid[4]
    rebuild.args[1:4] = [numel - 1, (numel,), (-1,)]


def negative_offset(rebuild, data):
    rebuild.args[1] = -1


def expanded_size(rebuild, data):
    """Stride 0 keeps a 10**12-element view inside a 1-element storage: bounded by the file's size."""
    rebuild.args[2:4] = [(10 ** 12,), (0,)]


def size_object(rebuild, data):
    rebuild.args[2] = Global("torch", "Size")((10 ** 12,))


def dtensor_shape(data: bytes, marker: Path, target) -> bytes:
    """A DTensor's global shape may exceed its rank file (it spans every rank), but not without bound."""
    tree = to_tree(archive_pickle(data))
    rebuild = calls(find_key(tree, target), "_rebuild_from_type_v2")[0]
    args = rebuild.args[2]
    rebuild.args[2] = (*args[:2], Global("torch", "Size")((10 ** 12,)), *args[3:])
    return rewrite_archive(data, to_pickle(tree))


def tensor_constructor(data: bytes, marker: Path, _target) -> bytes:
    alloc = Global("torch", "Tensor")(10 ** 11)  # 400 GB if a reader ever called torch.Tensor
    return rewrite_archive(data, to_pickle(with_payload(to_tree(archive_pickle(data)), alloc)))


def duplicate_data_pkl(data: bytes, marker: Path, _target) -> bytes:
    return rewrite_archive(data, extra=[("data.pkl", archive_pickle(data))])


def duplicate_storage(data: bytes, marker: Path, target) -> bytes:
    tree = to_tree(archive_pickle(data))
    key = calls(find_key(tree, target) if target else tree, "_rebuild_tensor_v2")[0].args[0].pid[2]
    return rewrite_archive(data, extra=[(f"data/{key}", b"\0" * member_size(data, key))])


def dunder_state(data: bytes, marker: Path, _target) -> bytes:
    """A record's pickled state with a dunder field; a Namespace is added where the file has no record."""
    tree = to_tree(archive_pickle(data))
    records = [n for n in walk(tree) if isinstance(n, NewObj) and isinstance(n.state, dict)]
    if records:
        records[0].state["__class__"] = "Replicate"
    else:
        tree = {"model": tree[0] if isinstance(tree, list) else tree,
                "args": NewObj(Global("argparse", "Namespace"), state={"__class__": "Namespace", "tp": 1})}
    return rewrite_archive(data, to_pickle(tree))


def compressed(method: int, member: str = "data.pkl"):
    """`member` stored compressed; torch.save never compresses. The reproduced bomb was a bzip2 data.pkl of
    2**30 zero bytes (796 bytes in the file); here the real data.pkl is compressed, which the old reader
    inflated and merged (rc 0): the refusal must come from the method alone, before anything is inflated."""
    def payload(data: bytes, marker: Path, _target) -> bytes:
        return rewrite_archive(data, compress={member: method})
    return payload


def marker_args(marker: Path):
    return (f"touch {marker}",)


CODE = {
    "os.system": (code("os", "system", marker_args), "os.system is not allowed"),
    "posix.system-stack-global": (code("posix", "system", marker_args, stack=True), "posix.system is not allowed"),
    "builtins.exec": (code("builtins", "exec", lambda m: (f"open({str(m)!r}, 'w').close()",)),
                      "builtins.exec is not allowed"),
    "subprocess.Popen": (code("subprocess", "Popen", lambda m: (["touch", str(m)],)), "subprocess.Popen is not allowed"),
}
STORAGE = {
    "numel=-1": (on_tensor(numel_minus_one), "declares -1 elements"),
    "numel-past-member": (on_tensor(numel_past_member), "bytes, fewer than"),
    "numel=2**40": (on_tensor(numel_2_40), "bytes, fewer than 1099511627776"),
    "offset-past-storage": (on_tensor(offset_past_storage), "of a storage of"),
    "stride-past-storage": (on_tensor(stride_past_storage), "of a storage of"),
    "negative-stride": (on_tensor(negative_stride), "are negative"),
    "negative-offset": (on_tensor(negative_offset), "are negative"),
    "size-10**12-stride-0": (on_tensor(expanded_size), "more elements than the file"),
    "torch.Size-10**12": (on_tensor(size_object), "more elements than the file"),
    "DTensor-shape-10**12": (dtensor_shape, "declares more elements than the file"),
    "torch.Tensor(10**11)": (tensor_constructor, "refused to unpickle"),
    "duplicate-data.pkl": (duplicate_data_pkl, "holds data.pkl twice"),
    "duplicate-storage-member": (duplicate_storage, "twice"),
    "dunder-setstate": (dunder_state, "'__class__'"),
}
ARCHIVE = {
    "bzip2-data.pkl": (compressed(zipfile.ZIP_BZIP2), "data.pkl is compressed (bzip2"),
    "deflate-data.pkl": (compressed(zipfile.ZIP_DEFLATED), "data.pkl is compressed (deflate"),
    "lzma-byteorder": (compressed(zipfile.ZIP_LZMA, "byteorder"), "byteorder is compressed (lzma"),
}


# ---- the readers: where each payload goes -------------------------------------------------------


@pytest.fixture(scope="session")
def legacy_ckpt(tmp_path_factory):
    return write_megatron_checkpoint(tmp_path_factory.mktemp("hostile-legacy"), "llama", tp=1, pp=1, vpp=1)


@pytest.fixture(scope="session")
def dist_ckpt(tmp_path_factory):
    return write_dist_checkpoint(tmp_path_factory.mktemp("hostile-dist"), "llama", layout="verl091")


def dist_dir(ckpt) -> Path:
    return ckpt.role_dir / "model" / "dist_ckpt"


def attack_file(path: Path, payload, marker: Path, target) -> None:
    path.write_bytes(payload(path.read_bytes(), marker, target))


def fsdp_rank_file(ckpt, payload, marker):
    path = ckpt.role_dir / "model_world_size_2_rank_0.pt"
    attack_file(path, payload, marker, "model.norm.weight")
    return path


def legacy_model_file(ckpt, payload, marker):
    path = ckpt.role_dir / "model" / "mp_rank_00" / "model.pt"
    attack_file(path, payload, marker, None)
    return path


def common_pt(ckpt, payload, marker):
    """common.pt holds no tensor: one is saved beside its `args` first (as Megatron's rng state may be)."""
    import torch

    path = dist_dir(ckpt) / "common.pt"
    common = torch.load(path, weights_only=False)  # our own fixture file: trusted
    torch.save({**common, "rng_state": torch.arange(6, dtype=torch.float32)}, path)
    attack_file(path, payload, marker, "rng_state")
    return path


def distcp_chunk(ckpt, payload, marker):
    """The embedding's chunk item, rewritten and appended to its .distcp file; .metadata points at it."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = dist_dir(ckpt)
    metadata = FileSystemReader(str(folder)).read_metadata()
    index, info = next((i, v) for i, v in metadata.storage_data.items() if i.fqn == "embedding.word_embeddings.weight")
    path = folder / info.relative_path
    data = path.read_bytes()
    item = payload(data[info.offset:info.offset + info.length], marker, None)
    if len(item) < info.length:  # a shrunken member: keep the item as long as .metadata's chunk needs
        item = rewrite_archive(item, extra=[("padding", bytes(info.length - len(item)))])
    path.write_bytes(data + item)
    metadata.storage_data[index] = dataclasses.replace(info, offset=len(data), length=len(item))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return path


READERS = {"fsdp": ("fsdp2-w2", fsdp_rank_file), "legacy": ("legacy", legacy_model_file),
           "common.pt": ("dist", common_pt), "distcp": ("dist", distcp_chunk)}


# ---- payloads on the DCP .metadata: (metadata tree, marker, tmp_path) -> tree -------------------

def storage_infos(tree) -> list[NewObj]:
    return [n for n in walk(tree) if isinstance(n, NewObj) and getattr(n.func, "name", None) == "_StorageInfo"]


def outside_copy(folder: Path, tmp_path: Path) -> Path:
    outside = tmp_path / "elsewhere" / "__0_0.distcp"
    outside.parent.mkdir(exist_ok=True)
    outside.write_bytes((folder / "__0_0.distcp").read_bytes())
    return outside


def absolute_path(tree, marker, folder, tmp_path):
    outside = outside_copy(folder, tmp_path)
    for info in storage_infos(tree):
        info.state["relative_path"] = str(outside)


def parent_path(tree, marker, folder, tmp_path):
    (folder.parent / "__0_0.distcp").write_bytes((folder / "__0_0.distcp").read_bytes())
    for info in storage_infos(tree):
        info.state["relative_path"] = "../__0_0.distcp"


def tensor_metadata(tree, fqn):
    for node in walk(tree):
        if isinstance(node, dict) and fqn in node and isinstance(node[fqn], NewObj):
            return node[fqn].state
    raise KeyError(fqn)


def huge_size(tree, marker, folder, tmp_path):
    tensor_metadata(tree, "embedding.word_embeddings.weight")["size"] = Global("torch", "Size")([10 ** 12, 64])


def huge_length(tree, marker, folder, tmp_path):
    storage_infos(tree)[0].state["length"] = 2 ** 40


def chunk_outside(tree, marker, folder, tmp_path):
    chunk = tensor_metadata(tree, "embedding.word_embeddings.weight")["chunks"][0]
    chunk.state["offsets"] = Global("torch", "Size")([10, 0])


def metadata_dunder(tree, marker, folder, tmp_path):
    (metadata,) = [n for n in walk(tree) if isinstance(n, NewObj) and n.func.name == "Metadata"]
    metadata.state["__class__"] = "Metadata"


def metadata_code(module, name, args, stack=False):
    def edit(tree, marker, folder, tmp_path):
        tensor_metadata(tree, "embedding.word_embeddings.weight")["evil"] = Global(module, name, stack)(*args(marker))
    return edit


METADATA = {
    "os.system": (metadata_code("os", "system", marker_args), "os.system is not allowed"),
    "posix.system-stack-global": (metadata_code("posix", "system", marker_args, True), "posix.system is not allowed"),
    "builtins.exec": (metadata_code("builtins", "exec", lambda m: (f"open({str(m)!r}, 'w').close()",)),
                      "builtins.exec is not allowed"),
    "subprocess.Popen": (metadata_code("subprocess", "Popen", lambda m: (["touch", str(m)],)),
                         "subprocess.Popen is not allowed"),
    "absolute-path": (absolute_path, "not a file of the checkpoint folder"),
    "parent-path": (parent_path, "not a file of the checkpoint folder"),
    "size-10**12": (huge_size, "declares 64000000000000 elements"),
    "length-2**40": (huge_length, "1099511627776"),
    "chunk-outside-tensor": (chunk_outside, "lies outside its tensor"),
    "dunder-setstate": (metadata_dunder, "'__class__'"),
}


# ---- the table ----------------------------------------------------------------------------------

def assert_refused(result, target: Path, marker: Path, file: Path, reason: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    # a refusal met mid-merge (a .distcp chunk is read with its layer group) follows the progress line
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error:"), result.stderr
    message = errors[0]
    assert file.name in message and reason in message, message
    assert not marker.exists(), "the payload ran"
    assert not target.exists()
    assert not list(target.parent.glob(f".{target.name}.ckptflow-*")), "a staging folder was left behind"


PAYLOADS = {**CODE, **STORAGE, **ARCHIVE}
CASES = [pytest.param(reader, payload, id=f"{reader}:{payload}")
         for reader in READERS for payload in PAYLOADS
         if not (reader == "distcp" and payload == "dunder-setstate")  # a chunk item holds a bare tensor
         and not (reader != "fsdp" and payload == "DTensor-shape-10**12")]


@pytest.mark.parametrize("reader, payload", CASES)
def test_hostile_torch_files_are_refused(reader, payload, demo, legacy_ckpt, dist_ckpt, cli, tmp_path):
    fixture, attack = READERS[reader]
    original = {"legacy": legacy_ckpt, "dist": dist_ckpt}.get(fixture) or demo(fixture)
    ckpt = copy_run(original, tmp_path / "ckpt")
    marker, target = tmp_path / "pwned", tmp_path / "out" / "model"
    make, reason = PAYLOADS[payload]
    file = attack(ckpt, make, marker)
    result = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", target)
    assert_refused(result, target, marker, file, reason)


@pytest.mark.parametrize("payload", list(METADATA))
def test_hostile_dcp_metadata_is_refused(payload, dist_ckpt, cli, tmp_path):
    ckpt = copy_run(dist_ckpt, tmp_path / "ckpt")
    marker, target = tmp_path / "pwned", tmp_path / "out" / "model"
    edit, reason = METADATA[payload]
    path = dist_dir(ckpt) / ".metadata"
    tree = to_tree(path.read_bytes())
    edit(tree, marker, dist_dir(ckpt), tmp_path)
    path.write_bytes(to_pickle(tree))
    result = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", target)
    assert_refused(result, target, marker, path, reason)


def test_hand_written_pickles_round_trip_a_real_file(dist_ckpt, tmp_path):
    """The corpus's tools are faithful: a real .metadata and a real model file re-pickled unchanged read
    back equal, so each refusal above is the payload's doing."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    folder = dist_ckpt.role_dir / "model" / "dist_ckpt"
    copy = tmp_path / "dist"
    copy.mkdir()
    for file in folder.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    (copy / ".metadata").write_bytes(to_pickle(to_tree((folder / ".metadata").read_bytes())))
    ours, theirs = FileSystemReader(str(copy)).read_metadata(), FileSystemReader(str(folder)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    saved = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4).t()}
    torch.save(saved, tmp_path / "w.pt")
    data = (tmp_path / "w.pt").read_bytes()
    (tmp_path / "again.pt").write_bytes(rewrite_archive(data, to_pickle(to_tree(archive_pickle(data)))))
    assert torch.equal(torch.load(tmp_path / "again.pt", weights_only=True)["w"], saved["w"])


# ---- hostile metadata files: every JSON/YAML a merge or verify reads ------------------------------------------
# Each is refused through the real CLI in one line naming the file, exit 2, nothing written. Kept apart from the
# archive cases above.

DEEP = '{"a": ' + "[" * 200_000 + "]" * 200_000 + "}"  # deeper than the JSON parser's stack


def refused_in_one_line(result, target: Path, *fragments: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error:"), result.stderr
    assert all(fragment in errors[0] for fragment in fragments), errors[0]
    assert not target.exists()
    assert not list(target.parent.glob(f".{target.name}.ckptflow-*")), "a staging folder was left behind"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.write_text(text)
    return path


FSDP_METADATA = {  # file under the role folder, content, fragment of the one-line error
    "config-deeply-nested": ("huggingface/config.json", DEEP, "nested too deeply"),
    "config-huge-integer": ("huggingface/config.json", '{"hidden_size": ' + "9" * 5000 + "}", "not valid JSON"),
    "fsdp_config-deeply-nested": ("fsdp_config.json", DEEP, "nested too deeply"),
    "fsdp_config-world_size-list": ("fsdp_config.json", '{"FSDP_version": 2, "world_size": [2]}', "world_size"),
    "fsdp_config-world_size-string": ("fsdp_config.json", '{"FSDP_version": 2, "world_size": "2"}', "world_size"),
}


@pytest.mark.parametrize("case", FSDP_METADATA)
def test_hostile_fsdp_metadata_is_refused(case, demo, cli, tmp_path):
    name, content, fragment = FSDP_METADATA[case]
    ckpt = copy_run(demo("fsdp2-w2"), tmp_path / "ckpt")
    path = _write(ckpt.role_dir / name, content)
    target = tmp_path / "out" / "model"
    result = cli("merge", "--backend", "fsdp", "--local_dir", ckpt.role_dir, "--target_dir", target)
    refused_in_one_line(result, target, path.name, fragment)


LORA_METADATA = {  # lora_train_meta.json / adapter_config.json beside the rank files of a full LoRA save
    "meta-r-text": ("lora_train_meta.json", '{"r": "eight", "lora_alpha": 16}', "not a positive whole number"),
    "meta-r-list": ("lora_train_meta.json", '{"r": [8], "lora_alpha": 16}', "not a positive whole number"),
    "meta-alpha-text": ("lora_train_meta.json", '{"r": 8, "lora_alpha": "16"}', "not a positive number"),
    "meta-targets-number": ("lora_train_meta.json", '{"lora_alpha": 16, "target_modules": 5}',
                            "not a list of module names"),
    "meta-deeply-nested": ("lora_train_meta.json", DEEP, "nested too deeply"),
    "adapter-config-r-float": ("adapter_config.json", '{"r": 8.5, "lora_alpha": 16}', "not a positive whole number"),
}


@pytest.mark.parametrize("case", LORA_METADATA)
def test_hostile_lora_metadata_is_refused(case, demo, cli, tmp_path):
    name, content, fragment = LORA_METADATA[case]
    ckpt = copy_run(demo("lora-full"), tmp_path / "ckpt")
    for stale in ("lora_train_meta.json", "adapter_config.json"):  # the file read is the one written here
        (ckpt.role_dir / stale).unlink(missing_ok=True)
    path = _write(ckpt.role_dir / name, content)
    target = tmp_path / "out" / "model"
    result = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", target)
    refused_in_one_line(result, target, path.name, fragment)


CUSTOM_MAPPINGS = {  # a --custom-mapping file for a Megatron checkpoint
    "yaml-a-list": ("map.yaml", "- decoder.x\n- model.x\n", "must map Megatron patterns"),
    "yaml-number-key": ("map.yaml", "1: [model.x, plain]\n", "not a Megatron name pattern"),
    "yaml-kind-a-list": ("map.yaml", "decoder.x: [model.x, [column]]\n", "with kind one of"),
    "yaml-hf-a-number": ("map.yaml", "decoder.x: {hf: 5, kind: column}\n", "with kind one of"),
    "yaml-not-yaml": ("map.yaml", "a: [b\n", "cannot be parsed"),
    "json-deeply-nested": ("map.json", DEEP, "cannot be parsed"),
}


@pytest.mark.parametrize("case", CUSTOM_MAPPINGS)
def test_hostile_custom_mappings_are_refused(case, legacy_ckpt, cli, tmp_path):
    name, content, fragment = CUSTOM_MAPPINGS[case]
    mapping = _write(tmp_path / name, content)
    target = tmp_path / "out" / "model"
    result = cli("merge", "--local_dir", legacy_ckpt.role_dir, "--target_dir", target, "--custom-mapping", mapping)
    refused_in_one_line(result, target, mapping.name, fragment)


MANIFESTS = {  # the manifest of a merged folder, replaced
    "files-a-list": '{"files": [], "source": {"location": "/x"}}',
    "files-entry-a-string": '{"files": {"config.json": "abc"}, "source": {"location": "/x"}}',
    "source-options-text": '{"files": {}, "source": {"location": "/x", "options": "fsdp"}}',
    "aliases-a-list": '{"files": {}, "source": {"location": "/x"}, "aliases": []}',
    "deeply-nested": DEEP,
}


@pytest.mark.parametrize("case", MANIFESTS)
def test_hostile_manifests_are_refused_by_verify(case, demo, cli, tmp_path):
    out = tmp_path / "out"
    assert cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", out).exit_code == 0
    _write(out / "ckptflow_manifest.json", MANIFESTS[case])
    result = cli("verify", out)
    message = result.stderr.strip()
    assert result.exit_code == 2, result.output
    assert message.startswith("error:") and "\n" not in message and "ckptflow_manifest.json" in message, message


INDEXES = {  # model.safetensors.index.json of a reference folder (`ckptflow test --test_hf_dir`)
    "weight_map-a-list": '{"weight_map": ["model.safetensors"]}',
    "weight_map-file-a-number": '{"weight_map": {"model.norm.weight": 5}}',
    "not-an-object": "[1, 2]",
    "deeply-nested": DEEP,
}


@pytest.mark.parametrize("case", INDEXES)
def test_hostile_indexes_are_refused(case, demo, cli, tmp_path):
    import shutil

    ckpt = demo("fsdp2-w2")
    reference = tmp_path / "reference"
    shutil.copytree(ckpt.reference_dir, reference)
    _write(reference / "model.safetensors.index.json", INDEXES[case])
    result = cli("test", "--local_dir", ckpt.role_dir, "--test_hf_dir", reference)
    assert result.exit_code == 2, result.output
    assert "model.safetensors.index.json" in result.stderr.split("error:", 1)[-1]
    assert len(result.stderr.split("error:", 1)[-1].strip().splitlines()) == 1


# ---- damaged bytes: every member a merge reads is checked against the CRC-32 torch.save recorded ------

def damaged_legacy(ckpt) -> tuple[Path, str]:
    path = ckpt.role_dir / "model" / "mp_rank_00" / "model.pt"
    return path, damage_tensor_member(path)


def damaged_distcp(ckpt) -> tuple[Path, str]:
    """The embedding's chunk item inside its .distcp file (each item is a torch.save archive)."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = dist_dir(ckpt)
    metadata = FileSystemReader(str(folder)).read_metadata()
    info = next(v for i, v in metadata.storage_data.items() if i.fqn == "embedding.word_embeddings.weight")
    path = folder / info.relative_path
    return path, damage_tensor_member(path, info.offset, info.length)


DAMAGED = {"fsdp": ("fsdp2-w2", damaged_fsdp), "legacy": ("legacy", damaged_legacy), "distcp": ("dist", damaged_distcp)}


def merge_process(role: Path, target: Path, **env) -> subprocess.CompletedProcess:
    """`python -m ckptflow.flows.cli merge` in a process of its own, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "merge", "--local_dir", str(role), "--target_dir",
                           str(target)], capture_output=True, text=True, env={**os.environ, **env}, timeout=300)


@pytest.mark.parametrize("reader", list(DAMAGED))
def test_damaged_tensor_bytes_are_refused_by_their_crc(reader, demo, legacy_ckpt, dist_ckpt, tmp_path):
    fixture, damage = DAMAGED[reader]
    original = {"legacy": legacy_ckpt, "dist": dist_ckpt}.get(fixture) or demo(fixture)
    ckpt = copy_run(original, tmp_path / "ckpt")
    path, member = damage(ckpt)
    target = tmp_path / "out" / "model"
    result = merge_process(ckpt.role_dir, target)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    errors = errors[errors.index(next(e for e in errors if e.startswith("error:"))):]  # after the progress line
    assert len(errors) == 1, result.stderr
    assert str(path) in errors[0] and f"member {member} fails its CRC-32 check" in errors[0], errors[0]
    assert not target.exists()
    assert not list(target.parent.glob(f".{target.name}.ckptflow-*")), "a staging folder was left behind"


def test_crc_switch_off_merges_the_damage_silently(demo, tmp_path):
    """CKPTFLOW_CHECK_CRC=0 (benchmarks only) gives back the old behaviour: the damaged bytes pass the round-trip
    check, which compares the output with the same damaged input. So the refusal above is the CRC check's."""
    ckpt = copy_run(demo("fsdp2-w2"), tmp_path / "ckpt")
    damaged_fsdp(ckpt)
    result = merge_process(ckpt.role_dir, tmp_path / "out", CKPTFLOW_CHECK_CRC="0")
    assert result.returncode == 0, result.stderr
    assert "round-trip ok" in result.stdout
