"""Views of a checkpoint under other names: fused LoRA, and the Hub's on-disk layout."""
