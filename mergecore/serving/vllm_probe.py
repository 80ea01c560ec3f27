"""Load a model folder in vLLM and score fixed token ids: run by the engine's own interpreter, never imported.

    ENGINE_PYTHON vllm_probe.py REQUEST.json RESULT.json

This file is a standalone script (standard library and vLLM only): vLLM pins its own torch and transformers, so
it lives in its own environment (`ckptflow engine install vllm`) and ckptflow talks to it through two files.
REQUEST.json: {"folder", "prompt" (token ids), "max_tokens", "top" (logprobs per position), "dtype"}.
RESULT.json, always written: {"status": "ran" | "unavailable" | "failed", ...}: "ran" with vLLM's version, its
device, and per position the logprobs vLLM returned ({token id: logprob}); "unavailable" when this engine cannot
run this folder on this machine (the reason names it); "failed" when it should have and did not (the error).
Output of vLLM's own goes to stdout/stderr, which the caller keeps in a log.
"""

import json
import os
import sys
import traceback


def engine_environment():
    """Set before vLLM is imported, in the engine's process only (importing this file elsewhere, as the project's
    checks do, must not turn a caller's Hub offline): the engine core runs in this process (no child process to
    outlive the caller), nothing is sent or fetched."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # vLLM compiles a logprob helper with torch.compile even when eager; on CPU that needs a C++ compiler and
    # ~15 s. Without dynamo the same numbers come eagerly.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


# What vLLM's CPU backend runs (vLLM 0.32 on x86-64): attention head sizes, and the weight schemes with a kernel.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
GPU_HINT = "a GPU work pool (the CUDA worker image) can run it"

# vLLM errors that mean "not on this machine" rather than "this folder is wrong", by a part of their message.
UNAVAILABLE_MESSAGES = {
    "expected scalar type Float but found BFloat16": "vLLM's CPU fp8 kernel fails on a bf16 bias",
}


def config_of(folder):
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return config.get("text_config") or config, config.get("quantization_config") or {}


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "", set()
    vendor = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return vendor, set(flags)


def weight_bits(quantization):
    if quantization.get("quant_method") == "fp8":
        return "fp8"
    groups = quantization.get("config_groups") or {}
    for group in groups.values():
        return group.get("weights", {}).get("num_bits")
    return None


def cannot_run_on_cpu(folder, has_bias):
    """Why vLLM's CPU backend cannot run `folder` here, or None."""
    text, quantization = config_of(folder)
    heads = text.get("num_attention_heads") or 1
    head_size = text.get("head_dim") or text.get("hidden_size", 0) // heads
    if head_size not in CPU_HEAD_SIZES:
        return (f"vLLM's CPU attention has no kernel for head size {head_size} (it has "
                f"{', '.join(map(str, CPU_HEAD_SIZES))})")
    bits = weight_bits(quantization)
    vendor, flags = cpu_flags()
    if bits == 8 and vendor != "AuthenticAMD":
        return f"vLLM's CPU backend has no w8a16 (uint8b128) kernel on this CPU ({vendor or 'unknown vendor'}; AMD Zen only)"
    if bits == "fp8" and not {"amx_tile", "amx_bf16"} <= flags:
        return "vLLM's CPU fp8 kernel needs AMX, which this CPU lacks"
    if bits == "fp8" and has_bias:
        return "vLLM's CPU fp8 kernel fails on a bf16 bias, and this model's linear layers have biases"
    return None


def main(request_path, result_path):
    with open(request_path) as f:
        request = json.load(f)
    result = {"status": "failed"}
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform

        device = str(current_platform.device_type)
        result.update(version=vllm.__version__, device=device)
        why = cannot_run_on_cpu(request["folder"], request.get("has_bias", False)) if device == "cpu" else None
        if why:
            result.update(status="unavailable", reason=f"{why}; {GPU_HINT}")
            return result
        llm = LLM(model=request["folder"], dtype=request["dtype"], seed=0, enforce_eager=True,
                  distributed_executor_backend="uni", kv_cache_memory_bytes=64 << 20,
                  max_model_len=len(request["prompt"]) + request["max_tokens"] + 8,
                  skip_tokenizer_init=True)
        sampling = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, prompt_logprobs=request["top"],
                                  logprobs=request["top"], detokenize=False)
        generated = llm.generate([{"prompt_token_ids": request["prompt"]}], sampling, use_tqdm=False)[0]
        completion = generated.outputs[0]
        # Position i scores token i+1 of prompt + generated tokens: vLLM's prompt_logprobs[0] is None (nothing
        # predicts the first token), prompt_logprobs[i] scores prompt token i, logprobs[j] generated token j.
        scored = list(generated.prompt_logprobs[1:]) + list(completion.logprobs)
        result.update(status="ran", generated=list(completion.token_ids),
                      logprobs=[{str(token): entry.logprob for token, entry in position.items()} for position in scored])
    except BaseException as error:  # noqa: BLE001 - whatever stops vLLM is reported, SystemExit included
        message = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}"
        known = next((why for part, why in UNAVAILABLE_MESSAGES.items() if part in str(error)), None)
        result.update(status="unavailable" if known else "failed",
                      reason=f"{known} ({message}); {GPU_HINT}" if known else message,
                      traceback=traceback.format_exc()[-4000:])
    return result


if __name__ == "__main__":
    engine_environment()
    outcome = main(sys.argv[1], sys.argv[2])
    with open(sys.argv[2], "w") as out:
        json.dump(outcome, out)
    # A normal exit (not os._exit): vLLM's exit hooks remove the files it made under $TMPDIR.
    sys.exit(0)
