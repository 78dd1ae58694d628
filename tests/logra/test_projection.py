import hashlib
import math
import os
import subprocess
import sys

import pytest
import torch

from logra_rl.logra import canonical_name, make_projection, projection_fingerprint, projection_seed

Q_PROJ = "model.layers.0.self_attn.q_proj"


def _independent_seed(base: int, update: int, name: str) -> int:
    parts = [p for p in name.split(".") if p not in {"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod"}]
    digest = int.from_bytes(hashlib.blake2b(".".join(parts).encode(), digest_size=8).digest(), "little")
    return (base * 1_000_003 + update * 7_919 + digest) % 2**62


@pytest.mark.parametrize(
    ("base", "update", "name", "expected"),
    [
        (1, 0, Q_PROJ, 589964330622317010),
        (42, 200, "model.layers.27.mlp.down_proj", 2713415077184968509),
        (2**61, 3, "lm", 1406279707309279058),  # large base: the 62-bit mask wraps
    ],
)
def test_seed_formula_on_known_names(base, update, name, expected):
    assert projection_seed(base, update, name) == expected == _independent_seed(base, update, name)


def test_seed_ignores_wrapper_components():
    wrapped = "_orig_mod.model.layers.0._checkpoint_wrapped_module.self_attn._fsdp_wrapped_module.q_proj"
    assert canonical_name(wrapped) == Q_PROJ
    assert projection_seed(7, 5, wrapped) == projection_seed(7, 5, Q_PROJ)
    assert projection_seed(7, 5, Q_PROJ) != projection_seed(7, 6, Q_PROJ) != projection_seed(8, 5, Q_PROJ)


@pytest.mark.parametrize("rank", [1, 3, 8, 256])
def test_rademacher_entries_are_exactly_plus_minus_inverse_sqrt_rank(rank):
    a = make_projection(rank, 37, seed=11)
    assert a.dtype == torch.float32 and a.device.type == "cpu" and a.shape == (rank, 37)
    magnitude = torch.tensor(1 / math.sqrt(rank), dtype=torch.float32)
    assert torch.equal(a.abs(), magnitude.expand_as(a))
    assert (a > 0).any() and (a < 0).any()


def test_gaussian_is_drawn_in_float64_then_cast():
    a = make_projection(16, 512, seed=5, distribution="gaussian")
    generator = torch.Generator().manual_seed(5)
    expected = (torch.randn(16, 512, generator=generator, dtype=torch.float64) / 4).float()
    assert torch.equal(a, expected)
    assert abs(float(a.var()) * 16 - 1) < 0.05  # entries have variance 1/rank


def test_projection_is_a_pure_function_of_seed_and_shape():
    assert torch.equal(make_projection(8, 64, 3), make_projection(8, 64, 3))
    assert not torch.equal(make_projection(8, 64, 3), make_projection(8, 64, 4))
    with pytest.raises(ValueError, match="unknown projection distribution"):
        make_projection(8, 64, 3, distribution="uniform")
    with pytest.raises(ValueError, match="positive"):
        make_projection(0, 64, 3)


_CHILD = """
import sys
from logra_rl.logra import make_projection, projection_fingerprint, projection_seed
seed = projection_seed(1, 4, "model.layers.0.mlp.up_proj")
print(projection_fingerprint(make_projection(16, 1000, seed, "rademacher")),
      projection_fingerprint(make_projection(16, 1000, seed, "gaussian")))
"""


@pytest.mark.parametrize("cpu_capability", ["default", "avx2"])
def test_projection_identical_across_processes_and_cpu_kernels(cpu_capability):
    """A rollout process on another CPU draws the same A: float32 normal draws would not (AVX2 vs scalar)."""
    seed = projection_seed(1, 4, "model.layers.0.mlp.up_proj")
    here = [projection_fingerprint(make_projection(16, 1000, seed, dist)) for dist in ("rademacher", "gaussian")]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": cpu_capability}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == here


def test_fingerprint_changes_when_projection_changes():
    a = make_projection(8, 64, 3)
    assert projection_fingerprint(a) == projection_fingerprint(a.clone())
    b = a.clone()
    b[7, 63] = -b[7, 63]
    assert projection_fingerprint(b) != projection_fingerprint(a)
    assert projection_fingerprint(make_projection(8, 64, 4)) != projection_fingerprint(a)


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_rademacher_bits_are_the_counter_hash_computed_exactly():
    """The device-side generator is plain 32-bit integer hashing done in int64 tensors without overflow:
    it must equal the same hash in Python's exact integers for every entry, which is what makes a CUDA
    draw equal a CPU draw bit for bit (gpu_check compares the two on a GPU)."""
    rank, cols, seed = 5, 77, projection_seed(3, 9, Q_PROJ)
    keys = (_fmix32(seed & 0xFFFFFFFF), _fmix32(seed >> 32))
    expected = torch.empty(rank * cols, dtype=torch.bool)
    for entry in range(rank * cols):
        word, bit = divmod(entry, 32)
        expected[entry] = (_fmix32(_fmix32(word ^ keys[0]) ^ keys[1]) >> bit) & 1
    drawn = make_projection(rank, cols, seed)
    assert torch.equal(drawn > 0, expected.view(rank, cols))
    big = make_projection(256, 4096, seed)  # balanced, and rows nearly orthogonal: AAᵀ ≈ (k / r)·I
    gram = big @ big.t()
    assert abs(float((big > 0).float().mean()) - 0.5) < 0.01
    assert float((gram - torch.diag(torch.diag(gram))).abs().max()) < 6 * 4096**0.5 / 256
