"""Prefect flows over mergecore, and the `ckptflow` command line (flows.cli)."""

from . import run_logs

run_logs.install()  # our errors are one line in Prefect's logs too, in every process that runs our flows
