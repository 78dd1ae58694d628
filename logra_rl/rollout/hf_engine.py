"""Rollout with HF transformers `generate`: the CPU default, and a reference for other engines.

The engine keeps its own low-precision copy of the policy. LoGRA payloads are merged in place
into the targeted weights through a `PayloadMerger` (version gate + error-feedback residual);
a full resync loads the trainer's fp32 master state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from logra_rl.config import RunConfig
from logra_rl.logra import PayloadMerger, canonical_name, find_targets, hf_targets, parse_payload
from logra_rl.models.footprint import GENERATING, Lengths, Machine, ModelFootprint, Part
from logra_rl.models.head import fold_head_inputs
from logra_rl.rollout.base import (
    Completion,
    EngineSpec,
    MergeMode,
    RolloutEngine,
    SamplingParams,
    SyncResult,
    engine_weights,
    resync_split,
)
from logra_rl.rollout.resync import BucketedResync, bucket_tensors
from logra_rl.utils.device import resolve_device
from logra_rl.utils.memory import release_free_memory
from logra_rl.utils.state_dict import tied_duplicates
from logra_rl.utils.transfer import TRANSFER_TIMEOUT_S, Layout, TransferAddress, TransferGroup

GENERATE_BATCH_ROWS = 256  # rows per generate call: bounds the KV cache of large eval sets


class SampledLogprobs(LogitsProcessor):
    """Records each sampled token's log-prob under the processed (temperature, top-p) distribution it was
    drawn from, while `generate` runs: it keeps one step's log-softmax (rows × vocab) and takes the sampled
    entry at the next step, instead of every step's full-vocabulary scores (`output_scores`)."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.values: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._take(input_ids)
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, input_ids: torch.Tensor) -> None:
        if self.previous is not None:  # input_ids now ends with the token sampled from `previous`
            self.values.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
            self.previous = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """(rows, generated tokens) log-probs, aligned with `sequences`' generated columns."""
        self._take(sequences)
        return torch.stack(self.values, dim=1)


def stop_token_ids(model, tokenizer) -> list[int]:
    """End-of-turn ids: the generation config's (chat models list several) and the tokenizer's EOS."""
    configured = model.generation_config.eos_token_id
    configured = [] if configured is None else [configured] if isinstance(configured, int) else list(configured)
    return sorted({*configured, tokenizer.eos_token_id} - {None})


class HFEngine(RolloutEngine):
    @staticmethod
    def memory(
        config: RunConfig, model: ModelFootprint, lengths: Lengths, machine: Machine, merges: bool
    ) -> tuple[list[Part], list[str]]:
        """Its weights and residual; while generating, a generate batch's KV cache and sampling logits, and the
        prefill's peak: the batch's prompts go through one layer at a time, that layer's intermediates."""
        weights, residual = engine_weights(config, model, merges)
        dtype = getattr(torch, config.rollout.dtype).itemsize
        # a step's (or an eval's) share of the rows, at most one generate batch
        train = config.trainer.prompts_per_step * config.rollout.n
        evaluation = (config.data.eval_size or 0) * config.eval.samples if config.eval.every else 0
        rows = min(GENERATE_BATCH_ROWS, math.ceil(max(train, evaluation) / config.rollout.num_engines))
        prefill = rows * lengths.prompt * model.saved_frozen * dtype / model.compute_bytes
        parts = [
            weights,
            residual,
            Part("KV cache", rows * lengths.sequence * model.kv_bytes_per_token(dtype), GENERATING),
            Part("logits", 3 * 4 * rows * model.vocab, GENERATING),
            Part("prefill", prefill, GENERATING),
        ]
        if residual.nbytes:
            parts.append(resync_split(model))
        return parts, []

    def __init__(self, spec: EngineSpec) -> None:
        self.device = resolve_device(spec.device)
        transformers.logging.disable_progress_bar()
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            spec.model_path, dtype=getattr(torch, spec.dtype), attn_implementation=spec.attn_implementation
        ).to(self.device)
        self.model.eval().requires_grad_(False)
        fold_head_inputs(self.model)
        targets = find_targets(self.model, spec.target_modules)
        weights = {canonical_name(name): module.weight for name, module in targets}
        self.merger = PayloadMerger(hf_targets(weights, spec.residual), chunk_rows=spec.merge_chunk_rows)
        if spec.adapter_scale:
            self.merger.hold_bases()  # the checkpoint's weights: a LoRA run's adapters start at zero
        names = self.model.state_dict().keys() - tied_duplicates(self.model)
        self.resync = BucketedResync(self.merger, names, spec.adapter_scale)
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]
        self.transfer: TransferGroup | None = None  # sync.resync_route=process_group

    @property
    def version(self) -> int:
        return self.merger.version

    def merge_mode(self) -> MergeMode:
        return MergeMode("in_place")  # the HF weights are the targets themselves

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> list[Completion]:
        """Sample `params.n` responses per prompt, with per-token sampling log-probs, in batches of rows."""
        rows = [prompt for prompt in prompts for _ in range(params.n)]
        torch.manual_seed(seed)
        completions = []
        for start in range(0, len(rows), GENERATE_BATCH_ROWS):
            completions += self._generate_batch(rows[start : start + GENERATE_BATCH_ROWS], params)
        release_free_memory()  # the KV cache and logits: the train ranks run next
        return completions

    def _generate_batch(self, rows: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One left-padded `generate` call."""
        width = max(len(row) for row in rows)
        pad = self.pad_id
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        # the warpers are ours, so the recorder runs after them (HF puts its own after any custom processor)
        recorder = SampledLogprobs()
        processors = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
        processors += [TopPLogitsWarper(params.top_p)] if params.top_p < 1.0 else []
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            logits_processor=LogitsProcessorList([*processors, recorder]),
            max_new_tokens=params.max_new_tokens,
            eos_token_id=self.stop_ids,
            pad_token_id=pad,
        )
        logprobs = recorder.finish(sequences)
        generated = sequences[:, width:].tolist()
        completions = []
        for prompt, tokens, token_logprobs in zip(rows, generated, logprobs.float().tolist(), strict=True):
            stops = [i for i, token in enumerate(tokens) if token in self.stop_ids]
            finished = bool(stops)
            length = stops[0] + 1 if finished else len(tokens)
            completions.append(Completion(prompt, tokens[:length], token_logprobs[:length], finished, self.version))
        return completions

    def apply_payload(self, payload: np.ndarray) -> SyncResult:
        """Parsed straight from the object store (one copy, into the factors' storage). Any failure (refusal,
        bad bytes, an error mid-merge) is reported, never raised: the weight sync answers it with a full resync."""
        try:
            self.merger.apply(parse_payload(payload, pin_memory=self.device.type == "cuda"))
        except Exception as error:
            return SyncResult(applied=False, version=self.version, reason=f"{type(error).__name__}: {error}")
        finally:
            release_free_memory()
        return SyncResult(applied=True, version=self.version)

    def load_weights(
        self, state: Mapping[str, np.ndarray | torch.Tensor], version: int, bucket: int = 0, buckets: int = 1
    ) -> SyncResult:
        """Bucket `bucket` of `buckets` of a full resync from the trainer's fp32 master state (HF names):
        weights and exact residuals; the last bucket sets `version` once every weight has arrived."""
        state = self.resync.merged(bucket_tensors(state))
        unexpected = self.model.load_state_dict(state, strict=False).unexpected_keys
        if unexpected:
            raise KeyError(f"full resync sent weights this model does not have: {unexpected[:4]}")
        self.resync.receive(state, version, bucket, buckets)
        release_free_memory()
        return SyncResult(applied=True, version=self.version)

    def join_transfer(self, address: TransferAddress, first_rank: int) -> None:
        self.transfer = TransferGroup(address, first_rank, TRANSFER_TIMEOUT_S)

    def receive_bucket(self, layout: Layout, version: int, bucket: int, buckets: int) -> SyncResult:
        return self.load_weights(self.transfer.receive(layout), version, bucket, buckets)

    def weights_at(self, coordinates: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The targeted weights at (rows, cols), as float32: the drift check."""
        targets = self.merger.targets
        return {name: targets[name].weight[rows, cols].float().cpu() for name, (rows, cols) in coordinates.items()}
