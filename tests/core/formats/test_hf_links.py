"""A checkpoint's huggingface/ folder is untrusted: only regular files inside the checkpoint are published.

Links out of the checkpoint (a secret, /etc/shadow), links to devices (/dev/zero) or folders, FIFOs, sockets and
names that are not UTF-8 are refused in one line naming the file, before anything is written, through the real
CLI in a subprocess (a FIFO must not hang it). A link that resolves inside the checkpoint is copied as a file;
copied files get ordinary permissions, never the source's mode.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import assert_refused


def role_copy(demo, tmp_path) -> Path:
    """The demo's role folder copied into tmp_path (links are added to the copy only)."""
    role = tmp_path / "ckpt" / "actor"
    shutil.copytree(demo("fsdp2-w2").role_dir, role)
    return role


def run_merge(role: Path, target: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "merge", "--backend", "fsdp", "--local_dir", str(role),
                           "--target_dir", str(target)], capture_output=True, text=True, timeout=timeout)


def link_to_secret(hf: Path, tmp_path: Path) -> str:
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2\n")
    (hf / "leak.txt").symlink_to(secret)
    return "leak.txt"


def link_to_shadow(hf: Path, tmp_path: Path) -> str:
    (hf / "shadow.txt").symlink_to("/etc/shadow")
    return "shadow.txt"


def link_to_dev_zero(hf: Path, tmp_path: Path) -> str:
    (hf / "zeros.bin.txt").symlink_to("/dev/zero")
    return "zeros.bin.txt"


def fifo(hf: Path, tmp_path: Path) -> str:
    os.mkfifo(hf / "pipe.json")
    return "pipe.json"


def unix_socket(hf: Path, tmp_path: Path) -> str:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(hf / "sock"))
    sock.close()
    return "sock"


def link_to_folder(hf: Path, tmp_path: Path) -> str:
    (hf / "code").symlink_to(hf.parent)  # inside the checkpoint, but a folder
    return "code"


def dangling_link(hf: Path, tmp_path: Path) -> str:
    (hf / "gone.json").symlink_to(hf / "nowhere.json")
    return "gone.json"


def non_utf8_name(hf: Path, tmp_path: Path) -> str:
    with open(os.fsencode(hf) + b"/bad-\xff.txt", "wb") as f:  # a bytes path makes the odd name
        f.write(b"x")
    return "bad-"


def config_linked_out(hf: Path, tmp_path: Path) -> str:
    private = tmp_path / "private-config.json"
    shutil.move(hf / "config.json", private)
    (hf / "config.json").symlink_to(private)
    return "config.json"


HOSTILE = {"link-to-secret": (link_to_secret, "outside the checkpoint"),
           "link-to-etc-shadow": (link_to_shadow, "outside the checkpoint"),
           "link-to-dev-zero": (link_to_dev_zero, "outside the checkpoint"),
           "fifo": (fifo, "a FIFO"),
           "socket": (unix_socket, "a socket"),
           "link-to-folder": (link_to_folder, "a link to the folder"),
           "dangling-link": (dangling_link, "does not exist"),
           "non-utf8-name": (non_utf8_name, "not UTF-8"),
           "config-linked-out": (config_linked_out, "outside the checkpoint")}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_huggingface_entries_are_refused_before_anything_is_written(case, demo, tmp_path):
    role = role_copy(demo, tmp_path)
    make, reason = HOSTILE[case]
    name = make(role / "huggingface", tmp_path)
    target = tmp_path / "out" / "model"
    result = run_merge(role, target, timeout=60)  # a FIFO opened for reading would block forever
    assert_refused(result, target, name, reason)


def test_a_fifo_does_not_hang_the_merge(demo, tmp_path):
    role = role_copy(demo, tmp_path)
    (role / "huggingface" / "tokenizer.json").unlink(missing_ok=True)
    os.mkfifo(role / "huggingface" / "tokenizer.json")
    target = tmp_path / "out" / "model"
    assert_refused(run_merge(role, target, timeout=30), target, "tokenizer.json", "a FIFO")


def test_a_link_inside_the_checkpoint_is_copied_as_a_regular_file(demo, tmp_path):
    role = role_copy(demo, tmp_path)
    shared = role / "shared_template.jinja"
    shared.write_text("{{ messages }}")
    shared.chmod(0o600)
    (role / "huggingface" / "shared_template.jinja").symlink_to("../shared_template.jinja")
    target = tmp_path / "out" / "model"
    result = run_merge(role, target)
    assert result.returncode == 0, result.stderr
    copied = target / "shared_template.jinja"
    assert not copied.is_symlink() and copied.read_text() == "{{ messages }}"
    assert stat.S_IMODE(copied.stat().st_mode) == 0o666 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("mode", [0o600, 0o777, 0o4755])
def test_copied_files_get_ordinary_permissions(demo, tmp_path, mode):
    role = role_copy(demo, tmp_path)
    source = role / "huggingface" / "tokenizer_config.json"
    if not source.exists():
        source.write_text("{}")
    source.chmod(mode)
    target = tmp_path / "out" / "model"
    result = run_merge(role, target)
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE((target / source.name).stat().st_mode) == 0o666 & ~current_umask()


def test_subfolders_are_skipped_not_refused(demo, tmp_path):
    role = role_copy(demo, tmp_path)
    (role / "huggingface" / "extra").mkdir()
    (role / "huggingface" / "extra" / "notes.txt").write_text("x")
    target = tmp_path / "out" / "model"
    result = run_merge(role, target)
    assert result.returncode == 0, result.stderr
    assert not (target / "extra").exists()
