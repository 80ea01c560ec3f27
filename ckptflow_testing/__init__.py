"""Checkpoint writers for tests, benchmarks and `ckptflow demo-checkpoint`: never imported by the merge library.

- `demo_checkpoint`: a real verl FSDP checkpoint, written by real torch.distributed (gloo) ranks.
- `large_world`: a verl FSDP2 checkpoint of hundreds or thousands of ranks, written in one process with
  torch's fake process group (real DTensor pickles), and `save_pretrained` of the model it shards.
- `megatron_fixtures` / `megatron_dist_fixtures`: legacy and dist_ckpt Megatron checkpoints re-sharded
  from Hugging Face models with mergecore's own transforms. Being the merge run backwards, they are
  evidence for nothing about the layout: tests use them for damaged or odd inputs only; layout
  evidence comes from checkpoints saved by real megatron-core (tests/mcore_dist_save.py).
"""
