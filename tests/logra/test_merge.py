"""Rollout-side merges: bit-exact tracking of the trainer, version gating, refusal without side effects."""

import dataclasses

import pytest
import torch

import logra_rl.logra.merge as merge_module
from logra_rl.config import OptimizerConfig
from logra_rl.logra import (
    AdapterEntry,
    AdapterPayload,
    LoGRAConfig,
    LoGRAOptimizer,
    MergeTarget,
    PayloadMerger,
    PayloadRefused,
    UpdatePayload,
    adapter_change,
    hf_targets,
    join_master,
    make_projection,
    merge_low_rank_,
    parse_payload,
    split_master,
)
from logra_rl.logra.merge import low_rank_change, new_residual, rademacher_signs, row_chunks
from logra_rl.train.lora import adapter_payload, add_lora, lora_layers, merged_state
from tests.tiny_models import random_batch, tiny_qwen3, token_sum_loss


class Trainer:
    """A tiny Qwen3 trained by LoGRA; each step returns the payload, as bytes on the wire."""

    def __init__(self, seed=0, **config):
        self.model = tiny_qwen3(seed=seed)
        self.opt = LoGRAOptimizer(self.model, LoGRAConfig(rank=8, seed=7, **config))
        self.step_index = 0

    def master(self):
        return {t.name: t.module.weight.detach() for t in self.opt.targets}

    def step(self, alpha=2.0):
        batch = random_batch(2, 16, seed=self.step_index)
        self.step_index += 1
        token_sum_loss(self.model, batch).backward()
        self.opt.prepare(num_tokens=batch[:, 1:].numel())
        return UpdatePayload.from_bytes(self.opt.commit(alpha).to_bytes())


def rollout_copy(master, residual_dtype):
    weights = {name: torch.empty_like(w, dtype=torch.bfloat16) for name, w in master.items()}
    merger = PayloadMerger(hf_targets(weights, residual_dtype))
    merger.resync(master, version=0)
    return merger


def snapshot(merger):
    tensors = [t.weight for t in merger.targets.values()] + [t.residual for t in merger.targets.values()]
    return [t.clone() for t in tensors if t is not None]


def test_fifty_payloads_keep_bf16_copy_equal_to_rounded_master():
    trainer = Trainer()
    exact = rollout_copy(trainer.master(), "float32")
    plain = rollout_copy(trainer.master(), "none")
    initial = {name: w.clone() for name, w in trainer.master().items()}
    for _ in range(50):
        payload = trainer.step()
        exact.apply(payload)
        plain.apply(payload)
        for name, master in trainer.master().items():
            assert torch.equal(exact.weights[name], master.to(torch.bfloat16)), name
    assert exact.version == plain.version == trainer.opt.policy_version == 50
    # without the residual, the bf16 copy lost most of the accumulated update
    lost = sum(
        (plain.weights[n].float() - m).norm() ** 2 / (m - initial[n]).norm() ** 2 for n, m in trainer.master().items()
    )
    assert float(lost) / len(initial) > 0.1


def bits(x):
    return x.float().view(torch.int32)


def ties_rounded_to_even_below(master):
    """Masters exactly halfway between two bf16 values whose even neighbour is the lower one (toward −∞)."""
    pattern = bits(master)
    return ((pattern & 0xFFFF) == 0x8000) & (((pattern >> 16) & 1) == (pattern < 0).int())


def edge_values():
    """Binade edges, zeros, subnormals, exact ties of either parity, huge and tiny, of both signs."""
    one_ulp_fp32 = torch.tensor([0x3F7FFFFF, 0x3F800000, 0x3F800001, 0x3FFFFFFF, 0x40000000], dtype=torch.int32)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x00008000, 0x00018000, 0x7F7E8000, 0x7F7F8000], dtype=torch.int32)
    subnormals = [0x00000001, 0x00007FFF, 0x0000FFFF, 0x00010000, 0x007FFFFF, 0x00800000]
    subnormals = torch.tensor(subnormals, dtype=torch.int32)
    positive = torch.cat([one_ulp_fp32, ties, subnormals]).view(torch.float32)
    special = torch.tensor([0.0, 1e-30, 3e38, 1e-3, 0.1, 1 / 3])
    values = torch.cat([positive, special, torch.randn(4096, generator=torch.Generator().manual_seed(0))])
    return torch.cat([values, -values])


def test_tail_reconstructs_every_master_bit_for_bit():
    master = edge_values()
    weight, tail = split_master(master)
    assert weight.dtype == torch.bfloat16 and tail.dtype == torch.int16
    assert torch.equal(bits(join_master(weight, tail)), bits(master))  # -0.0 and subnormals included
    ties = ties_rounded_to_even_below(master)
    assert int(ties.sum()) == 6  # +0x3F808000, +0x00008000, +0x7F7E8000 and -0x3F818000, -0x00018000, -0x7F7F8000
    rounded = master.to(torch.bfloat16)
    assert torch.equal(bits(weight)[~ties], bits(rounded)[~ties])
    # at a tie: the other nearest neighbour, the one toward +inf, and the tail at -2^15
    assert bool((weight[ties].float() > rounded[ties].float()).all())
    assert bool((tail[ties] == -(2**15)).all())
    near = ties & rounded.isfinite()  # -0x7F7F8000: round-to-nearest-even overflows to -inf, the tail does not
    assert torch.equal((weight.float() - master).abs()[near], (rounded.float() - master).abs()[near])


def test_tail_merges_across_binade_edges_zeros_and_subnormals_track_the_fp32_master():
    """The trainer's fp32 merge and a bf16 + tail copy, fed steps that cross powers of two and zero."""
    values = edge_values()
    half = len(values) // 2  # the second half is the first negated
    master = torch.cat([values[:32], values[half : half + 32]]).reshape(8, 8).clone()
    weight, tail = split_master(master)
    generator = torch.Generator().manual_seed(1)
    for step in range(40):
        scale = 10.0 ** -(step % 8)  # from moves of whole binades down to sub-ulp nudges
        factor = (torch.randn(8, 2, generator=generator) * scale).to(torch.bfloat16).float()
        projection = torch.randn(2, 8, generator=generator)
        merge_low_rank_(master, factor, projection, chunk_rows=3)
        merge_low_rank_(weight, factor, projection, tail, chunk_rows=3)
        assert torch.equal(bits(join_master(weight, tail)), bits(master)), step
        assert torch.equal(weight, split_master(master)[0]), step


def test_two_hundred_payloads_keep_bf16_plus_tail_equal_to_the_master():
    trainer = Trainer()
    tail = rollout_copy(trainer.master(), "tail")
    exact = rollout_copy(trainer.master(), "float32")
    tie_count = 0
    for _ in range(200):
        payload = trainer.step()
        tail.apply(payload)
        exact.apply(payload)
    for name, master in trainer.master().items():
        target = tail.targets[name]
        assert torch.equal(bits(join_master(target.weight, target.residual)), bits(master)), name
        ties = ties_rounded_to_even_below(master)
        tie_count += int(ties.sum())
        differs = target.weight != master.to(torch.bfloat16)
        assert torch.equal(differs, ties), name  # bf16(master) everywhere but at exact ties
        assert torch.equal(exact.weights[name], master.to(torch.bfloat16)), name
    assert tail.version == trainer.opt.policy_version == 200
    print(f"exact ties after 200 updates: {tie_count}")


def test_a_tail_residual_needs_bf16_weights():
    assert hf_targets({"w": torch.zeros(2, 2)}, "tail")["w"].residual is None  # fp32: its own master
    with pytest.raises(ValueError, match="residual=tail is exact for bfloat16 weights"):
        hf_targets({"w": torch.zeros(2, 2, dtype=torch.float16)}, "tail")


def test_payloads_into_an_fp32_copy_track_master_exactly():
    trainer = Trainer()
    copy = {name: w.clone() for name, w in trainer.master().items()}
    merger = PayloadMerger(hf_targets(copy, "none"))
    for _ in range(5):
        merger.apply(trainer.step())
    assert merger.version == 5
    assert all(torch.equal(copy[name], w) for name, w in trainer.master().items())


def test_merge_with_fp32_residual_is_exact_on_random_updates():
    generator = torch.Generator().manual_seed(0)
    master = torch.randn(300, 48, generator=generator) * 0.02
    weight, residual = master.to(torch.bfloat16), torch.zeros(300, 48)
    residual.copy_(master - weight.float())
    for _ in range(20):
        factor = (torch.randn(300, 4, generator=generator) * 1e-5).to(torch.bfloat16)
        projection = torch.randn(4, 48, generator=generator)
        merge_low_rank_(master, factor, projection, chunk_rows=64)
        merge_low_rank_(weight, factor, projection, residual, chunk_rows=64)
        assert torch.equal(weight.float() + residual, master)
        assert torch.equal(weight, master.to(torch.bfloat16))


def test_merges_are_bit_identical_whatever_the_chunking_shards_or_reduction_order():
    """The trainer's FSDP shards and an engine's fused / TP blocks cut rows differently, and a GPU GEMM
    picks its reduction order by shape. Every element's change must not depend on any of it."""
    generator = torch.Generator().manual_seed(3)
    rows, cols, rank = 301, 96, 64
    master = torch.randn(rows, cols, generator=generator) * 0.02
    projection = make_projection(rank, cols, seed=5)
    factors = [(torch.randn(rows, rank, generator=generator) * 1e-4).to(torch.bfloat16) for _ in range(4)]
    factors[0][:, :8] *= 1e-6  # rows of U spanning many orders of magnitude
    trainer = master.clone()  # 2 FSDP shards of 151 and 150 rows, chunks of 7 rows
    engine_weight = master.to(torch.bfloat16)  # one engine, 2 TP shards of 100 + 201 rows, chunks of 256
    engine_residual = master - engine_weight.float()
    for factor in factors:
        for start, stop in ((0, 151), (151, rows)):
            merge_low_rank_(trainer[start:stop], factor[start:stop], projection, chunk_rows=7, row_offset=start)
        for start, stop in ((0, 100), (100, rows)):
            block = slice(start, stop)
            merge_low_rank_(engine_weight[block], factor[block], projection, engine_residual[block], chunk_rows=256)
    assert torch.equal(engine_weight.float() + engine_residual, trainer)
    assert torch.equal(engine_weight, trainer.to(torch.bfloat16))
    # the reduction over the rank in another order (a split-K kernel) gives the same bits
    permutation = torch.randperm(rank, generator=generator)
    change = low_rank_change(factors[1], projection, rademacher_signs(projection))
    permuted = low_rank_change(
        factors[1][:, permutation], projection[permutation], rademacher_signs(projection[permutation])
    )
    assert torch.equal(change, permuted)
    row_by_row = torch.cat(
        [low_rank_change(factors[1][i : i + 1], projection, rademacher_signs(projection)) for i in range(rows)]
    )
    assert torch.equal(change, row_by_row)


def test_duplicate_stale_out_of_order_and_foreign_payloads_are_refused_untouched():
    trainer = Trainer()
    merger = rollout_copy(trainer.master(), "float32")
    first, second, third = trainer.step(), trainer.step(), trainer.step()
    merger.apply(first)
    merger.apply(second)
    before = snapshot(merger)
    refusals = {
        "duplicate": (second, "duplicate or stale"),
        "stale": (first, "duplicate or stale"),
        "out-of-order": (trainer.step(), "out-of-order"),  # version 3 -> 4 while at 2
        "fingerprint": (dataclasses.replace(third, fingerprint="0" * 32), "fingerprint mismatch"),
        "other seed": (dataclasses.replace(third, base_seed=8), "fingerprint mismatch"),
        "unknown module": (
            dataclasses.replace(third, entries=(dataclasses.replace(third.entries[0], name="lm_head"),)),
            "do not hold",
        ),
        "shape": (
            dataclasses.replace(third, entries=(dataclasses.replace(third.entries[0], k_in=65),)),
            "payload shape",
        ),
    }
    for case, (payload, message) in refusals.items():
        with pytest.raises(PayloadRefused, match=message):
            merger.apply(payload)
        assert merger.version == 2 and not merger.needs_resync, case
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(merger), strict=True)), case
    merger.apply(third)
    assert merger.version == 3


def test_failure_during_apply_demands_a_resync(monkeypatch):
    trainer = Trainer()
    merger = rollout_copy(trainer.master(), "float32")
    payload = trainer.step()
    calls = []
    real_merge = merge_module.merge_low_rank_

    def failing_merge(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        real_merge(*args, **kwargs)

    monkeypatch.setattr(merge_module, "merge_low_rank_", failing_merge)
    with pytest.raises(RuntimeError, match="device lost"):
        merger.apply(payload)
    assert merger.needs_resync and merger.version == 0
    monkeypatch.setattr(merge_module, "merge_low_rank_", real_merge)
    with pytest.raises(PayloadRefused, match="need a full resync"):
        merger.apply(payload)
    merger.resync(trainer.master(), version=trainer.opt.policy_version)
    assert not merger.needs_resync and merger.version == 1
    merger.apply(trainer.step())
    assert all(torch.equal(merger.weights[n], w.to(torch.bfloat16)) for n, w in trainer.master().items())


def test_invalid_residual_dtype():
    with pytest.raises(ValueError, match="residual_dtype='int8'"):
        hf_targets({}, residual_dtype="int8")


def test_a_shard_merges_its_rows_in_the_same_chunks_as_the_full_weight():
    """Chunks start at global multiples of chunk_rows, so each row is computed in the same GEMM shape everywhere."""
    assert row_chunks(300, 64) == [slice(0, 64), slice(64, 128), slice(128, 192), slice(192, 256), slice(256, 300)]
    assert row_chunks(150, 64, row_offset=150) == [slice(0, 42), slice(42, 106), slice(106, 150)]  # global 192, 256
    assert row_chunks(10, 64, row_offset=128) == [slice(0, 10)]
    generator = torch.Generator().manual_seed(1)
    full = torch.randn(300, 48, generator=generator)
    factor = torch.randn(300, 4, generator=generator).to(torch.bfloat16)
    projection = torch.randn(4, 48, generator=generator)
    expected = full.clone()
    merge_low_rank_(expected, factor, projection, chunk_rows=64)
    shards = [full[:150].clone(), full[150:].clone()]
    merge_low_rank_(shards[0], factor[:150], projection, chunk_rows=64, row_offset=0)
    merge_low_rank_(shards[1], factor[150:], projection, chunk_rows=64, row_offset=150)
    assert torch.equal(torch.cat(shards), expected)


def test_default_chunks_are_sized_from_the_full_width_and_change_no_bit(monkeypatch):
    """merge_chunk_rows=0 cuts chunks of about CHUNK_ELEMENTS elements from the module's full width, so a
    column block of a row-parallel weight (TP) cuts the rows the full weight does; any chunking gives the same
    bits (the tail residual included), which is what lets a GPU use few large chunks."""
    monkeypatch.setitem(merge_module.CHUNK_ELEMENTS, "cpu", 48 * 40)  # 40 rows of the full 48 columns
    assert merge_module.chunk_rows_for(0, 48, torch.device("cpu")) == 40
    assert merge_module.chunk_rows_for(0, 24, torch.device("cpu")) == 80  # what a half-width block alone would cut
    assert merge_module.chunk_rows_for(7, 48, torch.device("cpu")) == 7
    generator = torch.Generator().manual_seed(2)
    master = torch.randn(300, 48, generator=generator) * 0.02
    factor = (torch.randn(300, 8, generator=generator) * 1e-4).to(torch.bfloat16)
    projection = make_projection(8, 48, seed=3, distribution="rademacher")
    results = []
    for chunk_rows in (0, 1, 64, 300):
        weight, tail = split_master(master)
        merge_low_rank_(weight, factor, projection, tail, chunk_rows=chunk_rows)
        results.append((weight, tail))
    assert all(torch.equal(w, results[0][0]) and torch.equal(t, results[0][1]) for w, t in results[1:])
    weight, tail = split_master(master)
    block = weight[:, 24:].clone(), tail[:, 24:].clone()  # the second TP rank's columns of a row-parallel weight
    merge_low_rank_(block[0], factor, projection[:, 24:], block[1], k_in=48)
    trainer = master - low_rank_change(factor, projection, rademacher_signs(projection))
    assert torch.equal(join_master(results[0][0], results[0][1]), trainer)  # the fp32 master, bit for bit
    assert torch.equal(block[0], results[0][0][:, 24:]) and torch.equal(block[1], results[0][1][:, 24:])


def test_resync_in_parts_refuses_payloads_until_every_target_arrived():
    trainer = Trainer()
    merger = rollout_copy(trainer.master(), "float32")
    payload = trainer.step()
    master = trainer.master()
    names = list(master)
    merger.begin_resync()
    merger.load({name: master[name] for name in names[:3]})
    with pytest.raises(PayloadRefused, match="full resync"):
        merger.apply(payload)
    with pytest.raises(ValueError, match="resync is missing weights"):
        merger.finish_resync(version=1)
    assert merger.version == 0 and merger.needs_resync
    merger.load({name: master[name] for name in names[3:]})
    merger.finish_resync(version=1)
    assert merger.version == 1 and not merger.needs_resync
    for name, target in merger.targets.items():
        assert torch.equal(target.weight, master[name].to(torch.bfloat16)), name
        assert torch.equal(target.weight.float() + target.residual, master[name]), name


def lora_step(layers, generator):
    """Adapters moved as an AdamW step would move them (both factors, every module)."""
    for layer in layers.values():
        for factor in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
            factor.data += 0.01 * torch.randn(factor.shape, generator=generator)


@pytest.mark.parametrize("residual", ["tail", "float32"])
def test_adapter_payloads_keep_every_engine_copy_at_bf16_of_the_trainers_merged_weights(residual):
    """A LoRA run's engines: bases held, each update's adapters set the targets. Thirty updates later, an HF-layout
    copy and a copy split into row x column blocks (tensor-parallel shards, another chunking) both equal
    bf16(base + s·B·A) as the trainer merges it, bit for bit."""
    config = OptimizerConfig(name="lora", lora_rank=4, lora_alpha=8.0)
    model = tiny_qwen3(seed=5)
    for param in model.parameters():  # a bf16 checkpoint: the engines read the trainer's base exactly
        param.data = param.data.bfloat16().float()
    model = add_lora(model, config, ("q_proj", "down_proj"))
    layers = lora_layers(model)
    base = {name: layer.base_layer.weight.detach().clone() for name, layer in layers.items()}
    whole = PayloadMerger(hf_targets({n: w.bfloat16() for n, w in base.items()}, residual))
    split = []  # four "ranks", each holding one row x column block of every target
    for r, c in ((r, c) for r in (slice(0, 16), slice(16, None)) for c in (slice(0, 24), slice(24, None))):
        targets = {}
        for name, weight in base.items():
            block = weight[r, c].bfloat16().clone()
            targets[name] = MergeTarget(block, new_residual(block, residual), tuple(weight.shape), r, c)
        split.append(PayloadMerger(targets, chunk_rows=3))
    for merger in (whole, *split):
        merger.hold_bases()
    generator = torch.Generator().manual_seed(0)
    for version in range(30):
        lora_step(layers, generator)
        payload = parse_payload(adapter_payload(layers, version, config.lora_scaling, 4).to_bytes())
        for merger in (whole, *split):
            merger.apply(payload)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    merged = merged_state(state, config.lora_scaling)
    for name, target in whole.targets.items():
        master = merged[f"{name}.weight"]
        assert not torch.equal(master, base[name])  # the adapters moved it
        assert torch.equal(target.weight, rounded(master, residual)), name
        if residual == "tail":
            assert torch.equal(join_master(target.weight, target.residual), master), name
    for merger in split:
        for name, target in merger.targets.items():
            assert torch.equal(target.weight, rounded(merged[f"{name}.weight"], residual)[target.rows, target.cols])
    assert whole.version == 30


def rounded(master, residual):
    return split_master(master)[0] if residual == "tail" else master.bfloat16()


def test_adapter_payloads_are_refused_untouched_without_bases_or_out_of_order():
    weight = torch.randn(6, 5).bfloat16()
    entry = AdapterEntry("m", 6, 5, torch.randn(6, 2), torch.randn(2, 5))
    merger = PayloadMerger(hf_targets({"m": weight.clone()}))
    with pytest.raises(PayloadRefused, match="holds no base weight"):
        merger.apply(AdapterPayload(0, 1, 2, 1.0, (entry,)))
    merger.hold_bases()
    with pytest.raises(PayloadRefused, match="these weights are at version 0"):
        merger.apply(AdapterPayload(1, 2, 2, 1.0, (entry,)))
    assert torch.equal(merger.targets["m"].weight, weight) and merger.version == 0
    merger.apply(AdapterPayload(0, 1, 2, 1.0, (entry,)))
    expected = weight.float() + adapter_change(entry.b, entry.a, 1.0)
    assert torch.equal(merger.targets["m"].weight, split_master(expected)[0]) and merger.version == 1
