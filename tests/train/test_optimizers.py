import pytest

from logra_rl.config import OptimizerConfig
from logra_rl.train.optimizers import dense_lr_factor


def test_dense_schedule_matches_the_paper_baseline():
    config = OptimizerConfig(name="dense")
    lr = [config.lr * dense_lr_factor(i, config) for i in range(301)]
    assert lr[0] == pytest.approx(1e-6 / 9)
    assert lr[8] == pytest.approx(1e-6)
    assert lr[100] == pytest.approx(7.96e-7, rel=1e-3)
    assert lr[199] == pytest.approx(3.38e-7, rel=1e-3)
    assert lr[299] == pytest.approx(1e-7) and lr[300] == pytest.approx(1e-7)
