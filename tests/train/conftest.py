"""Fixtures of the training tests."""
from __future__ import annotations

import pytest

from elastic_job import Run


@pytest.fixture
def run(tmp_path, request):
    """An elastic DiLoCo job of its own (tests/support/elastic_job.py), named after the test."""
    r = Run(tmp_path, request.node.name[:40])
    yield r
    r.close()
