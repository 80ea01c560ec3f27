"""Proofs that a published model is what was trained: the round trip, the manifest, reference tensors and logits."""
