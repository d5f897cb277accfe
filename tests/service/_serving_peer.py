"""A pack worker that plans honestly but serves consumers wrongly (tests only).

``python tests/service/_serving_peer.py MODE WORKER-FLAGS...`` runs ``streampack worker``
with one change, by MODE:

- ``tamper``: every batch it serves has its first token changed (a worker that alters
  one token of a batch: the consumer must catch it before yielding the batch);
- ``hang``: it accepts a consumer's ``get`` and never answers.

Its plans are exactly the contract's (the producer accepts them), so the only fault is
on the data plane.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from streampack import cli
from streampack.service import worker
from streampack.service.store import BatchStore


class TamperingStore(BatchStore):
    def take(self, key: Any, now: float) -> Any:
        batch = super().take(key, now)
        if batch is None:
            return None
        tokens = batch.tokens.copy()
        tokens[0] = (int(tokens[0]) + 1) % batch.binding.vocab_size
        return dataclasses.replace(batch, tokens=tokens)


class ServingPeer(worker.Worker):
    mode = ""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        if self.mode == "tamper":
            self.store = TamperingStore(settings.store_bytes, settings.store_seconds)

    def handle_get(self, serving: Any) -> None:
        if self.mode == "hang":
            serving.recv_multipart()  # taken, never answered
            return
        super().handle_get(serving)


if __name__ == "__main__":
    ServingPeer.mode = sys.argv[1]
    assert ServingPeer.mode in ("tamper", "hang"), sys.argv
    worker.Worker = ServingPeer  # type: ignore[misc]
    sys.exit(cli.main(["worker", *sys.argv[2:]]))
