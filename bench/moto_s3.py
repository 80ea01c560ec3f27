"""A local moto S3 server for the object-storage benches, with this process pointed at it.

    server, env = start_moto()   # env: this process's environment, to hand to the subprocesses timed
    ...
    server.stop()
"""

from __future__ import annotations

import os
import socket


def start_moto():
    """Start moto's threaded S3 server on a free local port, set `AWS_*` and `FSSPEC_S3_ENDPOINT_URL` (fsspec
    passes it to s3fs as endpoint_url) in this process, and return (server, a copy of the environment)."""
    import fsspec.config
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      FSSPEC_S3_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    fsspec.config.set_conf_env(fsspec.config.conf)  # fsspec read its environment when first imported
    return server, dict(os.environ)
