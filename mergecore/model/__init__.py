"""The published model folder's format: what a merged folder holds beside its weights, and how it is written."""
