"""One merge request: what to merge, how, and where to — built once at the edge (the CLI, a flow's parameters,
the Python API) and passed down whole.

Every field is a plain JSON value, so Prefect shows the request as a flow parameter and ships it to Dask workers,
and `MergeRequest.from_dict(request.to_dict())` gives it back. Each part checks its own values when it is built,
so a bad value is one line (`CheckpointError`) before any file is opened.

>>> request = MergeRequest.of("ckpts/run1/global_step_100/actor", "out/model", dtype="bf16", max_shard_size="2GB")
>>> request.how.dtype, request.where.target, request.what.role
('bf16', 'out/model', 'actor')
>>> MergeRequest.from_dict(request.to_dict()) == request
True
>>> MergeRequest.of("ckpts/run1", dtype="bf17")
Traceback (most recent call last):
  ...
mergecore.errors.CheckpointError: unknown --dtype 'bf17': use auto, keep, bf16, fp16 or fp32
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from .errors import CheckpointError
from .numbers.budget import chunk_bytes as parse_chunk_bytes
from .numbers.budget import parse_size
from .numbers.dtypes import resolve_dtype
from .numbers.nonfinite import check_nonfinite_policy
from .quantize.schemes import quantize_spec
from .model.folder import own_name_in
from .storage.retries import lock_timeout
from .views.lora import LORA_OUTPUTS

# What a path or URL may be here (Linux's PATH_MAX and NAME_MAX): a longer one fails in the system call, later.
_PATH_BYTES, _NAME_BYTES = 4095, 255


def checked_path(value, what: str, optional: bool = False) -> str | None:
    """`value` if it can name a folder, file or URL: a non-empty string without NUL bytes, within the system's
    length limits; else a one-line CheckpointError naming `what` (`None` passes when `optional`). Every path a
    request carries comes through here, from the CLI, a flow's parameters, an event or Python alike.

    >>> checked_path("ckpts/run1", "checkpoint")
    'ckpts/run1'
    >>> checked_path("ckpts/\\x00run1", "checkpoint")
    Traceback (most recent call last):
      ...
    mergecore.errors.CheckpointError: checkpoint 'ckpts/\\x00run1': holds a NUL byte, which no path can; fix the path
    """
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise CheckpointError(f"{what} {value!r}: give a folder or URL (a non-empty string)")
    if "\x00" in value:
        raise CheckpointError(f"{what} {value!r}: holds a NUL byte, which no path can; fix the path")
    encoded = value.encode("utf-8", "surrogateescape")
    if len(encoded) > _PATH_BYTES or any(len(part) > _NAME_BYTES for part in encoded.split(b"/")):
        raise CheckpointError(f"{what} {value[:60]!r}...: longer than the system allows ({_PATH_BYTES} bytes, "
                              f"{_NAME_BYTES} a name); give a shorter path")
    return value


@dataclass(frozen=True)
class LoraSettings:
    """How a verl FSDP LoRA checkpoint is merged. Every field None: decided by the checkpoint (its metadata,
    its tensors; `output`: `both` for a full save, `adapter` for a save_lora_only one without `base_model`).

    >>> LoraSettings(alpha=16.0).overrides()
    {'alpha': 16.0}
    >>> LoraSettings(output="fused")
    Traceback (most recent call last):
      ...
    mergecore.errors.CheckpointError: --lora fused: choose one of fuse, adapter, both
    """

    output: str | None = None          # fuse, adapter or both
    alpha: float | None = None         # never guessed: the checkpoint's metadata, or this
    r: int | None = None
    target_modules: str | None = None  # comma separated
    base_model: str | None = None      # a save_lora_only checkpoint's base weights: HF folder or Hub repo id

    def __post_init__(self):
        if self.output is not None and self.output not in LORA_OUTPUTS:
            raise CheckpointError(f"--lora {self.output}: choose one of {', '.join(LORA_OUTPUTS)}")
        if self.alpha is not None and not self.alpha > 0:
            raise CheckpointError(f"--lora-alpha {self.alpha}: give a positive number")
        if self.r is not None and (isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1):
            raise CheckpointError(f"--lora-r {self.r}: give a positive whole number")
        checked_path(self.base_model, "--base-model", optional=True)

    def given(self) -> bool:
        return any(value is not None for value in asdict(self).values())

    def overrides(self, output: str | None = None) -> dict:
        """The settings given, as `mergecore.views.lora` reads them (a fresh dict: the reader may consume it);
        `output`: the output decided for this checkpoint, in place of the requested one."""
        found = {k: v for k, v in asdict(self).items() if v is not None}
        return {**found, "output": output} if output else found


@dataclass(frozen=True)
class MergeSource:
    """What to merge: the checkpoint (role folder, global_step_N folder or run root; path or fsspec URL) and
    how to read it."""

    checkpoint: str
    role: str = "actor"
    backend: str = "auto"              # auto, fsdp, megatron, megatron_legacy, megatron_dist
    hf_dir: str | None = None          # config.json's folder when the checkpoint lacks huggingface/
    custom_mapping: str | None = None  # extra Megatron -> HF name patterns (JSON/YAML file)
    lora: LoraSettings = field(default_factory=LoraSettings)

    def __post_init__(self):
        checked_path(self.checkpoint, "checkpoint")
        checked_path(self.hf_dir, "--hf_model_path", optional=True)
        checked_path(self.custom_mapping, "--custom-mapping", optional=True)
        if isinstance(self.lora, dict):  # as it comes back from JSON
            object.__setattr__(self, "lora", LoraSettings(**self.lora))
        if self.custom_mapping is not None and self.lora.given():
            raise CheckpointError("--lora and the LoRA flags apply to verl FSDP LoRA checkpoints, not with "
                                  "--custom-mapping: drop one")


@dataclass(frozen=True)
class MergeSettings:
    """How to merge: the output's dtype or quantization, its files, the checks, the memory and threads."""

    dtype: str = "auto"                      # auto (config.json's), keep, bf16, fp16, fp32
    max_shard_size: str | int = "5GB"        # largest output file
    tie_word_embedding: bool | None = None   # asserted against config.json when given
    check_replicas: bool = False             # HSDP: also check the replicas are identical
    on_nonfinite: str | None = None          # NaN/Inf in the converted weights: fail or warn (None: fail with quantize)
    chunk_bytes: int | str | None = None     # memory per worker (default CKPTFLOW_CHUNK_BYTES, 64 MiB; 0: unbounded)
    workers: int = 2                         # threads reading, converting and writing tensors
    verify: bool = True                      # the round trip against the shards before publishing
    quantize: str | None = None              # fp8-block, w8a16, w4a16 (mergecore.quantize); None: plain `dtype`
    quantize_ignore: tuple[str, ...] = ()    # module patterns kept unquantized, beside each family's defaults

    def __post_init__(self):
        resolve_dtype(self.dtype, {})  # refuses an unknown name; "auto" needs config.json, read later
        if parse_size(self.max_shard_size) <= 0:
            raise CheckpointError(f"--max-shard-size {self.max_shard_size!r}: give a positive size like 5GB")
        if self.on_nonfinite is None:  # a quantized weight cannot carry NaN/Inf: with --quantize, refuse unless told
            object.__setattr__(self, "on_nonfinite", "fail" if self.quantize else "warn")
        check_nonfinite_policy(self.on_nonfinite)
        if self.chunk_bytes is not None:
            parse_chunk_bytes(self.chunk_bytes)
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise CheckpointError(f"--workers {self.workers}: give a whole number of at least 1")
        object.__setattr__(self, "quantize_ignore", tuple(self.quantize_ignore or ()))  # JSON gives a list back
        quantize_spec(self.quantize, self.quantize_ignore)  # an unknown scheme: one line, before anything is opened


@dataclass(frozen=True)
class MergeTarget:
    """Where the model goes: a folder (published by one atomic rename) or an fsspec URL (manifest last)."""

    target: str
    overwrite: bool = False  # replace a target holding another model

    def __post_init__(self):
        checked_path(self.target, "target")
        if own := own_name_in(self.target):
            raise CheckpointError(f"target {self.target!r}: {own} is a folder ckptflow keeps for itself (staging, "
                                  "results, lock); name the model's own folder")
        lock_timeout()  # what a writer waits by, for another writer of this target: refused now if unusable


_PARTS = {"what": MergeSource, "how": MergeSettings, "where": MergeTarget}


@dataclass(frozen=True)
class MergeRequest:
    """What to merge, how, and where to (`where` is None when nothing is written, e.g. `prepare`)."""

    what: MergeSource
    how: MergeSettings = field(default_factory=MergeSettings)
    where: MergeTarget | None = None

    def __post_init__(self):
        for name, kind in _PARTS.items():  # parts given as dicts (JSON, Prefect's parameter forms) become parts
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, kind(**value))

    @classmethod
    def of(cls, checkpoint: str, target: str | None = None, **options) -> MergeRequest:
        """A request from one checkpoint, an optional target and flat options, each option going to the part
        that has a field of its name (`lora` takes a `LoraSettings` or its fields as a dict)."""
        parts: dict[str, dict] = {name: {} for name in _PARTS}
        owner = {f.name: name for name, kind in _PARTS.items() for f in fields(kind)}
        for key, value in options.items():
            if key not in owner or key in ("checkpoint", "target"):
                raise TypeError(f"MergeRequest.of: unknown option {key!r} (known: {', '.join(sorted(owner))})")
            parts[owner[key]][key] = value
        if isinstance(parts["what"].get("lora"), dict):
            parts["what"]["lora"] = LoraSettings(**parts["what"]["lora"])
        where = MergeTarget(str(target), **parts["where"]) if target is not None else None
        if where is None and parts["where"]:
            raise TypeError(f"MergeRequest.of: {', '.join(parts['where'])} given without a target")
        return cls(MergeSource(str(checkpoint), **parts["what"]), MergeSettings(**parts["how"]), where)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> MergeRequest:
        return cls(**data)

    def with_source(self, **changes) -> MergeRequest:
        """The same request with parts of `what` changed (e.g. a path as Dask workers see it)."""
        return replace(self, what=replace(self.what, **changes))


def as_request(request: MergeRequest | str, **options) -> MergeRequest:
    """`request` itself, or a request for the checkpoint path `request` with `options` (a shorthand for scripts
    and tests: `prepare("ckpts/run1", dtype="bf16")`)."""
    if isinstance(request, MergeRequest):
        if options:
            raise TypeError(f"options {', '.join(options)} given beside a MergeRequest: put them in the request")
        return request
    return MergeRequest.of(str(request), **options)
