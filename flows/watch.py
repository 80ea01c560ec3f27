"""`ckptflow watch`: storage that sends no notifications, polled for new complete checkpoints.

Each poll lists the root once (`mergecore.formats.completeness.poll`); a checkpoint that is complete and unchanged
since the previous poll is announced with one `checkpoint.uploaded` event (`flows.events`), then recorded in
a state file, written atomically, so a restarted watcher neither announces it again nor forgets the sizes
it saw. A crash between the POST and the state write announces that checkpoint once more after the restart:
the promotion it triggers is then all cache hits.

>>> watcher = Watcher("s3://ckpts", "http://127.0.0.1:4200/api")      # doctest: +SKIP
>>> watcher.poll_once()                                              # doctest: +SKIP
['s3://ckpts/run1/global_step_100/actor']
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from mergecore import CheckpointError
from mergecore.formats.completeness import poll
from mergecore.storage import Location

from .events import checkpoint_event, post_events

STATE_VERSION = 1


def default_state_file(root: str) -> Path:
    """`$PREFECT_HOME/ckptflow-watch/<hash of the root URL>.json`: one state per watched root, outside it."""
    from prefect.settings import PREFECT_HOME

    key = hashlib.sha256(Location.of(root).url.encode()).hexdigest()[:16]
    return Path(PREFECT_HOME.value()).expanduser() / "ckptflow-watch" / f"{key}.json"


class Watcher:
    """Polls `root`, posts one event per complete checkpoint to `api_url`, keeps its state in `state_file`."""

    def __init__(self, root: str, api_url: str, state_file: str | os.PathLike | None = None):
        self.root = Location.of(root)
        self.api_url = api_url
        self.state_file = Path(state_file) if state_file else default_state_file(self.root.url)
        self.state = self._load()

    def poll_once(self) -> list[str]:
        """One look at the root; returns the checkpoints announced by it."""
        seen = poll(self.root, self.state["sizes"])
        fresh = [url for url in seen.complete if url not in self.state["announced"]]
        if fresh:
            post_events(self.api_url, [checkpoint_event(url) for url in fresh])
        self.state["announced"].update({url: time.time() for url in fresh})
        self.state["sizes"] = {url: sizes for url, sizes in seen.sizes.items() if url not in self.state["announced"]}
        self._save()
        return fresh

    def run(self, interval_s: float, announced: Callable[[str], None] = lambda url: None,
            stop: Callable[[], bool] = lambda: False) -> None:
        """Poll every `interval_s` seconds until `stop()` (or for ever)."""
        while not stop():
            started = time.monotonic()
            for url in self.poll_once():
                announced(url)
            time.sleep(max(0.0, interval_s - (time.monotonic() - started)))

    def _load(self) -> dict:
        empty = {"version": STATE_VERSION, "root": self.root.url, "announced": {}, "sizes": {}}
        try:
            state = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return empty
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{self.state_file}: unreadable watch state ({type(error).__name__}); delete it "
                                  "(every complete checkpoint is then announced again) or pass another --state") from None
        if not _well_formed(state):
            raise CheckpointError(f"{self.state_file}: not a watch state (an object with a root, the announced "
                                  "checkpoints and the sizes seen); delete it (every complete checkpoint is then "
                                  "announced again) or pass another --state")
        if state.get("root") != self.root.url:
            raise CheckpointError(f"{self.state_file}: this state belongs to the root {state.get('root')!r}, not "
                                  f"{self.root.url!r}; pass a --state file of its own for each root")
        return {**empty, **state}

    def _save(self) -> None:
        """Write the state atomically: a temporary file beside it, fsynced, renamed over it."""
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=self.state_file.parent, prefix=self.state_file.name + ".")
        try:
            with os.fdopen(handle, "w") as stream:
                json.dump(self.state, stream)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(partial, self.state_file)
        finally:
            Path(partial).unlink(missing_ok=True)


def _well_formed(state) -> bool:
    """Whether a state file's JSON has the shape `Watcher` writes: {"announced": {url: time}, "sizes": {url: {...}}}
    (either may be missing)."""
    if not isinstance(state, dict):
        return False
    announced, sizes = state.get("announced", {}), state.get("sizes", {})
    return (isinstance(announced, dict) and all(isinstance(t, (int, float)) for t in announced.values())
            and isinstance(sizes, dict) and all(isinstance(seen, dict) and all(isinstance(n, int) for n in seen.values())
                                                for seen in sizes.values()))
