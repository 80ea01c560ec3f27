"""Text we did not write — paths, object keys, config values, tensor names — is printed as it is, in every medium:
the terminal (Rich, markup off), Prefect's markdown artifacts and the model card (`markdown_text`), the HTML page.

Markdown is judged by a real CommonMark renderer (markdown-it, Rich's own dependency) with GFM tables on: the HTML
it makes must hold no tag and no table row the value smuggled in.
"""

from __future__ import annotations

import json
import shutil

import pytest
from markdown_it import MarkdownIt

from mergecore.model.card import markdown_text

HOSTILE = "run<b>x</b>\n![m](http://127.0.0.1:9/pixel.png) | y"


def rendered(markdown: str) -> str:
    return MarkdownIt("commonmark").enable("table").render(markdown)


def copied_run(demo, where):
    """A demo run copied under the folder `where` (any name a file system allows); its role folder."""
    original = demo("fsdp2-w2")
    shutil.copytree(original.run_root, where, ignore=shutil.ignore_patterns("reference"))
    return where / original.role_dir.relative_to(original.run_root)


def injected(html: str) -> list[str]:
    return [bad for bad in ("<b>", "<img", "<script") if bad in html]


def test_markdown_text_is_literal_for_a_renderer():
    html = rendered(f"| a | b |\n|---|---|\n| source | {markdown_text(HOSTILE)} |\n")
    assert not injected(html) and html.count("<tr>") == 2  # the header and our one row: nothing added
    assert "run&lt;b&gt;x&lt;/b&gt; ![m](http://127.0.0.1:9/pixel.png) | y" in html


@pytest.mark.parametrize("name", ["brk[/x]", "a[red]b", "[bold]x[/bold]"])
def test_merge_from_a_path_with_brackets_publishes_and_pushes(demo, cli, hub, tmp_path, name):
    # was: the model published, then Rich's MarkupError as a traceback (exit 1) before the push; `[red]` vanished
    role = copied_run(demo, tmp_path / name / "run1")
    result = cli("merge", "--local_dir", role, "--target_dir", tmp_path / "out", "--hf_upload_path", "alice/m")
    assert result.exit_code == 0, result.output
    assert str(role) in result.stdout and "Traceback" not in result.output
    assert "pushed to" in result.stdout and "ckptflow_manifest.json" in hub.files("alice/m")


def test_inspect_shows_brackets_in_paths_and_config_values(demo, cli, tmp_path):
    role = copied_run(demo, tmp_path / "brk[" / "x]")
    result = cli("inspect", role)
    assert result.exit_code == 0, result.output
    assert str(role) in result.stdout

    config = role / "huggingface" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "qwen[/x]"}))
    result = cli("inspect", role)
    assert "Traceback" not in result.output and "MarkupError" not in result.output, result.output
    assert "qwen[/x]" in result.output


def test_artifacts_and_card_of_a_hostile_folder_name_inject_nothing(prefect_server, demo, cli, tmp_path):
    # was: the merge report took the location unescaped: raw HTML and whole markdown lines from a folder's name
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    role = copied_run(demo, tmp_path / HOSTILE / "run1")
    target = tmp_path / "model"
    result = cli("promote", role, "--target", target)
    assert result.exit_code == 0, result.output
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["merge-report", "checkpoint-picture"])))
    newest = {}
    for artifact in sorted(found, key=lambda a: a.created):
        newest[artifact.key] = artifact
    assert set(newest) == {"merge-report", "checkpoint-picture"}
    for artifact in newest.values():
        assert not injected(rendered(artifact.data)) and "run&lt;b&gt;x" in rendered(artifact.data), artifact.key
        assert not injected(rendered(artifact.description or "")), artifact.key
    report = rendered(newest["merge-report"].data)
    assert report.count("<table>") == 2 and report.split("<table>")[1].count("<tr>") == 10  # header + 9 facts
    card = rendered((target / "README.md").read_text())
    assert not injected(card)


def test_the_card_never_lets_yaml_or_markdown_through(demo, cli, tmp_path):
    role = copied_run(demo, tmp_path / "run1")
    config = role / "huggingface" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "_name_or_path": "org/base\nlicense: evil"}))
    (role.parent / "actor").rename(role.parent / "actor\nlicense: evil")
    role = role.parent / "actor\nlicense: evil"
    assert cli("merge", "--local_dir", role, "--target_dir", tmp_path / "out").exit_code == 0
    card = (tmp_path / "out" / "README.md").read_text()
    front = card.split("---")[1]
    assert "license" not in front and "evil" not in front  # neither the role folder nor config.json wrote YAML
    assert not injected(rendered(card))
