"""Megatron checkpoints read without megatron-core: verl's legacy `mp_rank_*` files and dist_ckpt, on one common base."""
