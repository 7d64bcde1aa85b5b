"""Adapters to engines that scale past one GPU. They import ``objective`` and ``kk``, never the other way round.

trl    ``LoptiGRPOTrainer``: TRL's GRPOTrainer with Advantage Reweighting and Lopti (accelerate, DeepSpeed, vLLM),
       its config, the K&K reward as a TRL reward function and a K&K ``datasets.Dataset`` builder
       (needs the optional extra: ``pip install "lopti-lab[trl]"``)
trl_callback  ``TokenCreditCallback``: lopti_lab's per-bin token credit (probes.credit) logged from any GRPOTrainer,
       TRL's own included, through its own logging
verl   ``compute_score``: the K&K reward with verl's custom reward signature, for our parquet export; the module
       docstring says where AR and Lopti go in verl's GRPO
engines  AR and Lopti in the forms other engines' extension points take (verl's registered policy loss, prime-rl's
       custom loss, per-token advantages and loss weights); docs/engines.md says where each hook goes

Nothing is imported here, so ``import lopti_lab.integrations`` works without TRL installed.
"""
