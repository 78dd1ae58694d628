import pytest

from logra_rl.logra import KLConfig, LoGRAConfig


def test_defaults_are_the_reference_port_defaults():
    config = LoGRAConfig()
    assert (config.rank, config.seed, config.distribution, config.refresh) == (256, 1, "rademacher", True)
    assert config.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert (config.beta2, config.epsilon, config.update_ratio, config.wire_dtype) == (0.95, 1e-8, 6e-5, "bfloat16")
    kl = config.kl
    assert (kl.budget, kl.final_budget, kl.schedule, kl.schedule_steps, kl.alpha_max) == (
        2e-4,
        2e-5,
        "cosine",
        300,
        3.0,
    )
    assert (kl.probe_responses, kl.probe_max_tokens) == (2, 4096)
    # ours: the guard on 16 random responses per rank, proposals from its own measurements
    assert (kl.estimator, kl.guard_responses, kl.guard_confidence, kl.max_overshoot) == ("previous", 16, 0.9, 1.5)
    assert (kl.mismatch_subtraction, kl.mismatch_ema_weight, kl.mismatch_budget_floor) == (True, 0.3, 0.5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": 2.5}, "rank"),
        ({"seed": -1}, "seed"),
        ({"distribution": "uniform"}, "distribution"),
        ({"target_modules": []}, "target_modules"),
        ({"target_modules": "q_proj"}, "target_modules"),
        ({"beta2": 1.0}, "beta2"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"update_ratio": -6e-5}, "update_ratio"),
        ({"update_ratio": float("nan")}, "update_ratio"),
        ({"wire_dtype": "float16"}, "wire_dtype"),
        ({"kl": {"budget": 0.0}}, "kl.budget"),
        ({"kl": {"schedule": "linear"}}, "kl.schedule"),
        ({"kl": {"estimator": "exact"}}, "kl.estimator"),
        ({"kl": {"alpha_max": float("inf")}}, "kl.alpha_max"),
        ({"kl": {"mismatch_ema_weight": 0.0}}, "kl.mismatch_ema_weight"),
        ({"kl": {"probe_responses": 0}}, "kl.probe_responses"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"config: logra\.{field}="):
        LoGRAConfig(**kwargs)


def test_from_dict_round_trip_and_unknown_keys():
    config = LoGRAConfig(rank=8, target_modules=("q_proj",), kl=KLConfig(estimator="finite_difference"))
    assert LoGRAConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['logra.rnak'\]"):
        LoGRAConfig.from_dict({"rnak": 8})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['logra.kl.budjet'\]"):
        LoGRAConfig.from_dict({"kl": {"budjet": 1e-4}})
