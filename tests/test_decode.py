"""fast.decode and fast.forward: the lean Qwen2 path against HF, token for token and in distribution.

- greedy: the same tokens as HF generate, on tiny random Qwen2s of several shapes (GQA, MQA, MHA, explicit head_dim,
  tied or untied embeddings, rope theta and scaling, LoRA) and on the bundled lab model, with left padding and
  several stop tokens, so rows end at different steps and the batch is compacted;
- sampled: the same tokens as HF generate under the same torch seed while the batch is not compacted; with
  compaction, every token's randomized probability integral transform under an independent full forward is uniform
  (a Kolmogorov-Smirnov test at a stated false-alarm rate, with a negative control that must fail);
- the decoder's log-probs and entropies equal a full forward's, and the shared-prompt forward equals HF's forward
  and its gradients in float64;
- the path choice: which models take the lean path, and that "lean" fails loudly where it cannot.
"""

import math

import pytest
import torch
from tiny import tiny_qwen2, tiny_tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM
from transformers.generation.logits_process import TopPLogitsWarper

from lopti_lab.lean import decode
from lopti_lab.lean import forward as lean_forward
from lopti_lab.lean.decode import DRAWS, lean_generate, pick_tokens, top_p_filter
from lopti_lab.lean.forward import lean_unsupported, length_buckets
from lopti_lab.rollout import add_logprobs, response_logprobs, sample, use_lean

PROMPTS = [
    "<|im_start|>user\nZoey said that Oliver is a knight.<|im_end|>\n<|im_start|>assistant\n<think>",
    "Hi",
    "Knights always tell the truth, and knaves always lie. So who is a knight?",
]
SHAPES = {
    "gqa-tied": {},
    "mqa-untied-theta": {"num_attention_heads": 6, "num_key_value_heads": 1, "hidden_size": 48, "layers": 3,
                         "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 5e2}},
    "mha-head_dim": {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": False},
    "linear-rope": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
}  # fmt: skip


def qwen2(vocab: int, shape: dict, dtype=torch.float32, seed: int = 0) -> Qwen2ForCausalLM:
    """A random Qwen2 with its lm_head scaled x 8 (entropy ~4.6 nats instead of ~5.7, the uniform's): greedy
    decisions are not near-ties, and temperature and top-p visibly change the distribution."""
    shape = dict(shape)
    hidden, layers = shape.pop("hidden_size", 32), shape.pop("layers", 2)
    model = tiny_qwen2(vocab, hidden, layers, seed, **shape).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def encode(tokenizer, prompts=PROMPTS):
    enc = tokenizer(prompts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]  # (n, P)


def stops_for(vocab: int) -> list[int]:
    """Many stop tokens (every 9th id and EOS), so random models end rows at scattered steps."""
    return sorted({2, *range(5, vocab, 9)})


def hf_generate(model, ids, mask, group, stops, max_new, greedy, temperature=1.0, top_p=1.0):
    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": 0}
    config = GenerationConfig(
        do_sample=not greedy, max_new_tokens=max_new, eos_token_id=stops, pad_token_id=0, **sampling
    )
    rows, row_mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    with torch.inference_mode():
        return model.generate(input_ids=rows, attention_mask=row_mask, generation_config=config)[:, ids.shape[1] :]


def full_forward_logits(model, ids, mask, response, group):
    """HF logits (B, T, V) at the position before each response token, from one forward of [prompt | response]."""
    rows, row_mask = ids.repeat_interleave(group, 0), mask.repeat_interleave(group, 0)
    full = torch.cat([rows, response], 1)
    full_mask = torch.cat([row_mask, torch.ones_like(response)], 1)
    with torch.no_grad():
        logits = model(input_ids=full, attention_mask=full_mask, position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0))
    T = response.shape[1]
    return logits.logits[:, -T - 1 : -1].double()  # (B, T, V)


def real_mask(response, stops):
    """(B, T) 1 up to and including the first stop token."""
    is_stop = torch.isin(response, torch.tensor(stops))
    first = torch.where(is_stop.any(1), is_stop.int().argmax(1), response.shape[1])
    return torch.arange(response.shape[1])[None] <= first[:, None]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_tokens_and_logprobs_equal_hf(tok, shape):
    model = qwen2(len(tok), SHAPES[shape])
    ids, mask = encode(tok)
    stops = stops_for(len(tok))
    expected = hf_generate(model, ids, mask, 2, stops, 20, greedy=True)
    with torch.inference_mode():
        out = lean_generate(
            model, ids, mask, 2, max_new_tokens=20, stop_ids=stops, pad_id=0, greedy=True, dead_share=0.02
        )  # fmt: skip  (compact at every finished row)
    assert torch.equal(out.response_ids, expected)
    lengths = real_mask(expected, stops).sum(1)
    assert lengths.min() < lengths.max()  # rows ended at different steps: the batch was compacted
    logp = full_forward_logits(model, ids, mask, expected, 2).log_softmax(-1)  # (B, T, V)
    chosen = logp.gather(-1, expected[..., None])[..., 0] * real_mask(expected, stops)
    torch.testing.assert_close(out.logp.double(), chosen, atol=2e-5, rtol=0)
    entropy = -(logp.exp() * logp).sum(-1) * real_mask(expected, stops)
    torch.testing.assert_close(out.entropy.double(), entropy, atol=2e-5, rtol=0)


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.9), (1.0, 1.0), (1.3, 0.5)])
def test_sampled_tokens_equal_hf_under_the_same_seed(tok, temperature, top_p):
    """With HF's draw (``draw="multinomial"``) and without compaction (dead_share > 1) the loop draws one
    multinomial per step over the same rows as HF, from the same probabilities, so the same seed gives the same
    tokens: the probabilities every draw sees are HF's, bit for bit."""
    model = qwen2(len(tok), SHAPES["gqa-tied"])
    ids, mask = encode(tok)
    stops = stops_for(len(tok))
    torch.manual_seed(5)
    expected = hf_generate(model, ids, mask, 4, stops, 20, False, temperature, top_p)
    torch.manual_seed(5)
    with torch.inference_mode():
        out = lean_generate(model, ids, mask, 4, max_new_tokens=20, stop_ids=stops, pad_id=0,
                            temperature=temperature, top_p=top_p, dead_share=2.0, draw="multinomial")  # fmt: skip
    assert torch.equal(out.response_ids, expected)
    assert len({tuple(r.tolist()) for r in expected}) > 6  # genuinely random rows


def ks_uniform_pvalue(u: torch.Tensor) -> float:
    """Asymptotic Kolmogorov-Smirnov p-value of the sample u against Uniform(0, 1)."""
    n = len(u)
    x = u.double().sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    d = max((grid - x).max().item(), (x - (grid - 1 / n)).max().item())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    return min(1.0, max(0.0, 2 * sum((-1) ** (k - 1) * math.exp(-2 * (k * lam) ** 2) for k in range(1, 101))))


def pit(probs: torch.Tensor, tokens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Randomized probability integral transform F(y - 1) + U p(y) of each token y under probs (N, V): i.i.d.
    Uniform(0, 1) exactly when every token was drawn from its row of probs (each given the tokens before it)."""
    below = probs.cumsum(-1).gather(-1, tokens[:, None])[:, 0] - probs.gather(-1, tokens[:, None])[:, 0]
    return (
        below
        + torch.rand(len(tokens), generator=generator, dtype=probs.dtype) * probs.gather(-1, tokens[:, None])[:, 0]
    )


@pytest.mark.parametrize("draw", DRAWS)
def test_sampling_with_compaction_draws_from_the_model(tok, draw):
    """After compaction (here at every finished row), and with the inverse-CDF draw at any time, the draws differ
    from HF's in value, not in law. Reference law:
    HF's forward of the sampled sequences, HF's own TopPLogitsWarper, softmax. The KS test rejects at p < 1e-3 (a
    0.1% false alarm for a correct sampler; the seed is fixed, so the outcome is too). It catches a compaction that
    feeds rows each other's tokens (p ~ 1e-20 in a trial); position and mask mix-ups barely move a random model's
    law, so the greedy test catches those. Negative control: the same tokens judged at temperature 1 must be
    rejected."""
    model = qwen2(len(tok), SHAPES["gqa-tied"])
    ids, mask = encode(tok)
    stops = stops_for(len(tok))
    temperature, top_p = 0.7, 0.9
    torch.manual_seed(11)
    with torch.inference_mode():
        out = lean_generate(model, ids, mask, 24, max_new_tokens=24, stop_ids=stops, pad_id=0,
                            temperature=temperature, top_p=top_p, dead_share=0.02, draw=draw)  # fmt: skip
    response = out.response_ids
    real = real_mask(response, stops)
    assert real.sum(1).min() < real.sum(1).max() and real.sum() > 400
    logits = full_forward_logits(model, ids, mask, response, 24)[real]  # (N, V) one row per real token
    tokens = response[real]  # (N,)

    def law(temp, p):
        scores = logits / temp
        return (TopPLogitsWarper(p)(None, scores) if p < 1 else scores).softmax(-1)

    generator = torch.Generator().manual_seed(0)
    assert ks_uniform_pvalue(pit(law(temperature, top_p), tokens, generator)) > 1e-3
    assert ks_uniform_pvalue(pit(law(1.0, 1.0), tokens, generator)) < 1e-6


def test_top_p_filter_is_hfs_warper():
    """Hand case: probabilities (0.5, 0.3, 0.2), top_p 0.6: ascending cumulative mass (0.2, 0.5, 1.0), only 0.2 <= 0.4
    is removed. Then HF's TopPLogitsWarper on random scores, exactly."""
    kept = top_p_filter(torch.tensor([[0.5, 0.3, 0.2]]).log(), 0.6)
    assert torch.isinf(kept[0, 2]) and torch.isfinite(kept[0, :2]).all()
    scores = torch.randn(16, 50, generator=torch.Generator().manual_seed(0)) * 3
    for p in (0.3, 0.9, 0.999):
        assert torch.equal(top_p_filter(scores, p), TopPLogitsWarper(p)(None, scores))
    tokens, logp, _ = pick_tokens(scores, 0.5, 1.0, True, True)
    assert torch.equal(tokens, scores.argmax(-1))  # greedy is scored at temperature 1
    torch.testing.assert_close(logp, scores.log_softmax(-1).max(-1).values)


def test_lab_model_matches_hf_generate():
    """The bundled lab model on real K&K prompts: greedy to the end of each answer, and sampled at T = 0.7 under the
    same seed (no compaction) token for token; the decoder's log-probs equal a forward's to 2e-5."""
    from lopti_lab.kk import build_prompt, load_split
    from lopti_lab.lab.trace import RL_PROMPT_STYLE as LAB_PROMPT_STYLE
    from lopti_lab.models import load_policy

    model, tokenizer = load_policy("lab", lora=None)
    prompts = [build_prompt(p, LAB_PROMPT_STYLE, tokenizer) for p in load_split("test", (2, 3), limit=2)]
    ids, mask = encode(tokenizer, prompts)
    stops = [tokenizer.eos_token_id]
    cap = 640  # the lab model's response cap (PretrainConfig.max_new_tokens): every answer ends before it
    expected = hf_generate(model, ids, mask, 1, stops, cap, greedy=True)
    with torch.inference_mode():
        out = lean_generate(model, ids, mask, 1, max_new_tokens=cap, stop_ids=stops, pad_id=0, greedy=True)
    assert torch.equal(out.response_ids, expected)
    assert torch.isin(expected, torch.tensor(stops)).any(1).all()  # every answer ended before the cap
    torch.manual_seed(3)
    expected = hf_generate(model, ids, mask, 2, stops, 200, False, 0.7)
    torch.manual_seed(3)
    with torch.inference_mode():
        out = lean_generate(model, ids, mask, 2, max_new_tokens=200, stop_ids=stops, pad_id=0, temperature=0.7,
                            dead_share=2.0, draw="multinomial")  # fmt: skip
    assert torch.equal(out.response_ids, expected)
    real = real_mask(expected, stops)
    logp = (full_forward_logits(model, ids, mask, expected, 2) / 0.7).log_softmax(-1)
    chosen = logp.gather(-1, expected[..., None])[..., 0] * real
    torch.testing.assert_close(out.logp.double(), chosen, atol=2e-5, rtol=0)


def test_inverse_cdf_draw():
    """The docstring's case (a zero-probability token has an empty interval), then the law on 200,000 draws of a
    distribution with a tiny and a zero entry: every frequency within 5 binomial SEs of its probability, the zero
    never drawn; the same seed gives the same tokens."""
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3]])
    for u, token in [(0.2, 2), (0.95, 3), (0.0, 0), (1 - 2**-53, 3)]:
        with mock_rand(u):
            assert decode._inverse_cdf(probs).item() == token
    p = torch.tensor([0.5, 0.0, 1e-4, 0.25, 0.2499])
    n = 200_000
    torch.manual_seed(0)
    tokens = decode._inverse_cdf(p.expand(n, -1))
    freq = torch.bincount(tokens, minlength=len(p)).double() / n
    se = (p.double() * (1 - p.double()) / n).sqrt()
    assert freq[1] == 0 and ((freq - p.double()).abs() <= 5 * se + 1e-12).all()
    torch.manual_seed(0)
    assert torch.equal(decode._inverse_cdf(p.expand(n, -1)), tokens)
    with pytest.raises(RuntimeError, match="nan"):  # a broken model fails loudly, as torch.multinomial does
        decode._inverse_cdf(torch.tensor([[0.5, float("nan")], [0.5, 0.5]]))


class mock_rand:
    """torch.rand returning u everywhere (inside the draw)."""

    def __init__(self, u: float):
        self.u, self.real = u, torch.rand

    def __enter__(self):
        torch.rand = lambda *shape, **kw: torch.full(*shape, self.u, **kw)

    def __exit__(self, *exc):
        torch.rand = self.real


def test_fused_step_is_the_modules_arithmetic(monkeypatch):
    """The decode step's fused [q|k|v] and [gate|up] matmuls and F.rms_norm give the lab model's module arithmetic
    bit for bit: tokens, log-probs and entropies equal those of the same loop calling every module, on real K&K
    prompts with sampling (HF's draw) and compaction."""
    from lopti_lab.kk import build_prompt, load_split
    from lopti_lab.lab.trace import RL_PROMPT_STYLE as LAB_PROMPT_STYLE
    from lopti_lab.models import load_policy

    model, tokenizer = load_policy("lab", lora=None)
    prompts = [build_prompt(p, LAB_PROMPT_STYLE, tokenizer) for p in load_split("test", (2, 3), limit=2)]
    ids, mask = encode(tokenizer, prompts)
    kwargs = dict(max_new_tokens=60, stop_ids=[tokenizer.eos_token_id, 303], pad_id=0, temperature=0.8,
                  draw="multinomial", dead_share=0.05)  # fmt: skip
    runs = []
    for modules in (False, True):
        if modules:  # every projection and norm called as its module
            monkeypatch.setattr(decode, "norm", lambda module: module)
            monkeypatch.setattr(decode, "_fused", lambda ms: lambda h: torch.cat([m(h) for m in ms], -1))
        torch.manual_seed(4)
        with torch.inference_mode():
            runs.append(lean_generate(model, ids, mask, 3, **kwargs))
    fused, reference = runs
    assert fused.response_ids.shape[1] > 5 and (fused.response_ids == 0).any()  # some rows ended: compaction ran
    for name in ("response_ids", "logp", "entropy"):
        assert torch.equal(getattr(fused, name), getattr(reference, name)), name


def rms_norm_in_float64(self, hidden_states):
    """Qwen2RMSNorm in the input's dtype: HF's casts to float32 even in a float64 model, and the shared prompt's
    gradient is summed over its rows before that norm's backward instead of after, so float32 rounding would show."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.mark.parametrize("variant", ["gqa-tied", "mqa-untied-theta", "mha-head_dim", "lora", "checkpointing"])
def test_shared_prompt_forward_equals_hf_forward_and_gradients(tok, variant, monkeypatch):
    """float64: log-probs, entropies and the gradient of a policy-gradient loss through the shared-prompt forward
    equal those through HF's forward of every row (the prompt's rows share it; autograd sums their gradients; the
    responses run in length buckets)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    monkeypatch.setattr(Qwen2RMSNorm, "forward", rms_norm_in_float64)
    monkeypatch.setattr(lean_forward, "BUCKET_TOKENS", 1)  # 16-token responses in several buckets, as long ones are
    model = qwen2(len(tok), SHAPES.get(variant, SHAPES["gqa-tied"]), torch.float64)
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
    if variant == "checkpointing":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.generation_config.eos_token_id = stops_for(len(tok))  # responses of many lengths: several buckets
    torch.manual_seed(0)
    rollout = sample(model, tok, PROMPTS, 4, max_new_tokens=16, temperature=0.8, with_logprobs=False)
    assert len(length_buckets(rollout.lengths.long())) > 1
    advantages = torch.randn(len(rollout), 1, dtype=torch.float64)
    model.train()
    results = {}
    for path in ("hf", "lean"):
        model.zero_grad()
        args = (rollout.input_ids, rollout.attention_mask, rollout.response_mask.double(), 0.8, True)
        logp, entropy = response_logprobs(model, *args, fast_path=path)
        (-(advantages * logp).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[path] = (logp.detach(), entropy.detach(), grads)
    (logp_hf, ent_hf, grad_hf), (logp_lean, ent_lean, grad_lean) = results["hf"], results["lean"]
    torch.testing.assert_close(logp_lean, logp_hf, atol=1e-10, rtol=0)
    torch.testing.assert_close(ent_lean, ent_hf, atol=1e-10, rtol=0)
    assert grad_hf.keys() == grad_lean.keys() and grad_hf
    for name in grad_hf:
        torch.testing.assert_close(grad_lean[name], grad_hf[name], atol=1e-11, rtol=1e-9)


def test_lean_sample_keeps_the_rollout_contract(tok):
    """sample() on the lean path: group layout, masks up to the first stop token, texts, finished flags, and
    old_logp / entropy equal to HF's log-prob forward; chunked calls give the same greedy rollout."""
    model = qwen2(len(tok), SHAPES["gqa-tied"])
    model.generation_config.eos_token_id = stops_for(len(tok))
    stops = [*stops_for(len(tok)), tok.eos_token_id]
    torch.manual_seed(2)
    r = sample(model, tok, PROMPTS, 4, max_new_tokens=16, temperature=0.7, fast_path="lean")
    B, T = r.response_ids.shape
    assert B == 12 and r.group_size == 4 and torch.equal(r.prompt_ids[0], r.prompt_ids[3])
    for b in range(B):
        n = int(r.lengths[b])
        assert not r.response_mask[b, n:].any() and r.response_mask[b, :n].all()
        if r.finished[b]:
            assert r.response_ids[b, n - 1] in stops and r.texts[b] == tok.decode(r.response_ids[b, : n - 1])
        else:
            assert n == T == 16
    assert r.finished.any() and r.lengths.min() < r.lengths.max()
    forward = add_logprobs(model, r.select(slice(0, B)), temperature=0.7, fast_path="hf")
    torch.testing.assert_close(r.old_logp, forward.old_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(r.entropy, forward.entropy, atol=1e-5, rtol=0)
    assert not r.old_logp.is_inference()
    one = sample(model, tok, PROMPTS, 2, max_new_tokens=16, greedy=True, fast_path="lean")
    chunked = sample(model, tok, PROMPTS, 2, max_new_tokens=16, greedy=True, fast_path="lean", batch_size=2)
    assert one.texts == chunked.texts
    torch.testing.assert_close(one.old_logp, chunked.old_logp, atol=1e-5, rtol=0)


def test_the_path_choice_is_explicit(tok, monkeypatch):
    """auto: the lean path for a Qwen2 on a CPU, HF for anything else; hf: never lean; lean: fail, naming why."""
    model = tiny_qwen2(len(tok))
    assert lean_unsupported(model) is None and use_lean(model) and not use_lean(model, "hf")
    with pytest.raises(ValueError, match="fast_path"):
        use_lean(model, "fastest")
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4))  # fmt: skip
    sliding = qwen2(len(tok), {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0})
    patched = tiny_qwen2(len(tok))
    patched.forward = patched.forward  # an instance-level forward (tests bias logits so): HF must run it
    on_meta = tiny_qwen2(len(tok)).to("meta")
    for other, reason in [(llama, "Qwen2"), (sliding, "sliding"), (patched, "forward"), (on_meta, "meta")]:
        assert not use_lean(other)
        with pytest.raises(ValueError, match=reason):
            use_lean(other, "lean")
    calls = []
    real = Qwen2ForCausalLM.generate
    monkeypatch.setattr(Qwen2ForCausalLM, "generate", lambda self, **kw: calls.append(1) or real(self, **kw))
    for path, expected in [("auto", 0), ("hf", 1)]:
        sample(model, tok, PROMPTS[:1], 2, max_new_tokens=3, fast_path=path)
        assert len(calls) == expected
    from lopti_lab.train_config import TrainConfig

    with pytest.raises(ValueError, match="fast_path"):
        TrainConfig(fast_path="fastest")


def test_length_buckets():
    """The docstring's case, then: every row in exactly one bucket, and equal lengths stay one bucket."""
    buckets = length_buckets(torch.tensor([10, 90, 12, 88]))
    assert [b.tolist() for b in buckets] == [[0, 2], [3, 1]]
    # the cut points are optimal: every split of the sorted rows into consecutive groups costs at least as much
    lengths = torch.tensor([5, 40, 41, 90, 7, 300, 120, 33, 64, 250])
    cost = lambda groups: sum(len(g) * int(lengths[g].max()) + 32 for g in groups)  # noqa: E731
    order, best = lengths.argsort(), cost(length_buckets(lengths, 32))
    for mask in range(2 ** (len(lengths) - 1)):
        cuts = [i + 1 for i in range(len(lengths) - 1) if mask >> i & 1]
        assert cost(list(order.tensor_split(cuts))) >= best
    lengths = torch.randint(1, 200, (64,), generator=torch.Generator().manual_seed(0))
    assert sorted(torch.cat(length_buckets(lengths)).tolist()) == list(range(64))
    assert len(length_buckets(torch.full((8,), 5))) == 1


def test_lean_rms_norm_is_hfs_forward_with_an_exact_backward():
    """``forward.norm``: a float32 Qwen2RMSNorm's values bit for bit, and gradients (input and weight) as close to a
    float64 computation as autograd through HF's composite gets; any other norm (a hook on it, its forward replaced,
    bf16 weights) is the module itself. A backward missing the mean term is off by O(1)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from lopti_lab.lean.forward import norm

    torch.manual_seed(0)
    module = Qwen2RMSNorm(96, eps=1e-6)
    module.weight.data.normal_(1.0, 0.3)
    x, grad = torch.randn(4, 7, 96) * 3, torch.randn(4, 7, 96)

    def run(f):  # f None: the float64 computation
        x_ = x.clone().to(torch.float64 if f is None else torch.float32).requires_grad_(True)
        weight = module.weight if f is not None else module.weight.detach().double().requires_grad_(True)
        out = f(x_) if f is not None else weight * x_ * torch.rsqrt(x_.pow(2).mean(-1, keepdim=True) + 1e-6)
        weight.grad = None
        (out * grad.to(out.dtype)).sum().backward()
        return out.detach(), x_.grad.double(), weight.grad.double()

    fast = norm(module)
    assert fast is not module
    (y_hf, gx_hf, gw_hf), (y, gx, gw), (_, gx_64, gw_64) = run(module), run(fast), run(None)
    assert torch.equal(y, y_hf)
    for ours, hf, exact in ((gx, gx_hf, gx_64), (gw, gw_hf, gw_64)):
        assert (ours - exact).abs().max() <= 2 * (hf - exact).abs().max() + 1e-6 * exact.abs().max()
    hook = module.register_forward_hook(lambda m, args, out: None)
    assert norm(module) is module
    hook.remove()
    module.forward = module.forward  # replaced on the instance, as the float64 probe does
    assert norm(module) is module
    del module.forward
    assert norm(module.to(torch.bfloat16)) is module


@pytest.mark.parametrize("shape", ["gqa-tied", "mha-head_dim", "linear-rope"])
def test_lean_layer_input_is_hfs_rotary_and_attention(shape):
    """``forward.layer_input`` rotates q and k as roll(x, D / 2) x signed sin: HF's apply_rotary_pos_emb bit for bit,
    values and gradients (the same products, summed in the same order); ``attend`` lets SDPA serve a key/value head's
    query heads (GQA) instead of copying k and v to every head as HF's repeat_kv does: the same softmax, to float32
    rounding. A wrong sign or a roll by the wrong amount moves every value by O(1)."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb, repeat_kv

    from lopti_lab.lean.forward import attend, layer_input, prompt_allowed, prompt_positions, rotary

    model = qwen2(64, SHAPES[shape])
    core, layer = model.model, model.model.layers[0]
    attn = layer.self_attn
    torch.manual_seed(0)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0  # a left-padded row: positions start later
    x = torch.randn(3, 9, core.config.hidden_size, requires_grad=True)
    # a hook on the norm makes layer_input call the module (lean.forward.norm), so the gradients below are HF's norm
    # backward's on both sides and the rotary's own backward is compared bit for bit (the norm's: test_lean_rms_norm)
    hook = layer.input_layernorm.register_forward_hook(lambda module, args, out: None)
    q, k, v = layer_input(layer, x, *rotary(core, x, prompt_positions(mask)))
    hook.remove()

    x_hf = x.detach().clone().requires_grad_(True)
    h = layer.input_layernorm(x_hf)
    shape_ = (3, 9, -1, attn.head_dim)
    q_hf, k_hf = apply_rotary_pos_emb(
        attn.q_proj(h).view(shape_).transpose(1, 2),
        attn.k_proj(h).view(shape_).transpose(1, 2),
        *core.rotary_emb(x_hf, prompt_positions(mask)),
    )
    assert torch.equal(q, q_hf) and torch.equal(k, k_hf)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    torch.autograd.backward([q, k], [gq, gk])
    torch.autograd.backward([q_hf, k_hf], [gq, gk])
    assert torch.equal(x.grad, x_hf.grad)

    allowed = prompt_allowed(mask)
    groups = attn.num_key_value_groups
    with torch.no_grad():
        ours = attend(layer, q, k, v, allowed)
        theirs = torch.nn.functional.scaled_dot_product_attention(
            q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=allowed, scale=attn.scaling
        )
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
