"""Proving a merged folder equals what was trained, three independent ways.

- `verify_round_trip`: no reference needed. Re-slice every output tensor as each rank held it
  and compare bit for bit with that rank's shard (cast to the output dtype; identity for keep).
- `compare_with_reference`: tensor by tensor against a Hugging Face folder (key set, shapes, values).
- `compare_logits`: load both folders with transformers and compare logits on fixed token ids.
And `verify_manifest`: a folder's files are still its manifest's (`reader.check_manifest`). `verify` of a published
model, wherever it lies, is `published.verify_model`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..numbers.arrays import bitwise_equal, cast, dtype_of
from ..errors import CheckpointError, VerificationError
from ..formats import CheckpointSource
from ..model.manifest import MANIFEST_FILE, file_changed, load_manifest
from ..storage import Location
from ..storage.ledger import recalled, with_private
from ..storage.tensorio import HfWeights, read_json
from .quantized import quantized_round_trip
from .reader import FolderReader, check_manifest


def verify_round_trip(source: CheckpointSource, folder: Path, aliases: dict[str, str], workers: int = 2,
                      plan=None) -> dict:
    """Every shard of every rank (replicas too) must be found, bit for bit, in the output files.

    `aliases` maps source tensors that were not written (a tied head) to the output tensor holding them.
    With a quantized `plan` the names are the plan's, and its quantized weights are proven by
    `quantized.quantized_round_trip` (exact re-quantization, decoded within the scheme's bound).
    `plan`: the merge's own, when it proves what it just staged; without it the folder is a published one and its
    plan is its manifest's (`recorded_plan`), so a quantized part that no longer matches is a file changed after
    the merge (`file_changed`), as a changed hash is.
    """
    published = plan is None
    plan = plan or recorded_plan(source, folder)
    quantized = plan is not None and plan.quantization
    expected = {t.name for t in plan.tensors} if quantized else set(source.tensors()) - set(aliases)
    with HfWeights(folder) as weights:
        found = set(weights.names())
        if found != expected:
            raise tensors_differ(folder, found, expected)
        pieces, errors = round_trip_of(source, weights.get, found, aliases, plan if quantized else None, folder,
                                       workers, published)
    return {"check": "round-trip", "tensors": len(source.tensors()), "pieces": pieces, **errors, "ok": True}


def round_trip_of(source: CheckpointSource, get, held: set[str], aliases: dict[str, str], plan=None, where=None,
                  workers: int = 1, published: bool = False) -> tuple[int, dict]:
    """The round trip of the output tensors `held` (a folder's, or one weight file's), each read with `get(name)`:
    plain tensors piece by piece (`round_trip_pieces`), and with a quantized `plan`, each quantized weight whose
    parts are held re-quantized, compared and decoded within the scheme's bound (`quantized_round_trip`; `where`:
    the model's folder or URL, whose file its errors name). `published`: the model was published (its merge proved
    it), so a mismatch there is a file changed after the merge. Returns (pieces compared, the quantized errors: {}
    without any)."""
    if plan is None or not plan.quantization:
        return round_trip_pieces(source, get, held, aliases, workers), {}
    plain = {t.name for t in plan.tensors if not t.part and t.name in held}
    parts = {t.name for t in plan.tensors if t.part and t.name in held}
    changed = file_changed if published else None
    errors = quantized_round_trip(source, get, plan, where, workers, held=parts, changed=changed) if parts else {}
    return round_trip_pieces(source, get, plain, aliases, workers) + len(parts), errors


def round_trip_pieces(source: CheckpointSource, get, held: set[str], aliases: dict[str, str], workers: int = 1) -> int:
    """The round trip of every checkpoint tensor stored under a name in `held` (itself, or the output tensor its
    alias names), each output tensor read with `get(name)`; returns the pieces compared. The one loop behind the
    check of a folder, of a remote file being verified, and of a remote file just written."""
    checked = [name for name in source.tensors() if aliases.get(name, name) in held]
    with ThreadPoolExecutor(max(1, workers)) as pool:
        return sum(pool.map(lambda name: source.check_round_trip(name, get(aliases.get(name, name))), checked))


def verify_manifest(folder: str | Path, full: bool = True) -> dict:
    """Every file the folder's manifest lists is there and unchanged, and nothing else is: re-hashed, or with
    `full=False` only its size and modification time compared (enough to notice any ordinary write).

    >>> verify_manifest("out/model", full=False)  # doctest: +SKIP
    {'check': 'manifest (size, mtime)', 'files': 7, 'ok': True}
    """
    return check_manifest(FolderReader(folder), load_manifest(folder), full)


def manifest_plan(source: CheckpointSource, config: dict, manifest: dict):
    """The plan of the merge `manifest` records (dtype, shard size, quantization), made again from the source by the
    merge's own planner (`merge.output_plan`), so verify reads the decisions the merge made."""
    from ..families.layout import tied_embeddings
    from ..engine.merge import output_plan

    return output_plan(source, config, tied_embeddings(config), manifest["source"].get("options") or {})


def recorded_plan(source: CheckpointSource, folder: Path):
    """The plan of a published quantized folder, from its manifest (None for a plain merge, or without a manifest)."""
    if not (Path(folder) / MANIFEST_FILE).exists():
        return None
    return quantized_plan(source, load_manifest(folder))


def quantized_plan(source: CheckpointSource, manifest: dict):
    """The plan of the quantized merge `manifest` records, made again from `source` (None for a plain merge)."""
    from ..formats.base import read_hf_config

    if not (manifest["source"].get("options") or {}).get("quantize"):
        return None
    return manifest_plan(source, read_hf_config(source), manifest)


# The wording of a failed check, shared by a staged folder's round trip and a published model's (published.py).
def tensors_differ(folder, found: set[str], expected: set[str]) -> VerificationError:
    odd = sorted(found ^ expected)
    return VerificationError(f"{folder}: output tensors differ from the checkpoint's ({', '.join(odd[:3])}); "
                             "the folder was not merged from this checkpoint")


def compare_with_reference(folder: Path, reference: Path, atol: float = 0.0, rtol: float = 0.0) -> dict:
    """Same names and shapes as `reference`; values equal after casting the reference to our dtype.

    With atol = rtol = 0 (the default) the comparison is exact.
    """
    rows, worst = [], 0.0
    with HfWeights(folder) as ours, HfWeights(reference) as theirs:
        missing = sorted(set(theirs.names()) - set(ours.names()))
        extra = sorted(set(ours.names()) - set(theirs.names()))
        if missing or extra:
            raise VerificationError(
                f"{folder}: tensor names differ from {reference} (missing: {missing[:3]}, extra: {extra[:3]}); "
                "check the role (actor/critic) and tie_word_embeddings"
            )
        for name in theirs.names():
            mine, ref = ours.get(name), theirs.get(name)
            if mine.shape != ref.shape:
                raise VerificationError(f"{folder}: tensor {name} is {tuple(mine.shape)} but {tuple(ref.shape)} in {reference}")
            ref = cast(ref, dtype_of(mine))
            ok = bitwise_equal(mine, ref)
            diff = 0.0
            if not ok and mine.size:
                a, b = cast(mine, "float64"), cast(ref, "float64")
                diff = float(np.abs(a - b).max())
                ok = bool(np.allclose(a, b, atol=atol, rtol=rtol))
            worst = max(worst, diff)
            rows.append({"tensor": name, "shape": list(mine.shape), "dtype": dtype_of(mine), "max_abs_diff": diff, "ok": ok})
    bad = [r["tensor"] for r in rows if not r["ok"]]
    if bad:
        raise VerificationError(
            f"{folder}: {len(bad)} tensors differ from {reference} beyond atol={atol} rtol={rtol} "
            f"(first: {bad[0]}, max abs diff {worst:.3g}); the checkpoint is not the reference model"
        )
    return {"check": "reference", "tensors": len(rows), "max_abs_diff": worst, "ok": True, "rows": rows}


def auto_class(folder: Path):
    import transformers

    architectures = read_json(folder / "config.json").get("architectures") or [""]
    if not isinstance(architectures, list) or not isinstance(architectures[0], str):
        raise CheckpointError(f"{folder / 'config.json'}: architectures is {architectures!r}, not a list of class names")
    if architectures[0].endswith("ForTokenClassification"):
        return transformers.AutoModelForTokenClassification
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    # A vision-language model (Qwen2.5-VL, Qwen3-VL) has no causal-LM auto class; its text forward is the same.
    model_type = read_json(folder / "config.json").get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


LOGITS_ATOL = 1e-5
REFERENCE_CHECKS = ("reference", "logits")


def reference_checks(folder: Path, reference: Path, trust_remote_code: bool = False, logits: bool = True,
                     atol: float | None = None, rtol: float | None = None, device: str | None = None) -> list[dict]:
    """`folder` against a reference model: every tensor (exact unless tolerances are given), then the logits
    (within `atol`, default LOGITS_ATOL, and `rtol`) on `device` (see `logits_device`).

    >>> [c["check"] for c in reference_checks(Path("out/model"), Path("ref/model"))]  # doctest: +SKIP
    ['reference', 'logits']
    """
    quantization = read_json(folder / "config.json").get("quantization_config")
    if quantization:  # its tensors are not the reference's: what a server loads is compared, by its logits
        return [compare_quantized_logits(folder, reference, quantization, trust_remote_code, device=device)]
    tensors = compare_with_reference(folder, reference, atol or 0.0, rtol or 0.0)
    results = [{k: v for k, v in tensors.items() if k != "rows"}]
    if logits:
        results.append(compare_logits(folder, reference, LOGITS_ATOL if atol is None else atol, trust_remote_code,
                                      rtol=rtol or 0.0, device=device))
    return results


def load_model(auto, folder: Path, **kwargs):
    try:
        return auto.from_pretrained(folder, **kwargs)
    except Exception as err:  # noqa: BLE001 - whatever transformers raises, the folder is what the user can fix
        hint = "pass --trust-remote-code if it needs its own model code" if "trust_remote_code" in str(err) else \
            "check its config.json and weights"
        raise CheckpointError(f"{folder}: transformers cannot load it ({type(err).__name__}: "
                              f"{(str(err).strip().splitlines() or [''])[0]}); {hint}") from None


LOGITS_DEVICE_ENV = "CKPTFLOW_LOGITS_DEVICE"


def logits_device(requested: str | None = None) -> str:
    """Where the logits check runs: `requested`, else $CKPTFLOW_LOGITS_DEVICE, else "cuda" when torch sees a GPU,
    else "cpu". A device that torch does not know or cannot use here is refused in one line.

    >>> logits_device("cpu")
    'cpu'
    """
    import torch

    name = requested or os.environ.get(LOGITS_DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    told = "the device asked for" if requested else f"${LOGITS_DEVICE_ENV}"
    try:
        kind = torch.device(name).type
    except (RuntimeError, ValueError):
        raise CheckpointError(f"{told} is {name!r}, not a torch device: use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"{told} is {name!r} but torch {torch.__version__} sees no CUDA GPU here: "
                              f"use cpu, or a CUDA build of torch on a GPU machine")
    if kind not in ("cpu", "cuda"):
        raise CheckpointError(f"{told} is {name!r}: the logits check runs on cpu or cuda")
    return name


def compare_logits(
    folder: Path, reference: Path, atol: float = LOGITS_ATOL, trust_remote_code: bool = False, seq_len: int = 16,
    rtol: float = 0.0, device: str | None = None,
) -> dict:
    """Logits of the merged model vs the reference, both in the merged dtype (bf16, fp16 or fp32), on fixed
    token ids: equal when |ours - theirs| <= atol + rtol * |theirs| everywhere. Runs on `logits_device(device)`:
    the GPU when one is present, unless told otherwise. The token ids are drawn on the CPU, so every device
    sees the same ones.

    >>> compare_logits(Path("out/model"), Path("ref/model"))["device"]  # doctest: +SKIP
    'cuda'
    """
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = logits_device(device)
    auto = auto_class(folder)
    kwargs = {"trust_remote_code": trust_remote_code}
    ours = load_model(auto, folder, dtype="auto", **kwargs).to(device).eval()
    theirs = load_model(auto, reference, dtype=ours.dtype, **kwargs).to(device).eval()
    vocab = ours.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits.float(), theirs(input_ids=ids).logits.float()
    diff = (a - b).abs().max().item()
    result = {"check": "logits", "device": device, "dtype": str(ours.dtype).removeprefix("torch."),
              "shape": list(a.shape), "max_abs_diff": diff, "atol": atol, "rtol": rtol, "ok": bool(((a - b).abs() <= atol + rtol * b.abs()).all())}
    if not result["ok"]:
        raise VerificationError(f"{folder}: logits differ from {reference} by {diff:.3g} (beyond atol {atol}, "
                                f"rtol {rtol}) on {device}")
    return result


# Per scheme: the most a quantized model's next-token distribution may drift from the unquantized merge's, on
# average (KL(reference || quantized), nats per position); docs/quantization.md gives the reasons and measurements.
QUANTIZED_KL_MAX = {"fp8": 0.01, "w8a16": 0.005, "w4a16": 0.1}


def quantized_loader_config(quantization: dict):
    """transformers' config that loads a quantized folder on any machine, decoding to the model's dtype."""
    from transformers import CompressedTensorsConfig, FineGrainedFP8Config

    if quantization.get("quant_method") == "fp8":
        return FineGrainedFP8Config(dequantize=True)
    return CompressedTensorsConfig(dequantize=True)


def scheme_name(quantization: dict) -> str:
    """The scheme of a quantized folder's `quantization_config`: fp8, w8a16 or w4a16."""
    if quantization.get("quant_method") == "fp8":
        return "fp8"
    bits = quantization["config_groups"]["group_0"]["weights"]["num_bits"]
    return f"w{bits}a16"


def compare_quantized_logits(folder: Path, reference: Path, quantization: dict, trust_remote_code: bool = False,
                             seq_len: int = 16, device: str | None = None) -> dict:
    """Load a quantized `folder` with transformers' own loader (no missing or unexpected keys allowed) and compare
    its logits with the unquantized `reference`'s on fixed token ids: max |diff|, mean KL and top-1 agreement; the
    mean KL must stay within `QUANTIZED_KL_MAX` of its scheme.

    >>> compare_quantized_logits(Path("out/model-fp8"), Path("out/model"), {"quant_method": "fp8"})["ok"]  # doctest: +SKIP
    True
    """
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = logits_device(device)
    auto, scheme = auto_class(folder), scheme_name(quantization)
    ours, info = load_model(auto, folder, quantization_config=quantized_loader_config(quantization),
                             output_loading_info=True, trust_remote_code=trust_remote_code)
    odd = {kind: sorted(names)[:3] for kind, names in info.items() if kind in ("missing_keys", "unexpected_keys") and names}
    if odd:
        raise VerificationError(f"{folder}: transformers loads it with {odd}; the quantized folder does not match its "
                                "model class: merge again (or report this)")
    ours = ours.to(device).eval()
    theirs = load_model(auto, reference, dtype=ours.dtype, trust_remote_code=trust_remote_code).to(device).eval()
    vocab = ours.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits.float(), theirs(input_ids=ids).logits.float()
    kl = torch.nn.functional.kl_div(a.log_softmax(-1), b.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    result = {"check": "logits (quantized)", "scheme": scheme, "device": device, "shape": list(a.shape),
              "max_abs_diff": (a - b).abs().max().item(), "mean_kl": kl.mean().item(),
              "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(), "kl_max": QUANTIZED_KL_MAX[scheme]}
    result["ok"] = result["mean_kl"] <= result["kl_max"]
    if not result["ok"]:
        raise VerificationError(f"{folder}: its logits drift from {reference}'s by a mean KL of {result['mean_kl']:.3g} "
                                f"(beyond {result['kl_max']} for {scheme}) on {device}; keep more modules unquantized "
                                "(--quantize-ignore) or use a finer scheme")
    return result


def manifest_source(manifest: dict, source: str | None = None, hf_dir: str | None = None) -> tuple[str, str | None]:
    """(checkpoint, hf_dir) that `verify` reopens for a manifest: the user's (`--source`, `--hf_model_path`) when
    given, else the manifest's own only where they are local paths. A downloaded model's manifest is not the
    user's word: a URL in it (`http://169.254.169.254/...`, someone's bucket) is never contacted; that is a
    one-line CheckpointError saying how to pass the checkpoint.

    >>> manifest_source({"source": {"location": "s3://ckpts/run1/actor"}}, source="s3://ckpts/run1/actor")
    ('s3://ckpts/run1/actor', None)
    """
    recorded = manifest["source"]  # as `as_recorded` gives it: this machine's own paths put back
    options = recorded.get("options") or {}
    location = source or _local_only(recorded["location"], "its source checkpoint", "--source CHECKPOINT")
    folder = hf_dir or (options.get("hf_dir") and _local_only(options["hf_dir"], "its huggingface/ folder",
                                                              "--hf_model_path FOLDER"))
    base_model = (options.get("lora") or {}).get("base_model") if isinstance(options.get("lora"), dict) else None
    if base_model and not Path(str(base_model)).expanduser().is_dir():
        raise CheckpointError(f"{MANIFEST_FILE}: names the base model {base_model!r}, not a local folder; verify "
                              "does not download what a manifest names: pass --skip-source (hashes only)")
    return location, folder


def as_recorded(manifest: dict) -> dict:
    """`manifest` with the full local paths of its sources, where this machine merged it: the manifest itself names
    them publicly (`run1/global_step_100/actor`), its ledger keeps them (`storage.ledger`)."""
    kept = recalled(manifest.get("weights_id"))
    return {**manifest, "source": with_private(manifest["source"], kept)} if kept else manifest


def _local_only(value, what: str, flag: str) -> str:
    """`value` if it is an absolute local path; a URL, or a public name (as a manifest names what this machine did
    not merge), is never opened."""
    try:
        local = isinstance(value, str) and Location.of(value).is_local and os.path.isabs(os.path.expanduser(value))
    except (ValueError, ImportError):  # a protocol fsspec does not know
        local = False
    if not local:
        raise CheckpointError(f"{MANIFEST_FILE}: names {what} as {value!r}, not a local path this machine merged "
                              f"from; verify never contacts a location a manifest names: pass {flag} if you trust it "
                              "(or --skip-source)")
    return value
