"""Prefect flows over mergecore, and the `ckptflow` command line (flows.cli)."""
