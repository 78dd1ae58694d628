"""The Controller: the synchronous, on-policy RL step loop of DESIGN.md §1.

    1. sample prompts → rollout engines generate (token ids + sampling log-probs)
    2. grade → rewards → advantages
    3. TrainWorkers: log-probs, policy-gradient loss, backward over microbatches
    4–6. all-reduce sketches → RowAdam → update ratio; KL probe → α; commit (one payload)
    7. every engine applies the payload (version-gated); full resync every K steps or on refusal
    8. metrics; eval every E steps; checkpoint every C steps

The controller runs in the driver process; the workers are Ray actors (orchestration.cluster).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from transformers import AutoTokenizer

from logra_rl.config import RunConfig
from logra_rl.data import Example, PromptSampler, load_task
from logra_rl.eval import eval_metrics
from logra_rl.logra import find_targets
from logra_rl.logra.optimizer import check_rank
from logra_rl.models.tiny import build_quickstart_model
from logra_rl.orchestration.cluster import WorkerGroup, start_ray
from logra_rl.rewards import GradeRequest, RewardPool, grader_metrics
from logra_rl.rl import RunningBaseline, group_advantages, length_weighted
from logra_rl.rollout import Completion, SamplingParams
from logra_rl.rollout.hf_engine import HFEngine
from logra_rl.train.batch import TrainBatch
from logra_rl.train.worker import TrainWorker
from logra_rl.utils.checkpoint import Checkpoints, read_controller_state
from logra_rl.utils.metrics import MetricsLogger
from logra_rl.utils.plot import plot_run


@dataclass(frozen=True)
class Prompt:
    example: Example
    token_ids: list[int]


class Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[f"timing_s/{name}"] = time.perf_counter() - start


class Controller:
    def __init__(self, config: RunConfig, run_dir: Path, resolved_config: dict[str, Any]) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.resolved_config = resolved_config
        self.checkpoints = Checkpoints(self.run_dir, config.trainer.keep_checkpoints)
        self.baseline = RunningBaseline(
            config.algorithm.baseline_weight, config.algorithm.failure_reward, success_threshold=1.0
        )
        self.version = 0  # policy version: updates committed so far (the engines' version after a sync)
        self.start_step = 0

    # ---- set-up -------------------------------------------------------------------------------

    def setup(self, train: bool = True, model_path: str | None = None) -> None:
        """Data, Ray, the rollout engines and the reward pool; with `train` also the train group, resume and
        the first full resync (`logra-eval` runs without them, on `model_path`)."""
        config = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        task = load_task(config.data)
        self.model_path = model_path or self._model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.task_name = task.name
        self.train_prompts = self._encode(task.train, "train")
        self.eval_prompts = self._encode(task.eval, "eval")
        self.sampler = PromptSampler(self.train_prompts, config.data.seed)
        if train:
            self.targets = self._target_shapes()  # checks targets and rank on the driver, before any actor starts
        self._owns_ray = start_ray(config)
        if train:
            self.train = WorkerGroup(
                TrainWorker,
                config.cluster.train_workers,
                "train",
                cpus=config.cluster.cpus_per_worker,
                gpus=1,
                arguments=lambda rank: (config, self.model_path, rank, config.cluster.train_workers),
            )
        engine, engine_arguments = self._engine()
        self.rollout = WorkerGroup(
            engine,
            config.rollout.num_engines,
            "rollout",
            cpus=config.cluster.cpus_per_worker,
            gpus=config.rollout.gpus_per_engine,
            arguments=lambda _: engine_arguments,
        )
        self.rewards = RewardPool(config.trainer.grader_workers, config.trainer.grader_timeout_s)
        if not train:
            return
        master = ray.get(self.train.actors[0].address.remote())
        self.train.call("setup", *master)
        self.resync_buckets = self.train.call("state_buckets", int(config.rollout.resync_bucket_mb * 2**20))[0]
        self._resume()
        self.full_resync()
        self.metrics = MetricsLogger(
            self.run_dir, config.logger, self.resolved_config, config.trainer.total_steps, self.start_step
        )

    def _engine(self) -> tuple[type, tuple]:
        """The rollout engine class for `rollout.backend` and its constructor arguments."""
        config = self.config
        rollout, targets, chunk = config.rollout, config.logra.target_modules, config.logra.merge_chunk_rows
        if rollout.backend == "vllm":
            from logra_rl.rollout.vllm_engine import VLLMEngine  # imports vLLM only inside the actor

            max_model_len = config.data.max_prompt_length + config.data.max_response_length
            arguments = (self.model_path, rollout.dtype, rollout.residual, targets, rollout.gpus_per_engine)
            return VLLMEngine, (*arguments, rollout.gpu_memory_utilization, max_model_len, chunk, config.trainer.seed)
        device = "cuda" if torch.cuda.is_available() and config.cluster.device != "cpu" else "cpu"
        arguments = (self.model_path, rollout.dtype, rollout.residual, targets, device)
        return HFEngine, (*arguments, config.model.attn_implementation, chunk)

    def _model_path(self) -> str:
        model = self.config.model
        if model.builder == "quickstart":
            path = self.run_dir / "base_model"
            if not (path / "config.json").exists():
                build_quickstart_model(path, seed=self.config.trainer.seed)
            return str(path)
        return model.path

    def _encode(self, examples: Sequence[Example], split: str) -> list[Prompt]:
        limit = self.config.data.max_prompt_length
        prompts, too_long = [], 0
        for example in examples:
            encoded = self.tokenizer.apply_chat_template(list(example.messages), add_generation_prompt=True)
            ids = list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)
            if len(ids) > limit:
                too_long += 1
                continue
            prompts.append(Prompt(example, ids))
        if too_long:
            print(f"[logra-train] dropped {too_long} {split} prompts longer than data.max_prompt_length={limit}")
        if split == "train" and not prompts:
            raise ValueError(f"every train prompt is longer than data.max_prompt_length={limit} tokens")
        return prompts

    def _target_shapes(self) -> dict[str, tuple[int, int]]:
        """Names and shapes of the LoGRA targets, read from the model config without loading weights."""
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.model_path))
        modules = find_targets(model, self.config.logra.target_modules)
        check_rank(modules, self.config.logra.rank)
        return {name: tuple(m.weight.shape) for name, m in modules}

    def _resume(self) -> None:
        resume = self.config.trainer.resume
        path = None
        if resume == "auto":
            path = self.checkpoints.latest()
        elif resume != "never":
            path = Path(resume)
            if not (path / "controller.json").exists():
                raise FileNotFoundError(f"trainer.resume={resume}: no checkpoint there (expected controller.json)")
        if path is None:
            return
        state = read_controller_state(path)
        self.train.call("load", str(path))
        self.start_step = state["step"]
        self.version = state["version"]
        self.sampler.load_state_dict(state["sampler"])
        self.baseline.load_state_dict(state["baseline"])
        print(f"[logra-train] resumed from {path} at step {self.start_step}")

    # ---- the step loop --------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        self.setup()
        try:
            trainer = self.config.trainer
            for step in range(self.start_step, trainer.total_steps):
                metrics = {}
                if trainer.eval_every and step % trainer.eval_every == 0:
                    metrics.update(self.evaluate(step))
                metrics.update(self.step(step))
                self.metrics.log(step, metrics)
                if trainer.checkpoint_every and (step + 1) % trainer.checkpoint_every == 0:
                    self.save_checkpoint(step + 1)
            if trainer.eval_every and self.start_step < trainer.total_steps:
                self.metrics.log(trainer.total_steps, self.evaluate(trainer.total_steps))
            self.finish()
            return self.metrics.history
        finally:
            self.teardown()

    def step(self, step: int) -> dict[str, float]:
        timer = Timer()
        with timer("step"):
            prompts = self.sampler.next_batch(self.config.trainer.prompts_per_step)  # 1. prompts
            with timer("rollout"):
                completions = self.generate(prompts, self.sampling(), seed=self._seed(step))  # 1. rollouts
            with timer("reward"):
                rewards, reward_metrics = self.grade(prompts, completions)  # 2. rewards
            baseline = self.baseline.value
            advantages = self.advantages(rewards, completions)  # 2. advantages
            batch = self.pack(completions, advantages)
            with timer("train"):
                train_metrics, payloads = self.train_on(batch, step)  # 3.–6. backward, prepare, probe, commit
            with timer("sync"):
                sync_metrics = self.sync(payloads, step)  # 7. payload to every engine
        return {
            **self.rollout_metrics(rewards, completions, baseline),
            **reward_metrics,
            **train_metrics,
            **sync_metrics,
            **self.memory_metrics(),
            **timer.seconds,
            "perf/updates_per_hour": 3600 * self.config.algorithm.epochs / timer.seconds["timing_s/step"],
        }

    def sampling(self, evaluation: bool = False) -> SamplingParams:
        rollout, length = self.config.rollout, self.config.data.max_response_length
        if evaluation:
            return SamplingParams(rollout.eval_temperature, rollout.eval_top_p, length, n=rollout.eval_samples)
        return SamplingParams(rollout.temperature, rollout.top_p, length, n=rollout.n)

    def _seed(self, step: int, stream: int = 0) -> int:
        return int(np.random.SeedSequence([self.config.trainer.seed, step, stream]).generate_state(1)[0])

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams, seed: int) -> list[Completion]:
        """Split the prompts over the engines (contiguous chunks); completions come back in prompt order."""
        chunks = np.array_split(np.arange(len(prompts)), len(self.rollout))
        calls = [
            engine.generate.remote([prompts[i].token_ids for i in chunk], params, seed + e)
            for e, (engine, chunk) in enumerate(zip(self.rollout.actors, chunks, strict=True))
            if len(chunk)  # fewer prompts than engines: the rest sit this one out
        ]
        return [c for part in self.rollout.gather(calls) for c in part]

    def grade(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> tuple[torch.Tensor, dict]:
        n = len(completions) // len(prompts)
        requests = [
            GradeRequest(
                reward=p.example.reward,
                response=self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                answer=p.example.answer,
                metadata=p.example.metadata,
            )
            for p, c in zip([p for p in prompts for _ in range(n)], completions, strict=True)
        ]
        results = self.rewards.grade(requests)
        rewards = torch.tensor([r.reward for r in results], dtype=torch.float64)
        return rewards, grader_metrics(results)

    def advantages(self, rewards: torch.Tensor, completions: Sequence[Completion]) -> torch.Tensor:
        algorithm = self.config.algorithm
        lengths = torch.tensor([len(c.token_ids) for c in completions])
        if algorithm.estimator == "grpo":
            advantages = group_advantages(rewards, self.config.rollout.n, algorithm.grpo_normalize_std)
        else:
            advantages = self.baseline.advantages(rewards, valid=lengths > 0)
        if algorithm.length_reference is not None:
            advantages = length_weighted(advantages, lengths, algorithm.length_reference)
        return advantages.float()

    def pack(self, completions: Sequence[Completion], advantages: torch.Tensor) -> TrainBatch:
        """Right-padded prompt + response rows; response positions carry the loss mask and sampling log-probs."""
        rows = [c.prompt_ids + c.token_ids for c in completions]
        width = max(len(r) for r in rows)
        shape = (len(rows), width)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        input_ids = torch.full(shape, pad, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        loss_mask = torch.zeros(shape)
        rollout_logprobs = torch.zeros(shape)
        for i, (row, c) in enumerate(zip(rows, completions, strict=True)):
            start = len(c.prompt_ids)
            input_ids[i, : len(row)] = torch.tensor(row)
            attention_mask[i, : len(row)] = 1
            loss_mask[i, start : len(row)] = 1
            rollout_logprobs[i, start : len(row)] = torch.tensor(c.logprobs)
        completed = torch.tensor([c.finished for c in completions])
        return TrainBatch(input_ids, attention_mask, loss_mask, rollout_logprobs, advantages, completed)

    def train_on(self, batch: TrainBatch, step: int) -> tuple[dict[str, float], list[bytes | None]]:
        """Steps 3–6 on the train group: one update per epoch; returns metrics and the payloads in order."""
        algorithm = self.config.algorithm
        shards = [batch.rows(torch.as_tensor(part)) for part in np.array_split(np.arange(len(batch)), len(self.train))]
        if algorithm.clip_low is not None or algorithm.clip_high is not None:
            old = self.train.call_each("logprobs", [(shard,) for shard in shards])
            shards = [_with_old_logprobs(shard, logprobs) for shard, logprobs in zip(shards, old, strict=True)]
        payloads, metrics = [], {}
        for epoch in range(algorithm.epochs):
            sums = _sum(self.train.call_each("forward_backward", [(shard,) for shard in shards]))
            # the rollout-vs-trainer gap is measured once, before this step's first update moved the weights
            gap_tokens = int(sums["gap_tokens"]) if epoch == 0 else 0
            results = self.train.call("update", step, sums["tokens"], sums["gap"], gap_tokens)
            update_metrics, payload = results[0]
            payloads.append(payload)
            if not update_metrics["actor/skipped"]:
                self.version += 1
            metrics = {
                "actor/loss": sums["loss"] / max(sums["tokens"], 1),
                "actor/is_ratio_mean": sums["is_ratio"] / max(sums["tokens"], 1),
                "actor/is_truncated_frac": sums["is_truncated"] / max(sums["tokens"], 1),
                "actor/clip_frac": sums["clipped"] / max(sums["tokens"], 1),
                "actor/tokens": sums["tokens"],
                "rollout/logprob_diff_mean": sums["gap_all"] / max(sums["tokens"], 1),
                **update_metrics,
            }
        return metrics, payloads

    # ---- policy sync ----------------------------------------------------------------------------

    def full_resync(self) -> float:
        """Load bf16(master) (with exact residuals) into every engine; returns the bytes moved per engine.

        The fp32 master streams in buckets (`rollout.resync_bucket_mb`): train rank 0 gathers one into
        Ray's object store, the engines read it from there; no process holds the whole fp32 model.
        """
        count, results = len(self.resync_buckets), []
        for index, (keys, _) in enumerate(self.resync_buckets):
            bucket = next(r for r in self.train.call("full_state_ref", keys) if r is not None)
            results = self.rollout.call("load_weights", bucket, self.version, index, count)
            del bucket  # frees it in the object store before the next one is gathered
        for result in results:  # the last bucket's: each engine's version after the whole resync
            if result.version != self.version:
                raise RuntimeError(f"full resync left an engine at version {result.version}, not {self.version}")
        return float(sum(size for _, size in self.resync_buckets))

    def sync(self, payloads: Sequence[bytes | None], step: int) -> dict[str, float]:
        """Apply each payload on every engine; resync fully on refusal, for dense updates, or every K steps."""
        resync_every = self.config.rollout.resync_every
        needs_resync = any(p is None for p in payloads) or (resync_every and (step + 1) % resync_every == 0)
        refused, payload_bytes, results = 0, 0.0, []
        for payload in payloads:
            if payload is None:
                continue
            payload_bytes += len(payload)
            results = self.rollout.call("apply_payload", ray.put(payload))
            refused += sum(not r.applied for r in results)
            if refused:
                needs_resync = True
                break
        if not needs_resync:  # every payload applied: the last one left each engine at its version
            needs_resync = any(r.version != self.version for r in results)
        metrics = {"sync/payload_bytes": payload_bytes, "sync/refused": float(refused)}
        metrics["sync/full_resync_bytes"] = self.full_resync() if needs_resync else 0.0
        metrics["sync/weight_max_abs_diff"] = self.drift(step)
        return metrics

    def drift(self, step: int) -> float:
        """max |W_rollout − bf16(master)| at seeded coordinates of every target (0 with an fp32 residual)."""
        generator = torch.Generator().manual_seed(self._seed(step, stream=1) % 2**63)
        count = self.config.rollout.probe_coordinates
        coordinates = {
            name: (
                torch.randint(rows, (count,), generator=generator),
                torch.randint(cols, (count,), generator=generator),
            )
            for name, (rows, cols) in self.targets.items()
        }
        masters = self.train.call("weights_at", coordinates)
        engines = self.rollout.call("weights_at", coordinates)
        dtype = getattr(torch, self.config.rollout.dtype)
        worst = 0.0
        for name in coordinates:
            holders = torch.stack([held for _, held in (m[name] for m in masters)]).sum(0)
            if not bool((holders == 1).all()):
                raise RuntimeError(f"drift probe: rows of {name} are not held by exactly one train rank")
            master = torch.stack([values for values, _ in (m[name] for m in masters)]).sum(0)
            expected = master.to(dtype).float()
            for engine in engines:
                if name not in engine:
                    continue  # an engine in full-resync mode cannot read its weights as HF values
                difference = (engine[name] - expected).abs()
                worst = max(worst, float("inf") if difference.isnan().any() else float(difference.max()))
        return worst

    # ---- metrics, eval, checkpoints ---------------------------------------------------------------

    def rollout_metrics(
        self, rewards: torch.Tensor, completions: Sequence[Completion], baseline: float
    ) -> dict[str, float]:
        lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float64)
        metrics = {
            "reward/mean": float(rewards.mean()),
            "response_length/mean": float(lengths.mean()),
            "response_length/clip_ratio": float(np.mean([not c.finished for c in completions])),
            "policy/version": float(self.version),
        }
        if self.config.algorithm.estimator == "running_baseline":
            metrics["reward/baseline"] = baseline
        return metrics

    def memory_metrics(self) -> dict[str, float]:
        memory = self.train.call("memory")
        return {
            "memory/train_avg_gib": float(np.mean([m["current_gib"] for m in memory])),
            "memory/train_peak_gib": float(max(m["peak_gib"] for m in memory)),
        }

    def evaluate(self, step: int) -> dict[str, float]:
        """pass@1 and pass@k on the eval split, overall and per source; graded samples go to eval/step_N.jsonl."""
        if not self.eval_prompts:
            return {}
        params = self.sampling(evaluation=True)
        completions = self.generate(self.eval_prompts, params, seed=self._seed(step, stream=2))
        rewards, _ = self.grade(self.eval_prompts, completions)
        per_prompt = rewards.view(len(self.eval_prompts), params.n).tolist()
        sources = [
            str(p.example.metadata.get("source", self.task_name)).removeprefix(f"{self.task_name}/")
            for p in self.eval_prompts
        ]  # e.g. reasoning_gym/maze → eval/reasoning_gym/maze/pass@1
        if self.config.eval.write_samples:
            self._write_samples(step, completions, rewards.tolist(), params.n)
        return eval_metrics(per_prompt, sources, params.n, prefix=f"eval/{self.task_name}")

    def _write_samples(self, step: int, completions: Sequence[Completion], rewards: list[float], n: int) -> None:
        path = self.run_dir / "eval" / f"step_{step}.jsonl"
        path.parent.mkdir(exist_ok=True)
        with path.open("w") as stream:
            for index, (completion, reward) in enumerate(zip(completions, rewards, strict=True)):
                example = self.eval_prompts[index // n].example
                record = {
                    "prompt": example.messages[-1]["content"],
                    "response": self.tokenizer.decode(completion.token_ids, skip_special_tokens=True),
                    "answer": example.answer,
                    "reward": reward,
                    "sample": index % n,
                    "source": example.metadata.get("source", self.task_name),
                    "finished": completion.finished,
                }
                stream.write(json.dumps(record) + "\n")

    def save_checkpoint(self, step: int) -> None:
        path = self.checkpoints.begin(step)
        self.train.call("save", str(path))
        state = {
            "step": step,
            "version": self.version,
            "sampler": self.sampler.state_dict(),
            "baseline": self.baseline.state_dict(),
        }
        self.checkpoints.commit(step, state)

    def finish(self) -> None:
        self.metrics.close()
        console = self.metrics.console
        console.print(self.metrics.summary(self.task_name))
        if self.config.logger.plot and self.metrics.history:
            png = plot_run(
                self.metrics.path, self.run_dir / "run.png", self.task_name, self.config.rollout.eval_samples
            )
            console.print(f"[logra-train] metrics: {self.metrics.path}  plot: {png}")

    def teardown(self) -> None:
        if hasattr(self, "rewards"):
            self.rewards.close()
        for name in ("train", "rollout"):
            if hasattr(self, name):  # train is absent under logra-eval
                getattr(self, name).kill()
        if getattr(self, "_owns_ray", False):
            ray.shutdown()


def _sum(results: Sequence[Mapping[str, float]]) -> dict[str, float]:
    return {key: float(sum(r[key] for r in results)) for key in results[0]}


def _with_old_logprobs(shard: TrainBatch, logprobs: torch.Tensor) -> TrainBatch:
    shard.old_logprobs = logprobs
    return shard
