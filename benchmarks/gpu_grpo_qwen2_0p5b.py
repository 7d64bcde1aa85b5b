"""GPU check, prepared for a session that has the GPU machine: a short bf16 LoRA GRPO run of a random-weight
Qwen2-0.5B-shaped model with our trainer (GRPO, then AR+Lopti), step time split and peak memory, and the memory
estimate for Qwen2.5-3B-Instruct at the paper's lengths (prompt 400, response 4096).

One call on the device machine (the H200 image has torch, transformers, peft, pandas, tqdm; nothing to download):

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_grpo_qwen2_0p5b.py --out $OUT     # ~4 min

Without a GPU, ``--estimate-only`` prints the estimates and ``--smoke`` dry-runs the same code on CPU in seconds.
The model is random and its tokenizer tiny (tests/tiny.py) while the model keeps Qwen's 151,936-token vocabulary,
so every response runs to max_new_tokens (a fixed amount of work per step) and rewards come from a hash of the text
(3 or -0.5), which gives nonzero advantages. The measured peak is printed beside the estimate for the same shapes,
which is how the 3B estimate is checked.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

GIB = 2**30
# Qwen2-0.5B / Qwen2.5-0.5B shapes and Qwen2.5-3B-Instruct's (their config.json files)
QWEN2_0P5B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
QWEN25_3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def estimate_memory(
    shape: dict,
    prompt_len: int = 400,
    response_len: int = 4096,
    generate_batch: int = 128,
    micro_batch: int = 4,
    lora_r: int | None = 16,
    gradient_checkpointing: bool = True,
    kl: bool = True,
) -> dict[str, float]:
    """GiB of GPU memory for one RL step of our trainer (bf16 weights, LoRA on the 7 projections in float32 with
    AdamW), by part, and the peak: weights + adapter state + max(generation, log-prob pass, update).

    generation   KV cache: 2 (K, V) x layers x kv_heads x head_dim x 2 bytes x rows x (prompt + response)
    update       checkpointed layer inputs (layers x rows x L x hidden x 2 bytes), one layer's recomputed
                 activations (RMSNorm upcasts included), the bf16 response logits and their gradient
                 (rows x T x V x 2 bytes each) and float32 chunks of the selective log-softmax (3 x 128 MiB)
    Without gradient checkpointing every layer keeps its activations. ``kl`` adds nothing persistent: the
    reference is the same weights with the adapter off. Not counted: the CUDA context (~0.5-1 GiB, outside
    torch's allocator) and fragmentation (allow ~10%).
    """
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    vocab, heads, kv_heads = shape["vocab_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim, kv_dim = h // heads, h // heads * kv_heads
    per_layer = 2 * h * h + 2 * h * kv_dim + h + 2 * kv_dim + 3 * h * inter + 2 * h  # q, o, k, v (+bias), MLP, norms
    n_params = vocab * h * (1 if shape["tie_word_embeddings"] else 2) + layers * per_layer + h
    weights = 2 * n_params
    if lora_r is None:  # full fine-tuning in bf16: grads + 2 AdamW moments, all bf16
        adapter = 3 * weights
    else:
        per_layer_lora = lora_r * ((h + h) * 2 + (h + kv_dim) * 2 + (h + inter) * 3)
        adapter = 16 * layers * per_layer_lora  # fp32 weight + grad + 2 moments
    seq = prompt_len + response_len
    kv_cache = 2 * layers * kv_heads * head_dim * 2 * generate_batch * seq
    generation = kv_cache + generate_batch * vocab * 4 * 2  # last-position logits, float32 processors
    one_layer = micro_batch * seq * (2 * (6 * h + 2 * kv_dim + 4 * inter) + 8 * h)
    saved = layers * micro_batch * seq * h * 2 if gradient_checkpointing else layers * one_layer
    logits = micro_batch * response_len * vocab * 2
    chunks = 3 * 128 * 2**20
    update = saved + (one_layer if gradient_checkpointing else 0) + 2 * logits + chunks
    logprob_pass = one_layer + logits + chunks  # no grad: one layer alive at a time
    parts = {
        "params_billion": n_params / 1e9,
        "weights": weights / GIB,
        "adapter_and_optimizer": adapter / GIB,
        "generation": generation / GIB,
        "logprob_pass": logprob_pass / GIB,
        "update": update / GIB,
    }
    parts["peak"] = parts["weights"] + parts["adapter_and_optimizer"] + max(generation, logprob_pass, update) / GIB
    return parts


def _print_estimate(title: str, est: dict[str, float]) -> None:
    print(f"{title}: peak ~{est['peak']:.1f} GiB  (" + ", ".join(f"{k} {v:.2f}" for k, v in est.items()) + ")")


def make_model(folder: Path, shape: dict, device: str) -> str:
    import torch
    from tiny import tiny_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape, max_position_embeddings=32768, rope_theta=1e6)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for gpu_grpo.json (the device machine's $OUT)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--minibatch", type=int, default=32, help="2 optimizer steps per stage, as the paper's 256/512")
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--steps", type=int, default=2, help="steps per variant; the first one is warm-up")
    parser.add_argument("--budget-s", type=float, default=420, help="skip what would start after this many seconds")
    parser.add_argument("--estimate-only", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a seconds-long CPU dry run of this script (tiny shapes)")
    args = parser.parse_args()

    _print_estimate("Qwen2.5-3B-Instruct, paper lengths, generate 128 rows, micro-batch 4", estimate_memory(QWEN25_3B))
    _print_estimate("  ... generate 512 rows at once", estimate_memory(QWEN25_3B, generate_batch=512))
    _print_estimate("  ... no gradient checkpointing", estimate_memory(QWEN25_3B, gradient_checkpointing=False))
    if args.estimate_only:
        return

    import torch
    from transformers import AutoTokenizer

    import lopti_lab.evaluate as evaluation  # score_rollout's module: its score_response is replaced below
    from lopti_lab.kk import Reward, build_prompt, load_split
    from lopti_lab.train_config import TrainConfig
    from lopti_lab.trainer import train

    shape, device = QWEN2_0P5B, "cuda"
    if args.smoke:  # the same code path on CPU: 2 layers of width 64, Qwen's vocabulary, a few tokens
        shape = {**QWEN2_0P5B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
        device, args.prompts, args.group, args.minibatch, args.micro, args.new_tokens = "cpu", 2, 2, 2, 1, [4]
    else:
        assert torch.cuda.is_available(), "this script needs a GPU (--estimate-only or --smoke without one)"
    cuda = device == "cuda"
    start = time.perf_counter()
    evaluation.score_response = lambda text, p: Reward(3.0 if zlib.crc32(text.encode()) % 3 == 0 else -0.5, 1.0, 0.0)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_grpo_"))
    model_path = make_model(tmp / "model", shape, device)
    name = torch.cuda.get_device_name() if cuda else "CPU smoke run"
    print(f"{name}, torch {torch.__version__}; model built in {time.perf_counter() - start:.0f} s")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [build_prompt(p, "instruct") for p in load_split("train", (3, 4, 5, 6, 7), limit=64)]
    prompt_len = max(len(ids) for ids in tokenizer(prompts)["input_ids"])  # the tiny tokenizer's, for the estimate
    print(f"longest prompt: {prompt_len} tokens")
    results = []
    for new_tokens in args.new_tokens:
        base = TrainConfig(
            model=model_path,
            lora_r=16,
            lora_alpha=32,
            dtype="bfloat16",
            device=device,
            gradient_checkpointing=True,
            prompt_style="instruct",
            train_people=(3, 4, 5, 6, 7),
            train_limit=64,
            eval_people=(),
            prompts_per_step=args.prompts,
            group_size=args.group,
            minibatch_size=args.minibatch,
            micro_batch_size=args.micro,
            max_new_tokens=new_tokens,
            lr=1e-5,
            steps=args.steps,
            save_every=0,
            progress=False,
        )
        for name, cfg in {"GRPO": base, "GRPO+AR+Lopti": replace(base, ar_alpha=0.3, lopti_eta=0.5)}.items():
            if time.perf_counter() - start > args.budget_s:
                print(f"budget spent: skipping {name} at {new_tokens} tokens")
                continue
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            history = train(replace(cfg, run_dir=str(tmp / f"{name}-{new_tokens}"))).history
            last = history[-1]
            peak = torch.cuda.max_memory_allocated() / GIB if cuda else float("nan")
            est = estimate_memory(shape, prompt_len, new_tokens, args.prompts * args.group, args.micro)
            row = {
                "variant": name,
                "max_new_tokens": new_tokens,
                "rows": cfg.batch_size,
                "step_s": last["time/step"],
                **{k: last[f"time/{k}"] for k in ("generate", "logprob", "score", "update")},
                "response_mean": last["len/response_mean"],
                "peak_gib": peak,
                "estimate_peak_gib": est["peak"],
                "finite": all(v == v for v in last.values()),
            }
            results.append(row)
            print(json.dumps(row))
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                Path(args.out, "gpu_grpo.json").write_text(json.dumps(results, indent=2) + "\n")
    for n in args.new_tokens:
        pair = {r["variant"]: r for r in results if r["max_new_tokens"] == n}
        if len(pair) == 2:
            g, l = pair["GRPO"], pair["GRPO+AR+Lopti"]
            print(
                f"{n} tokens: AR+Lopti / GRPO step {l['step_s'] / g['step_s']:.2f}x, "
                f"update {l['update'] / g['update']:.2f}x, generate share {g['generate'] / g['step_s']:.0%}"
            )
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
