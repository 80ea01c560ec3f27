"""`ckptflow inspect --html`: the picture of a checkpoint, loaded in a real headless Chromium; and the same
picture as the Prefect artifact of a promotion."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from safetensors import safe_open

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH (./dev test installs it with apt-get)")


def browser_dom(page: Path) -> str:
    """The DOM Chromium built from the page (headless, no GPU, no network needed)."""
    done = subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class _Rows(HTMLParser):
    """Each tensor row of the page: (class attribute, tensor name, the row's text)."""

    def __init__(self):
        super().__init__()
        self.rows: list[list[str]] = []
        self._in_row = self._in_name = False

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "tr":
            self._in_row = "tensor" in classes
            if self._in_row:
                self.rows.append([" ".join(classes), "", ""])
        self._in_name = self._in_row and tag == "span" and "name" in classes

    def handle_endtag(self, tag):
        if tag in ("span", "tr"):
            self._in_name = False
        if tag in ("tr", "table"):
            self._in_row = False

    def handle_data(self, data):
        if self._in_row:
            self.rows[-1][2] += data
            if self._in_name:
                self.rows[-1][1] += data


def tensor_rows(dom: str) -> list[tuple[str, str, str]]:
    parser = _Rows()
    parser.feed(dom)
    return [tuple(row) for row in parser.rows]


def inspect_html(checkpoint: Path, page: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptflow.flows.cli", "inspect", str(checkpoint), "--html", str(page), *extra],
                          capture_output=True, text=True, timeout=600)


def saved_names(reference: Path) -> list[str]:
    """Tensor names of save_pretrained's own files (the independent truth)."""
    names = []
    for file in sorted(reference.glob("*.safetensors")):
        with safe_open(str(file), "np") as f:
            names += list(f.keys())
    return names


def chunk_rows(total: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's row ranges, as FSDP2 shards dim 0 (FACTS: 1001 over 4 -> 251, 251, 251, 248)."""
    import torch

    bounds, start = [], 0
    for chunk in torch.chunk(torch.arange(total), parts):
        bounds.append((start, start + len(chunk)))
        start += len(chunk)
    return bounds + [(total, total)] * (parts - len(bounds))


def assert_self_contained(text: str) -> None:
    """No script and nothing a browser would fetch: every link is to an anchor of the page itself."""
    assert "<script" not in text.lower()
    assert not re.search(r"\bsrc\s*=", text) and "url(" not in text and "@import" not in text
    assert all(h.startswith("#") for h in re.findall(r'href="([^"]*)"', text))


@needs_chromium
def test_page_shows_ranks_groups_and_each_ranks_rows(demo, tmp_path):
    ckpt = demo("fsdp2-w4-llama-tied")
    page = tmp_path / "picture.html"
    done = inspect_html(ckpt.role_dir, page)
    assert done.returncode == 0, done.stderr
    assert f"picture: {page}" in done.stdout
    assert_self_contained(page.read_text())
    dom = browser_dom(page)
    ranks = len(list(ckpt.role_dir.glob("model_world_size_*_rank_*.pt")))
    assert ranks == 4 and "<dt>ranks (files)</dt><dd>4</dd>" in dom
    for group in ("embed", "layers.0", "layers.1", "head"):
        assert f'id="g-{group}"' in dom
    embed = next(text for _, name, text in tensor_rows(dom) if name == "model.embed_tokens.weight")
    for rank, (low, high) in enumerate(chunk_rows(1001, 4)):
        assert f"rank {rank}: rows {low}:{high}" in embed  # 0:251, 251:502, 502:753, 753:1001


@needs_chromium
def test_lora_adapters_are_marked(demo, tmp_path):
    ckpt = demo("lora-full")
    page = tmp_path / "lora.html"
    assert inspect_html(ckpt.role_dir, page, "--lora-alpha", "16").returncode == 0
    dom = browser_dom(page)
    assert 'id="lora"' in dom and "LoRA checkpoint (full save)" in dom
    rows = tensor_rows(dom)
    adapters = [classes for classes, name, _ in rows if re.search(r"\.lora_[AB]\.", name)]
    assert adapters and all("kind-row-lora" in c for c in adapters)
    bases = [classes for classes, name, _ in rows if ".base_layer." in name]
    assert bases and not any("kind-row-lora" in c for c in bases)  # the base weights are not adapters


@needs_chromium
def test_moe_experts_are_marked(demo, tmp_path):
    ckpt = demo("qwen3_moe")
    page = tmp_path / "moe.html"
    assert inspect_html(ckpt.role_dir, page).returncode == 0
    rows = tensor_rows(browser_dom(page))
    experts = [(c, text) for c, name, text in rows if ".mlp.experts." in name]
    assert len(experts) == len([n for n in saved_names(ckpt.reference_dir) if ".mlp.experts." in n])
    assert all("kind-row-expert" in c for c, _ in experts)
    assert all(text.count(": whole") == 1 for _, text in experts)  # each expert lives on one rank


@needs_chromium
def test_vision_tower_groups_are_marked(demo, tmp_path):
    ckpt = demo("qwen2_5_vl")
    page = tmp_path / "vl.html"
    assert inspect_html(ckpt.role_dir, page).returncode == 0
    dom = browser_dom(page)
    saved = saved_names(ckpt.reference_dir)
    blocks = {found[1] for n in saved if (found := re.match(r"(?:model\.)?visual\.blocks\.(\d+)\.", n))}
    assert blocks and all(f'id="g-visual.blocks.{b}"' in dom for b in blocks)
    rows = tensor_rows(dom)
    vision = [c for c, name, _ in rows if re.match(r"(model\.)?visual\.", name)]
    assert len(vision) == len([n for n in saved if re.match(r"(model\.)?visual\.", n)])
    assert all("kind-row-vision" in c for c in vision)
    assert not any("kind-row-vision" in c for c, name, _ in rows if not re.match(r"(model\.)?visual\.", name))


def test_bad_html_path_is_one_line_and_writes_nothing(demo, tmp_path):
    ckpt = demo("fsdp2-w2")
    page = tmp_path / "missing-folder" / "p.html"
    done = inspect_html(ckpt.role_dir, page)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and str(page) in done.stderr and "Traceback" not in done.stderr
    assert not page.parent.exists()


@needs_chromium
def test_a_1024_rank_page_stays_small_and_aggregates(tmp_path):
    from ckptflow.testing.large_world import LargeWorldSpec, write_large_world

    spec = LargeWorldSpec(world_size=1024, vocab_size=2048, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    world = write_large_world(tmp_path / "w1024", spec)
    page = tmp_path / "w1024.html"
    done = inspect_html(world.role_dir, page)
    assert done.returncode == 0, done.stderr
    assert page.stat().st_size < 2 * 1024 * 1024
    dom = browser_dom(page)
    assert "<dd>1024</dd>" in dom and "1024 ranks, 8 per column" in dom
    assert "ranks 0–1023: rows 0:2048, 2 rows each" in dom  # 2048 vocab rows, torch.chunk: 2 per rank
    heat = re.search(r'<svg class="heat".*?</svg>', dom, re.S)[0]
    assert heat.count("<rect") == 128 * dom.count('class="group"')  # buckets, not one box per rank


def test_promotion_makes_a_picture_artifact(prefect_server, demo_copy, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from ckptflow.flows.pictures import ARTIFACT_KEY, picture_file
    from ckptflow.flows.promote import promote_checkpoint
    from ckptflow.flows.requests import PromotionRequest
    from mergecore.model.card import markdown_text

    ckpt = demo_copy("fsdp2-w2")
    target = tmp_path / "model"
    promote_checkpoint(PromotionRequest.of(str(ckpt.run_root), str(target)))
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY])))
    artifact = max(found, key=lambda a: a.created)
    assert artifact.type == "markdown"
    svg = base64.b64decode(re.search(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", artifact.data)[1]).decode()
    assert svg.startswith('<svg xmlns="http://www.w3.org/2000/svg"') and "rank 1 · layers.0" in svg
    assert "| layers.0 |" in artifact.data
    page = picture_file(str(target))
    assert markdown_text(str(page)) in artifact.data and "rank 1: rows" in page.read_text()  # shown literally
    assert not (target / page.name).exists()  # beside the published model, never inside it


def test_picture_of_an_s3_checkpoint_downloads_no_tensor_bytes(s3_env, demo):
    """Drawing asks every tensor for its pieces' places: a remote source must not fetch their bytes."""
    import collections

    pytest.importorskip("s3fs")
    from ckptflow.testing.s3_reads import counting
    from mergecore.formats import open_checkpoint
    from mergecore.describe import shown_view
    from mergecore.picture import checkpoint_layout

    ckpt = demo("fsdp2-w2")
    s3_env.mkdir("pic-ckpts")
    s3_env.put(str(ckpt.role_dir), "pic-ckpts/run/global_step_1/actor", recursive=True)
    with counting() as (fetched, _):
        source = shown_view(open_checkpoint("s3://pic-ckpts/run/global_step_1/actor"))
        source.describe()  # opening: each rank file's directory and pickle
        opened = collections.Counter(fetched)
        layout = checkpoint_layout(source)
    assert [len(g["held"]) for g in layout["groups"]] == [2] * 4 and sum(opened.values()) > 0
    assert fetched == opened  # not one byte more
