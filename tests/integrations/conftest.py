"""One service for the trainer tests: the bundled corpus, one epoch, step targets of
2 micro-batches per rank (``accumulation = 2``). Each test that counts what it served
reads ``batches_served`` before and after itself; tests run one at a time."""

from __future__ import annotations

import pytest
from _service import FIXTURE, Service

#: The producer's settings, which the in-process oracle (``rank_stream``) repeats.
SETTINGS = {"accumulation": 2, "epochs": 1}


@pytest.fixture(scope="session")
def service():
    with Service(FIXTURE, serve_workers=1, **SETTINGS) as running:
        yield running
