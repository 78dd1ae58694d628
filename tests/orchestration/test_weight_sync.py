"""WeightSync's answer to engines restarted mid-call (no Ray: a scripted train group and rollout group)."""

from logra_rl.config import RunConfig
from logra_rl.orchestration.rollout_group import EnginesRestarted
from logra_rl.orchestration.weight_sync import WeightSync
from logra_rl.rollout import SyncResult
from logra_rl.train.api import ResyncBucket


class Train:
    def resync_buckets(self, max_bytes):
        return [ResyncBucket(("a",), 4), ResyncBucket(("b",), 4), ResyncBucket(("c",), 4)]

    def resync_bucket(self, bucket):
        return bucket.keys


class Rollout:
    """Two engines; `lose` lists (call number, engines) at which load_weights / generate lose engines."""

    def __init__(self, lose):
        self.lose = dict(lose)
        self.calls = []

    def __len__(self):
        return 2

    def _call(self, name, engines):
        self.calls.append((name, engines))
        lost = self.lose.pop(len(self.calls), None)
        if lost:
            raise EnginesRestarted(lost, "killed")

    def load_weights(self, state, version, bucket, buckets, engines=None):
        self._call(f"load {state[0]}", engines)
        return {e: SyncResult(True, version) for e in engines or range(2)}

    def generate(self):
        self._call("generate", None)
        return "samples"


def test_an_engine_lost_during_a_resync_restarts_that_resync_and_a_lost_call_is_asked_again():
    config = RunConfig.from_mapping({"optimizer": {"name": "dense"}})
    rollout = Rollout({2: [1], 6: [0], 7: [0]})  # bucket b of the first resync; the generate; its resync's bucket a
    sync = WeightSync(config, Train(), rollout, {})
    assert sync.full_resync(version=3) == 12
    assert sync.retried(rollout.generate) == "samples"
    assert [name for name, _ in rollout.calls] == [
        *("load a", "load b"),  # engine 1 lost: the resync starts again from its first bucket, for every engine
        *("load a", "load b", "load c"),
        "generate",  # engine 0 lost: resynced alone ...
        "load a",  # ... lost again during that resync: started again, never nested
        *("load a", "load b", "load c"),
        "generate",  # ... and asked again
    ]
    assert [engines for _, engines in rollout.calls[6:10]] == [[0]] * 4
    assert sync.engine_versions == [3, 3] and sync.version == 3
