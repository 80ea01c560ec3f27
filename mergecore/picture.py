"""A picture of a checkpoint: which rank holds which rows of which tensor, as one self-contained HTML page.

Two steps, both plain data: `checkpoint_layout(source)` reads metadata only (the group table of
`describe_source`, plus every piece's place: holder, offsets, sizes) and `render_html(layout)` draws it
(inline CSS and SVG; no script, nothing fetched from the network). `render_markdown(layout)` is the
short form for places that show markdown (the pipeline's Prefect artifact): the heat map as an SVG image.

Many ranks stay readable: over `MAX_COLUMNS` holders the heat map shows buckets of ranks (mean bytes per
rank), and over `DETAIL_RANKS` holders a tensor's shards are listed as runs of alike ranks, so a
1024-rank page stays a few hundred KB.

>>> layout = checkpoint_layout(shown_view(open_checkpoint("ckpts/run1")))  # doctest: +SKIP
>>> Path("run1.html").write_text(render_html(layout))  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import html
import math
import re
from pathlib import Path

from .numbers.arrays import element_size
from .errors import CheckpointError
from .formats.fetching import places_only
from .describe import describe_source
from .families.layout import group_of
from .formats.lora import hf_name, is_lora_name
from .model.card import markdown_text

MAX_COLUMNS = 128   # heat-map columns at most: more holders are drawn as buckets of ranks
OPEN_TENSORS = 60   # a checkpoint of up to this many tensors shows them all opened
DETAIL_RANKS = 32   # up to this many holders every one gets its own line per tensor; more: runs of alike ranks

# What a tensor is, for colours and markers; the first that applies wins.
KINDS = {
    "lora": ("LoRA adapter", 28),     # name -> (legend text, hue)
    "vision": ("vision tower", 275),
    "expert": ("MoE expert", 140),
    "router": ("MoE router", 180),
    "dense": ("dense", 215),
}
_ROUTER = re.compile(r"\.(?:mlp\.gate|block_sparse_moe\.gate|router|mlp\.shared_expert_gate)\.")
_RANK_FILE = re.compile(r"rank_(\d+)\.pt$")


def tensor_kind(name: str) -> str:
    """"lora", "vision", "expert", "router" or "dense".

    >>> tensor_kind("model.layers.0.mlp.experts.3.up_proj.weight")
    'expert'
    >>> tensor_kind("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    'lora'
    """
    if is_lora_name(name):
        return "lora"
    if group_of(hf_name(name))[1].startswith("visual"):
        return "vision"
    if ".experts." in name:
        return "expert"
    if _ROUTER.search(name):
        return "router"
    return "dense"


# ---- data ----------------------------------------------------------------------------------------


def checkpoint_layout(source, lora: dict | None = None) -> dict:
    """Facts, groups and, per tensor, each holder's boxes (`[holder, offsets, sizes, primary]`): plain data.

    `source` is the view to draw (`mergecore.describe.shown_view`); no tensor value is read (remote sources do
    not even download them, see `places_only`). `holders` are the rank files (their labels), in rank order.

    >>> checkpoint_layout(source)["holders"][:2]  # doctest: +SKIP
    ['rank 0', 'rank 1']
    """
    report = describe_source(source, lora)
    facts = {k: v for k, v in report["checkpoint"].items() if k != "files"}
    order = {str(location): i for i, location in enumerate(source.input_files())}
    holders: dict[str, int] = {}
    groups = {g["group"]: {**g, "members": [], "kinds": set()} for g in report["groups"]}
    with places_only():
        for name, info in source.tensors().items():
            boxes = []
            for piece in source.pieces(name):
                holder = piece.source.split(": ", 1)[0]  # Megatron pieces say "file: key (part)"
                boxes.append([holders.setdefault(holder, len(holders)), list(piece.offsets), list(piece.sizes),
                              piece.primary])
            kind = tensor_kind(name)
            group = groups[group_of(hf_name(name))[1]]
            group["kinds"].add(kind)
            group["members"].append({"name": name, "shape": list(info.shape), "dtype": info.dtype,
                                     "layout": info.layout, "kind": kind,
                                     "bytes": info.numel * element_size(info.dtype), "boxes": boxes})
    # holders in rank order (the order of input_files), each renumbered
    ranked = sorted(holders, key=lambda h: (order.get(h, len(order)), holders[h]))
    renumber = {holders[h]: i for i, h in enumerate(ranked)}
    for group in groups.values():
        held = [0] * len(ranked)
        for member in group["members"]:
            size = element_size(member["dtype"])
            for box in member["boxes"]:
                box[0] = renumber[box[0]]
                held[box[0]] += math.prod(box[2]) * size
        group["held"] = held
        group["kinds"] = sorted(group["kinds"], key=list(KINDS).index)
    layout = {"checkpoint": facts, "holders": [_label(h, str(source.location)) for h in ranked],
              "groups": list(groups.values())}
    if "lora" in report:
        layout["lora"] = report["lora"]
    return layout


def _label(holder: str, location: str) -> str:
    """"rank 3" for an FSDP rank file, else the file's path inside the checkpoint."""
    match = _RANK_FILE.search(holder)
    if match:
        return f"rank {match[1]}"
    return holder[len(location):].lstrip("/") if holder.startswith(location) else holder


def group_colour(group: dict) -> int:
    """The hue of a group: its most telling kind (vision, experts, LoRA, ...), dense last."""
    for kind in ("vision", "expert", "lora", "router"):
        if kind in group["kinds"]:
            return KINDS[kind][1]
    return KINDS["dense"][1]


# ---- shards as text --------------------------------------------------------------------------------


def split_dims(member: dict) -> list[int]:
    """The dims along which the tensor's boxes are cut (empty: every box is the whole tensor)."""
    return [d for d in range(len(member["shape"])) if any(box[2][d] != member["shape"][d] for box in member["boxes"])]


def _axis(dim: int) -> str:
    return {0: "rows", 1: "cols"}.get(dim, f"dim {dim}")


def box_text(member: dict, offsets: list[int], sizes: list[int]) -> str:
    """"rows 0:251" (half-open, as a Python slice) along each cut dim; "whole" when none is cut."""
    dims = split_dims(member)
    if not dims:
        return "whole"
    if any(sizes[d] == 0 for d in dims):
        return "nothing"
    return ", ".join(f"{_axis(d)} {offsets[d]}:{offsets[d] + sizes[d]}" for d in dims)


def holder_spans(member: dict, holders: int) -> list[tuple[list, list, bool]]:
    """Per holder its boxes as `(offsets, sizes, primary)`, adjacent boxes along one cut dim joined (a
    Megatron QKV part comes as one view per query group)."""
    dims = split_dims(member)
    spans: list[list] = [[] for _ in range(holders)]
    for holder, offsets, sizes, primary in sorted(member["boxes"], key=lambda b: (b[0], b[1])):
        mine = spans[holder]
        if len(dims) == 1 and mine and mine[-1][2] == primary:
            last_offsets, last_sizes, _ = mine[-1]
            d = dims[0]
            if last_offsets[d] + last_sizes[d] == offsets[d]:
                last_sizes = list(last_sizes)
                last_sizes[d] += sizes[d]
                mine[-1] = (last_offsets, last_sizes, primary)
                continue
        mine.append((offsets, sizes, primary))
    return spans


def shard_lines(member: dict, labels: list[str]) -> list[tuple[str, str]]:
    """(who, what) lines: one per holder up to DETAIL_RANKS holders, else runs of alike, adjacent holders
    ("ranks 0–999", "rows 0:16000, 16 rows each")."""
    spans = holder_spans(member, len(labels))
    texts = [_spans_text(member, mine) for mine in spans]
    if len(labels) <= DETAIL_RANKS:
        return [(label, text) for label, text in zip(labels, texts)]
    lines, start = [], 0
    while start < len(labels):
        end = start + 1
        while end < len(labels) and _continues(member, spans[end - 1], spans[end]):
            end += 1
        lines.append(_run_line(member, labels, spans, texts, start, end))
        start = end
    return lines


def _spans_text(member: dict, mine: list) -> str:
    if not mine:
        return "nothing"
    return "; ".join(box_text(member, o, s) + ("" if primary else " (replica)") for o, s, primary in mine)


def _continues(member: dict, before: list, after: list) -> bool:
    """Whether `after` extends the run `before` ended: one box each, the same size, the same kind
    (replica or not), starting where `before` stopped; or both empty."""
    if not before or not after:
        return not before and not after
    dims = split_dims(member)
    if len(before) != 1 or len(after) != 1 or len(dims) != 1:
        return False
    (o1, s1, p1), (o2, s2, p2) = before[0], after[0]
    d = dims[0]
    return p1 == p2 and s1 == s2 and o1[d] + s1[d] == o2[d]


def _run_line(member, labels, spans, texts, start, end) -> tuple[str, str]:
    if end - start == 1:
        return labels[start], texts[start]
    who = _range_label(labels[start], labels[end - 1], end - start)
    if not spans[start]:
        return who, "nothing"
    d = split_dims(member)[0] if split_dims(member) else None
    if d is None:
        return who, texts[start]
    first, last = spans[start][0], spans[end - 1][0]
    each = first[1][d]
    replica = "" if first[2] else " (replicas)"
    return who, f"{_axis(d)} {first[0][d]}:{last[0][d] + last[1][d]}, {each} {_axis(d)} each{replica}"


def _range_label(first: str, last: str, count: int) -> str:
    if first.startswith("rank ") and last.startswith("rank "):
        return f"ranks {first[5:]}–{last[5:]}"
    return f"{first} – {last} ({count} files)"


# ---- drawing ---------------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    """Bytes in binary units, for people.

    >>> human_bytes(3 * 1024 ** 2)
    '3.0 MiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _columns(holders: int) -> tuple[int, int]:
    """(ranks per column, columns) of the heat map."""
    per = max(1, math.ceil(holders / MAX_COLUMNS))
    return per, math.ceil(holders / per) if holders else 0


def heat_svg(layout: dict, standalone: bool = False) -> str:
    """Groups (rows) × ranks (columns), each cell shaded by the bytes that rank holds of that group.

    `standalone` adds the SVG namespace and fonts, for an SVG file or a data: URL outside an HTML page.
    """
    e = html.escape
    labels, groups = layout["holders"], layout["groups"]
    per, ncols = _columns(len(labels))
    cell_w = max(5.0, min(28.0, 900 / max(ncols, 1)))
    cell_h, left, top, right = 18, 160, 34, 110
    width, height = left + ncols * cell_w + right, top + len(groups) * cell_h + 8
    values = [[sum(g["held"][c * per:(c + 1) * per]) / len(g["held"][c * per:(c + 1) * per]) for c in range(ncols)]
              for g in groups]
    peak = max((v for row in values for v in row), default=0) or 1
    namespace = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    out = [f'<svg{namespace} class="heat" width="{width:.0f}" height="{height}" viewBox="0 0 {width:.0f} {height}" '
           f'font-family="sans-serif" font-size="11" role="img" aria-label="bytes per rank and group">']
    out.append(f'<text x="{left}" y="12" fill="#333">{e(_column_caption(len(labels), per))}</text>')
    step = max(1, math.ceil(ncols / 16))
    for c in range(0, ncols, step):
        out.append(f'<text x="{left + c * cell_w:.1f}" y="28" fill="#555">{c * per}</text>')
    for r, (group, row) in enumerate(zip(groups, values)):
        y, hue = top + r * cell_h, group_colour(group)
        out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end" fill="#222">{e(group["group"])}</text>')
        for c, value in enumerate(row):
            light = 96 - 58 * (value / peak)
            who = labels[c * per] if per == 1 else f"ranks {c * per}–{min((c + 1) * per, len(labels)) - 1}"
            amount = human_bytes(value) if per == 1 else f"{human_bytes(value)} per rank (mean)"
            out.append(f'<rect x="{left + c * cell_w:.1f}" y="{y}" width="{cell_w - 1:.1f}" height="{cell_h - 2}" '
                       f'fill="hsl({hue},70%,{light:.0f}%)"><title>{e(who)} · {e(group["group"])} · {amount}</title></rect>')
        out.append(f'<text x="{left + ncols * cell_w + 6:.1f}" y="{y + 13}" fill="#222">{human_bytes(group["bytes"])}</text>')
    out.append("</svg>")
    return "".join(out)


def _column_caption(holders: int, per: int) -> str:
    if per == 1:
        return f"{holders} ranks → (shade: bytes held)"
    return f"{holders} ranks, {per} per column → (shade: mean bytes per rank)"


def _bar_svg(member: dict, spans: list, labels: list[str]) -> str:
    """The tensor along its cut dim, one segment per holder's box (alternate shades)."""
    dims = split_dims(member)
    if len(dims) != 1:
        return ""
    d, total, width = dims[0], member["shape"][dims[0]] or 1, 320
    hue = KINDS[member["kind"]][1]
    out = [f'<svg class="bar" width="{width}" height="14" viewBox="0 0 {width} 14">']
    drawn = 0
    for holder, mine in enumerate(spans):
        for offsets, sizes, primary in mine:
            if not primary or not sizes[d]:
                continue
            x, w = width * offsets[d] / total, max(width * sizes[d] / total, 0.5)
            light = 55 if holder % 2 == 0 else 75
            out.append(f'<rect x="{x:.1f}" y="1" width="{w:.1f}" height="12" fill="hsl({hue},60%,{light}%)">'
                       f'<title>{html.escape(labels[holder])}: {box_text(member, offsets, sizes)}</title></rect>')
            drawn += 1
            if drawn > 4 * MAX_COLUMNS:  # enough to see the pattern; the text lists every run
                break
    out.append("</svg>")
    return "".join(out)


_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{font-size:1.3em} h2{font-size:1.1em;margin-top:1.5em}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:2px 14px} dl.facts dt{font-weight:600}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.kind{display:inline-block;border-radius:3px;padding:0 5px;margin-right:3px;font-size:11px;color:#fff}
.kind-lora{background:hsl(28,80%,45%)} .kind-vision{background:hsl(275,55%,45%)} .kind-expert{background:hsl(140,55%,32%)}
.kind-router{background:hsl(180,55%,32%)} .kind-dense{background:hsl(215,50%,45%)}
details{margin:4px 0} summary{cursor:pointer} .shards{font-family:monospace;font-size:12px;white-space:nowrap}
.heat-wrap{overflow-x:auto}
"""


def _kind_badge(kind: str) -> str:
    return f'<span class="kind kind-{kind}">{html.escape(KINDS[kind][0])}</span>'


def render_html(layout: dict) -> str:
    """The whole page: facts, legend, heat map, the group table, and each group's tensors with their shards."""
    e = html.escape
    facts, labels = layout["checkpoint"], layout["holders"]
    title = f"{facts.get('format', 'checkpoint')} · {facts.get('location', '')}"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{e(title)}</title>",
             f"<style>{_STYLE}</style></head><body>", f"<h1>Checkpoint picture: {e(str(facts.get('location', '')))}</h1>"]
    parts.append('<dl class="facts">')
    shown = {**facts, "ranks (files)": len(labels)}
    for key, value in shown.items():
        parts.append(f"<dt>{e(str(key))}</dt><dd>{e(_fact_text(key, value))}</dd>")
    parts.append("</dl>")
    if "lora" in layout:
        found = layout["lora"]
        parts.append(f'<p id="lora">{_kind_badge("lora")} LoRA checkpoint ({e(found["save"])} save): r {e(str(found["r"]))}, '
                     f"alpha {e(str(found['alpha']))}, target modules {e(', '.join(found['target_modules']))}</p>")
    parts.append("<h2>Which rank holds how much of each group</h2>")
    parts.append("<p>Legend: " + " ".join(_kind_badge(k) for k in KINDS) + " — a darker cell holds more bytes; "
                 "hover a cell for the rank and the amount.</p>")
    parts.append(f'<div class="heat-wrap">{heat_svg(layout)}</div>')
    parts.append("<h2>Groups</h2><table><tr><th>group</th><th>kinds</th><th>tensors</th><th>bytes</th>"
                 "<th>dtypes</th><th>layouts (placements)</th></tr>")
    for group in layout["groups"]:
        parts.append(f'<tr><td><a href="#g-{e(group["group"])}">{e(group["group"])}</a></td>'
                     f'<td>{"".join(_kind_badge(k) for k in group["kinds"])}</td><td class="num">{group["tensors"]}</td>'
                     f'<td class="num">{group["bytes"]:,}</td><td>{e(", ".join(group["dtypes"]))}</td>'
                     f'<td>{e("; ".join(group["layouts"]))}</td></tr>')
    parts.append("</table>")
    parts.append("<h2>Tensors and their shards</h2><p>Rows and cols are half-open ranges, like Python slices "
                 "(<code>rows 0:251</code> is rows 0 to 250).</p>")
    small = sum(g["tensors"] for g in layout["groups"]) <= OPEN_TENSORS
    for group in layout["groups"]:
        parts.append(_group_details(group, labels, small))
    parts.append("</body></html>")
    return "\n".join(parts)


def _fact_text(key: str, value) -> str:
    if key == "bytes":
        return f"{value:,} ({human_bytes(value)})"
    if isinstance(value, list):
        return " × ".join(map(str, value)) if key == "mesh_shape" else ", ".join(map(str, value))
    return str(value)


def _group_details(group: dict, labels: list[str], opened: bool) -> str:
    e = html.escape
    rows = [f'<details id="g-{e(group["group"])}" class="group"{" open" if opened else ""}><summary><b>{e(group["group"])}</b> — '
            f'{group["tensors"]} tensor{"s" if group["tensors"] != 1 else ""}, {human_bytes(group["bytes"])} {"".join(_kind_badge(k) for k in group["kinds"])}'
            "</summary><table><tr><th>tensor</th><th>shape</th><th>dtype</th><th>layout</th><th>bytes</th>"
            "<th>held by</th></tr>"]
    for member in group["members"]:
        spans = holder_spans(member, len(labels))
        lines = "<br>".join(f"{e(who)}: {e(what)}" for who, what in shard_lines(member, labels))
        rows.append(f'<tr class="tensor kind-row-{member["kind"]}"><td>{_kind_badge(member["kind"])}<span class="name">{e(member["name"])}</span></td>'
                    f'<td>{e(" × ".join(map(str, member["shape"])) or "scalar")}</td><td>{e(member["dtype"])}</td>'
                    f'<td>{e(member["layout"])}</td><td class="num">{member["bytes"]:,}</td>'
                    f'<td>{_bar_svg(member, spans, labels)}<div class="shards">{lines}</div></td></tr>')
    rows.append("</table></details>")
    return "".join(rows)


def render_markdown(layout: dict, html_file: str | None = None) -> str:
    """The short form for a markdown viewer (Prefect's artifact page): facts, the heat map as an SVG image
    (a data: URL, which Prefect's UI allows in image sources), the group table, and where the full page is."""
    m = markdown_text  # the checkpoint's path, names and facts are not ours: shown literally
    facts, labels = layout["checkpoint"], layout["holders"]
    image = base64.b64encode(heat_svg(layout, standalone=True).encode()).decode()
    lines = [f"### Checkpoint picture: {m(facts.get('location', ''))}", "",
             m(", ".join(f"{k}: {_fact_text(k, v)}" for k, v in facts.items()) + f", ranks (files): {len(labels)}"), ""]
    if "lora" in layout:
        lines += [m(f"LoRA checkpoint ({layout['lora']['save']} save): r {layout['lora']['r']}, "
                    f"alpha {layout['lora']['alpha']}"), ""]
    lines += [f"![bytes per rank and group](data:image/svg+xml;base64,{image})", "",
              "| group | kinds | tensors | bytes | layouts |", "|---|---|---:|---:|---|"]
    for group in layout["groups"]:
        kinds = ", ".join(KINDS[k][0] for k in group["kinds"])
        lines.append(f"| {m(group['group'])} | {kinds} | {group['tensors']} | {group['bytes']:,} | "
                     f"{m('; '.join(group['layouts']))} |")
    if html_file:
        lines += ["", f"Full picture (every tensor's shards per rank): {m(html_file)}"]
    return "\n".join(lines)


def write_picture(layout: dict, file: str) -> Path:
    """`render_html(layout)` written to `file` whole or not at all (a temporary file beside it, renamed);
    a path that cannot be written is a CheckpointError naming it.

    >>> write_picture(checkpoint_layout(source), "run1.html")  # doctest: +SKIP
    PosixPath('/abs/run1.html')
    """
    import os
    import tempfile

    target = Path(file).expanduser().absolute()
    if target.is_dir():
        raise CheckpointError(f"{target}: is a folder; pass a file name for the picture, e.g. {target / 'checkpoint.html'}")
    try:
        handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as error:
        raise CheckpointError(f"{target}: cannot write the picture there ({error.strerror}); "
                              "pass a path in an existing, writable folder") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(render_html(layout))
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return target
