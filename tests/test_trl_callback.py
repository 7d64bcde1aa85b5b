"""integrations/trl_callback.py and probes/credit.py: the token-credit metrics on a stock TRL GRPOTrainer, equal to
lopti_lab's own probe path on one batch, on CPU.

The runs use a tiny random Qwen2 with large initial weights (initializer_range 1.0, as tests/test_integrations_trl.py)
so that its sampled tokens' probabilities spread over every quarter, and a hash-of-the-text reward so that every
group has nonzero advantages.
"""

import math

import pytest
import torch
from tiny import peaky_qwen2_folder, spread_reward

pytest.importorskip("trl", reason="the trl extra is not installed (pip install -e '.[trl]')")

from trl import GRPOConfig, GRPOTrainer

from lopti_lab import trainer as trainer_module
from lopti_lab.bins import DEFAULT_BINS
from lopti_lab.integrations.trl import LoptiGRPOConfig, LoptiGRPOTrainer, kk_dataset
from lopti_lab.integrations.trl_callback import TokenCreditCallback, probed_params
from lopti_lab.kk import generate_puzzle
from lopti_lab.probes import GradientProbe, fig3_metrics
from lopti_lab.probes.credit import CreditSums, fig3_sums, token_sums
from lopti_lab.rollout import Rollout, response_logprobs
from lopti_lab.update import Objective, UpdateSpec, advantages_and_stages, update_policy

K = len(DEFAULT_BINS) - 1


@pytest.fixture(scope="module")
def peaky_model(tmp_path_factory):
    return peaky_qwen2_folder(tmp_path_factory.mktemp("peaky_qwen2_credit"), tie_word_embeddings=False)


@pytest.fixture(scope="module")
def one_prompt():
    """One puzzle repeated: no left padding, so TRL's forward (no position_ids) and ours see the same positions."""
    return kk_dataset([generate_puzzle(2, seed=0)] * 16, "base")


def settings(tmp_path, **overrides) -> dict:
    base = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, activation_checkpointing=False,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, max_completion_length=8,
        temperature=1.0, learning_rate=5e-2, lr_scheduler_type="constant", report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=0, max_steps=3,
    )  # fmt: skip
    return {**base, **overrides}


def stock(model, dataset, tmp_path, peft_config=None, **kw) -> GRPOTrainer:
    args = GRPOConfig(**settings(tmp_path, **kw))
    return GRPOTrainer(
        model=model, reward_funcs=[spread_reward], args=args, train_dataset=dataset, peft_config=peft_config
    )


def logged_rows(trainer) -> list[dict]:
    return [row for row in trainer.state.log_history if "tokens/share_bin0" in row]


# --- the definitions, by hand ----------------------------------------------------------------------------------------


def test_token_sums_by_hand():
    """One row, quarters: p_old (.1, .6, .9, .3), A = (+1, +1, -2, +1) per token, the last token masked out; ratio
    (1, 1.5, .5, 1): token share (1/3, 0, 1/3, 1/3); positive mass 2 split (1/2, 0, 1/2, 0); negative mass all in
    bin 3; bin 2's token is clipped above (A > 0, ratio 1.5 > 1.28), bin 3's below (A < 0, .5 < .8)."""
    p_old = torch.tensor([[0.1, 0.6, 0.9, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, -2.0, 1.0]])
    log_ratio = torch.tensor([[1.0, 1.5, 0.5, 1.0]]).log()
    entropy = torch.tensor([[0.5, 1.0, 2.0, 9.0]])
    m = token_sums(p_old, mask, adv, entropy=entropy, log_ratio=log_ratio, clip_low=0.2, clip_high=0.28).metrics()
    assert [m[f"tokens/share_bin{k}"] for k in range(K)] == pytest.approx([1 / 3, 0, 1 / 3, 1 / 3])
    assert [m[f"adv/pos_share_bin{k}"] for k in range(K)] == pytest.approx([0.5, 0, 0.5, 0])
    assert [m[f"adv/neg_share_bin{k}"] for k in range(K)] == pytest.approx([0, 0, 0, 1])
    assert m["clip/high_share_bin2"] == 1 and m["clip/low_share_bin3"] == 1 and m["clip/low_share_bin2"] == 0
    assert math.isnan(m["clip/high_share_bin1"])  # no token in bin 1
    assert [m[f"entropy/mean_bin{k}"] for k in (0, 2, 3)] == pytest.approx([0.5, 1.0, 2.0])
    assert not any(key.startswith(("grad/", "fig3/")) for key in m)  # not measured: no keys


def test_sums_add_and_reduce_as_one_batch():
    """Two halves added (micro-batches) or reduced (processes) give the metrics of the whole batch."""
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(6, 5, generator=gen)
    mask = (torch.rand(6, 5, generator=gen) > 0.2).float()
    adv = torch.randn(6, generator=gen)
    ent = torch.rand(6, 5, generator=gen)
    whole = token_sums(p, mask, adv, entropy=ent).metrics()
    a, b = (token_sums(p[s], mask[s], adv[s], entropy=ent[s]) for s in (slice(0, 3), slice(3, 6)))
    added = (a + b).metrics()
    reduced = a.reduced(lambda t: t + b.pack()).metrics()
    for key, value in whole.items():
        assert added[key] == pytest.approx(value, nan_ok=True) and reduced[key] == pytest.approx(value, nan_ok=True)


def test_fig3_sums_equal_update_shift_fig3_metrics():
    """The callback's Fig. 3 counts and our trainer's ``fig3_metrics`` give the same numbers on the same log-probs,
    ties (unmoved tokens) included."""
    gen = torch.Generator().manual_seed(1)
    before = -torch.rand(5, 7, generator=gen) * 3
    after = before + torch.randn(5, 7, generator=gen) * 1e-3 * (torch.rand(5, 7, generator=gen) > 0.3)
    mask = (torch.rand(5, 7, generator=gen) > 0.2).float()
    p_old = before.exp()
    ours = fig3_metrics({"float32": before}, {"float32": after}, p_old, mask, {"q": DEFAULT_BINS})
    shared = fig3_sums(before, after, p_old, mask).metrics()
    assert set(ours) == set(shared)
    for key, value in ours.items():
        assert shared[key] == pytest.approx(value, nan_ok=True), key
    assert any(shared[f"fig3/float32/q/zero_share_bin{k}"] > 0 for k in range(K))  # ties are counted apart


# --- the callback on TRL's own trainer --------------------------------------------------------------------------------


def assert_rows_are_metrics(rows: list[dict], grad: bool = True) -> None:
    for row in rows:
        shares = [row[f"tokens/share_bin{k}"] for k in range(K)]
        assert sum(shares) == pytest.approx(1.0)
        for sign in ("pos", "neg"):
            assert sum(row[f"adv/{sign}_share_bin{k}"] or 0 for k in range(K)) == pytest.approx(1.0)
        if grad:
            total = sum(row[f"grad/share_bin{k}"] or 0 for k in range(K)) + row["grad/share_context"]
            assert total == pytest.approx(1.0, abs=1e-4)
        correct = [row[f"fig3/float32/q/correct_bin{k}"] for k in range(K)]
        assert all(c is None or 0.0 <= c <= 1.0 for c in correct)
        assert any(c is not None for c in correct)


def test_callback_logs_per_bin_rows_on_stock_grpo_full_fine_tuning(peaky_model, one_prompt, tmp_path):
    """Stock GRPOTrainer, unchanged class, full fine-tuning: 3 optimizer steps, one logged row each, in
    log_history beside TRL's own metrics; the wrapped compute_loss is this instance's only."""
    trainer = stock(peaky_model, one_prompt, tmp_path)
    callback = TokenCreditCallback(every=1).attach(trainer)
    assert "compute_loss" in vars(trainer) and "compute_loss" not in vars(GRPOTrainer).get("__dict__", {})
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    rows = logged_rows(trainer)
    assert len(rows) == 3 and all("entropy" in row and "reward" in row for row in rows)  # TRL's own, same row
    assert_rows_are_metrics(rows)
    assert any(not torch.equal(p, start[n]) for n, p in trainer.model.named_parameters())
    callback.detach()
    assert "compute_loss" not in vars(trainer)


def test_callback_every_n_steps_with_lora_and_checkpointing(peaky_model, one_prompt, tmp_path, monkeypatch):
    """LoRA (peft), activation checkpointing (TRL's default) and every=2: steps 1 and 3 are measured, step 2 is not;
    the extra forwards run in row chunks (one row each here), as on a large vocabulary."""
    from peft import LoraConfig

    from lopti_lab.integrations import trl_callback

    monkeypatch.setattr(trl_callback, "LOGITS_PER_CHUNK", 1)
    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = stock(peaky_model, one_prompt, tmp_path, peft_config=peft, activation_checkpointing=True)
    TokenCreditCallback(every=2).attach(trainer)
    trainer.train()
    steps = [row["step"] for row in logged_rows(trainer)]
    assert steps == [1, 3]
    assert_rows_are_metrics(logged_rows(trainer))


def test_fig3_in_float64_logs_under_its_precision(peaky_model, one_prompt, tmp_path):
    """fig3_precision="float64": both Fig. 3 forwards through ``probes.float64``, keyed fig3/float64/..."""
    trainer = stock(peaky_model, one_prompt, tmp_path, max_steps=1)
    callback = TokenCreditCallback(fig3_precision="float64").attach(trainer)
    trainer.train()
    (row,) = logged_rows(trainer)
    correct = [row[f"fig3/float64/q/correct_bin{k}"] for k in range(K)]
    assert any(c is not None for c in correct) and not any(key.startswith("fig3/float32") for key in row)
    assert callback.last_local.precision == "float64"


@pytest.mark.parametrize("method", ["ar", "lopti", "ar+lopti"])
def test_callback_on_our_subclass_with_ar_and_lopti(peaky_model, one_prompt, tmp_path, method):
    """Our LoptiGRPOTrainer: AR's (B, T) advantages and Lopti's stage masks (each optimizer step one stage)."""
    kw = {"ar_alpha": 0.3} if "ar" in method else {}
    if "lopti" in method:
        kw |= {"lopti_eta": 0.5, "max_steps": 2}
    args = LoptiGRPOConfig(**settings(tmp_path, **kw))
    trainer = LoptiGRPOTrainer(model=peaky_model, reward_funcs=[spread_reward], args=args, train_dataset=one_prompt)
    TokenCreditCallback().attach(trainer)
    trainer.train()
    rows = logged_rows(trainer)
    assert len(rows) == trainer.state.global_step
    assert_rows_are_metrics(rows)
    if "lopti" in method:  # stage 1 trains the tokens below eta = 0.5 only, stage 2 the rest
        low, high = rows[0], rows[1]
        assert low["tokens/share_bin2"] == 0 and low["tokens/share_bin3"] == 0
        assert high["tokens/share_bin0"] == 0 and high["tokens/share_bin1"] == 0


def test_advantage_mass_is_the_one_the_loss_reads_with_ar_applied_inside_the_forward(peaky_model, one_prompt, tmp_path):
    """AR on our subclass's single-iteration path is applied inside the loss forward (no old log-probs buffered):
    the callback's positive and negative advantage mass is that of the AR-weighted advantages TRL's loss reads."""
    args = LoptiGRPOConfig(**settings(tmp_path, ar_alpha=0.3, max_steps=1, gradient_accumulation_steps=1))
    trainer = LoptiGRPOTrainer(model=peaky_model, reward_funcs=[spread_reward], args=args, train_dataset=one_prompt)
    read = []
    compute = trainer._compute_loss

    def recording(model, inputs):
        loss = compute(model, inputs)
        mask = inputs["completion_mask"].float()
        read.append(
            ((inputs["advantages"].clamp(min=0) * mask).sum(), ((-inputs["advantages"]).clamp(min=0) * mask).sum())
        )
        return loss

    trainer._compute_loss = recording
    callback = TokenCreditCallback().attach(trainer)
    trainer.train()
    ((pos, neg),) = read
    sums = callback.last_local.sums
    assert sums["adv_pos"].sum().item() == pytest.approx(pos.item(), rel=1e-5)
    assert sums["adv_neg"].sum().item() == pytest.approx(neg.item(), rel=1e-5)


# --- one batch through both paths: the callback on TRL, our trainer's probe -------------------------------------------


class Capturing(TokenCreditCallback):
    """Keeps the micro-steps' inputs of the measured step (the batch fed to our trainer's path below)."""

    def __init__(self):
        super().__init__(every=1)
        self.batches = []

    def _before_loss(self, model, inputs):
        self.batches.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        super()._before_loss(model, inputs)


def test_one_batch_gives_equal_metrics_through_the_callback_and_our_trainers_probe(peaky_model, one_prompt, tmp_path):
    """One RL step of TRL's stock GRPOTrainer with the callback (2 micro-steps of 4 rows, one backward each), and
    the same batch, from the same weights, through lopti_lab's update_policy with GradientProbe and the credit
    functions, as our trainer's probe path runs: gradient share equal to 1e-5, token share and advantage mass
    exactly, entropy to float rounding. LoRA on the attention, so that both probe the same weights (TRL's fused head
    keeps the output head out of any module call)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = stock(peaky_model, one_prompt, tmp_path, peft_config=peft, max_steps=1)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    callback = Capturing().attach(trainer)
    trainer.train()
    theirs = callback.last
    assert len(callback.batches) == 2

    # our side: the same weights (LoRA B starts at zero, so copy every tensor), the same rows in the same order
    ours = get_peft_model(AutoModelForCausalLM.from_pretrained(peaky_model), peft)
    ours.load_state_dict(start)
    cat = {k: torch.cat([b[k] for b in callback.batches]) for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                     "completion_mask", "advantages")}  # fmt: skip
    mask = cat["completion_mask"].float()
    rollout = Rollout(
        prompt_ids=cat["prompt_ids"], prompt_mask=cat["prompt_mask"], response_ids=cat["completion_ids"],
        response_mask=mask, texts=[""] * len(mask), group_size=4, finished=torch.ones(len(mask), dtype=torch.bool),
    )  # fmt: skip
    ours.eval()
    with torch.no_grad():
        rollout.old_logp, rollout.entropy = response_logprobs(ours, rollout.input_ids, rollout.attention_mask, mask,
                                                              1.0, with_entropy=True)  # fmt: skip
    spec = UpdateSpec(Objective(), temperature=1.0, minibatch_size=8, micro_batch_size=4, grad_clip=None)
    token_adv, stages, _ = advantages_and_stages(rollout, cat["advantages"], spec.objective)
    probe = GradientProbe(ours, DEFAULT_BINS, params=probed_params(ours))
    optimizer = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=0.0)
    with probe:
        updated = update_policy(ours, optimizer, rollout, token_adv, stages, spec, probe)
    # what our trainer logs on a probe step: trainer._Update's credit and update_policy's per-bin clip shares
    step = trainer_module._Update(ours, optimizer, rollout, cat["advantages"], token_adv, stages, spec, scaler=None)
    mine = {**step._credit(probe, DEFAULT_BINS, 1.0, skipped=False), **updated}
    assert len(probe.frame()["record"].unique()) == 2  # two backwards each side

    for k in range(K):
        for key in (f"tokens/share_bin{k}", f"adv/pos_share_bin{k}", f"adv/neg_share_bin{k}"):
            assert mine[key] == pytest.approx(theirs[key], abs=1e-12, nan_ok=True), key
        assert mine[f"entropy/mean_bin{k}"] == pytest.approx(theirs[f"entropy/mean_bin{k}"], abs=1e-5, nan_ok=True)
        assert mine[f"grad/share_bin{k}"] == pytest.approx(theirs[f"grad/share_bin{k}"], abs=1e-5, nan_ok=True)
        for key in (f"clip/low_share_bin{k}", f"clip/high_share_bin{k}"):
            assert mine[key] == pytest.approx(theirs[key], abs=1e-12, nan_ok=True), key
    assert mine["grad/share_context"] == pytest.approx(theirs["grad/share_context"], abs=1e-5)
    # and the shared definition is the probe's own: the trainer's existing grad/share keys are these numbers
    for key, value in probe.metrics().items():
        if key.startswith(("grad/share", "tokens/share")):
            assert mine[key] == pytest.approx(value, abs=1e-12), key
    assert sum(1 for k in range(K) if theirs[f"tokens/share_bin{k}"] > 0) >= 3  # the bins are really spread


def test_a_callback_passed_without_attach_stops_training_with_the_fix(peaky_model, one_prompt, tmp_path):
    args = GRPOConfig(**settings(tmp_path, max_steps=1))
    trainer = GRPOTrainer(model=peaky_model, reward_funcs=[spread_reward], args=args, train_dataset=one_prompt,
                          callbacks=[TokenCreditCallback()])  # fmt: skip
    with pytest.raises(RuntimeError, match=r"call .attach\(trainer\)"):
        trainer.train()


def test_bad_settings_are_rejected_naming_the_setting():
    with pytest.raises(ValueError, match="every"):
        TokenCreditCallback(every=0)
    with pytest.raises(ValueError, match="fig3_precision"):
        TokenCreditCallback(fig3_precision="bfloat16")
    with pytest.raises(ValueError, match="bins"):
        TokenCreditCallback(bins=(0.0, 0.5))
    with pytest.raises(ValueError, match="add bins"):
        CreditSums((0.0, 0.5, 1.0)) + CreditSums()


# --- what the callback relies on in TRL and transformers (canary) -----------------------------------------------------


def test_canary_the_trl_and_transformers_hooks_the_callback_uses():
    """A TRL or transformers upgrade that moves these must fail here, naming the versions, not log wrong numbers."""
    import inspect

    import transformers
    import trl
    from transformers import Trainer

    from lopti_lab.integrations.trl import TESTED_TRL, _unannotated

    versions = f"trl {trl.__version__}, transformers {transformers.__version__} (written against trl {TESTED_TRL[0]})"
    recorded = "(self, model, inputs, return_outputs=False, num_items_in_batch=None)"
    assert _unannotated(Trainer.compute_loss) == recorded, f"{versions}: Trainer.compute_loss changed"
    assert _unannotated(GRPOTrainer.compute_loss) == recorded, f"{versions}: GRPOTrainer.compute_loss changed"
    loop = inspect.getsource(Trainer._run_epoch)
    # the step's micro-batches run between on_step_begin and on_step_end, whose metrics the log right after reads
    order = [loop.index(s) for s in ("on_step_begin(", "self.training_step(", "self.optimizer.step()",
                                     "on_step_end(", "self._maybe_log_save_evaluate(")]  # fmt: skip
    assert order == sorted(order), f"{versions}: the training loop's hook order changed"
    source = inspect.getsource(GRPOTrainer)
    assert 'self._metrics = {"train": defaultdict(list)' in source, f"{versions}: GRPOTrainer._metrics changed"
    log = inspect.getsource(GRPOTrainer.log)
    assert "for key, val in self._metrics[mode].items()" in log and "math.isnan(v)" in log, versions
    compute = inspect.getsource(GRPOTrainer._compute_loss)
    for key in ('inputs["prompt_ids"]', 'inputs["completion_ids"]', 'inputs["completion_mask"]', '"tool_mask"',
                'inputs["advantages"]', 'inputs.get("old_per_token_logps")'):  # fmt: skip
        assert key in compute, f"{versions}: GRPOTrainer._compute_loss no longer reads {key}"
    assert "self.epsilon_low" in compute and "self.epsilon_high" in compute, versions


def test_the_callback_does_not_change_training(peaky_model, one_prompt, tmp_path):
    """Its forwards take no random number and train nothing: the same losses and weights with it as without."""
    runs = []
    for with_callback in (False, True):
        trainer = stock(peaky_model, one_prompt, tmp_path / str(with_callback), max_steps=2)
        if with_callback:
            TokenCreditCallback().attach(trainer)
        trainer.train()
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        runs.append((losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}))
    (plain_losses, plain), (probed_losses, probed) = runs
    assert plain_losses == probed_losses
    assert all(torch.equal(plain[n], probed[n]) for n in plain)
