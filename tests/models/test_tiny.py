import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from logra_rl.config import RunConfig
from logra_rl.models.loading import resolve_model_path
from logra_rl.models.tiny import build_quickstart_model


def answer_probability(model, tokenizer, text: str, answer: int) -> float:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
    with torch.no_grad():
        probabilities = model(input_ids=torch.tensor([ids])).logits[0, -1].softmax(-1)
    return float(probabilities[tokenizer.convert_tokens_to_ids(str(answer))])


def test_a_base_model_taught_to_copy_reads_the_prompt_and_is_still_at_chance_on_the_task(tmp_path):
    path = build_quickstart_model(tmp_path / "model", hidden_size=64, seed=3, format_steps=600, copy_share=0.5)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    copied = [answer_probability(model, tokenizer, f"{a}+0=?", a) for a in range(10)]
    task = [answer_probability(model, tokenizer, f"{a}+1=?", (a + 1) % 10) for a in range(10)]
    assert min(copied) > 0.9  # it reads the digit
    assert sum(task) / 10 == pytest.approx(0.1, abs=0.02)  # and has learned nothing of the task: RL's job


def test_the_run_config_builds_the_base_model_it_names(tmp_path):
    config = RunConfig.from_mapping(
        {"model": {"quickstart_format_steps": 3, "quickstart_copy_share": 0.5}, "trainer": {"seed": 2}}
    )
    built = resolve_model_path(config, tmp_path)
    same = build_quickstart_model(tmp_path / "same", seed=2, format_steps=3, copy_share=0.5)
    format_only = build_quickstart_model(tmp_path / "format_only", seed=2, format_steps=3)
    weights = [
        torch.cat([p.flatten() for p in AutoModelForCausalLM.from_pretrained(d).parameters()])
        for d in (built, same, format_only)
    ]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])
    with pytest.raises(ValueError, match="quickstart_copy_share"):
        RunConfig.from_mapping({"model": {"quickstart_copy_share": 1.5}})
