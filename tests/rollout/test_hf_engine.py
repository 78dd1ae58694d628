"""The HF rollout engine: sampling log-probs, payload merges, refusals, full resync."""

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from logra_rl.logra import LoGRAConfig, LoGRAOptimizer
from logra_rl.rollout import EngineSpec, SamplingParams
from logra_rl.rollout.hf_engine import HFEngine

TARGETS = LoGRAConfig().target_modules


def hf_engine(path, dtype: str, residual: str) -> HFEngine:
    spec = EngineSpec(str(path), dtype, residual, TARGETS, merge_chunk_rows=256, device="cpu")
    return HFEngine(spec)


def prompts(engine, digits=(1, 5, 9)):
    template = engine.tokenizer.apply_chat_template
    return [
        list(template([{"role": "user", "content": f"{d}+1=?"}], add_generation_prompt=True)["input_ids"])
        for d in digits
    ]


def test_generate_returns_the_sampling_logprobs(quickstart_model):
    engine = hf_engine(quickstart_model, "float32", "none")
    params = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=4, n=2)
    completions = engine.generate(prompts(engine), params, seed=3)
    assert len(completions) == 6
    assert completions == engine.generate(prompts(engine), params, seed=3)  # seeded
    eos = engine.tokenizer.eos_token_id
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) > 0
        assert c.finished == (c.token_ids[-1] == eos)
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1] / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_recorded_logprobs_equal_the_full_scores_under_top_p(quickstart_model):
    """Recording while generating (one vocab row kept) gives the tokens and log-probs that keeping every
    step's processed scores would (`output_scores` + `compute_transition_scores`), top-p included."""
    engine = hf_engine(quickstart_model, "float32", "none")
    params = SamplingParams(temperature=0.7, top_p=0.7, max_new_tokens=6, n=3)
    completions = engine.generate(prompts(engine), params, seed=11)
    rows = [p for p in prompts(engine) for _ in range(3)]
    width = max(len(r) for r in rows)
    torch.manual_seed(11)
    out = engine.model.generate(
        input_ids=torch.tensor([[engine.pad_id] * (width - len(r)) + r for r in rows]),
        attention_mask=torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]),
        do_sample=True,
        temperature=0.7,
        top_p=0.7,
        top_k=0,
        max_new_tokens=6,
        eos_token_id=engine.stop_ids,
        pad_token_id=engine.pad_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    full = engine.model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    for row, completion in enumerate(completions):
        length = len(completion.token_ids)
        assert completion.token_ids == out.sequences[row, width : width + length].tolist()
        torch.testing.assert_close(torch.tensor(completion.logprobs), full[row, :length], rtol=0, atol=1e-6)
    assert any(not math.isclose(v, 0.0) for c in completions for v in c.logprobs)


def test_payloads_keep_bf16_weights_equal_to_rounded_master(quickstart_model):
    engine = hf_engine(quickstart_model, "bfloat16", "float32")
    trainer = AutoModelForCausalLM.from_pretrained(quickstart_model, dtype=torch.float32)
    opt = LoGRAOptimizer(trainer, LoGRAConfig(rank=8, seed=2, update_ratio=1e-3))
    engine.load_weights(trainer.state_dict(), version=0)
    ids = torch.tensor(prompts(engine))
    payloads = []
    for _ in range(3):
        trainer(input_ids=ids).logits.logsumexp(-1).sum().backward()
        opt.prepare(num_tokens=ids.numel())
        # as Ray delivers a PayloadRef: a read-only uint8 view of the object store
        payloads.append(np.frombuffer(bytes(opt.commit(1.0).to_bytes()), dtype=np.uint8))
        assert engine.apply_payload(payloads[-1]).applied
    assert engine.version == 3
    modules = dict(trainer.named_modules())
    for name, weight in engine.merger.weights.items():
        assert torch.equal(weight, modules[name].weight.detach().to(torch.bfloat16)), name
    stale = engine.apply_payload(payloads[1])
    assert not stale.applied and "stale" in stale.reason and stale.version == 3
    corrupted = payloads[2].copy()
    corrupted[-1] ^= 0xFF
    broken = engine.apply_payload(corrupted)  # reported, not raised: the controller resyncs
    assert not broken.applied and "PayloadFormatError" in broken.reason and engine.version == 3
    coordinates = {name: (torch.tensor([0, 3]), torch.tensor([1, 2])) for name in list(engine.merger.weights)[:2]}
    values = engine.weights_at(coordinates)
    for name, (rows, cols) in coordinates.items():
        assert torch.equal(values[name], modules[name].weight.detach()[rows, cols].to(torch.bfloat16).float())


def test_full_resync_resets_version_and_weights(quickstart_model):
    engine = hf_engine(quickstart_model, "bfloat16", "float32")
    master = AutoModelForCausalLM.from_pretrained(quickstart_model, dtype=torch.float32).state_dict()
    master = {k: v + 0.01 for k, v in master.items()}
    result = engine.load_weights(master, version=7)
    assert result.applied and engine.version == 7
    for name, weight in engine.model.state_dict().items():
        assert torch.equal(weight, master[name].to(torch.bfloat16)), name


def test_resync_from_read_only_arrays_as_the_object_store_serves_them(quickstart_model):
    """The trainer sends numpy arrays, read without a copy from Ray's shared memory (read-only views)."""
    engine = hf_engine(quickstart_model, "bfloat16", "float32")
    master = AutoModelForCausalLM.from_pretrained(quickstart_model, dtype=torch.float32).state_dict()
    master = {k: v + 0.01 for k, v in master.items()}
    arrays = {k: v.numpy().copy() for k, v in master.items()}
    for array in arrays.values():
        array.setflags(write=False)
    assert engine.load_weights(arrays, version=3).version == 3
    for name, weight in engine.model.state_dict().items():
        assert torch.equal(weight, master[name].to(torch.bfloat16)), name
    for name, target in engine.merger.targets.items():
        assert torch.equal(target.weight.float() + target.residual, master[f"{name}.weight"]), name
    assert all(torch.equal(torch.from_numpy(arrays[k].copy()), master[k]) for k in master)  # only read


def test_resync_in_buckets_sets_the_version_only_when_every_weight_arrived(quickstart_model):
    engine = hf_engine(quickstart_model, "bfloat16", "float32")
    master = AutoModelForCausalLM.from_pretrained(quickstart_model, dtype=torch.float32).state_dict()
    master = {k: v + 0.01 for k, v in master.items()}
    keys = list(master)
    buckets = [keys[i : i + 5] for i in range(0, len(keys), 5)]
    for index, bucket in enumerate(buckets[:-1]):
        assert engine.load_weights({k: master[k] for k in bucket}, 4, index, len(buckets)).version == 0
        assert engine.merger.needs_resync  # half-loaded weights take no payload
    assert engine.load_weights({k: master[k] for k in buckets[-1]}, 4, len(buckets) - 1, len(buckets)).version == 4
    assert not engine.merger.needs_resync
    for name, weight in engine.model.state_dict().items():
        assert torch.equal(weight, master[name].to(torch.bfloat16)), name
    for name, target in engine.merger.targets.items():  # exact residuals: W + R is the fp32 master
        assert torch.equal(target.weight.float() + target.residual, master[f"{name}.weight"]), name

    engine.load_weights({k: master[k] for k in buckets[0]}, 5, 0, 2)
    with pytest.raises(KeyError, match="full resync ended without weights") as refused:
        engine.load_weights({k: master[k] for k in buckets[2]}, 5, 1, 2)  # bucket 1 never sent
    assert sorted(set(keys) - set(buckets[0]) - set(buckets[2]))[0] in str(refused.value)
    assert engine.version == 4 and engine.merger.needs_resync


def test_resync_of_a_tied_model_sends_the_shared_embedding_once(tmp_path):
    from logra_rl.models.tiny import char_tokenizer, tiny_model

    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = hf_engine(str(tmp_path), "bfloat16", "float32")
    master = {k: v + 0.01 for k, v in model.state_dict().items() if k != "lm_head.weight"}

    assert engine.load_weights(master, version=2).version == 2
    assert torch.equal(engine.model.lm_head.weight, master["model.embed_tokens.weight"].to(torch.bfloat16))
