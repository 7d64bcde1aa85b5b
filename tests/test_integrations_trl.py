"""integrations/trl.py: LoptiGRPOTrainer against stock TRL, a hand computation and our own trainer, on CPU.

Every run uses a tiny random Qwen2 saved to a temp folder (loaded by path, as a user would) with large initial
weights (initializer_range 1.0) so that its token probabilities spread over (0, 1): about half of the sampled tokens
fall below eta = 0.5 and both Lopti stages have tokens. A random model never solves a puzzle, so the runs score with
a hash of the text (``spread_reward``), which gives every group nonzero advantages; ``kk_reward`` has its own tests.
"""

import inspect

import pytest
import torch
from tiny import peaky_qwen2_folder, spread_reward

trl = pytest.importorskip("trl", reason="the trl extra is not installed (pip install -e '.[trl]')")

from packaging.version import Version  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from lopti_lab.integrations import trl as adapter  # noqa: E402
from lopti_lab.integrations.trl import (  # noqa: E402
    SEQUENCE_ADVANTAGES,
    STAGE_MASK,
    TESTED_TRL,
    LoptiGRPOConfig,
    LoptiGRPOTrainer,
    kk_dataset,
    kk_reward,
)
from lopti_lab.kk import generate_puzzle, score_response  # noqa: E402
from lopti_lab.objective import lopti_stages, policy_loss, reweight_advantages  # noqa: E402
from lopti_lab.rollout import Rollout, response_logprobs  # noqa: E402
from lopti_lab.train_config import TrainConfig  # noqa: E402
from lopti_lab.update import advantages_and_stages, update_policy  # noqa: E402

ETA = 0.5


@pytest.fixture(scope="module")
def peaky_model(tmp_path_factory):
    """A tiny random Qwen2 whose sampled tokens have probabilities spread over (0, 1), as a local model folder."""
    return peaky_qwen2_folder(tmp_path_factory.mktemp("peaky_qwen2"))


@pytest.fixture(scope="module")
def dataset():
    return kk_dataset([generate_puzzle(2, seed=i) for i in range(16)], "base")


@pytest.fixture(scope="module")
def one_prompt():
    """One puzzle repeated: no left padding, so TRL's forward (no position_ids: a padded row is scored at shifted RoPE
    positions, equal only up to float rounding, about 3e-5 in log-prob with this model) and ours (positions from
    the attention mask) see the same positions and agree to float32 precision."""
    return kk_dataset([generate_puzzle(2, seed=0)] * 16, "base")


def settings(tmp_path, **overrides) -> dict:
    """2 prompts x G 4 per generation, micro-batches of 4 rows, a large lr so that stage 2 sees stage 1's drift."""
    base = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        temperature=1.0,
        learning_rate=5e-2,
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    return {**base, **overrides}


def make(trainer_cls, config_cls, model, dataset, tmp_path, reward=spread_reward, optimizers=(None, None), **kw):
    args = config_cls(**settings(tmp_path, **kw))
    return trainer_cls(model=model, reward_funcs=[reward], args=args, train_dataset=dataset, optimizers=optimizers)


def params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def fresh_batch(trainer) -> dict:
    """One buffered slice at the rollout weights: what the first micro-step of training sees (no step taken)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer._prepare_inputs(batch)


def loss_and_grads(trainer, inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = trainer.model
    loss = trainer.compute_loss(model, inputs)
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return loss.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(model.parameters(), grads)]


# --- construction ---------------------------------------------------------------------------------------------------

BAD = [
    ({"ar_alpha": -0.1}, "ar_alpha"),
    ({"ar_alpha": 1.5}, "ar_alpha"),
    ({"ar_alpha": float("nan")}, "ar_alpha"),
    ({"ar_alpha": True}, "ar_alpha"),
    ({"lopti_eta": 0.0}, "lopti_eta"),
    ({"lopti_eta": 1.0}, "lopti_eta"),
    ({"lopti_eta": -0.5}, "lopti_eta"),
    ({"lopti_eta": 0.5, "lopti_order": "middle"}, "lopti_order"),
    ({"lopti_eta": 0.5, "steps_per_generation": 3}, "gradient_accumulation_steps"),  # S = 3, GA = 2
    ({"lopti_eta": 0.5, "gradient_accumulation_steps": 4, "steps_per_generation": 2}, "gradient_accumulation_steps"),
    ({"lopti_eta": 0.5, "loss_type": "grpo"}, "loss_type"),
    ({"lopti_eta": 0.5, "loss_type": "bnpo"}, "loss_type"),
    ({"lopti_eta": 0.5, "importance_sampling_level": "sequence"}, "importance_sampling_level"),
    ({"lopti_eta": 0.5, "entropy_coef": 0.01}, "entropy_coef"),
    ({"lopti_eta": 0.5, "max_steps": 3}, "max_steps"),  # 2 optimizer steps per RL step
    ({"lopti_eta": 0.5, "save_strategy": "steps", "save_steps": 3}, "save_steps"),
    ({"steps_per_generation": 3}, "minibatch_token_mean"),
    ({"rl_steps": 0}, "rl_steps"),
]


@pytest.mark.parametrize(("change", "name"), BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD)])
def test_bad_settings_are_rejected_at_construction_naming_the_setting(tmp_path, change, name):
    with pytest.raises(ValueError, match=f"LoptiGRPOConfig.{name} "):
        LoptiGRPOConfig(**settings(tmp_path, **change))


def test_good_layouts_and_rl_steps(tmp_path):
    paper = LoptiGRPOConfig(**settings(tmp_path, lopti_eta=0.5, steps_per_generation=4, rl_steps=3))
    assert paper.optimizer_steps_per_generation == 2 * 4 // 2  # 2 stages x S / GA
    assert paper.max_steps == 3 * 4
    plain = LoptiGRPOConfig(**settings(tmp_path, steps_per_generation=3, minibatch_token_mean=False))
    assert plain.stages == 1  # TRL's own layouts stay open without Lopti


def test_trainer_needs_the_lopti_config(peaky_model, dataset, tmp_path):
    with pytest.raises(TypeError, match="LoptiGRPOConfig"):
        make(LoptiGRPOTrainer, GRPOConfig, peaky_model, dataset, tmp_path)


# --- off = stock TRL; AR ----------------------------------------------------------------------------------------------

LAYOUTS = {
    "one step per generation": {},  # TRL's aligned path: no old log-probs
    "two steps per generation": {"steps_per_generation": 4},  # TRL's denominator: minibatch_token_mean=False
    "two iterations": {"num_iterations": 2},  # TRL buffers old log-probs
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("ar", [None, 0.0], ids=["off", "ar-alpha-0"])
def test_subclass_equals_stock_grpo_with_ar_and_lopti_off_or_alpha_zero(peaky_model, dataset, tmp_path, layout, ar):
    """Same seed, same data: stock GRPOTrainer and the subclass (AR and Lopti off, or AR with alpha = 0, whose
    weight is exactly 1) end with bit-identical parameters after 4 optimizer steps."""
    stock = make(GRPOTrainer, GRPOConfig, peaky_model, dataset, tmp_path / "stock", max_steps=4, **LAYOUTS[layout])
    before = params(stock)
    stock.train()  # each trainer seeds the RNGs at construction: build one, train it, then the next
    trl_mean = {"minibatch_token_mean": False} if "steps_per_generation" in LAYOUTS[layout] else {}
    ours = make(
        LoptiGRPOTrainer, LoptiGRPOConfig, peaky_model, dataset, tmp_path / "ours", max_steps=4, ar_alpha=ar,
        **LAYOUTS[layout], **trl_mean,
    )  # fmt: skip
    ours.train()
    after_stock, after_ours = params(stock), params(ours)
    assert any(not torch.equal(before[n], after_stock[n]) for n in before)  # training moved the weights
    for name, value in after_stock.items():
        assert torch.equal(value, after_ours[name]), name


@pytest.mark.parametrize("trl_method", [{"loss_type": "cispo"}, {"top_entropy_quantile": 0.2}])
def test_trls_own_token_methods_are_unchanged_with_ours_off(peaky_model, dataset, tmp_path, trl_method):
    """TRL's CISPO loss and its forking tokens (top_entropy_quantile) through the subclass with AR and Lopti off:
    bit-identical to stock GRPOTrainer after 4 optimizer steps."""
    stock = make(GRPOTrainer, GRPOConfig, peaky_model, dataset, tmp_path / "stock", max_steps=4, **trl_method)
    stock.train()
    ours = make(LoptiGRPOTrainer, LoptiGRPOConfig, peaky_model, dataset, tmp_path / "ours", max_steps=4, **trl_method)
    ours.train()
    assert all(torch.equal(a, b) for a, b in zip(params(stock).values(), params(ours).values()))


def test_ar_and_lopti_train_with_trls_cispo_and_forking_tokens(peaky_model, dataset, tmp_path):
    """AR + Lopti with loss_type="cispo" and top_entropy_quantile=0.2, accepted where they used to be refused: one RL
    step takes both stages, and each stage's forking mask keeps only part of that stage's tokens."""
    trainer = make(
        LoptiGRPOTrainer, LoptiGRPOConfig, peaky_model, dataset, tmp_path, ar_alpha=0.3, lopti_eta=ETA,
        loss_type="cispo", top_entropy_quantile=0.2, rl_steps=1,
    )  # fmt: skip
    kept = []
    real = trainer.get_high_entropy_mask
    trainer.get_high_entropy_mask = lambda e, m, t: (
        kept.append((real(e, m, t).sum().item(), m.sum().item())) or real(e, m, t)
    )
    trainer.train()
    assert trainer.state.global_step == 2  # the two Lopti stages
    assert kept and all(0 < k < n for k, n in kept if n >= 5), kept


def test_minibatch_token_mean_is_a_no_op_in_trls_default_layout(peaky_model, dataset, tmp_path):
    stock = make(GRPOTrainer, GRPOConfig, peaky_model, dataset, tmp_path / "s", max_steps=2)
    stock.train()
    ours = make(LoptiGRPOTrainer, LoptiGRPOConfig, peaky_model, dataset, tmp_path / "o", max_steps=2)
    assert ours.args.minibatch_token_mean
    ours.train()
    assert all(torch.equal(a, b) for a, b in zip(params(stock).values(), params(ours).values()))


@pytest.mark.parametrize("layout", ["one step per generation", "two iterations"])
def test_ar_loss_and_gradient_equal_a_hand_computation(peaky_model, dataset, tmp_path, layout):
    """At the rollout weights the ratio is 1, so the clipped loss is -sum_t A_hat_t / N with
    A_hat_t = [alpha * pi_old(o_t) + 1 - alpha] * A (docs/paper.md §3) and N the generation batch's response tokens
    (DAPO, one optimizer step per generation); pi_old and the gradient come from a naive float32 forward here
    (logits / T, log_softmax, gather), independent of TRL's fused LM head."""
    alpha = 0.3
    trainer = make(LoptiGRPOTrainer, LoptiGRPOConfig, peaky_model, dataset, tmp_path, ar_alpha=alpha, **LAYOUTS[layout])
    inputs = fresh_batch(trainer)
    loss, grads = loss_and_grads(trainer, inputs)

    prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
    mask = inputs["completion_mask"].float()  # (B, T)
    ids = torch.cat([prompt, completion], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logits = trainer.model(input_ids=ids, attention_mask=attention).logits[:, prompt.shape[1] - 1 : -1]  # (B, T, V)
    logp = (logits / trainer.args.temperature).log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)
    pi_old = logp.detach().exp()  # (B, T)
    a_hat = (alpha * pi_old + 1 - alpha) * inputs[SEQUENCE_ADVANTAGES][:, None]  # AR, Eq. 4, (B, T)
    n_tokens = sum(s["completion_mask"].sum() for s in trainer._buffered_inputs)  # the whole generation batch
    ratio = torch.exp(logp - logp.detach())
    hand = -(ratio * a_hat * mask).sum() / n_tokens
    hand_grads = torch.autograd.grad(hand, list(trainer.model.parameters()), allow_unused=True)

    torch.testing.assert_close(loss, hand.detach(), atol=1e-6, rtol=1e-5)
    for g, h in zip(grads, hand_grads):
        torch.testing.assert_close(g, torch.zeros_like(g) if h is None else h, atol=1e-6, rtol=1e-4)
    assert (a_hat.abs() < inputs[SEQUENCE_ADVANTAGES][:, None].abs() - 1e-4).any()  # AR changed something


# --- Lopti -----------------------------------------------------------------------------------------------------------


class Recording(LoptiGRPOTrainer):
    """Keeps what each micro-step's loss saw, and every generation batch as buffered (before any update)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen, self.generations = [], []

    def _prepare_inputs(self, generation_batch):
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if self._buffered_inputs is not before:
            self.generations.append([dict(s) for s in self._buffered_inputs])
        return inputs

    def _compute_loss(self, model, inputs):
        self.seen.append({"step": self._step, "global_step": self.state.global_step, **inputs})
        return super()._compute_loss(model, inputs)


@pytest.mark.parametrize("order", ["low_first", "high_first"])
def test_lopti_updates_one_stage_then_the_other_on_the_same_buffered_batch(peaky_model, dataset, tmp_path, order):
    trainer = make(
        Recording, LoptiGRPOConfig, peaky_model, dataset, tmp_path, ar_alpha=0.3, lopti_eta=ETA, lopti_order=order,
        rl_steps=2,
    )  # fmt: skip
    trainer.train()
    steps = trainer.args.steps_per_generation  # S micro-steps per pass over a generation
    assert len(trainer.generations) == 2
    assert trainer.state.global_step == 2 * 2 * steps // trainer.args.gradient_accumulation_steps

    first, second = ("low", "high") if order == "low_first" else ("high", "low")
    touched = {"low": 0, "high": 0}
    for k, seen in enumerate(trainer.seen):
        stage = first if (seen["step"] // steps) % 2 == 0 else second
        live = (seen["advantages"] != 0) & seen["tool_mask"].bool() & seen["completion_mask"].bool()  # (B, T)
        pi_old = seen["old_per_token_logps"].exp()
        assert bool((pi_old[live] < ETA).all() if stage == "low" else (pi_old[live] >= ETA).all()), k
        assert not (seen["advantages"].ne(0) & ~seen["tool_mask"].bool()).any()  # nothing outside the stage
        touched[stage] += int(live.sum())
        if stage == second:  # the same slice as S micro-steps earlier: the SAME pi_old tensor, not recomputed
            earlier = trainer.seen[k - steps]
            assert seen["old_per_token_logps"] is earlier["old_per_token_logps"]
            assert seen["global_step"] > earlier["global_step"]  # ... although the weights moved in between
    assert touched["low"] > 0 and touched["high"] > 0
    logged = {key for entry in trainer.state.log_history for key in entry}
    assert {"lopti/low_share", "ar/weight_mean"} <= logged


def test_lopti_takes_twice_the_optimizer_steps_of_grpo(peaky_model, dataset, tmp_path):
    runs = {}
    for name, eta in (("grpo", None), ("lopti", ETA)):
        trainer = make(Recording, LoptiGRPOConfig, peaky_model, dataset, tmp_path / name, lopti_eta=eta, rl_steps=2)
        trainer.train()
        runs[name] = trainer.state.global_step / len(trainer.generations)
    assert runs["lopti"] == 2 * runs["grpo"]


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "cispo"])
def test_stage_gradients_sum_to_the_one_stage_gradient_at_ratio_one(peaky_model, dataset, tmp_path, loss_type):
    """With the weights still the rollout's, the low and high stages partition the tokens of every term (policy and
    KL) and share one denominator, so their losses and gradients add up to the single-stage AR loss's."""
    trainer = make(
        LoptiGRPOTrainer, LoptiGRPOConfig, peaky_model, dataset, tmp_path, ar_alpha=0.3, lopti_eta=ETA, beta=0.1,
        loss_type=loss_type,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move the policy off the reference (loaded at construction), so the KL term is not 0
        for p in trainer.model.parameters():
            p.add_(3e-3 * torch.randn(p.shape, generator=generator))
    stage_1 = fresh_batch(trainer)  # _prepare_inputs hands out the stage-1 view at micro-step 0
    buffered = trainer._buffered_inputs[0]
    stage_2 = trainer._stage_view(buffered, 1)
    assert stage_1["tool_mask"].sum() > 0 and stage_2["tool_mask"].sum() > 0
    one_stage = {k: v for k, v in buffered.items() if k != STAGE_MASK}  # AR advantages over all response tokens

    loss_1, grads_1 = loss_and_grads(trainer, stage_1)
    loss_2, grads_2 = loss_and_grads(trainer, stage_2)
    loss_all, grads_all = loss_and_grads(trainer, one_stage)
    torch.testing.assert_close(loss_1 + loss_2, loss_all, atol=1e-6, rtol=1e-5)
    for a, b, total in zip(grads_1, grads_2, grads_all):
        torch.testing.assert_close(a + b, total, atol=1e-6, rtol=1e-5)
    assert any(a.abs().sum() > 0 for a in grads_1) and any(b.abs().sum() > 0 for b in grads_2)
    assert min(trainer._metrics["train"]["kl"]) > 0  # the KL term took part


def test_resume_from_an_rl_step_checkpoint_reproduces_a_straight_run(peaky_model, dataset, tmp_path):
    """save_steps must be a multiple of the optimizer steps per RL step (validated), so a checkpoint never falls
    between two Lopti stages; resuming from one continues exactly: same weights as the run that never stopped."""
    run = dict(ar_alpha=0.3, lopti_eta=ETA, rl_steps=2, save_strategy="steps", save_steps=2, learning_rate=1e-2)
    straight = make(Recording, LoptiGRPOConfig, peaky_model, dataset, tmp_path / "straight", **run)
    straight.train()
    resumed = make(Recording, LoptiGRPOConfig, peaky_model, dataset, tmp_path / "resumed", **run)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "out" / "checkpoint-2"))
    assert len(resumed.generations) == 1 and resumed.state.global_step == 4  # only the second RL step ran
    for name, value in params(straight).items():
        assert torch.equal(value, resumed.model.get_parameter(name).detach()), name


# --- parity with lopti_lab's own trainer ------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1], ids=["low stage at the rollout weights", "high stage on drifted weights"])
def test_a_stage_loss_and_gradient_match_objective_policy_loss(peaky_model, one_prompt, tmp_path, stage):
    """The same batch and weights through our own pieces: response_logprobs, reweight_advantages, lopti_stages and
    policy_loss with the minibatch's full token count as denominator, dual clip = TRL's delta, k3 KL. Stage 2 runs
    on perturbed weights, so its ratio, clipping and KL are not trivial. The paper's KL has no ratio factor: TRL's
    use_bias_correction_kl (on by default) is turned off, as the recipes do."""
    alpha, eps_low, eps_high, delta, beta = 0.3, 0.2, 0.28, 4.0, 0.1
    trainer = make(
        LoptiGRPOTrainer, LoptiGRPOConfig, peaky_model, one_prompt, tmp_path, ar_alpha=alpha, lopti_eta=ETA,
        epsilon=eps_low, epsilon_high=eps_high, delta=delta, beta=beta, use_bias_correction_kl=False,
    )  # fmt: skip
    fresh_batch(trainer)
    if stage == 1:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(3e-3 * torch.randn(p.shape, generator=generator))
    view = trainer._stage_view(trainer._buffered_inputs[0], stage)
    trl_loss, trl_grads = loss_and_grads(trainer, view)

    old = view["old_per_token_logps"]
    mask = view["completion_mask"].float()  # (B, T)
    ids = torch.cat([view["prompt_ids"], view["completion_ids"]], 1)
    attention = torch.cat([view["prompt_mask"], view["completion_mask"]], 1)
    logp, _ = response_logprobs(trainer.model, ids, attention, mask, trainer.args.temperature)
    advantages = reweight_advantages(view[SEQUENCE_ADVANTAGES], old, alpha)
    stage_mask = lopti_stages(old, mask, ETA)[stage][1]
    n_tokens = sum(s["completion_mask"].sum() for s in trainer._buffered_inputs)  # the optimizer step's minibatch
    ref = view["ref_per_token_logps"]
    loss, stats = policy_loss(logp, old, advantages, stage_mask, eps_low, eps_high, delta, ref, beta, n_tokens)
    ours = torch.autograd.grad(loss, list(trainer.model.parameters()), allow_unused=True)

    torch.testing.assert_close(trl_loss, loss.detach(), atol=1e-6, rtol=1e-5)
    for g, o in zip(trl_grads, ours):
        torch.testing.assert_close(g, torch.zeros_like(g) if o is None else o, atol=1e-6, rtol=1e-4)
    assert (stats["kl"] > 0) == (stage == 1)


def as_rollout(slices: list[dict], group: int) -> tuple[Rollout, torch.Tensor]:
    """TRL's buffered generation (its micro-step order) as our Rollout: [left-padded prompt | right-padded response]."""
    rows = [k for k, v in slices[0].items() if isinstance(v, torch.Tensor) and v.ndim > 0]
    cat = {k: torch.cat([s[k] for s in slices]) for k in rows}
    rows = cat["completion_ids"].shape[0]
    return Rollout(
        prompt_ids=cat["prompt_ids"],
        prompt_mask=cat["prompt_mask"],
        response_ids=cat["completion_ids"],
        response_mask=cat["completion_mask"].float(),
        texts=[""] * rows,
        group_size=group,
        finished=torch.ones(rows, dtype=torch.bool),
        old_logp=cat["old_per_token_logps"],
        ref_logp=cat.get("ref_per_token_logps"),
    ), cat[SEQUENCE_ADVANTAGES]


@pytest.mark.parametrize(
    ("micro_steps", "accumulation"), [(2, 1), (2, 2)], ids=["paper: 2 minibatches per stage", "accumulate 2"]
)
def test_a_whole_lopti_rl_step_matches_our_update_policy(peaky_model, one_prompt, tmp_path, micro_steps, accumulation):
    """One RL step of AR + Lopti, both ways from the same weights and the same generation batch, with SGD: TRL's
    subclass (its optimizer steps, accumulation and buffer) and lopti_lab.trainer.update_policy end with the same
    weights, stage 2's drifted ratio and clipping included. The lr keeps every token's k3 KL below 10, where ours
    (like verl's low_var_kl) clamps and TRL's does not."""
    from transformers import AutoModelForCausalLM

    lr, alpha, beta = 0.002, 0.3, 0.05
    model = AutoModelForCausalLM.from_pretrained(peaky_model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make(
        Recording, LoptiGRPOConfig, model, one_prompt, tmp_path,
        optimizers=(torch.optim.SGD(model.parameters(), lr), None), ar_alpha=alpha, lopti_eta=ETA, beta=beta,
        use_bias_correction_kl=False, epsilon_high=0.28, delta=4.0, max_grad_norm=0.0, rl_steps=1,
        steps_per_generation=micro_steps, gradient_accumulation_steps=accumulation, per_device_train_batch_size=4,
    )  # fmt: skip
    trainer.train()
    (slices,) = trainer.generations
    rollout, sequence_advantages = as_rollout(slices, trainer.args.num_generations)
    rows = len(rollout)
    cfg = TrainConfig(
        model="lab", lora_r=None, prompts_per_step=rows // 4, group_size=4, temperature=1.0,
        minibatch_size=4 * accumulation, micro_batch_size=4, ppo_epochs=1, grad_clip=None,
        clip_low=0.2, clip_high=0.28, dual_clip=4.0, kl_coef=beta, ar_alpha=alpha, lopti_eta=ETA,
    )  # fmt: skip
    assert cfg.optimizer_steps_per_stage * 2 == trainer.state.global_step

    ours = AutoModelForCausalLM.from_pretrained(peaky_model)
    assert all(torch.equal(p, start[n]) for n, p in ours.named_parameters())
    token_adv, stages, _ = advantages_and_stages(rollout, sequence_advantages, cfg.objective())
    metrics = update_policy(ours, torch.optim.SGD(ours.parameters(), lr), rollout, token_adv, stages, cfg.update_spec())
    assert metrics["update/optimizer_steps"] == trainer.state.global_step

    moved = 0.0
    for name, param in ours.named_parameters():
        theirs = trainer.model.get_parameter(name).detach()
        torch.testing.assert_close(param.detach(), theirs, atol=2e-6, rtol=1e-4, msg=name)
        moved = max(moved, (theirs - start[name]).abs().max().item())
    assert moved > 1e-3  # the step did move the weights, so stage 2 ran on drifted weights
    assert metrics["policy/kl"] > 0


# --- the TRL internals the subclass relies on (canary) ----------------------------------------------------------------


def test_canary_trl_internals_the_subclass_overrides():
    """A TRL upgrade that moves these must fail here, loudly, not change the objective silently."""
    low, high = (Version(v) for v in TESTED_TRL)
    assert low <= Version(trl.__version__) < high, f"untested trl {trl.__version__}: rerun this file, then widen"
    assert list(inspect.signature(GRPOTrainer._compute_loss).parameters) == ["self", "model", "inputs"]
    compute = inspect.getsource(GRPOTrainer._compute_loss)
    forward, reads = compute.index("self._get_per_token_logps_and_entropies("), compute.index('inputs["advantages"]')
    assert forward < reads  # AR's single-iteration path fills the advantages from the forward before TRL reads them
    assert 'completion_mask * inputs["tool_mask"]' in compute  # the stage mask rides on tool_mask: loss only
    assert "if advantages.dim() == 1:" in compute  # (B, T) advantages pass through unchanged
    assert 'inputs["num_items_in_batch"]' in compute and "self.args.steps_per_generation" in compute  # DAPO
    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    assert "self._buffered_inputs[self._step % self.args.steps_per_generation]" in prepare
    assert "self.args.steps_per_generation * self.num_iterations" in prepare
    sampler = inspect.getsource(GRPOTrainer._get_train_sampler)
    assert "self.num_iterations * self.args.steps_per_generation" in sampler  # replays per stage come from here
    generate = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in generate  # old logps exist
    assert 'output["old_per_token_logps"] = old_per_token_logps' in generate
    assert "GRPOTrainer" in adapter.LoptiGRPOTrainer.__mro__[1].__name__


# --- override watch: one test per overridden TRL method ---------------------------------------------------------------

OVERRIDDEN = sorted(
    name for name in vars(LoptiGRPOTrainer) if not name.startswith("__") and callable(getattr(GRPOTrainer, name, None))
)


def test_every_override_is_recorded_and_documented():
    """A new override must come with its recorded TRL signature and a line in the module docstring."""
    assert sorted(adapter.OVERRIDES) == OVERRIDDEN, "record each overridden method's TRL signature in OVERRIDES"
    for name in OVERRIDDEN:
        assert f"``{name}``" in adapter.__doc__, f"{name}: say in the module docstring what it changes and why"


@pytest.mark.parametrize("name", sorted(adapter.OVERRIDES))
def test_override_watch_the_hooked_trl_signature_is_unchanged(name):
    """Fails, naming the TRL version, when TRL changes (or drops) a method the subclass overrides."""
    drift = adapter.signature_drift()
    assert name not in drift, drift[name]


def test_override_watch_sees_a_changed_signature_and_warns_at_construction(monkeypatch, peaky_model, dataset, tmp_path):
    class Changed(GRPOTrainer):
        def _prepare_inputs(self, generation_batch, stage):  # a TRL that added a parameter
            return generation_batch

    drift = adapter.signature_drift(Changed)
    assert list(drift) == ["_prepare_inputs"]
    assert (
        f"TRL {trl.__version__} changed Changed._prepare_inputs(self, generation_batch, stage)"
        in drift["_prepare_inputs"]
    )
    monkeypatch.setattr(adapter, "signature_drift", lambda: {"_prepare_inputs": "TRL x changed it"})
    with pytest.warns(RuntimeWarning, match="TRL x changed it"):
        make(LoptiGRPOTrainer, LoptiGRPOConfig, peaky_model, dataset, tmp_path)


# --- K&K reward and dataset -------------------------------------------------------------------------------------------


def test_kk_dataset_and_reward_score_exactly_as_score_response():
    puzzles = [generate_puzzle(2, seed=1), generate_puzzle(3, seed=2)]
    data = kk_dataset(puzzles, "instruct")
    assert data.column_names == ["prompt", "puzzle", "n_people"]
    assert all(p.endswith("<think>") for p in data["prompt"])
    a, b = puzzles
    completions = [
        f" ok </think><answer> {a.solution_text_format} </answer>",  # right: 1 + 2
        " ok </think><answer> " + a.solution_text_format.replace("knight", "knave") + " </answer>",
        f" ok <answer> {b.solution_text_format} </answer>",  # no </think>: bad format
        " ok </think><answer> nobody </answer>",  # unparseable
    ]
    records = [data[0]["puzzle"], data[0]["puzzle"], data[1]["puzzle"], data[1]["puzzle"]]
    logged = {}
    rewards = kk_reward(completions, records, log_metric=logged.__setitem__)
    expected = [score_response(c, p) for c, p in zip(completions, [a, a, b, b])]
    assert rewards == [r.total for r in expected]
    assert rewards[0] == 3.0 and rewards[2] == -3.0
    assert logged["kk/format"] == pytest.approx(sum(r.format_score for r in expected) / 4)
    assert logged["kk/answer"] == pytest.approx(sum(r.answer_score for r in expected) / 4)
    assert logged["kk/accuracy"] == pytest.approx(1 / 4)
    assert logged["kk/format_error_rate"] == pytest.approx(1 / 4)
    assert logged["kk/accuracy_2ppl"] == pytest.approx(1 / 2) and logged["kk/accuracy_3ppl"] == 0.0


def test_kk_reward_rejects_mismatched_or_conversational_input():
    record = kk_dataset([generate_puzzle(2, seed=1)])[0]["puzzle"]
    with pytest.raises(ValueError, match="2 completions but 1 puzzles"):
        kk_reward(["a", "b"], [record])
    with pytest.raises(TypeError, match="plain-text"):
        kk_reward([[{"role": "assistant", "content": "x"}]], [record])
    with pytest.raises(ValueError, match="no puzzles"):
        kk_dataset([])


def test_kk_reward_metrics_reach_trls_logs(peaky_model, dataset, tmp_path):
    trainer = make(LoptiGRPOTrainer, LoptiGRPOConfig, peaky_model, dataset, tmp_path, reward=kk_reward, max_steps=1)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["kk/format"] == -1.0 and logged["kk/format_error_rate"] == 1.0  # a random model: no tags
    assert logged["rewards/kk_reward/mean"] == -3.0
