"""The engine check: the folder loads in the engine that serves it, and what that engine computes is what
transformers computes.

vLLM runs in its own interpreter (`environment.engine_python`) as a separate process group, so nothing of it can
outlive the check: on success, failure, timeout or a signal the whole group is ended. It loads the folder (offline,
eager, one in-process worker, a small KV cache), generates greedily from fixed token ids and returns the top
logprobs of every position, prompt and generated; transformers then scores the same sequence (float32; a quantized
folder dequantized by transformers' own loader) and every returned logprob is compared. Logprobs, not tokens: in
bf16 or int4 greedy tokens flip at near ties. The tolerances (`TOLERANCES`, max |Δ logprob|) are in
docs/serving.md with what was measured.

>>> engine_check(Path("out/model"), "vllm")  # doctest: +SKIP
{'check': 'engine', 'engine': 'vllm', 'version': '0.32.0', 'device': 'cpu', 'max_abs_diff': 2.4e-06, ...}
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import EngineUnavailable, VerificationError
from ..proofs.verify import auto_class, load_model, quantized_loader_config, scheme_name
from ..storage.retries import env_number
from ..model.folder import INDEX_FILE
from ..storage.tensorio import SafetensorsFile, read_json, read_weight_map
from .environment import check_engine, engine_folder, engine_python

PROBE = Path(__file__).with_name("vllm_probe.py")
# Most a returned logprob may differ from transformers' float32 one on the same folder. An unquantized folder runs
# in vLLM in float32 (bf16 and fp16 weights widen exactly), so the two agree to rounding: measured <= 3e-6. A
# quantized one runs in its own dtype (vLLM has no float32 path for fp8), with its kernels: measured w4a16 ~0.015,
# fp8-block ~0.007. docs/serving.md has the measurements.
TOLERANCES = {"float32": 1e-4, "fp8": 0.1, "w8a16": 0.1, "w4a16": 0.1}
PROMPT_TOKENS, GENERATED_TOKENS, TOP_LOGPROBS = 24, 8, 5
TIMEOUT_ENV = "CKPTFLOW_ENGINE_TIMEOUT_S"


def engine_check(folder: Path, engine: str = "vllm", python: str | os.PathLike | None = None) -> dict:
    """Prove `folder` in `engine`; returns the `engine` row of verify's table. Raises VerificationError when the
    engine disagrees or fails on the folder, EngineUnavailable when it cannot run it here (never a pass)."""
    check_engine(engine)
    interpreter = engine_python(engine, python)
    folder = Path(folder)
    config = read_json(folder / "config.json")
    text = config.get("text_config") or config
    quantization = config.get("quantization_config")
    scheme = scheme_name(quantization) if quantization else None
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16") if scheme else "float32"
    prompt = [random.Random(0).randrange(text["vocab_size"]) for _ in range(PROMPT_TOKENS)]
    started = time.perf_counter()
    result = _run_probe(interpreter, engine, {
        "folder": str(folder.resolve()), "prompt": prompt, "max_tokens": GENERATED_TOKENS, "top": TOP_LOGPROBS,
        "dtype": dtype, "has_bias": any(name.endswith(".bias") for name in _tensor_names(folder))})
    where = f"{engine} {result.get('version', '?')} on {result.get('device', '?')}"
    if result["status"] == "unavailable":
        raise EngineUnavailable(f"{folder}: {where} cannot run it here: {result['reason']}")
    if result["status"] != "ran":
        raise VerificationError(f"{folder}: {where} cannot load or run it ({result.get('reason')}); the folder is not "
                                "servable as it is")
    expected = reference_logprobs(folder, prompt + result["generated"], quantization)
    # entry k of the engine's list scores token k+1 of prompt + generated, as row k of transformers' does
    diffs = [abs(logprob - expected[k][int(token)]) for k, scored in enumerate(result["logprobs"])
             for token, logprob in scored.items()]
    if not diffs:
        raise VerificationError(f"{folder}: {where} returned no logprobs; nothing was compared")
    tolerance = TOLERANCES[scheme or dtype]
    row = {"check": "engine", "engine": engine, "version": result["version"], "device": result["device"],
           "scheme": scheme or "none", "dtype": dtype, "compared": len(diffs), "max_abs_diff": max(diffs),
           "mean_abs_diff": sum(diffs) / len(diffs), "tolerance": tolerance,
           "seconds": round(time.perf_counter() - started, 1)}
    row["ok"] = row["max_abs_diff"] <= tolerance
    if not row["ok"]:
        raise VerificationError(f"{folder}: {where} computes logprobs that differ from transformers' by up to "
                                f"{row['max_abs_diff']:.3g} (beyond {tolerance} for {scheme or dtype}); the folder "
                                "is read differently by the engine: check its config.json")
    return row


def reference_logprobs(folder: Path, tokens: list[int], quantization: dict | None):
    """transformers' float32 log-softmax of the next token after each of `tokens` but the last, [positions, vocab]
    (position i scores token i+1); a quantized folder is dequantized by transformers' own loader."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs = {"quantization_config": quantized_loader_config(quantization)} if quantization else {}
    model = load_model(auto_class(folder), folder, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return logits.log_softmax(-1).tolist()


def _tensor_names(folder: Path) -> list[str]:
    index = folder / INDEX_FILE
    if index.is_file():
        return list(read_weight_map(index))
    return [name for file in sorted(folder.glob("*.safetensors")) for name in SafetensorsFile(file).keys()]


def _run_probe(interpreter: Path, engine: str, request: dict) -> dict:
    """Run the probe in its own process group and return its result; the group is ended whatever happens."""
    timeout = env_number(TIMEOUT_ENV, 900.0, float)
    cache = engine_folder(engine) / "cache"
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "VLLM_CPU_KVCACHE_SPACE")}  # its own packages, our small cache
    env["VLLM_CACHE_ROOT"] = str(cache)
    with tempfile.TemporaryDirectory(prefix="ckptflow-engine-") as scratch:
        env["TMPDIR"] = scratch  # what vLLM leaves in $TMPDIR when it fails goes with the scratch folder
        asked, answer, log = (Path(scratch) / name for name in ("request.json", "result.json", "engine.log"))
        asked.write_text(json.dumps(request))
        with open(log, "w") as out:
            process = subprocess.Popen([str(interpreter), str(PROBE), str(asked), str(answer)], stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                       start_new_session=True, cwd=scratch)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise EngineUnavailable(f"{request['folder']}: {engine} did not finish within {timeout:g} s "
                                        f"(${TIMEOUT_ENV}); nothing was proven") from None
            finally:
                end_group(process)
        try:
            return json.loads(answer.read_text())
        except (OSError, ValueError):
            last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
            return {"status": "failed", "reason": f"the engine process exited with {process.returncode}: {last[:300]}"}


def end_group(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End `process` and everything it started (its own process group): SIGTERM, then SIGKILL after `grace_s`."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the group is empty: the probe and all it started have exited
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
