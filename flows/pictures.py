"""The checkpoint's picture for every promotion: an HTML file beside the target's cached results and a
markdown artifact in the Prefect UI.

Why markdown: Prefect 3's UI renders a markdown artifact with GitHub-style tables and sanitized HTML, which
drops inline `<svg>` and `<style>`, but it allows `data:` URLs as image sources; so the heat map (ranks ×
groups) travels as an SVG image inside the markdown, the group table as a markdown table, and the full page
(every tensor's shards per rank) is the HTML file whose path the artifact names. A link artifact to that file
would not open from the UI (browsers refuse file:// links from http pages).
"""

from __future__ import annotations

from pathlib import Path

from mergecore.describe import shown_view
from mergecore.picture import checkpoint_layout, render_markdown, write_picture
from mergecore.storage import Location
from mergecore.model.card import markdown_text
from ckptflow.tasks.caching import results_folder
from mergecore import MergeRequest
from ckptflow.tasks.sources import opened

ARTIFACT_KEY = "checkpoint-picture"


def picture_file(target: str) -> Path:
    """Where a promotion to `target` writes the picture: in the target's results folder, named after it
    (a results folder set by CKPTFLOW_RESULTS may serve several targets)."""
    return results_folder(target) / f"{Location.of(target).name or 'target'}.picture.html"


def publish_picture(request: MergeRequest, discovered: dict, target: str) -> Path:
    """Draw the checkpoint of `request` as `discovered` (metadata only, from the already opened files), write the
    page, and make the `checkpoint-picture` artifact of this flow run. Returns the page's path.

    >>> publish_picture(MergeRequest.of("ckpts/run1", "models/run1"), discovered, "models/run1")  # doctest: +SKIP
    PosixPath('models/.run1.ckptflow-results/run1.picture.html')
    """
    from prefect.artifacts import create_markdown_artifact

    layout = checkpoint_layout(shown_view(opened(request, discovered)), request.what.lora.overrides() or None)
    page = picture_file(target)
    page.parent.mkdir(parents=True, exist_ok=True)
    written = write_picture(layout, str(page))
    create_markdown_artifact(render_markdown(layout, str(written)), key=ARTIFACT_KEY,
                             description=f"ranks × groups of {markdown_text(layout['checkpoint'].get('location', request.what.checkpoint))}")
    return written
