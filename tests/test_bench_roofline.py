"""benchmarks/bench_step.py's decode roofline: a hand count on two rows, and the model's bytes from its config."""

from __future__ import annotations

import pytest
from scripts_loader import load_script

bench = load_script("bench_step", "benchmarks")


def test_decode_roofline_sums_each_parts_bound_over_the_live_rows_and_shared_prompts():
    shape = bench.Shape(linear=10.0, attention=1.0, head=5.0, weights=100.0, kv=2.0)
    # two rows of one prompt (3 tokens), responses of 3 and 2 tokens: steps s = 0 (both rows) and 1 (the first).
    # At 0.25 FLOP/s and 1 byte/s:
    # s = 0: dense 2 x 15 FLOP = 120 s against the weights' 100 s; attention 2 x (3 + 1) FLOP = 32 s against
    #        2 x (2 rows x 1 position + 3 prompt keys once) = 10 bytes, 10 s: 120 + 32
    # s = 1: dense 15 FLOP = 60 s against 100 s; attention (3 + 2) FLOP = 20 s against 2 x (1 x 2 + 3) = 10 s
    out = bench.decode_roofline(shape, [3, 3], [3, 2], group=2, flop_rate=0.25, read=1.0)
    assert out["roofline"] == pytest.approx(120 + 32 + 100 + 20)
    assert out["flop"] == pytest.approx((30 + 8 + 15 + 5) / 0.25)
    assert out["bytes"] == pytest.approx(110 + 110)
    # one prompt per row (group 1): each row reads its own prompt's keys
    alone = bench.decode_roofline(shape, [3, 3], [3, 2], group=1, flop_rate=1.0, read=1.0)
    assert alone["bytes"] == pytest.approx(100 + 2 * (2 + 6) + 100 + 2 * (2 + 3))


def test_shape_counts_the_weights_and_every_layers_keys_and_values():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    shape = bench.Shape.of(config, model)
    assert shape.weights == 4 * sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
    assert shape.kv == 3 * 2 * 2 * 8 * 4  # layers x (keys, values) x KV heads x head dim 8 x float32 bytes


def test_a_probe_twin_leaves_the_original_optimizer_as_it_was():
    """bench_step compares a probe step with a plain step from the same weights and optimizer state: the twin's
    optimizer steps must not move the original's moments or step count (``load_state_dict`` alone shares them)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).square().sum().backward()
    optimizer.step()
    before = {k: {n: t.clone() for n, t in s.items()} for k, s in optimizer.state_dict()["state"].items()}
    copied, copied_opt = bench.twin(model, optimizer)
    assert copied_opt.param_groups[0]["lr"] == 0.1
    copied_opt.zero_grad()
    copied(torch.randn(4, 3)).square().sum().backward()
    copied_opt.step()
    after = optimizer.state_dict()["state"]
    assert all(torch.equal(after[k][n], t) for k, s in before.items() for n, t in s.items())
    assert not torch.equal(copied.weight, model.weight)
