"""Cost of the gradient probes over one plain backward, measured side by side in one run.

    .venv/bin/python benchmarks/bench_probes.py            # tiny and ~100M random Qwen2, full fine-tuning and LoRA
    .venv/bin/python benchmarks/bench_probes.py --quick    # tiny only, a few seconds

Every variant runs the same forward (a [prompt | response] batch, the trainer's layout) and a token-mean
policy-gradient loss; what differs is the backward:

    plain     loss.backward()
    position  the same under an attached GradientProbe (set_tokens + hooks + the table)
    loss      bin_gradient_norms(attribution="loss", accumulate=True, batched=True): one batched backward over
              4 bins, which also leaves the full gradient in .grad
    loss_streamed  the same with batched=False: one backward for the full gradient and one per bin but the largest
    naive     one forward + backward per bin, plus one for the full gradient (what the probes replace)

Variants are interleaved round-robin and the median of each is divided by plain's, so shared-machine noise hits all
alike. Bins get the paper's token shares (19 / 10 / 10 / 61 %) rather than a random model's near-1/V probabilities.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from lopti_lab.bins import DEFAULT_BINS
from lopti_lab.probes import GradientProbe, bin_gradient_norms

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {
    "tiny": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "batch": 8,
        "prompt": 32,
        "response": 64,
    },
    # ~100M parameters, Qwen2.5-0.5B's shape scaled down (tied embeddings, GQA, a 32k vocabulary)
    "100M": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 32000,
        "batch": 4,
        "prompt": 32,
        "response": 96,
    },
}
PAPER_SHARES = (0.192, 0.102, 0.101, 0.605)  # Fig. 1a


def build(name: str, lora: bool):
    spec = dict(CONFIGS[name])
    batch, prompt, response = spec.pop("batch"), spec.pop("prompt"), spec.pop("response")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**spec, tie_word_embeddings=True, max_position_embeddings=512))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
    model.train()
    gen = torch.Generator().manual_seed(0)
    L = prompt + response
    ids = torch.randint(spec["vocab_size"], (batch, L), generator=gen)
    attn = torch.ones(batch, L, dtype=torch.long)
    attn[: batch // 2, : prompt // 4] = 0  # some left padding
    mask = torch.ones(batch, response, dtype=torch.bool)
    mask[batch // 2 :, -response // 8 :] = False  # some right padding
    attn[:, prompt:] = mask
    adv = torch.randn(batch, generator=gen)
    edges = torch.tensor([0.0, *torch.cumsum(torch.tensor(PAPER_SHARES), 0).tolist()])
    u = torch.rand(batch, response, generator=gen)
    k = torch.bucketize(u, edges[1:-1], right=True)  # bin k with the paper's share
    lo, hi = torch.tensor(DEFAULT_BINS[:-1])[k], torch.tensor(DEFAULT_BINS[1:])[k]
    probs = lo + (hi - lo) * torch.rand(batch, response, generator=gen) * 0.999
    return model, ids, attn, mask, adv, probs


def per_token_loss(model, ids, attn, mask, adv):
    T = mask.shape[1]
    logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=T + 1).logits[:, :-1]  # (B, T, V)
    logp = logits.log_softmax(-1).gather(-1, ids[:, -T:, None]).squeeze(-1)  # (B, T)
    return -(adv[:, None] * logp) * mask / mask.sum()


def variants(model, ids, attn, mask, adv, probs):
    params = [p for p in model.parameters() if p.requires_grad]
    bin_of = torch.bucketize(probs, torch.tensor(DEFAULT_BINS[1:-1]), right=True)

    def plain():
        per_token_loss(model, ids, attn, mask, adv).sum().backward()

    def position():
        with GradientProbe(model) as probe:
            probe.set_tokens(probs, mask)
            per_token_loss(model, ids, attn, mask, adv).sum().backward()
            probe.frame()

    def loss():
        bin_gradient_norms(
            model, per_token_loss(model, ids, attn, mask, adv), probs, mask, accumulate=True, batched=True
        )

    def loss_streamed():
        bin_gradient_norms(
            model, per_token_loss(model, ids, attn, mask, adv), probs, mask, accumulate=True, batched=False
        )

    def naive():
        for k in range(4):
            torch.autograd.grad(per_token_loss(model, ids, attn, mask, adv)[bin_of == k].sum(), params)
        plain()

    return {"plain": plain, "position": position, "loss": loss, "loss_streamed": loss_streamed, "naive": naive}


def measure(name: str, lora: bool, repeats: int) -> dict[str, float]:
    model, *batch = build(name, lora)
    runs = variants(model, *batch)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(repeats + 1):
        for label, fn in runs.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            fn()
            if rep:  # the first round warms up
                times[label].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    B, L = batch[0].shape
    print(
        f"{name:>5} {'LoRA' if lora else 'full':>4}  {n_params / 1e6:7.1f}M params ({n_train / 1e6:.2f}M trained)  "
        f"B={B} L={L}  plain {med['plain'] * 1e3:8.1f} ms  "
        + "  ".join(f"{k} {med[k] / med['plain']:.2f}x" for k in runs if k != "plain"),
        flush=True,
    )
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; ratios = median time / median plain forward+backward")
    for name in ["tiny"] if args.quick else ["tiny", "100M"]:
        for lora in (False, True):
            measure(name, lora, args.repeats if name == "tiny" else max(2, args.repeats // 2))


if __name__ == "__main__":
    main()
