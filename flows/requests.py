"""What the promotion flows take: one typed request, so the Prefect UI shows it as a form and a rerun edits it.

`PromotionRequest` is the library's `MergeRequest` (what, how, where: the same parts, the same field names) plus
what only a promotion has: the reference model, the Hub push and where the groups merge. It is a pydantic model
because Prefect builds its parameter form and its validation from pydantic; `mergecore` stays free of pydantic
and Prefect, so the request is converted to the library's in one place, `PromotionRequest.merge_request`.
`PromotionSettings` is what the event and schedule flows take instead: how each of their promotions reads, merges
and pushes (role, backend, `how`, the Hub's visibility and token), filled per promotion with its place.

Nothing here holds a rule of its own: each value is checked by the library's checks (`MergeRequest`'s parts,
`check_repo_id`, `check_runner_options`) when the model is built, so a bad value is one line (`CheckpointError`)
at the CLI before Prefect starts, and a failed run with that line when a deployment or a UI rerun sends it.

>>> request = PromotionRequest(what={"checkpoint": "ckpts/run1"}, where={"target": "out/model"}, how={"dtype": "bf16"})
>>> request.merge_request().how.dtype, request.merge_request().what.role
('bf16', 'actor')
>>> PromotionRequest(what={"checkpoint": "ckpts/run1"}, where={"target": "out/model"}, how={"dtype": "bf17"})
Traceback (most recent call last):
  ...
mergecore.errors.CheckpointError: unknown --dtype 'bf17': use auto, keep, bf16, fp16 or fp32
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mergecore import LoraSettings, MergeRequest, MergeSettings, MergeSource, MergeTarget
from mergecore.hub import check_repo_id
from mergecore.serving import check_engine
from ckptflow.tasks.verify import FolderChecks

from .runners import check_runner_options


class Part(BaseModel):
    """A part of a request: immutable like the library's, and a misspelt field is refused, never dropped."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Mirror(Part):
    """A part with a counterpart in the library (`library_part`, same field names): built here, it is built there
    too, so the library's checks are its checks and no rule is written twice."""

    library_part: ClassVar[type]

    @model_validator(mode="after")
    def _library_accepts(self) -> Mirror:
        self.library()
        return self

    def library(self):
        """This part as the library's (a nested part, such as `lora`, goes as a dict: the library builds it)."""
        return self.library_part(**self.model_dump())


class Lora(Mirror):
    """How a verl FSDP LoRA checkpoint is merged (mergecore's `LoraSettings`); None: the checkpoint decides."""

    library_part = LoraSettings

    output: str | None = Field(None, description="fuse, or both (the fused model with the PEFT adapter in "
                                                 "lora_adapter/); default both")
    alpha: float | None = Field(None, description="LoRA alpha; default: the checkpoint's metadata (never guessed)")
    r: int | None = Field(None, description="LoRA rank; default: the checkpoint's metadata, else its tensors")
    target_modules: str | None = Field(None, description="comma separated; default: the adapted modules found")
    base_model: str | None = Field(None, description="save_lora_only checkpoints: the base model to fuse into")


class Source(Mirror):
    """What to merge (mergecore's `MergeSource`)."""

    library_part = MergeSource

    checkpoint: str = Field(description="role folder, global_step_N folder or run root (path or fsspec URL)")
    role: str = Field("actor", description="actor or critic, when the checkpoint is a step folder or run root")
    backend: str = Field("auto", description="auto, fsdp, megatron, megatron_legacy, megatron_dist or dcp")
    hf_dir: str | None = Field(None, description="folder with config.json when the checkpoint lacks huggingface/")
    custom_mapping: str | None = Field(None, description="JSON/YAML file of extra Megatron -> HF name patterns")
    lora: Lora = Lora()


class Settings(Mirror):
    """How to merge (the part of mergecore's `MergeSettings` a promotion takes: it always verifies)."""

    library_part = MergeSettings

    dtype: str = Field("auto", description="auto (config.json's), keep, bf16, fp16 or fp32")
    max_shard_size: str = Field("5GB", description="largest output file")
    on_nonfinite: str = Field("fail", description="NaN/Inf in the weights: fail, or warn (publish and list them)")
    quantize: str | None = Field(None, description="fp8-block, w8a16 or w4a16 (docs/quantization.md)")
    quantize_ignore: list[str] | None = Field(None, description="module patterns kept unquantized")


class Target(Mirror):
    """Where the model goes (mergecore's `MergeTarget`)."""

    library_part = MergeTarget

    target: str = Field(description="output folder (published atomically) or fsspec URL (manifest last)")
    overwrite: bool = Field(False, description="replace a target holding a different merge")


class HubPush(Part):
    """Where a promotion is pushed on the Hub."""

    repo: str = Field(description="ORG/NAME")
    revision: str | None = Field(None, description="branch, e.g. step-1000 (created if missing); default main")
    private: bool = Field(True, description="visibility of a newly created repo")
    tag: str | None = Field(None, description="also tag the pushed revision")
    token_secret: str | None = Field(None, description="Prefect Secret block holding the Hub token (default HF_TOKEN)")

    @field_validator("repo", mode="after")
    @classmethod
    def _hub_accepts(cls, repo: str) -> str:
        return check_repo_id(repo)  # the Hub's own rule, before any work: never a merge that cannot be pushed


class Runner(Part):
    """Where the units are merged: threads of this process, or a Dask cluster (flows/runners.py)."""

    task_runner: str = Field("threads", description="threads, or dask")
    dask_address: str | None = Field(None, description="scheduler of an existing Dask cluster, tcp://HOST:PORT")
    dask_workers: int | None = Field(None, description="processes of a local Dask cluster started for the run")

    @model_validator(mode="after")
    def _runs(self) -> Runner:
        check_runner_options(self.task_runner, self.dask_address, self.dask_workers)
        return self


class PromotionRequest(Part):
    """One promotion: the library's request (what, how, where), the reference it is compared with, the Hub push
    (None: no push) and the runner."""

    what: Source
    how: Settings = Settings()
    where: Target
    reference: str | None = Field(None, description="reference HF folder: compare tensors and logits with it")
    trust_remote_code: bool = Field(False, description="allow custom model code in the logits check")
    engine: str | None = Field(None, description="prove the model in the engine that serves it before it is "
                                                 "published: vllm (docs/serving.md)")
    engine_python: str | None = Field(None, description="an interpreter that has the engine (default: "
                                                        "$CKPTFLOW_ENGINE_PYTHON, else `ckptflow engine install`'s)")
    hub: HubPush | None = None
    runner: Runner = Runner()

    @field_validator("engine", mode="after")
    @classmethod
    def _known_engine(cls, engine: str | None) -> str | None:
        return engine and check_engine(engine)

    def merge_request(self) -> MergeRequest:
        """The library's request: the same parts under the same names (each was checked there as it was built)."""
        return MergeRequest(self.what.library(), self.how.library(), self.where.library())

    def folder_checks(self) -> FolderChecks:
        """What is proven of the finished folder beyond the round trip: the reference, the serving engine."""
        return FolderChecks(self.reference, self.trust_remote_code, self.engine, self.engine_python)

    @classmethod
    def of(cls, checkpoint: str, target: str, **options) -> PromotionRequest:
        """A request from a checkpoint, a target and flat options (the CLI's flags, a script's keywords), each
        option going to the part that has a field of its name, as `MergeRequest.of` does; `lora` and `hub` take
        their part's fields as a dict.

        >>> PromotionRequest.of("ckpts/run1", "out/model", dtype="bf16", hub={"repo": "acme/run1"}).hub.private
        True
        """
        parts: dict[str, dict] = {"what": {"checkpoint": checkpoint}, "how": {}, "where": {"target": target}, "runner": {}}
        owner = {name: part for part, kind in _PARTS.items() for name in kind.model_fields}
        own = set(cls.model_fields) - set(_PARTS)  # the promotion's own fields: reference, trust_remote_code, hub
        given = {}
        for key, value in options.items():
            if key in owner and key not in ("checkpoint", "target"):
                parts[owner[key]][key] = value
            elif key in own:
                given[key] = value
            else:
                known = sorted((set(owner) | own) - {"checkpoint", "target"})
                raise TypeError(f"PromotionRequest.of: unknown option {key!r} (known: {', '.join(known)})")
        return cls(**parts, **given)


_PARTS = {"what": Source, "how": Settings, "where": Target, "runner": Runner}  # parts whose fields `of` takes flat


class PromotionSettings(Part):
    """How every promotion of a deployment is read, merged and pushed, whatever checkpoint it is for; the event or
    the schedule decides the place (checkpoint, target, Hub repo and branch)."""

    role: str = Field("actor", description="actor or critic")
    backend: str = Field("auto", description="auto, fsdp, megatron, megatron_legacy, megatron_dist or dcp")
    hf_dir: str | None = Field(None, description="folder with config.json and tokenizer files for checkpoints "
                                                 "without huggingface/ (torch DCP: torchtitan, Accelerate)")
    how: Settings = Settings()
    private: bool = Field(True, description="visibility of a newly created Hub repo")
    hub_token_secret: str | None = Field(None, description="Prefect Secret block holding the Hub token "
                                                           "(default HF_TOKEN)")
    engine: str | None = Field(None, description="prove each model in the engine that serves it: vllm")
    engine_python: str | None = Field(None, description="an interpreter that has the engine")

    @field_validator("engine", mode="after")
    @classmethod
    def _known_engine(cls, engine: str | None) -> str | None:
        return engine and check_engine(engine)

    def request(self, checkpoint: str, target: str, hub_repo: str | None, revision: str | None) -> PromotionRequest:
        """The promotion of `checkpoint` to `target` (and `hub_repo`@`revision`; None: no push) with these settings."""
        hub = (HubPush(repo=hub_repo, revision=revision, private=self.private, token_secret=self.hub_token_secret)
               if hub_repo else None)
        return PromotionRequest(what=Source(checkpoint=checkpoint, role=self.role, backend=self.backend,
                                            hf_dir=self.hf_dir), how=self.how,
                                where=Target(target=target), hub=hub, engine=self.engine,
                                engine_python=self.engine_python)
