"""`verify` checks a folder is exactly the merge of its source, and contacts only what the user names.

- Files beside the manifest's (`evil.py`, `sub/x.bin`) fail (exit 3), named.
- The files copied from the source's huggingface/ are compared with the source's, config.json with what a merge
  writes from it: an edit with the manifest's hash updated to match still fails.
- A manifest's source is opened only when it is a local path or passed with --source: a URL in a manifest is
  refused in one line (exit 2) and a real listening socket there receives no connection.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest

MANIFEST = "ckptflow_manifest.json"


@pytest.fixture
def merged(cli, demo, tmp_path) -> Path:
    out = tmp_path / "out"
    result = cli("merge", "--backend", "fsdp", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", out)
    assert result.exit_code == 0, result.output
    assert cli("verify", out).exit_code == 0
    return out


def rehash(folder: Path, name: str) -> None:
    """Update the manifest's entry for `name` to the file's current bytes (a tamperer covering their tracks)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    data = (folder / name).read_bytes()
    manifest["files"][name].update(sha256=hashlib.sha256(data).hexdigest(), size=len(data),
                                   mtime_ns=(folder / name).stat().st_mtime_ns)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def one_line(result) -> str:
    message = result.stderr.strip()
    assert message.startswith("error:") and "\n" not in message, result.output
    return message


@pytest.mark.parametrize("extra", ["evil.py", "sub/x.bin"])
@pytest.mark.parametrize("skip_source", [False, True])
def test_files_the_manifest_does_not_list_fail(cli, merged, extra, skip_source):
    (merged / extra).parent.mkdir(exist_ok=True)
    (merged / extra).write_text("import os; os.system('curl evil')")
    result = cli("verify", merged, *(["--skip-source"] if skip_source else []))
    assert result.exit_code == 3, result.output
    assert extra in one_line(result) and "does not list" in result.stderr


def test_an_edited_config_with_its_hash_updated_fails(cli, merged):
    config = json.loads((merged / "config.json").read_text())
    config["max_position_embeddings"] = 7
    (merged / "config.json").write_text(json.dumps(config, indent=2))
    rehash(merged, "config.json")
    assert cli("verify", merged, "--skip-source").exit_code == 0  # the hashes alone cannot tell
    result = cli("verify", merged)
    assert result.exit_code == 3, result.output
    assert "config.json" in one_line(result)


def test_an_edited_copied_file_with_its_hash_updated_fails(cli, merged, demo):
    copied = sorted(p.name for p in (demo("fsdp2-w2").role_dir / "huggingface").iterdir()
                    if p.name != "config.json" and (merged / p.name).exists())
    assert copied, "the demo's huggingface/ folder has files a merge copies"
    name = copied[0]
    (merged / name).write_bytes((merged / name).read_bytes() + b" ")
    rehash(merged, name)
    assert cli("verify", merged, "--skip-source").exit_code == 0
    result = cli("verify", merged)
    assert result.exit_code == 3, result.output
    assert name in one_line(result)


@pytest.fixture
def listener():
    """A real TCP socket listening on loopback; yields (port, connections accepted so far)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)

    def accepted() -> int:
        count = 0
        while True:
            try:
                conn, _ = server.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1

    yield server.getsockname()[1], accepted
    server.close()


@pytest.mark.parametrize("field", ["location", "hf_dir"])
def test_a_url_in_the_manifest_is_never_contacted(cli, merged, listener, field):
    port, accepted = listener
    url = f"http://127.0.0.1:{port}/latest/meta-data"
    manifest = json.loads((merged / MANIFEST).read_text())
    if field == "location":
        manifest["source"]["location"] = url
    else:
        manifest["source"].setdefault("options", {})["hf_dir"] = url
    (merged / MANIFEST).write_text(json.dumps(manifest))
    result = cli("verify", merged)
    assert result.exit_code == 2, result.output
    message = one_line(result)
    assert url in message and ("--source" in message or "--hf_model_path" in message), message
    assert accepted() == 0


def test_a_source_passed_by_the_user_is_used(cli, merged, demo, tmp_path):
    moved = tmp_path / "moved" / "actor"
    shutil.copytree(demo("fsdp2-w2").role_dir, moved)
    manifest = json.loads((merged / MANIFEST).read_text())
    manifest["source"]["location"] = "http://127.0.0.1:9/nowhere"
    (merged / MANIFEST).write_text(json.dumps(manifest))
    result = cli("verify", merged, "--source", moved)
    assert result.exit_code == 0, result.output
    assert "round-trip" in result.stdout and "copied files" in result.stdout


def flip_bit_in(folder: Path, tensor: str) -> str:
    """Flip one bit inside output tensor `tensor` (located by safetensors' own header); returns its file's name."""
    from safetensors import safe_open

    file = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][tensor]
    data = bytearray((folder / file).read_bytes())
    header = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:8 + header])[tensor]["data_offsets"]
    data[8 + header + begin + (end - begin) // 2] ^= 0x10
    (folder / file).write_bytes(bytes(data))
    with safe_open(folder / file, "pt") as weights:  # still a valid file: only a value changed
        assert tensor in weights.keys()
    return file


def test_an_edited_quantized_weight_with_its_hash_updated_changed_after_the_merge(cli, demo, tmp_path):
    """A packed word of a published w4a16 folder edited and its hash updated: `verify` re-quantizes from the rank
    files and says the file changed after the merge, naming it, exit 3 (was: "the merge is wrong ... please report
    this", as if the merge, which proved the folder before publishing it, had written it)."""
    out = tmp_path / "out"
    result = cli("merge", "--local_dir", demo("quant-dense-tied").role_dir, "--target_dir", out, "--quantize", "w4a16")
    assert result.exit_code == 0, result.output
    file = flip_bit_in(out, "model.layers.1.mlp.down_proj.weight_packed")
    rehash(out, file)
    assert cli("verify", out, "--skip-source").exit_code == 0  # the hashes alone cannot tell
    result = cli("verify", out)
    assert result.exit_code == 3, result.output
    message = one_line(result)
    assert f"{out / file}: model.layers.1.mlp.down_proj.weight's weight_packed" in message
    assert "the file changed after the merge" in message and "report" not in message
