"""What a person sees in the Prefect UI: the merge report and the equivalence table."""

from __future__ import annotations

from mergecore import MergePlan
from mergecore.model.card import markdown_cell_code, markdown_text


def merge_report(source: dict, plan: MergePlan, receipts: list[dict], cached: list[str], manifest: dict) -> str:
    """The `merge-report` artifact (markdown): what the checkpoint holds and what each group (or file) took.
    Values come from the checkpoint and its path, so each goes through `markdown_text`."""
    m = markdown_text
    total = sum(r["bytes"] for r in receipts)
    unit = lambda r: r.get("group") or r["file"]  # noqa: E731  (a remote target is written file by file)
    rows = "\n".join(
        f"| {m(unit(r))} | {r['tensors']} | {r['bytes']:,} | {r['seconds']:.2f} | {'cached' if unit(r) in cached else 'merged'} |"
        for r in receipts)
    return f"""# Merge report

| | |
|---|---|
| source | {markdown_cell_code(source['location'])} |
| format | {m(source['format'])} |
| step | {m(source.get('step'))} |
| world size | {m(source['world_size'])} |
| mesh | {m(source.get('mesh_shape'))} {m(source.get('mesh_dim_names') or '')} |
| output dtype | {m(manifest['dtype'])} |
| files | {len(plan.files)} ({total:,} bytes of weights) |
| groups | {len(plan.groups)} ({len(cached)} cached) |
| timings | {m(manifest.get('timings', {}))} |

| group (or file) | tensors | bytes | seconds | |
|---|---|---|---|---|
{rows}
"""


def equivalence_rows(checks: list[dict]) -> list[dict]:
    return [{"check": c["check"], "result": "passed" if c["ok"] else "FAILED",
             "details": ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("check", "ok", "rows"))}
            for c in checks]
