"""Numbers: arrays, dtypes and their casts, the memory budget, NaN/Inf checks, sizes a file claims."""
