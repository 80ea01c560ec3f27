"""Quantized export (fp8-block, w8a16, w4a16): which weights, their output tensors, the kernels, the row-band streaming."""
