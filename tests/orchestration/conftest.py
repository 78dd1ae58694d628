"""The uninterrupted run the fault tests compare against: run once per session."""

import pytest

from tests.runs import run_to_the_end, short_job


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory, quickstart_model) -> list[dict]:
    """The records of `short_job` (checkpoints every 3 steps) run to its end without a fault."""
    args = short_job(quickstart_model, checkpoint_every=3)
    return run_to_the_end(args, tmp_path_factory.mktemp("straight"), "straight")
