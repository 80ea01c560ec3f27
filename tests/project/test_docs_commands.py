"""Every `ckptflow` command and flag that README.md and docs/ show exists (read from the CLI's own definition,
as `--help` prints it), and the README's Python example runs as written."""

from __future__ import annotations

from helpers import REPO
import re
from pathlib import Path

import pytest
import typer

from ckptflow.flows.cli import app

ROOT = REPO
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shown_commands(text: str) -> list[str]:
    """`ckptflow ...` lines of code blocks, and inline code spans that start with `ckptflow `."""
    found = []
    for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", text, re.S):
        joined = block.replace("\\\n", " ")
        found += [line.split("#")[0] for line in joined.splitlines()
                  if re.match(r"\s*(?:[A-Z_]+=\S+\s+)*ckptflow\s", line)]
    found += re.findall(r"`(ckptflow [^`]+)`", text)
    return [re.sub(r"^\s*(?:[A-Z_]+=\S+\s+)*", "", line).strip() for line in found]


def options_of() -> dict[str, set[str]]:
    group = typer.main.get_command(app)
    return {name: {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}
            for name, command in group.commands.items()}


def test_the_pages_show_commands():
    assert len([c for page in PAGES for c in shown_commands(page.read_text())]) >= 20


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_and_flag_shown_exists(page):
    options = options_of()
    for command in shown_commands(page.read_text()):
        words = command.split()
        if len(words) < 2 or words[1].startswith(("-", "<", "[")) or not words[1].isidentifier() and "-" not in words[1]:
            continue
        assert words[1] in options, f"{page.name}: `{command}` names no command"
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", command):
            assert flag in options[words[1]], f"{page.name}: `{command}`: {flag} is not an option of {words[1]}"


def test_the_readme_python_example_runs(demo, tmp_path, hub):
    """Its four calls as written, against a real checkpoint and the loopback Hub (the push lands there)."""
    from huggingface_hub import HfApi

    from mergecore import verify_manifest

    example = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    ckpt = demo("fsdp2-w2")
    code = (example.replace("ckpts/run1/global_step_100/actor", str(ckpt.role_dir))
            .replace("out/model", str(tmp_path / "m")).replace("org/run1", "alice/run1"))
    exec(compile(code, "README.md", "exec"), {})
    assert verify_manifest(tmp_path / "m")["ok"]
    pushed = HfApi().list_repo_files("alice/run1", revision="step-100")
    assert "ckptflow_manifest.json" in pushed and "config.json" in pushed
