"""What the two Megatron readers (legacy `mp_rank_*` files, dist_ckpt) share: config.json, the mapping table of
the checkpoint's family (`mergecore.families.registry`) with a user's custom rows on top, whether it is a value
model, and the transform that merges each mapped parameter.

A reader says only how many rows its saved `output_layer.weight` has (`_output_rows`); the rest is here:

>>> MegatronReader.value_model({"architectures": ["Qwen2ForTokenClassification"]}, None)
True
>>> MegatronReader.value_model({"vocab_size": 1000}, 1000)
False
"""

from __future__ import annotations

from functools import cached_property

from ...errors import CheckpointError
from ...families.megatron_maps import Mapped, find, load_custom_mapping
from ...families.registry import names_value_head, table_for
from ...families.transforms import Replicated, ReplicatedGatedMLP, Transform, VocabParallel, make_transform
from ..base import read_hf_config


class MegatronReader:
    """Mixin of both Megatron readers; they set `hf_dir` and `custom_mapping` and define `_output_rows` and
    `saved_parameters`."""

    custom_mapping: str | None

    def _output_rows(self) -> int | None:
        """Rows of the saved `output_layer.weight` (one TP rank's, for legacy files), None when there is none."""
        raise NotImplementedError

    def saved_parameters(self) -> dict[str, str]:
        """Every saved parameter as the tables name it (legacy-style) -> as the checkpoint shows it."""
        raise NotImplementedError

    def unplaced(self) -> list[str]:
        """The saved parameters no row of the mapping table places (for `ckptflow inspect`); a family with no
        table at all is the mapping table's one-line error."""
        table = self._table
        return sorted({shown for key, shown in self.saved_parameters().items() if find(key, table) is None})

    @cached_property
    def config(self) -> dict:
        return read_hf_config(self)

    @staticmethod
    def value_model(config: dict, output_rows: int | None) -> bool:
        """A critic: named so by config.json (the registry's `VALUE_HEADS`), or an output layer of one row over a
        vocabulary of many."""
        if names_value_head(config):
            return True
        vocab = config.get("vocab_size")
        return output_rows == 1 and vocab is not None and int(vocab) > 1

    def _is_value_model(self) -> bool:
        return self.value_model(self.config, self._output_rows())

    @cached_property
    def _table(self):
        custom = load_custom_mapping(self.custom_mapping) if self.custom_mapping else None
        return table_for(self.config, custom, self._is_value_model(), self.hf_dir.join("config.json"))

    def _make_transform(self, mapped: Mapped, shape: tuple[int, ...], tp: int = 1) -> Transform:
        """The transform of one saved parameter of `shape` (one TP rank's piece), sized from config.json."""
        kind, config = mapped.kind, self.config
        try:
            if kind == "vocab":
                return VocabParallel(int(config["vocab_size"]), padded_size=shape[0] * tp)
            moe = config.get("moe_intermediate_size")
            if tp > 1 and ".mlp.experts." in mapped.pattern and isinstance(moe, int) and kind in ("gated", "row"):
                # expert_tensor_parallel_size=1: every TP rank holds whole experts
                if kind == "gated" and shape[0] == 2 * moe:
                    return ReplicatedGatedMLP()
                if kind == "row" and len(shape) == 2 and shape[1] == moe:
                    return Replicated()
            return make_transform(kind, config)
        except (KeyError, ValueError) as err:
            raise CheckpointError(f"{self.hf_dir.join('config.json')}: cannot size a {kind} tensor ({err})") from None

    @staticmethod
    def hf_names(mapped: Mapped, transform: Transform, shown: str, key: str,
                 indices: tuple[int, ...] | None = None) -> tuple[str, ...]:
        """The Hugging Face names of `key`, one per part of its transform (a table row naming another count fails)."""
        names = mapped.hf_names(indices)
        if len(names) != len(transform.parts):
            raise CheckpointError(
                f"{shown}: {key} maps to {len(names)} Hugging Face names but a {mapped.kind} tensor holds "
                f"{len(transform.parts)} ({', '.join(transform.parts)}); fix the mapping"
            )
        return names
